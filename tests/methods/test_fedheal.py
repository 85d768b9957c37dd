"""FedHEAL: its key equations against values worked out by hand (baselines spec 4)."""
import pytest
import torch

from raysim.core.aggregation import AllUploads
from raysim.config import ModelConfig
from raysim.core.contract import Upload
from raysim.methods.fedheal import FedHEAL
from raysim import testing


def setup(name="small_cnn", n=3, size=16):
    return testing.setup(image_shape=(1, size, size), num_clients=n, model=ModelConfig(name=name, norm="bn"))


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
