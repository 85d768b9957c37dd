"""FedHEAL, FedFA and FPL: each key equation against values worked out by hand (baselines spec 4)."""
import math

import numpy as np
import pytest
import torch

from raysim.core.aggregation import AllUploads, Mean
from raysim.config import ModelConfig, TrainConfig
from raysim.core.contract import Upload
from raysim.methods.fedfa import FFALayer, FedFA
from raysim.models.blocks import block_ends
from raysim.methods.fedheal import FedHEAL
from raysim.methods.fpl import FPL, cluster_prototypes, finch, prototype_losses
from raysim.models import build
from raysim import testing


def setup(name="small_cnn", n=3, size=16):
    return testing.setup(image_shape=(1, size, size), num_clients=n, model=ModelConfig(name=name, norm="bn"))


# ----------------------------------------------------------------------------- FedHEAL

def test_fedheal_two_rounds_on_a_scalar_by_hand():
    """beta = 0.4, tau = 0.3 (spec 4.1). Round 1, u = (+1, -3): m = (1, 1), H = (1, 0), d = (1, 3),
    dP = (0.1, 0.3), P = (0.6, 0.8), w = (3/7, 4/7): theta^1 = -9/7. Round 2, u = (-1, -1): client 1's
    history says up (cons 0 < tau: dropped), client 2's says down (kept): H = (0.5, 0), dP = (0.06, 0.58),
    P = (0.66, 1.38), element weights (0, 1): theta^2 = theta^1 - 1."""
    m = FedHEAL(FedHEAL.Hparams(), setup(n=2))
    state = {"global": {"t": torch.tensor([0.0])}, "params": ["t"], "clients": {}}
    thetas = []
    for us in ((1.0, -3.0), (-1.0, -1.0)):
        prev = state["global"]["t"]
        state = m.aggregate(state, AllUploads({k: Upload({"t": prev + u}, 1.0) for k, u in enumerate(us)}), 1)
        thetas.append(float(state["global"]["t"]))
        if len(thetas) == 1:
            assert [state["clients"][k]["P"] for k in (0, 1)] == pytest.approx([0.6, 0.8])
    c = state["clients"]
    assert thetas == pytest.approx([-9 / 7, -9 / 7 - 1], abs=1e-6)
    assert [float(c[k]["H"]["t"]) for k in (0, 1)] == [0.5, 0.0] and c[0]["n"] == 2
    assert [c[k]["dP"] for k in (0, 1)] == pytest.approx([0.06, 0.58]) and [c[k]["P"] for k in (0, 1)] == pytest.approx([0.66, 1.38])
    # round 3, u = (+1, +1): the history averages every observation, H = (2 * 0.5 + 1) / 3, (2 * 0 + 1) / 3;
    # client 1 (cons 0.5) keeps its update, client 2 (cons 0) drops it: theta moves by client 1's +1
    prev = state["global"]["t"]
    state = m.aggregate(state, AllUploads({k: Upload({"t": prev + 1.0}, 1.0) for k in (0, 1)}), 3)
    assert [float(state["clients"][k]["H"]["t"]) for k in (0, 1)] == pytest.approx([2 / 3, 1 / 3])
    assert float(state["global"]["t"]) == pytest.approx(float(prev) + 1.0)


def test_fedheal_keeps_an_element_only_a_consistent_client_moves_and_ignores_integer_buffers():
    m = FedHEAL(FedHEAL.Hparams.from_dict({"tau": 0.5}), setup(n=2))
    prev = {"w": torch.zeros(2), "n": torch.tensor(4)}
    state = {"global": prev, "params": ["w"], "clients": {0: {"H": {"w": torch.tensor([1.0, 1.0], dtype=torch.float64)},
                                                            "n": 3, "P": 1.0, "dP": 0.0}}}
    ups = AllUploads({0: Upload({"w": torch.tensor([-2.0, 3.0]), "n": torch.tensor(6)}, 1.0),
                      1: Upload({"w": torch.tensor([5.0, 1.0]), "n": torch.tensor(8)}, 1.0)})
    new = m.aggregate(state, ups, 2)["global"]
    # element 0: client 0 went down against an all-up history (dropped), client 1 is new: its full update
    assert float(new["w"][0]) == pytest.approx(5.0) and int(new["n"]) == 7


