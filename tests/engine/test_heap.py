"""A Ray actor keeps the memory it frees (raysim.engine.heap): blocks up to 32 MiB come from
glibc's heap and stay there once freed, so a buffered window's partial sums reuse the last
window's pages instead of faulting in new ones. (glibc's own defaults move with the process's
history, so the test checks the setting's effect, not the defaults'.)"""
import platform

import pytest

from raysim.engine import heap

BLOCKS, NBYTES = 10, 6 << 20  # a burst of frees just under heap.TRIM_THRESHOLD: 10 blocks of 6 MiB
BIG = 24 << 20  # one block glibc would map on its own unless something this big was freed before


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_an_actor_serves_big_blocks_from_its_heap_and_keeps_them(ray_session):
    ray = ray_session

    @ray.remote(num_cpus=0)
    class Worker:
        def churn(self, rounds: int, blocks: int, nbytes: int, big: int):
            """(whether the setting took, how far one big block moved the heap's end and how far
            freeing it moved it back, the minor page faults of each round of allocating the
            blocks, touching and freeing them)."""
            import ctypes
            import resource

            import torch

            from raysim.engine import heap
            kept = heap.keep_freed_memory()
            sbrk = ctypes.CDLL(None).sbrk
            sbrk.argtypes, sbrk.restype = [ctypes.c_long], ctypes.c_void_p
            start = sbrk(0)
            block = torch.ones(big // 8, dtype=torch.float64)
            grown = sbrk(0) - start
            del block
            shrunk = grown - (sbrk(0) - start)
            faults = []
            for _ in range(rounds):
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                held = [torch.ones(nbytes // 8, dtype=torch.float64) for _ in range(blocks)]
                del held
                faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
            return kept, grown, shrunk, faults

    kept, grown, shrunk, faults = ray.get(Worker.remote().churn.remote(6, BLOCKS, NBYTES, BIG))
    assert kept is True
    assert grown >= BIG and shrunk == 0  # from the heap, not a mapping of its own; kept there once freed
    assert max(faults[-3:]) < BLOCKS * NBYTES // 4096 // 20, faults  # later rounds reuse the earlier pages


def test_the_driver_keeps_glibcs_defaults(ray_session):
    assert heap.keep_freed_memory() is False  # the driver, and the InProcess backend's hosts in it
