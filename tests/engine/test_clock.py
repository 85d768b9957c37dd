"""Client system profiles and the simulated clock: hand-computed times, availability, memory
budgets, deadlines, and the same simulated times on any host layout; every pass a client step runs
is charged (raysim.engine.compute), whichever method runs it."""
import copy
import os

import pyarrow.parquet as pq
import pytest

from raysim.config import load_config
from raysim.core.errors import UserError
from raysim.app.experiment import federation
from raysim.engine.clock import device_time, fits_memory, read_trace
from raysim.engine.backend import InProcess
from raysim.engine.compute import ComputeMeter

LEVELS = [{"name": "fast", "flops": 1.0e9, "up_mbps": 10, "down_mbps": 50},
          {"name": "slow", "flops": 1.0e8, "up_mbps": 1, "down_mbps": 5, "availability": 0.6}]
RAW = {
    "method": "fedavg", "rounds": 3, "seed": 1,
    "data": {"dataset": "digits5", "options": {"image_size": 16},
             "partition": {"kind": "per_domain", "train_size": 40, "clients_per_domain": 2}},
    "model": {"name": "small_cnn", "norm": "bn"},
    "train": {"epochs": 1, "batch_size": 16, "lr": 0.05},
    "eval": {"every": 1},
    "runtime": {"num_hosts": 2},
    "clients": {"profiles": {"levels": LEVELS}},
}


def run(out, *overrides, **raw):
    cfg = load_config(raw={**RAW, **raw}, overrides=list(overrides))
    federation(cfg, str(out), progress=False, backend=InProcess()).run()
    return pq.read_table(os.path.join(out, "metrics.parquet")).to_pandas()


def client(df, metric):
    rows = df[(df.split == "train") & (df.client >= 0) & (df.metric == metric)]
    return {(int(r), int(c)): v for r, c, v in zip(rows["round"], rows.client, rows.value)}


def test_device_time_and_memory_by_hand():
    # 6e8 FLOPs at 1e9 FLOP/s = 0.6 s; 1.25 MB down at 50 Mbit/s = 0.2 s, 0.25 MB up at 10 Mbit/s = 0.2 s
    assert device_time({"flops": 1e9, "down_mbps": 50, "up_mbps": 10}, 6e8, 1.25e6, 2.5e5) == pytest.approx((0.6, 0.4))
    assert device_time({}, 6e8, 1e6, 1e6) == (0.0, 0.0)  # a level without speeds adds no time
    assert fits_memory({"memory_mb": 4}, 2 ** 20) and not fits_memory({"memory_mb": 3.9}, 2 ** 20)  # 4 MiB of float32
    assert fits_memory({}, 1e12)


def test_the_clock_of_a_run_is_the_profiles_and_the_same_on_any_layout(ray_session, tmp_path):
    from raysim.models import build, count_flops
    one = run(tmp_path / "one", "runtime.num_hosts=1")
    two = run(tmp_path / "two", "runtime.num_hosts=2")
    assert one.equals(two)
    # by hand for a fast client of round 1: 40 images (batches of 16, 16, 8), forward + backward
    # = 3 x 2 x MACs per sample; the payload and the upload are the model (small_cnn, float32)
    net = build("small_cnn", num_classes=10, in_channels=3, input_size=16, norm="bn")
    macs = count_flops(net, (3, 16, 16))
    size = sum(v.numel() * v.element_size() for v in net.state_dict().values())
    compute, comm = client(one, "sim_compute_s"), client(one, "sim_comm_s")
    assert compute[(1, 0)] == pytest.approx(6 * macs * 40 / 1e9)
    assert comm[(1, 0)] == pytest.approx(8 * size / 50e6 + 8 * size / 10e6)
    slow = next(k for k in compute if k[1] % 2)
    assert compute[slow] == pytest.approx(10 * compute[(1, 0)])  # the slow level: a tenth of the speed
    # availability 0.6 for the slow level (odd ids): some slow clients sit rounds out
    sampled = {r: {c for (rr, c) in compute if rr == r} for r in (1, 2, 3)}
    assert all({0, 2, 4, 6, 8} <= s for s in sampled.values()) and any(len(s) < 10 for s in sampled.values())
    rounds = one[(one.split == "clock") & (one.metric == "sim_round_s")].value.tolist()
    assert rounds == pytest.approx([max(v for (r, c), v in client(one, "sim_seconds").items() if r == k) for k in (1, 2, 3)])
    assert os.path.isfile(tmp_path / "one" / "metrics.parquet")


