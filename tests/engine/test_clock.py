"""Client system profiles and the simulated clock: hand-computed times, availability, memory
budgets, deadlines, and the same simulated times on any host layout."""
import os

import pyarrow.parquet as pq
import pytest

from raysim.config import load_config
from raysim.errors import UserError
from raysim.experiment import federation
from raysim.profiles import device_time, fits_memory, read_trace
from raysim.runtime.backend import InProcess

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
    # by hand for a fast client of round 1: 3 steps of 16 (40 images, batch 16), forward + backward
    # = 3 x 2 x MACs per sample; the payload and the upload are the model (small_cnn, float32)
    net = build("small_cnn", num_classes=10, in_channels=3, input_size=16, norm="bn")
    macs = count_flops(net, (3, 16, 16))
    size = sum(v.numel() * v.element_size() for v in net.state_dict().values())
    compute, comm = client(one, "sim_compute_s"), client(one, "sim_comm_s")
    assert compute[(1, 0)] == pytest.approx(6 * macs * 3 * 16 / 1e9)
    assert comm[(1, 0)] == pytest.approx(8 * size / 50e6 + 8 * size / 10e6)
    slow = next(k for k in compute if k[1] % 2)
    assert compute[slow] == pytest.approx(10 * compute[(1, 0)])  # the slow level: a tenth of the speed
    # availability 0.6 for the slow level (odd ids): some slow clients sit rounds out
    sampled = {r: {c for (rr, c) in compute if rr == r} for r in (1, 2, 3)}
    assert all({0, 2, 4, 6, 8} <= s for s in sampled.values()) and any(len(s) < 10 for s in sampled.values())
    rounds = one[(one.split == "clock") & (one.metric == "sim_round_s")].value.tolist()
    assert rounds == pytest.approx([max(v for (r, c), v in client(one, "sim_seconds").items() if r == k) for k in (1, 2, 3)])
    assert os.path.isfile(tmp_path / "one" / "metrics.parquet")


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
