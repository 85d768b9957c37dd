"""FedAvg's aggregate on tiny tensors, computed by hand."""
import torch

from raysim.core.aggregation import Mean
from raysim.methods.fedavg import FedAvg


def test_fedavg_aggregate_takes_the_weighted_mean():
    m = FedAvg(FedAvg.Hparams(), setup=None)
    state = {"global": {"w": torch.zeros(2)}}
    new = m.aggregate(state, Mean({"w": torch.tensor([1.0, 2.0])}, 3, [0, 1]), 1)
    assert torch.equal(new["global"]["w"], torch.tensor([1.0, 2.0]))