def test_the_hosts_clock_charges_a_methods_extra_passes(ray_session, tmp_path):
    """The engine's clock, not only the meter: Ditto's round (a global and a personal step on every
    batch) takes twice FedAvg's simulated compute on every client (the clock used to charge both
    the same: steps x batch x model)."""
    fedavg = client(run(tmp_path / "fedavg", "rounds=1"), "sim_compute_s")
    ditto = client(run(tmp_path / "ditto", "rounds=1", "method=ditto"), "sim_compute_s")
    assert ditto.keys() == fedavg.keys() and all(ditto[k] == pytest.approx(2 * fedavg[k]) for k in fedavg)


def test_deadline_and_memory_drop_clients_from_the_aggregate(ray_session, tmp_path):
    df = run(tmp_path / "deadline", clients={"profiles": {"levels": LEVELS}, "deadline_s": 1.0})
    done, dropped = client(df, "completed"), client(df, "dropped_deadline")
    assert all(done[k] == (k[1] % 2 == 0) for k in done) and all(dropped[k] == (k[1] % 2 == 1) for k in dropped)
    assert df[(df.split == "clock") & (df.metric == "sim_round_s")].value.tolist() == [1.0, 1.0, 1.0]
    # a level whose memory holds no small_cnn: its clients never train, and FedAvg averages the others
    tight = [{"name": "big"}, {"name": "tiny", "memory_mb": 0.01}]
    df = run(tmp_path / "memory", clients={"profiles": {"levels": tight}})
    mem = client(df, "dropped_memory")
    assert {c for (r, c), v in mem.items() if v} == {1, 3, 5, 7, 9}
    assert not any(c % 2 for (r, c) in client(df, "loss"))


def test_availability_trace(ray_session, tmp_path):
    trace = tmp_path / "online.csv"
    trace.write_text("client,round\n0,1\n3,1\n0,2\n7,3\n")
    assert read_trace(str(trace)) == {(0, 1), (3, 1), (0, 2), (7, 3)}
    df = run(tmp_path / "trace", clients={"profiles": {"levels": LEVELS, "trace": str(trace)}})
    seen = {(r, c) for (r, c) in client(df, "sim_seconds")}
    assert seen == {(1, 0), (1, 3), (2, 0), (3, 7)}
    with pytest.raises(UserError, match="clients.profiles.trace"):
        load_config(raw={**RAW, "clients": {"profiles": {"levels": LEVELS, "trace": "/nowhere.csv"}}})
    with pytest.raises(UserError, match="availability = 1.5"):
        load_config(raw={**RAW, "clients": {"profiles": {"levels": [{"name": "x", "availability": 1.5}]}}})


# ----------------------------------------------------------------------------- every pass is charged

def test_the_meter_charges_each_forward_and_backward_at_the_layers_multiply_accumulates():
    """Linear(3, 2) on a batch of 5: 30 MACs a forward. Trained: + 2 x 30 for its backward (input
    and weight gradients). Under no_grad: 30. Frozen, a gradient passing through it: + 30. A conv
    with one of its two filters zeroed (a pruned sub-model) costs what is left: 1 x 3 x 2 x 2 taps
    at 4 x 4 positions x 2 samples = 192."""
    import torch
    from torch import nn
    lin, x = nn.Linear(3, 2), torch.randn(5, 3)
    with ComputeMeter() as m:
        lin(x).sum().backward()
    assert m.macs == 3 * 30
    with ComputeMeter() as m, torch.no_grad():
        lin(x)
    assert m.macs == 30
    lin.requires_grad_(False)
    with ComputeMeter() as m:
        lin(x.requires_grad_()).sum().backward()
    assert m.macs == 2 * 30
    conv = nn.Conv2d(3, 2, 2)
    with torch.no_grad():
        conv.weight[1].zero_()
    with ComputeMeter() as m, torch.no_grad():
        conv(torch.randn(2, 3, 5, 5))
    assert m.macs == 3 * 2 * 2 * 16 * 2
    with ComputeMeter() as m:  # outside the meter nothing is counted; inside, any module
        pass
    lin(x)
    assert m.macs == 0



