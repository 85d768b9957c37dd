"""PartialFed: where a client starts from and what it uploads, on tiny models (baselines spec 3.3)."""
import torch
from torch import nn

from small_cnn_harness import context, setup, small
from raysim.core.aggregation import Mean, WeightedMean
from raysim.methods.partialfed import PartialFed, kept_keys
from raysim.testing import random_client_data


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1, self.layer2 = nn.Linear(2, 2), nn.Linear(2, 2)


def test_partialfed_starts_from_the_global_model_except_the_kept_layers():
    net = TwoLayers()
    m = PartialFed(PartialFed.Hparams.from_dict({"keep": ["layer2"]}), setup(2))
    assert kept_keys(net, ("layer2",)) == {"layer2.weight", "layer2.bias"}
    glob = {k: torch.full_like(v, 1.0) for k, v in net.state_dict().items()}
    own = {k: torch.full_like(v, 7.0) for k, v in net.state_dict().items()}
    m.load_client_model(net, {"global": glob}, {"model": own})  # init[1] = theta^t[1], init[2] = theta_c[2]
    assert float(net.layer1.weight.mean()) == 1.0 and float(net.layer2.weight.mean()) == 7.0
    m.load_client_model(net, {"global": glob}, {})  # first participation: everything loaded
    assert float(net.layer2.weight.mean()) == 1.0
    # kept layers are still uploaded and averaged: the server's layer 2 is the weighted mean
    state = m.aggregate({"global": glob}, Mean({k: torch.full_like(v, 4.0) for k, v in glob.items()}, 2, [0, 1]), 1)
    assert float(state["global"]["layer2.weight"].mean()) == 4.0
    default = kept_keys(small(), ("bn", "head"))
    assert default == {k for k in small().state_dict() if k.startswith(("features.bn", "head."))}
    assert m.personal_keys(net) == set()  # nothing stays out of the average


def test_partialfed_uploads_the_kept_layers_and_the_server_averages_them():
    """Spec 3.3 pitfall 1: unlike FedBN, BN and head are uploaded and averaged; only the starting
    point is personal. Two clients start from their own kept layers; the server's head is the
    n_k-weighted mean of their trained heads."""
    m = PartialFed(PartialFed.Hparams(), setup(2))
    model = small()
    glob = {k: v.clone() for k, v in model.state_dict().items()}
    kept = kept_keys(model, m.hp.keep)
    agg = WeightedMean()
    part, heads = agg.start(), []
    for cid in (0, 1):
        own = {k: v + 0.1 * (cid + 1) if v.is_floating_point() else v.clone() for k, v in glob.items()}
        state = {"model": own}
        m.load_client_model(model, {"global": glob}, state)
        up = m.local_update(context(m, model, {"global": glob}, state, cid=cid, data=random_client_data(num_train=4, seed=cid)))
        assert set(up.tensors) == set(model.state_dict()) and kept <= set(up.tensors)
        heads.append((up.tensors["head.weight"].clone(), up.weight))
        agg.add(part, cid, up)
    new = m.aggregate({"global": glob}, agg.reduce([part]), 1)["global"]
    mean = sum(h * w for h, w in heads) / sum(w for _, w in heads)
    assert torch.allclose(new["head.weight"], mean, atol=1e-6)
