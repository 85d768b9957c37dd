"""FedBN: every BN entry stays on the client, the rest is shared."""
import torch
from torch import nn

from raysim.methods.fedbn import FedBN


def tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(2, 2))


def test_fedbn_keeps_every_bn_entry_local_and_shares_the_rest():
    model = tiny()
    m = FedBN(FedBN.Hparams(), None)
    personal = m.personal_keys(model)
    assert personal == {"1.weight", "1.bias", "1.running_mean", "1.running_var", "1.num_batches_tracked"}
    state = m.init_server(model)
    assert set(state["global"]) == {"0.weight", "0.bias", "3.weight", "3.bias"}
    assert not personal & set(m.broadcast(state, 1)["global"])