def test_fedheal_consistency_equal_to_tau_is_dropped():
    """m_k = 1[cons > tau], strict (spec 4.1 pitfall 4; the official code agrees). tau = 0.5, client 0's
    history H = 0.5 after two observations, update +2: cons = 0.5, dropped; client 1 (first round, +4)
    is kept: theta moves by +4. Just below (tau = 0.49) client 0 is kept too."""
    from raysim.methods.fedheal import harmonize
    hist = {"H": torch.tensor([0.5], dtype=torch.float64), "n": 2}
    assert harmonize(torch.tensor([2.0]), hist, 0.5)[0].tolist() == [0.0]
    assert harmonize(torch.tensor([2.0]), hist, 0.49)[0].tolist() == [1.0]
    m = FedHEAL(FedHEAL.Hparams.from_dict({"tau": 0.5}), setup(n=2))
    state = {"global": {"w": torch.zeros(1)}, "params": ["w"], "clients": {0: {"H": {"w": hist["H"]}, "n": 2,
                                                                                 "P": 0.5, "dP": 0.0}}}
    ups = AllUploads({0: Upload({"w": torch.tensor([2.0])}, 1.0), 1: Upload({"w": torch.tensor([4.0])}, 1.0)})
    assert float(m.aggregate(state, ups, 3)["global"]["w"]) == pytest.approx(4.0)


def test_fedheal_distance_counts_parameters_only():
    """d_k sums the masked update's norms over the trainable parameters (spec 4.1 step 3; the official
    code's param_names): client 0 moves the parameter by +1 and a BN statistic by +100, client 1 the
    parameter by -3. d = (1, 3) as in the scalar test: P = (0.6, 0.8), w = (3/7, 4/7); the statistic
    is still aggregated with those weights: 3/7 * 100."""
    m = FedHEAL(FedHEAL.Hparams(), setup(n=2))
    state = {"global": {"w": torch.zeros(1), "rm": torch.zeros(1)}, "params": ["w"], "clients": {}}
    ups = AllUploads({0: Upload({"w": torch.tensor([1.0]), "rm": torch.tensor([100.0])}, 1.0),
                      1: Upload({"w": torch.tensor([-3.0]), "rm": torch.tensor([0.0])}, 1.0)})
    new = m.aggregate(state, ups, 1)
    assert [new["clients"][k]["P"] for k in (0, 1)] == pytest.approx([0.6, 0.8])
    assert float(new["global"]["w"]) == pytest.approx(-9 / 7) and float(new["global"]["rm"]) == pytest.approx(300 / 7)


# ----------------------------------------------------------------------------- FedFA

def test_ffa_with_zero_noise_is_the_identity_and_the_shared_variance_scales_channels():
    layer = FFALayer(2)
    x = torch.randn(4, 2, 3, 3)
    mu, sigma = x.mean(dim=(2, 3)), (x.var(dim=(2, 3)) + 1e-6).sqrt()
    assert torch.allclose(layer.augment(x, mu, sigma, torch.zeros(2, 4, 2)), x, atol=1e-5)
    stat = torch.tensor([[0.0, 0.0], [2.0, 2.0]])  # batch variance 2 (+ eps) in both channels
    layer.shared_var_mean.copy_(torch.tensor([0.0, 1e6]))  # r ~ (0, 1): gamma = (0, 2): factors (1, 3)
    assert (layer.spread(stat, layer.shared_var_mean) ** 2).tolist() == pytest.approx([2.0, 6.0], rel=1e-4)
    layer.shared_var_mean.copy_(torch.tensor([0.3, 0.3]))  # equal: gamma = (1, 1): factor 2
    assert (layer.spread(stat, layer.shared_var_mean) ** 2).tolist() == pytest.approx([4.0, 4.0], rel=1e-4)
    layer.eval()
    assert layer(x) is x


