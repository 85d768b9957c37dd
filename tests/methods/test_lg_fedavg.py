"""LG-FedAvg: which layers are shared and which stay on the client, on a tiny model (baselines spec 3)."""
import pytest
import torch

from small_cnn_harness import context, setup, small
from raysim.core.aggregation import WeightedMean
from raysim.core.errors import UserError
from raysim.methods.lg_fedavg import LGFedAvg, global_modules


def test_lg_fedavg_shares_the_top_layers_and_keeps_the_representation():
    model = small()
    assert global_modules(model, 2) == ["features.fc1", "head"]
    m = LGFedAvg(LGFedAvg.Hparams(), setup(3))
    personal = m.personal_keys(model)
    assert {k.split(".")[1] for k in personal} == {"conv1", "bn1", "conv2", "bn2"}
    assert not any(k.startswith(("head.", "features.fc1.")) for k in personal)
    with pytest.raises(UserError, match="global_layers = 9"):
        LGFedAvg(LGFedAvg.Hparams.from_dict({"global_layers": 9}), setup()).personal_keys(model)
    # two clients train, the server averages omega, and every client (the idle one too) gets it
    state = m.init_server(model)
    clients = {c: m.init_client_state(c, model) for c in range(3)}
    ups = {}
    for c in (0, 1):
        m.load_client_model(model, m.broadcast(state, 1), clients[c])
        ups[c] = m.local_update(context(m, model, m.broadcast(state, 1), clients[c], cid=c))
    agg = WeightedMean()
    part = agg.start()
    for c, u in ups.items():
        agg.add(part, c, u)
    state = m.aggregate(state, agg.reduce([part]), 1)
    for k in state["global"]:
        assert torch.allclose(state["global"][k], (ups[0].tensors[k] + ups[1].tensors[k]) / 2), k
    for c in range(3):
        m.eval_model(model, m.eval_payload(state, 1), clients[c])
        sd = model.state_dict()
        assert all(torch.equal(sd[k], state["global"][k]) for k in state["global"])
        assert all(torch.equal(sd[k], clients[c]["personal"][k]) for k in personal)
    assert not torch.equal(clients[0]["personal"]["features.conv1.weight"], clients[1]["personal"]["features.conv1.weight"])
