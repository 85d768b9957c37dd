"""``Method.upload_floor``: a buffered schedule plans server steps ahead on the promise that every
upload sends at least that many bytes (raysim.engine.timeline refuses a job quicker than its
transfers), so every method that runs buffered keeps it, on a tiny clocked federation with slow
links (its transfers dominate each job's time, and windows of several steps are planned)."""
import copy

import pytest

from raysim.core.contract import buffered_refusal
from raysim.core.errors import UserError
from raysim.methods import registry
from raysim.testing import TINY, run_rounds, setup

LINKS = {"levels": [{"name": "fast", "flops": 2.0e9, "up_mbps": 1, "down_mbps": 5},
                    {"name": "slow", "flops": 0.5e9, "up_mbps": 1, "down_mbps": 5}], "assign": "round_robin"}


def runs_buffered(name: str) -> bool:
    return not buffered_refusal(registry.get(name))


@pytest.mark.parametrize("method", [m for m in registry.names() if runs_buffered(m)])
def test_a_buffered_methods_uploads_send_at_least_its_upload_floor(method, tmp_path):
    config = copy.deepcopy(TINY)
    config["clients"] = {"profiles": LINKS}
    config["eval"] = {"every": 4, "splits": ["test"]}
    try:
        m = run_rounds(method, tmp_path, "schedule.kind=buffered", "schedule.buffer=1", "clients_per_round=4",
                       "data.partition.clients_per_domain=2",
                       "rounds=4", config=config)
    except UserError as err:  # personal tensors on this model (FedBN's BN layers): refused in one line
        assert "cannot run a buffered schedule" in str(err)
        return
    assert (m[(m.split == "clock") & (m.metric == "folded")].value == 1).all()


def test_fedavgs_floor_is_its_whole_model():
    cls = registry.get("fedavg")
    method = cls(cls.Hparams(), setup())
    model = method.build_model()
    assert method.upload_floor(model) == sum(v.numel() * v.element_size() for v in model.state_dict().values()) > 0
