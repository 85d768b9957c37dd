"""FedBuff's server step (raysim.core.buffered, methods/fedbuff.py) on values computed by hand,
and the host's delta upload it folds."""
import pytest
import torch

from raysim.core.aggregation import WeightedMean
from raysim.core.buffered import BufferedUploads, delta_upload, staleness_scaled
from raysim.core.contract import buffered_refusal as refusal
from raysim.core.contract import Upload
from raysim.methods import registry
from raysim.testing import setup


def fold_sums(deltas, weights, taus, staleness, hosts=1):
    """The hosts' folds (host.py ``_fold_step``: client c on host c % hosts) of these deltas."""
    agg = WeightedMean()
    partials = [agg.start() for _ in range(hosts)]
    for c, (d, w, tau) in enumerate(zip(deltas, weights, taus)):
        agg.add(partials[c % hosts], c, Upload(staleness_scaled({"w": d}, staleness.weight(tau)), w))
    return agg, partials


def fold(deltas, weights, taus, staleness, hosts=1):
    """What the hosts' fold and the server's reduce give for these deltas."""
    agg, partials = fold_sums(deltas, weights, taus, staleness, hosts)
    mean = agg.reduce(partials)
    return BufferedUploads(mean.mean, mean.total_weight, mean.clients, staleness=dict(enumerate(taus)),
                           staleness_weights={c: staleness.weight(tau) for c, tau in enumerate(taus)})


def test_fedbuff_steps_along_the_staleness_weighted_buffer_mean_with_server_momentum():
    fedbuff = registry.get("fedbuff")
    m = fedbuff(fedbuff.Hparams(), setup())
    assert (fedbuff.buffer, fedbuff.staleness.kind, fedbuff.server_optimizer) == (10, "sqrt", "momentum")
    state = {"global": {"w": torch.tensor([1.0, 2.0])}}
    # Δ1 fresh (s = 1), Δ2 three steps stale (s = 1/√4 = 1/2); equal weights:
    # Δ̄ = (1/K) Σ s_i Δ_i = (Δ1 + Δ2 / 2) / 2 = ([0.2, -0.4] + [0.3, 0]) / 2 = [0.25, -0.2]
    up = fold([torch.tensor([0.2, -0.4]), torch.tensor([0.6, 0.0])], [1.0, 1.0], [0, 3], fedbuff.staleness)
    assert torch.allclose(up.delta()["w"], torch.tensor([0.25, -0.2]))
    state = m.buffered_step(state, up, 1)  # momentum 0.9, lr 1: v = Δ̄, x = x + v
    assert torch.allclose(state["global"]["w"], torch.tensor([1.25, 1.8]))
    state = m.buffered_step(state, up, 2)  # v = 0.9 Δ̄ + Δ̄ = 1.9 Δ̄
    assert torch.allclose(state["global"]["w"], torch.tensor([1.25 + 0.475, 1.8 - 0.38]))


def test_the_buffer_divides_by_the_clients_weights_not_by_the_staleness_weights():
    staleness = registry.get("fedbuff").staleness
    # one client three steps stale alone: Δ̄ = s Δ = Δ / 2 (not Δ, which Σ s_i in the denominator would give)
    up = fold([torch.tensor([1.0])], [1.0], [3], staleness)
    assert torch.allclose(up.delta()["w"], torch.tensor([0.5]))


def test_the_buffered_fold_has_the_same_bits_however_the_uploads_are_grouped_over_hosts():
    # stale arrivals' s(τ) = 1/√(1+τ) are fractions: folded as the weight w·s, each float64 product
    # is rounded and the grouping over hosts shows in the sum's last bits (now and then in float32's
    # after the division). s applied to the float32 delta first, every product with an integer
    # weight w < 2^10 is exact (24 + 10 bits), and so is the sum while one element's terms span
    # fewer than 2^19 (here 2^7): the float64 sum is then the same whatever the grouping, the
    # condition under which a synchronous round's fold is grouping-free too
    g = torch.Generator().manual_seed(0)
    sign = lambda: torch.randint(0, 2, (4000,), generator=g) * 2.0 - 1.0  # noqa: E731
    deltas = [sign() * (1 + torch.rand(4000, generator=g)) * 2.0 ** -int(torch.randint(0, 7, (1,), generator=g))
              for _ in range(10)]
    weights = [float(w) for w in torch.randint(1, 600, (10,), generator=g)]
    taus = [int(t) for t in torch.randint(0, 12, (10,), generator=g)]
    staleness = registry.get("fedbuff").staleness

    def total(hosts):
        _, partials = fold_sums(deltas, weights, taus, staleness, hosts)
        return sum(p.sums["w"] for p in partials)

    for hosts in (2, 3, 4):
        assert torch.equal(total(hosts), total(1)), hosts
        assert torch.equal(fold(deltas, weights, taus, staleness, hosts).delta()["w"],
                           fold(deltas, weights, taus, staleness).delta()["w"])


def test_fedavg_buffered_with_fresh_arrivals_is_the_synchronous_mean():
    fedavg = registry.get("fedavg")
    m = fedavg(fedavg.Hparams(), setup())
    x = torch.tensor([1.0, -1.0])
    ys = [torch.tensor([2.0, 0.0]), torch.tensor([0.0, 3.0])]
    up = fold([y - x for y in ys], [3.0, 1.0], [0, 0], fedavg.staleness)
    new = m.buffered_step({"global": {"w": x}}, up, 1)["global"]["w"]
    assert torch.allclose(new, (3 * ys[0] + ys[1]) / 4)  # n_k-weighted mean, as a round's


def test_a_delta_upload_is_new_tensors_and_keeps_integer_buffers_as_they_are():
    model = {"w": torch.tensor([3.0]), "n": torch.tensor(5)}
    base = {"w": torch.tensor([1.0]), "n": torch.tensor(2)}
    d = delta_upload(model, base)
    assert d["w"].item() == 2.0 and d["n"].item() == 5
    model["n"] += 1
    assert d["n"].item() == 5  # a copy: the next client's training does not write into it


def test_scaling_a_delta_in_place_gives_the_bits_of_a_new_tensor():
    """A host scales its own delta upload in place before the fold (no new buffer per job): the
    same float32 rounding of s * delta, integer buffers untouched, s = 1 a no-op."""
    torch.manual_seed(0)
    delta = {"w": torch.randn(1000), "n": torch.tensor(7)}
    for s in (1 / 3 ** 0.5, 0.1, 1.0):
        mine = {k: v.clone() for k, v in delta.items()}
        new = staleness_scaled(delta, s)
        scaled = staleness_scaled(mine, s, in_place=True)
        assert scaled["w"].data_ptr() == mine["w"].data_ptr() and torch.equal(scaled["w"], new["w"])
        assert torch.equal(scaled["n"], torch.tensor(7))
    assert torch.equal(staleness_scaled(delta, 0.5)["w"], (delta["w"].double() * 0.5).float())  # exact: a power of two


@pytest.mark.parametrize("name, why", [("fedavg", ""), ("fedprox", ""), ("fedadam", ""), ("fedbuff", ""),
                                       ("fedasync", ""), ("scaffold", "own server step"),
                                       ("fdse", "keeps them all"), ("feddrop", "keeps them all"), ("fedbn", "personal tensors"),
                                       ("central", "every client's data")])
def test_which_methods_run_buffered(name, why):
    cls = registry.get(name)
    m = cls(cls.Hparams(), setup())
    said = refusal(m, m.build_model())
    assert (why in said) if why else said == "", said
