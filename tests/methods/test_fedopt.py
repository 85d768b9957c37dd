"""FedAvgM, FedAdam, FedYogi, FedAdagrad (methods/fedopt.py) are FedAvg with a server optimizer:
the same run as fedavg with that server.optimizer, through the real round loop, and a run resumed
from a checkpoint carries the optimizer's state."""
import os
import shutil

import pyarrow.parquet as pq
import pytest
import torch

from raysim.app.experiment import federation, resume_config
from raysim.engine.backend import InProcess
from raysim.methods import registry
from raysim.testing import run_rounds


def test_fedadam_is_fedavg_with_server_optimizer_adam_and_resumes_with_its_state(tmp_path, one_thread):
    adam = run_rounds("fedadam", tmp_path / "fedadam", "rounds=2")
    fedavg_adam = run_rounds("fedavg", tmp_path / "fedavg_adam", "rounds=2", "server.optimizer=adam",
                             "checkpoint.every=1")
    assert adam.equals(fedavg_adam)
    # and the optimizer ran: after round 1's server step the global model is not FedAvg's mean
    fedavg = run_rounds("fedavg", tmp_path / "fedavg", "rounds=1")
    loss = lambda df: df[(df["round"] == 1) & (df.split == "test") & (df.metric == "loss")]["value"].tolist()
    assert loss(adam) != loss(fedavg) and len(loss(fedavg)) > 0

    # round 1's checkpoint holds Adam's m and v; resumed from it, round 2 replays to the same metrics
    out = shutil.copytree(tmp_path / "fedavg_adam", tmp_path / "resumed")
    for name in ("metrics.parquet", "status.json"):
        os.remove(out / name)
    saved = torch.load(out / "checkpoints" / "round-000001" / "server.pt", weights_only=True)
    assert set(saved["server_optimizer"]) == {"m", "v", "step"} and saved["server_optimizer"]["step"] == 1
    federation(resume_config(str(out), []), str(out), progress=False, backend=InProcess()).run(resume=True)
    assert pq.read_table(out / "metrics.parquet").to_pandas().equals(fedavg_adam)


@pytest.mark.parametrize("name, optimizer", [("fedavgm", "momentum"), ("fedadagrad", "adagrad"),
                                             ("fedadam", "adam"), ("fedyogi", "yogi")])
def test_each_variant_is_fedavg_with_its_server_optimizer(name, optimizer):
    cls = registry.get(name)
    assert cls.server_optimizer == optimizer and issubclass(cls, registry.get("fedavg"))
    assert cls.aggregate is registry.get("fedavg").aggregate  # the default aggregate runs the optimizer
