"""FedAsync's server mix (methods/fedasync.py) on values computed by hand."""
import pytest
import torch

from raysim.core.buffered import BufferedUploads
from raysim.core.staleness import Staleness
from raysim.methods import registry
from raysim.testing import setup


def test_fedasync_mixes_the_arrival_in_with_alpha_times_its_staleness_weight():
    cls = registry.get("fedasync")
    m = cls(cls.Hparams(alpha=0.6), setup())
    assert (cls.buffer, cls.staleness) == (1, Staleness("polynomial", a=0.5))
    x = torch.tensor([1.0, 2.0])
    base = torch.tensor([0.0, 4.0])  # x_τ, the model the client downloaded three steps ago
    delta = torch.tensor([1.0, -2.0])  # its x_new = base + Δ = [1, 2] ... here [1.0, 2.0]
    s = (1 + 3) ** -0.5  # polynomial, a = 0.5: 1/2
    up = BufferedUploads({"w": delta}, weight=5.0, clients=[7], staleness={7: 3}, staleness_weights={7: s},
                         bases={7: {"w": base}})
    new = m.buffered_step({"global": {"w": x}}, up, 4)["global"]["w"]
    alpha_t = 0.6 * 0.5
    assert torch.allclose(new, (1 - alpha_t) * x + alpha_t * (base + delta))
    # a different arrival: x_new = [3, 0], fresh (s = 1): x = 0.4 x + 0.6 x_new
    up = BufferedUploads({"w": torch.tensor([3.0, -4.0])}, 1.0, [2], {2: 0}, {2: 1.0}, {2: {"w": base}})
    assert torch.allclose(m.buffered_step({"global": {"w": x}}, up, 1)["global"]["w"],
                          torch.tensor([0.4 * 1 + 0.6 * 3, 0.4 * 2 + 0.6 * 0]))


def test_fedasync_folds_its_arrival_unscaled_and_mixes_it_with_its_staleness_weight():
    # s(t − τ) is FedAsync's mixing weight α_t = α s, not a weight on the upload: the hosts fold Δ
    assert registry.get("fedasync").fold_staleness is False and registry.get("fedbuff").fold_staleness is True


def test_fedasync_clients_take_fedprox_steps_with_mu_rho():
    cls = registry.get("fedasync")
    assert cls.Hparams(rho=0.02).mu == 0.02 and issubclass(cls, registry.get("fedprox"))


@pytest.mark.parametrize("kind, tau, expected", [("constant", 5, 1.0), ("polynomial", 3, 0.5),
                                                 ("hinge", 4, 1.0), ("hinge", 6, 1 / (10 * 2 + 1))])
def test_fedasync_staleness_functions(kind, tau, expected):
    assert Staleness(kind, a=0.5 if kind == "polynomial" else 10, b=4).weight(tau) == pytest.approx(expected)
