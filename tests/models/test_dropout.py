"""Dropout masks come from the running client's keyed generator, never from torch's global one."""
import pytest
import torch
from torch import nn

from raysim.models import build
from raysim.models.dropout import KeyedDropout, dropout_generator, keyed_dropout


def test_keyed_dropout_is_dropouts_formula_on_the_installed_generator():
    """p = 0.5 on ones: each entry 0 or 1 / (1 - p) = 2, the mask a Bernoulli(1 - p) draw of the
    generator (the same seed: the same mask); the global generator is never touched."""
    drop, x = KeyedDropout(0.5), torch.ones(4, 6)
    before = torch.get_rng_state()
    with dropout_generator(torch.Generator().manual_seed(3)):
        a = drop(x)
    with dropout_generator(torch.Generator().manual_seed(3)):
        b = drop(x)
    keep = torch.empty(4, 6).bernoulli_(0.5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and torch.equal(a, 2 * keep) and set(a.unique().tolist()) == {0.0, 2.0}
    assert torch.equal(torch.get_rng_state(), before)
    drop.eval()
    assert torch.equal(drop(x), x)  # evaluation draws nothing, needs no generator


def test_a_train_mode_pass_outside_a_client_step_fails_rather_than_use_the_global_generator():
    with pytest.raises(RuntimeError, match="keyed generator"):
        KeyedDropout(0.5)(torch.ones(2, 2))


def test_every_zoo_model_with_dropout_uses_keyed_dropout():
    for name, kw in (("cnn6", {"input_size": 8}), ("alexnet", {"input_size": 63})):
        model = build(name, num_classes=3, **kw)
        drops = [m for m in model.modules() if isinstance(m, nn.Dropout)]
        assert drops and all(type(m) is KeyedDropout for m in drops), name
    # a model built elsewhere with nn.Dropout is converted by build()'s keyed_dropout
    net = keyed_dropout(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.3)))
    assert type(net[1]) is KeyedDropout and net[1].p == 0.3
