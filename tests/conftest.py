"""One Ray instance for the whole session (Ray takes ~3 s to start): 2 CPUs and one *logical*
GPU, so fractional-GPU placement is exercised for real on a machine without a GPU. It is started
the way `raysim run` starts its own (raysim.engine.cluster.start_local_ray: every process on
127.0.0.1, token authentication on), so tests/engine/test_network.py can check a run on it."""
import os

import pytest


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    import ray

    from raysim.engine.cluster import start_local_ray

    os.environ.setdefault("RAYSIM_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    if not ray.is_initialized():
        # niceness 15: Ray's own default, which this fixture has always run its workers at
        start_local_ray(num_cpus=2, num_gpus=1, niceness=15, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture
def one_torch_thread():
    """Tests of tiny tensors run on one torch thread: faster, and no spin-wait contention on the
    suite's two shared cores."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