def test_ffa_layers_follow_each_conv_block_and_the_server_shares_their_variance():
    assert block_ends(build("small_cnn", num_classes=3, in_channels=1, input_size=16).features) == ["pool1", "pool2"]
    assert block_ends(build("cnn6", num_classes=3, in_channels=1, input_size=16).features) == ["pool1", "pool2", "relu3"]
    assert len(block_ends(build("alexnet", num_classes=3, in_channels=3, input_size=64).features)) == 5  # FDSE A7.2
    model = FedFA(FedFA.Hparams(), setup()).build_model()
    assert [n for n, m in model.named_modules() if isinstance(m, FFALayer)] == ["features.ffa_pool1", "features.ffa_pool2"]
    assert model.features.ffa_pool1.running_mean.numel() == 16
    # three clients' running means of one 2-channel layer: per-channel variance vs the code's scalar
    means = [torch.tensor([0.0, 1.0]), torch.tensor([2.0, 1.0]), torch.tensor([4.0, 1.0])]
    extras = {c: {"ffa": {"features.ffa_pool1": (means[c], torch.ones(2))}} for c in range(3)}
    glob = {"features.ffa_pool1.shared_var_mean": torch.zeros(2), "features.ffa_pool1.shared_var_std": torch.zeros(2)}
    # var(0, 2, 4) = 4 and var(1, 1, 1) = 0 per channel; the code: var of all six (mean 1.5) = 9.5 / 5 = 1.9
    for mode, expected in (("per_channel", [4.0, 0.0]), ("scalar_code", [1.9, 1.9])):
        m = FedFA(FedFA.Hparams.from_dict({"shared_var": mode}), setup())
        out = m.aggregate({"global": glob}, Mean(dict(glob), 3.0, [0, 1, 2], extras), 1)["global"]
        assert out["features.ffa_pool1.shared_var_mean"].tolist() == pytest.approx(expected)


def _shared_variances(m):
    """The server's shared_var_mean for three clients' running means (0, 1), (2, 1), (4, 1) of one layer."""
    means = [torch.tensor([0.0, 1.0]), torch.tensor([2.0, 1.0]), torch.tensor([4.0, 1.0])]
    extras = {c: {"ffa": {"features.ffa_pool1": (means[c], torch.ones(2))}} for c in range(3)}
    glob = {"features.ffa_pool1.shared_var_mean": torch.zeros(2), "features.ffa_pool1.shared_var_std": torch.zeros(2)}
    return m.aggregate({"global": glob}, Mean(dict(glob), 3.0, [0, 1, 2], extras), 1)["global"][
        "features.ffa_pool1.shared_var_mean"]


def test_fedfa_default_shared_variance_is_the_released_codes_scalar():
    """The default (the defaults rule): the released code's one scalar, 1.9, copied to both
    channels, not the paper's per-channel variance across clients (4, 0)."""
    assert FedFA.Hparams().shared_var == "scalar_code"
    assert _shared_variances(FedFA(FedFA.Hparams(), setup())).tolist() == pytest.approx([1.9, 1.9])


def test_fedfa_shared_variance_forms_differ_in_the_augmentation():
    """What a client does with the server's variance: per channel (4, 0): r = (4 / 5, ~1e-6), gamma ~ (2, 0),
    the batch variance scaled by (3, 1); the scalar form (1.9, 1.9): gamma = (1, 1), scaled by (2, 2)."""
    stat = torch.tensor([[0.0, 0.0], [2.0, 2.0]])  # batch variance 2 (+ eps) in both channels
    for mode, factors in (("per_channel", [3.0, 1.0]), ("scalar_code", [2.0, 2.0])):
        layer = FFALayer(2)
        layer.shared_var_mean.copy_(_shared_variances(FedFA(FedFA.Hparams.from_dict({"shared_var": mode}), setup())))
        spread2 = layer.spread(stat, layer.shared_var_mean) ** 2
        assert (spread2 / 2.0).tolist() == pytest.approx(factors, rel=1e-4), mode


# ----------------------------------------------------------------------------- FPL

def test_fpl_losses_by_hand():
    z, y = torch.tensor([[1.0, 0.0]]), torch.tensor([0])
    protos, labels = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 1])
    cpcl, upcr = prototype_losses(z, y, protos, labels, tau=1.0)
    assert float(cpcl) == pytest.approx(math.log(1 + math.exp(-1)), abs=1e-5) and float(upcr) == 0.0
    # two prototypes of class 0 (both positive); the unbiased prototype is their mean [0.5, 0.5]
    protos, labels = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]), torch.tensor([0, 0, 1])
    cpcl, upcr = prototype_losses(z, y, protos, labels, tau=1.0)
    e = math.e
    assert float(cpcl) == pytest.approx(-math.log((e + 1) / (e + 1 + 1 / e)), abs=1e-5)
    assert float(upcr) == pytest.approx((0.25 + 0.25) / 2)
    # a sample whose class has no prototype adds nothing (but counts in the batch size)
    cpcl2, _ = prototype_losses(torch.cat([z, z]), torch.tensor([0, 2]), protos, labels, tau=1.0)
    assert float(cpcl2) == pytest.approx(float(cpcl) / 2, abs=1e-6)


