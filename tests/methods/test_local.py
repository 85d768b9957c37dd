"""Local training: nothing is shared."""
import torch
from torch import nn

from raysim.methods.local import Local


def tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(2, 2))


def test_local_shares_nothing():
    model = tiny()
    m = Local(Local.Hparams(), None)
    assert m.init_server(model)["global"] == {}
    assert set(m.init_client_state(0, model)["personal"]) == set(model.state_dict())
