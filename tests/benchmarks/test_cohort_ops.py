"""benchmarks/cohort_ops.py: operations per client in a cohort round, by where raysim runs them."""
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks import cohort_ops  # noqa: E402
from raysim.core.aggregation import accumulate  # noqa: E402


def test_operations_are_counted_by_the_raysim_functions_that_run_them():
    sums = {}
    with cohort_ops.OpCounter() as counter:
        accumulate(sums, {"w": torch.ones(3)}, 2.0)  # the first: a float64 copy, then its scaling
        accumulate(sums, {"w": torch.ones(3)}, 2.0)  # later ones: one fused add (a detached upload)
    assert counter.counts["aggregation.accumulate"] == 3
    assert counter.counts["(outside raysim)"] == 2  # the test's own torch.ones
    assert sums["w"].tolist() == [4.0, 4.0, 4.0]


@pytest.mark.slow
def test_the_script_writes_its_table_of_a_cohort_round(tmp_path):
    assert cohort_ops.main(["--rounds", "2", "--cohort-size", "16", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "cohort_ops.md").read_text()
    assert "workload D, cohort_size 16, cpu" in text
    assert "round 2: 100 clients" in text
    assert "cohort.train_cohort" in text and "cohort.snapshot" in text
    assert (tmp_path / "cohort_ops.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_gpu_is_one_line_and_exit_2(capsys):
    assert cohort_ops.main(["--device", "cuda", "--out", "/nonexistent"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs CUDA" in err[0]


def test_on_a_gpu_the_clients_data_stays_there_as_in_run_pys_device_arms():
    from benchmarks.run import DEVICE_DATA_MB
    assert cohort_ops.config("D", 64, 3, "cuda").runtime.device_data_mb == DEVICE_DATA_MB
    cpu = cohort_ops.config("D", 64, 3, "cpu").runtime
    assert cpu.device_data_mb == 0 and cpu.cohort_size == 64