def test_the_meters_nonzero_count_is_torchs_on_every_kind_of_weight():
    """The CPU count (the bits as integers, unless -0.0 is there) gives torch.count_nonzero's int64
    count for dense weights of every float width and for weights holding 0.0, -0.0 (what a masked
    negative weight becomes), NaN, inf or a denormal, a transposed weight and an empty one."""
    import torch
    from raysim.engine.compute import count_nonzero
    dense = torch.randn(7, 5)
    cases = {"dense": dense, "float64": dense.double(), "bfloat16": dense.bfloat16(), "empty": torch.empty(0, 3),
             "int": torch.tensor([[0, 1], [2, 0]])}
    for name, value in (("zero", 0.0), ("minus zero", -0.0), ("nan", float("nan")), ("inf", float("inf")),
                        ("denormal", 1e-45)):
        w = dense.clone()
        w[3, 2] = value
        cases[name] = w
    cases["masked"] = dense * (torch.rand(7, 5) > 0.5)  # -0.0 where a negative weight was masked
    cases["transposed"] = cases["zero"].t()
    cases["float16 with -0.0"] = cases["minus zero"].half()
    for name, w in cases.items():
        got, want = count_nonzero(w), torch.count_nonzero(w)
        assert got.dtype == want.dtype == torch.int64 and got.shape == want.shape == (), name
        assert int(got) == int(want), name
    assert int(count_nonzero(cases["minus zero"])) == 34 and int(count_nonzero(cases["nan"])) == 35

TINY = {
    "seed": 4,
    "data": {"dataset": "digits5", "options": {"image_size": 16},
             "partition": {"kind": "per_domain", "train_size": 12, "domains": ["mnist", "usps"]}},
    "model": {"name": "small_cnn", "norm": "bn"},
    "train": {"epochs": 1, "batch_size": 8, "lr": 0.05, "momentum": 0.5},
    # DapperFL's five device levels; client 0 on C4 (rho 0.6 for the methods that prune by level)
    "clients": {"profiles": {"levels": ["C1", "C2", "C3", "C4", "C5"], "assign": [3, 0]}},
}


def charged(method, hp=None, rounds=1, **train):
    """(MACs the meter charges client 0's step in the last of ``rounds`` rounds, the method, the
    model it trained, the upload): the real method on a tiny federation, in this process. Client 0
    holds 12 training images (batches of 8 and 4)."""
    import torch
    from raysim.core.contract import ClientContext
    from raysim.engine.federation import Federation
    from raysim.core.seeding import generator_for
    raw = {**TINY, "method": method, "train": {**TINY["train"], **train}}
    if hp:
        raw["hp"] = {method: hp}
    cfg = load_config(raw=raw)
    fed = Federation(cfg)
    m = fed.method
    model = fed.initial_model()
    payload = m.broadcast(m.init_server(model), 1)
    state = m.init_client_state(0, model)
    for rnd in range(1, rounds + 1):
        m.load_client_model(model, payload, state)
        ctx = ClientContext(client_id=0, domain=fed.domain(0), round=rnd, model=model, payload=payload, state=state,
                            data=fed.client_data(0).for_method(), train=cfg.train, lr=cfg.train.lr,
                            generator=generator_for(cfg.seed, rnd, 0, "train"), device=torch.device("cpu"),
                            profile=fed.profile(0))
        with ComputeMeter() as meter:
            up = m.local_update(ctx)
        state = ctx.state
    return meter.macs, m, model, up


def dense_macs(model) -> int:
    from raysim.models import count_flops
    return count_flops(model, (3, 16, 16))


def test_fedavg_is_charged_three_passes_of_its_model_per_sample():
    macs, _, model, _ = charged("fedavg")
    assert macs == 3 * dense_macs(model) * 12


