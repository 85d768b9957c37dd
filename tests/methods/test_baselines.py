"""The baselines' equations on tiny tensors, computed by hand."""
import torch
from torch import nn

from raysim.core.aggregation import Mean, WeightedMean
from raysim.core.contract import Upload
from raysim.core.tensors import bn_keys, load_tensors
from raysim.methods.fedavg import FedAvg
from raysim.methods.fedbn import FedBN
from raysim.methods.fedprox import FedProx, proximal_term
from raysim.methods.local import Local
from raysim.engine.messages import HostRoundResult
from raysim.engine.server import Server


def tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(2, 2))


def test_fedavg_aggregate_takes_the_weighted_mean():
    m = FedAvg(FedAvg.Hparams(), setup=None)
    state = {"global": {"w": torch.zeros(2)}}
    new = m.aggregate(state, Mean({"w": torch.tensor([1.0, 2.0])}, 3, [0, 1]), 1)
    assert torch.equal(new["global"]["w"], torch.tensor([1.0, 2.0]))


def test_server_mean_is_n_weighted_and_independent_of_host_grouping():
    # clients: n=1 with w=[1, 4], n=3 with w=[5, 0]  ->  (1*[1,4] + 3*[5,0]) / 4 = [4, 1]
    w1, w2 = torch.tensor([1.0, 4.0]), torch.tensor([5.0, 0.0])

    agg = WeightedMean()

    def host(h, pairs):  # the host's half: fold each client's upload into the host's partial
        partial = agg.start()
        for i, (w, n) in enumerate(pairs):
            agg.add(partial, h * 10 + i, Upload({"w": w}, float(n)))
        return HostRoundResult(host=h, uploads=partial, personal_sums=None, bytes_up=0,
                               client_metrics={h * 10 + i: {"loss": 0.0} for i in range(len(pairs))})

    class Fake:  # the Server's aggregation path only needs method + state
        def server_metrics(self, state):
            return {}

    srv = Fake()
    srv.method = FedAvg(FedAvg.Hparams(), None)
    for grouping in ([host(0, [(w1, 1), (w2, 3)])], [host(0, [(w1, 1)]), host(1, [(w2, 3)])]):
        srv.state = {"global": {"w": torch.zeros(2)}}
        Server.aggregate(srv, 1, *grouping)
        assert torch.equal(srv.state["global"]["w"], torch.tensor([4.0, 1.0]))
        assert srv.state["global"]["w"].dtype == torch.float32

    # bit-identical regrouping on awkward float32 values
    torch.manual_seed(1)
    ws = [torch.randn(1000) * 10 ** torch.randint(-6, 3, (1000,)).float() for _ in range(6)]
    ns = [17, 3, 250, 1, 99, 40]
    results = []
    for groups in ([[0, 1, 2, 3, 4, 5]], [[0, 2, 4], [1, 3, 5]], [[0], [1], [2], [3], [4], [5]]):
        srv.state = {"global": {"w": torch.zeros(1000)}}
        Server.aggregate(srv, 1, *[host(h, [(ws[i], ns[i]) for i in g]) for h, g in enumerate(groups)])
        results.append(srv.state["global"]["w"])
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_fedprox_proximal_term_by_hand():
    w = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([[3.0]])}
    anchor = {"a": torch.tensor([0.0, 0.0]), "b": torch.tensor([[1.0]])}
    # (mu/2) * (1 + 4 + 4) = 0.05 * 9 = 0.45 with mu = 0.1
    assert abs(proximal_term(w, anchor, 0.1).item() - 0.45) < 1e-7


def test_fedprox_gradient_pulls_toward_anchor():
    p = torch.tensor([2.0], requires_grad=True)
    proximal_term({"p": p}, {"p": torch.tensor([0.5])}, 0.2).backward()
    assert torch.allclose(p.grad, torch.tensor([0.2 * 1.5]))


def test_fedbn_keeps_every_bn_entry_local_and_shares_the_rest():
    model = tiny()
    m = FedBN(FedBN.Hparams(), None)
    personal = m.personal_keys(model)
    assert personal == {"1.weight", "1.bias", "1.running_mean", "1.running_var", "1.num_batches_tracked"}
    state = m.init_server(model)
    assert set(state["global"]) == {"0.weight", "0.bias", "3.weight", "3.bias"}
    assert not personal & set(m.broadcast(state, 1)["global"])


def test_local_shares_nothing():
    model = tiny()
    m = Local(Local.Hparams(), None)
    assert m.init_server(model)["global"] == {}
    assert set(m.init_client_state(0, model)["personal"]) == set(model.state_dict())


def test_load_tensors_copies_in_place():
    model = tiny()
    ptr = model[3].weight.data_ptr()
    load_tensors(model, {"3.weight": torch.ones(2, 2)})
    assert model[3].weight.data_ptr() == ptr and torch.equal(model[3].weight, torch.ones(2, 2))
    assert bn_keys(model) == {"1.weight", "1.bias", "1.running_mean", "1.running_var", "1.num_batches_tracked"}
