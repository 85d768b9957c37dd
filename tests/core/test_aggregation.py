"""Aggregation (raysim.core.aggregation): the aggregators by hand, and the weighted mean the hosts
fold and the server reduces, whatever the grouping of clients on hosts."""
import torch

from raysim.core.aggregation import AllUploads, KeepAll, WeightedMean, weighted_mean
from raysim.core.contract import Upload
from raysim.methods.fedavg import FedAvg
from raysim.engine.messages import HostRoundResult
from raysim.engine.server import Server


def test_aggregators_by_hand():
    a = Upload({"w": torch.tensor([1.0, 4.0]), "n": torch.tensor(3)}, 1.0, extras={"p": 1})
    b = Upload({"w": torch.tensor([5.0, 0.0]), "n": torch.tensor(6)}, 3.0)
    mean = WeightedMean()
    one, two = mean.start(), mean.start()
    mean.add(one, 4, a)
    mean.add(two, 1, b)
    out = mean.reduce([one, two])
    assert torch.equal(out.mean["w"], torch.tensor([4.0, 1.0])) and out.mean["n"] == 5  # (3 + 18) / 4 = 5.25
    assert out.mean["n"].dtype == torch.int64 and out.clients == [1, 4] and out.extras == {4: {"p": 1}}
    keep = KeepAll()
    p = keep.start()
    keep.add(p, 4, a)
    keep.add(p, 1, b)
    everything = keep.reduce([p])
    assert isinstance(everything, AllUploads) and everything.clients == [1, 4] and everything.total_weight == 4.0
    assert weighted_mean([({"w": torch.tensor([2.0])}, 0.25), ({"w": torch.tensor([6.0])}, 0.75)], total=1.0)["w"] \
        == torch.tensor([5.0])


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
        stages = None  # no privacy or compression stages

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


def test_statistics_are_folded_with_the_uploads_weights_and_kept_apart_from_the_model():
    """Upload.statistics (SCAFFOLD's Delta c_i): the same weighted float64 mean as the tensors, in
    Mean.statistics, whatever the hosts; never mixed into Mean.mean, even under the same name.
    By hand: weights 1 and 3, s = [2, -2] and [6, 2] -> (1 [2, -2] + 3 [6, 2]) / 4 = [5, 1]."""
    ups = [Upload({"w": torch.tensor([1.0])}, 1.0, statistics={"w": torch.tensor([2.0, -2.0])}),
           Upload({"w": torch.tensor([5.0])}, 3.0, statistics={"w": torch.tensor([6.0, 2.0])})]
    agg = WeightedMean()
    for groups in ([[0, 1]], [[0], [1]]):
        partials = []
        for g in groups:
            p = agg.start()
            for c in g:
                agg.add(p, c, ups[c])
            partials.append(agg.leave_device(p))
        out = agg.reduce(partials)
        assert torch.equal(out.mean["w"], torch.tensor([4.0])) and set(out.mean) == {"w"}
        assert torch.equal(out.statistics["w"], torch.tensor([5.0, 1.0])) and out.statistics["w"].dtype == torch.float32
    assert agg.reduce([agg.start()]).statistics == {}  # none uploaded: an empty dict
    keep = KeepAll()
    p = keep.start()
    keep.add(p, 0, ups[0])
    kept = keep.reduce([keep.leave_device(p)]).each[0].statistics["w"]
    assert torch.equal(kept, ups[0].statistics["w"]) and kept is not ups[0].statistics["w"]  # a copy


def test_the_engine_calls_aggregate_only_with_uploads():
    """The contract (Method.aggregate): a round whose clients all dropped has no server step."""
    class Refuses(FedAvg):
        def aggregate(self, state, uploads, round):
            raise AssertionError("aggregate called without uploads")

    class Fake:
        stages = None

        def server_metrics(self, state):
            return {}

    for aggregator in (WeightedMean(), KeepAll()):
        srv = Fake()
        srv.method = Refuses(FedAvg.Hparams(), None)
        srv.method.aggregator = aggregator
        srv.state = {"global": {"w": torch.zeros(2)}}
        dropped = {3: {"dropped_deadline": True, "completed": False, "sim_seconds": 9.0}}
        srv.cfg = type("Cfg", (), {"clients": type("Clients", (), {"deadline_s": 5.0})()})()
        summary = Server.aggregate(srv, 1, HostRoundResult(host=0, uploads=aggregator.start(), personal_sums=None,
                                                           bytes_up=0, client_metrics=dropped))
        assert torch.equal(srv.state["global"]["w"], torch.zeros(2)) and summary.clients == [3]


def test_the_server_reduces_into_buffers_of_its_own_leaving_the_hosts_sums_as_they_were():
    """reduce_sums adds into a buffer of its own (the first host's sums are not copied, the second's
    are added into a new one): the hosts' partials (which arrive as read-only views of the object
    store) are not written, and the mean is the out-of-place sum's, bit for bit."""
    torch.manual_seed(2)
    agg = WeightedMean()
    partials = []
    for h in range(3):
        partial = agg.start()
        for i in range(2):
            agg.add(partial, 10 * h + i, Upload({"w": torch.randn(50) * 10.0 ** (h - 1), "n": torch.tensor(h + i)},
                                                float(3 * h + i + 1)))
        partials.append(agg.leave_device(partial))
    before = [{k: v.clone() for k, v in p.sums.items()} for p in partials]
    out = agg.reduce(partials)
    for p, b in zip(partials, before):
        assert all(torch.equal(p.sums[k], b[k]) for k in b)
    total = sum(p.weight for p in partials)
    by_hand = (before[0]["w"] + before[1]["w"] + before[2]["w"]) / total
    assert torch.equal(out.mean["w"], by_hand.to(torch.float32))
    assert out.mean["n"] == torch.round((before[0]["n"] + before[1]["n"] + before[2]["n"]) / total).to(torch.int64)


def test_the_servers_reduce_returns_its_own_buffers_for_any_number_of_hosts_and_no_weight():
    """The cases the test above leaves out: one host (nothing to add, the division makes the new
    buffer), two, and no weight at all (a copy); none of the mean's tensors is a host's."""
    from raysim.core.aggregation import reduce_sums
    torch.manual_seed(0)
    parts = [{"w": torch.randn(7, dtype=torch.float64), "n": torch.tensor(6.0, dtype=torch.float64)} for _ in range(3)]
    dtypes = {"w": torch.float32, "n": torch.int64}
    kept = [{k: v.clone() for k, v in p.items()} for p in parts]
    for hosts in (1, 2, 3):
        for total in (4.0, 0.0):
            out = reduce_sums([(p, dtypes) for p in parts[:hosts]], total)
            summed = sum(p["w"] for p in kept[:hosts])
            want = (summed / total if total > 0 else summed).to(torch.float32)
            assert torch.equal(out["w"], want) and out["w"].dtype == torch.float32
            assert out["n"].dtype == torch.int64
            for p, k in zip(parts, kept):  # the hosts' partials as they arrived
                assert all(torch.equal(p[key], k[key]) for key in p)
            assert all(out[key].data_ptr() != p[key].data_ptr() for p in parts for key in p)
    same_dtype = reduce_sums([(parts[0], {"w": torch.float64, "n": torch.float64})], 0.0)  # a cast that copies nothing
    assert same_dtype["w"].data_ptr() != parts[0]["w"].data_ptr() and torch.equal(same_dtype["w"], parts[0]["w"])