def test_dittos_personal_solver_doubles_fedavgs_compute():
    """One step of each solver on every batch (the global model's and the personal model's)."""
    fedavg, _, model, _ = charged("fedavg")
    ditto, _, _, _ = charged("ditto")
    assert ditto == 2 * fedavg and ditto >= 1.9 * fedavg


def test_moon_is_charged_its_two_frozen_forwards():
    """From round 2 each batch also runs the received global model's and the previous local
    model's trunks (no gradient): 3 x M + 2 x (M - the classifier's MACs) per sample."""
    macs, _, model, _ = charged("moon", {"head": "none"}, rounds=2)
    m = dense_macs(model)
    head = model.head.in_features * model.head.out_features
    assert macs == 3 * m * 12 + 2 * (m - head) * 12
    first, _, _, _ = charged("moon", {"head": "none"}, rounds=1)  # round 1 contrasts nothing
    assert first == 3 * m * 12


def test_sub_model_methods_are_charged_their_sub_model_as_before():
    """FedMP and NeFL train a sub-model and run no other pass: 3 x its MACs per sample, the figure
    their client_footprint gives (what the clock charged before every pass was metered)."""
    for method in ("fedmp", "nefl"):
        macs, m, model, _ = charged(method)
        foot = m.client_footprint(0, {"params": 0.0, "macs": float(dense_macs(model))})
        assert foot["macs"] < dense_macs(model), method  # tier 3: a pruned model
        assert macs == pytest.approx(3 * foot["macs"] * 12), method


def test_dapperfl_is_charged_its_dense_epoch_pruned_epochs_and_bn_pass():
    """E = 3: one dense fine-tune epoch (3 x M), two pruned epochs (3 x the masked model's
    non-zero MACs), and with bn_stats: recovered one dense forward over D_i (M), which the clock
    used to add by hand and now sees."""
    from raysim.models import count_flops
    for bn_stats, extra in (("pruned", 0), ("recovered", 1)):
        macs, m, model, up = charged("dapperfl", {"rho": 0.6, "bn_stats": bn_stats}, epochs=3)
        dense = dense_macs(model)
        pruned = copy.deepcopy(model)
        pruned.load_state_dict(up.tensors)  # w * M: what the pruned epochs ran
        sub = count_flops(pruned, (3, 16, 16), nonzero_only=True)
        assert sub < 0.7 * dense
        assert macs == pytest.approx(3 * dense * 12 + 2 * 3 * sub * 12 + extra * dense * 12), bn_stats


def test_a_pass_the_method_does_not_declare_is_charged(monkeypatch):
    """A toy method: FedAvg plus a forward of the model under no_grad on every batch, declared
    nowhere: charged 3 x M + M per sample."""
    import torch
    import torch.nn.functional as F
    from raysim.methods import registry
    from raysim.methods.fedavg import FedAvg

    class PeekingFedAvg(FedAvg):
        name = "peeking_fedavg"

        def local_update(self, ctx):
            opt = ctx.optimizer()
            for x, y in ctx.batches():
                with torch.no_grad():
                    ctx.model(x)
                ctx.step(F.cross_entropy(ctx.model(x), y), opt)
            return self.upload(ctx, ctx.stats())

    monkeypatch.setitem(registry._METHODS, "peeking_fedavg", PeekingFedAvg)
    macs, _, model, _ = charged("peeking_fedavg")
    assert macs == 4 * dense_macs(model) * 12


def test_dittos_lam_auto_is_charged_a_personal_solver_per_grid_value_and_their_validation_passes():
    """lam auto trains one personal model per value of the grid (3) beside the global one, then
    scores each on the client's validation split (a forward pass per sample): 2 x a fixed lambda's
    training, plus 3 x M x n_val."""
    from raysim.engine.federation import Federation
    ditto, _, _, _ = charged("ditto")
    auto, _, model, _ = charged("ditto", {"lam": "auto"})
    n_val = len(Federation(load_config(raw={**TINY, "method": "ditto"})).client_data(0).for_method().val)
    assert n_val >= 4 and auto == 2 * ditto + 3 * dense_macs(model) * n_val
