"""Tensor helpers (raysim.core.tensors) on a tiny model."""
import torch
from torch import nn

from raysim.core.tensors import bn_keys, load_tensors


def tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(2, 2))


def test_load_tensors_copies_in_place():
    model = tiny()
    ptr = model[3].weight.data_ptr()
    load_tensors(model, {"3.weight": torch.ones(2, 2)})
    assert model[3].weight.data_ptr() == ptr and torch.equal(model[3].weight, torch.ones(2, 2))
    assert bn_keys(model) == {"1.weight", "1.bias", "1.running_mean", "1.running_var", "1.num_batches_tracked"}