def test_finch_splits_by_direction_and_the_clusters_are_member_means():
    x = np.array([[1.0, 0.0], [0.99, 0.14], [0.0, 1.0], [0.14, 0.99]])
    last = finch(x)[-1]
    assert last[0] == last[1] and last[2] == last[3] and last[0] != last[2]
    assert finch(np.array([[1.0, 0.0], [0.0, 1.0]]))[-1].tolist() == [0, 0]  # two points: one cluster
    protos = cluster_prototypes([torch.tensor(r, dtype=torch.float32) for r in x])
    assert torch.allclose(protos[0], torch.tensor([0.995, 0.07])) and torch.allclose(protos[1], torch.tensor([0.07, 0.995]))
    assert torch.equal(cluster_prototypes([torch.tensor([3.0, 4.0])]), torch.tensor([[3.0, 4.0]]))


def test_fpl_server_broadcasts_per_class_clusters():
    m = FPL(FPL.Hparams(), setup())
    state = {"global": {"w": torch.zeros(1)}, "protos": torch.zeros(0, 2), "proto_labels": torch.zeros(0, dtype=torch.long)}
    extras = {0: {"protos": torch.tensor([[1.0, 0.0], [0.0, 1.0]]), "classes": torch.tensor([0, 2])},
              1: {"protos": torch.tensor([[0.9, 0.1]]), "classes": torch.tensor([0])}}
    new = m.aggregate(state, Mean({"w": torch.ones(1)}, 2.0, [0, 1], extras), 1)
    assert new["proto_labels"].tolist() == [0, 2]  # class 0: its two prototypes form one cluster
    assert torch.allclose(new["protos"][0], torch.tensor([0.95, 0.05])) and m.server_metrics(new) == {"prototypes": 2.0}


def test_fpl_prototypes_are_the_means_of_finchs_last_partition():
    """Four pairs of directions, 0/2, 20/22, 90/92 and 110/112 degrees: FINCH's first partition is the
    four pairs, its second (and last) the two groups {0..22} and {90..112}; a class gets two prototypes,
    the means of four members each (the first partition would give four)."""
    deg = [0, 2, 20, 22, 90, 92, 110, 112]
    x = torch.tensor([[math.cos(math.radians(d)), math.sin(math.radians(d))] for d in deg])
    levels = finch(x.double().numpy())
    assert [int(p.max()) + 1 for p in levels] == [4, 2]
    protos = cluster_prototypes(list(x))
    assert protos.shape == (2, 2)
    assert torch.allclose(protos[0], x[:4].mean(0), atol=1e-6) and torch.allclose(protos[1], x[4:].mean(0), atol=1e-6)


class _Augmented:
    """Six 1 x 2 x 2 images of classes (0, 0, 1, 1, 2, 2), served as x + 10 p in pass p (an augmentation
    that differs per epoch)."""

    def __init__(self):
        self.x = torch.arange(24.0).view(6, 1, 2, 2)
        self.y = torch.tensor([0, 0, 1, 1, 2, 2])
        self.num_train, self.passes = 6, 0

    def batches(self, batch_size, generator, device, drop_last=False):
        shift, self.passes = 10.0 * self.passes, self.passes + 1
        order = torch.randperm(6, generator=generator)
        for i in range(0, 6, batch_size):
            yield self.x[order[i:i + batch_size]] + shift, self.y[order[i:i + batch_size]]


def test_fpl_local_prototypes_come_from_the_last_epoch():
    """features = flatten (no parameters: z = the image), E = 2: p_c = the class mean of the second
    pass's images, i.e. of x + 10 (both passes would give x + 5)."""
    from raysim.models.base import Net
    m = FPL(FPL.Hparams(), setup())
    model = Net(torch.nn.Flatten(), torch.nn.Linear(4, 3), (1, 2, 2))
    data = _Augmented()
    ctx = testing.client_context(m, model, data, state={}, train=TrainConfig(epochs=2, batch_size=4, lr=0.1),
                                 payload={"protos": torch.zeros(0, 4), "proto_labels": torch.zeros(0, dtype=torch.long)})
    up = m.local_update(ctx)
    assert data.passes == 2 and up.extras["classes"].tolist() == [0, 1, 2]
    expected = torch.stack([data.x[data.y == c].flatten(1).mean(0) + 10.0 for c in range(3)])
    assert torch.allclose(up.extras["protos"], expected)
