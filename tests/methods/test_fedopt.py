"""FedAvgM, FedAdam, FedYogi, FedAdagrad (methods/fedopt.py) are FedAvg with a server optimizer:
the same run as fedavg with that server.optimizer, through the real round loop."""
import pytest

from raysim.methods import registry
from raysim.testing import run_rounds


def test_fedadam_is_fedavg_with_server_optimizer_adam(tmp_path, one_thread):
    adam = run_rounds("fedadam", tmp_path / "fedadam", "rounds=2")
    assert adam.equals(run_rounds("fedavg", tmp_path / "fedavg_adam", "rounds=2", "server.optimizer=adam"))
    # and the optimizer ran: after round 1's server step the global model is not FedAvg's mean
    fedavg = run_rounds("fedavg", tmp_path / "fedavg", "rounds=1")
    loss = lambda df: df[(df["round"] == 1) & (df.split == "test") & (df.metric == "loss")]["value"].tolist()
    assert loss(adam) != loss(fedavg) and len(loss(fedavg)) > 0


@pytest.mark.parametrize("name, optimizer", [("fedavgm", "momentum"), ("fedadagrad", "adagrad"),
                                             ("fedadam", "adam"), ("fedyogi", "yogi")])
def test_each_variant_is_fedavg_with_its_server_optimizer(name, optimizer):
    cls = registry.get(name)
    assert cls.server_optimizer == optimizer and issubclass(cls, registry.get("fedavg"))
    assert cls.aggregate is registry.get("fedavg").aggregate  # the default aggregate runs the optimizer
