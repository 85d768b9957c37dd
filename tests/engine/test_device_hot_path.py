"""The device-resident hot path (the placement rule of ``raysim.core.contract``), checked on the CPU.

* The host's moves between CPU and device memory (``raysim.core.tensors.to_device``, which counts them)
  grow with hosts, not with clients: one payload move and one partial-result move per host per
  round, whether the host trains 2 clients or 8.
* ``accumulate``'s fused ``add_(t, alpha=w)`` is used on the CPU only where it rounds exactly like
  the float64 product then the sum, so CPU sums are bit for bit those of that formula.
* On the simulated accelerator (``tests/methods/accelerator.py``): the sums stay on the uploads'
  device until the partial leaves the host in one move; a client's state stays on the device
  within ``runtime.device_state_mb`` and the least recently used spill to CPU memory, then disk.
"""
import os
import sys
import warnings

import numpy as np
import pytest
import torch

from raysim.core.aggregation import KeepAll, WeightedMean, accumulate, exact_product
from raysim.config import load_config
from raysim.core.contract import Upload
from raysim.engine.store import ClientStateStore
from raysim.core.tensors import TRANSFERS, cpu_copy, keep_state_on, to_device

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "methods"))
from accelerator import devices, simulated_accelerator  # noqa: E402


# ----------------------------------------------------------------------------- bit for bit on the CPU

def old_accumulate(sums, tensors, weight):
    """The CPU formula before the device-resident path: a float64 copy, times w, added."""
    for k, t in tensors.items():
        v = t.detach().to("cpu", torch.float64, copy=True).mul_(float(weight))
        if k in sums:
            sums[k].add_(v)
        else:
            sums[k] = v


@pytest.mark.parametrize("weights", [[3, 17, 1, 250, 4096], [1.0] * 5, [0.1, 1 / 3, 2.5, 0.7, 123456.0],
                                     [536870912.0, 7.0, 536870913.0, 2.0**-40, -5.0]])
def test_cpu_sums_are_bit_identical_to_the_float64_product_then_sum(weights):
    g = torch.Generator().manual_seed(0)
    new, old = {}, {}
    for w in weights:
        scale = 10.0 ** torch.randint(-8, 8, (1,), generator=g).item()
        t = {"w": torch.randn(4099, generator=g) * scale, "b": torch.randn(3, generator=g).half(),
             "n": torch.tensor(7 + int(w) % 5), "z": -torch.zeros(5)}
        accumulate(new, t, w)
        old_accumulate(old, t, w)
    for k in old:
        assert new[k].dtype == torch.float64
        assert torch.equal(new[k].view(torch.int64), old[k].view(torch.int64)), k  # the bits, -0.0 included


def test_the_fused_kernel_alone_would_not_be_bit_identical_for_a_fractional_weight():
    """Why ``exact_product`` gates the fused form on the CPU: its kernel rounds w*t+s once (FMA)
    where the product-then-sum rounds twice; with an integer weight the product is exact and they
    agree."""
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(20000, generator=g, dtype=torch.float64) * 1e3, torch.randn(20000, generator=g)
    two_roundings = lambda w: s + t.to(torch.float64) * w  # noqa: E731
    assert torch.equal(s.clone().add_(t, alpha=17.0), two_roundings(17.0))
    fused = s.clone().add_(t, alpha=0.1)
    if torch.equal(fused, two_roundings(0.1)):  # a build without a vectorized FMA: nothing to show
        pytest.skip("this CPU kernel rounds the product separately")
    assert not exact_product(torch.float32, 0.1)


def test_exact_product_admits_weights_whose_significand_fits_29_bits():
    assert all(exact_product(torch.float32, w) for w in (0.0, 1.0, 3.0, 2.5, 2.0**29, -7.0, 2.0**-40))
    assert not any(exact_product(torch.float32, w) for w in (0.1, 1 / 3, 2.0**29 + 1, float("inf")))
    assert exact_product(torch.float16, 5.0) and not exact_product(torch.float64, 3.0)
    assert not exact_product(torch.int64, 3.0)


# ----------------------------------------------------------------------------- moves per round

def tiny_domains():
    from raysim.data.splits import ArraySplit, MultiDomainDataset
    rng = np.random.default_rng(0)
    return MultiDomainDataset("tiny", {d: {s: ArraySplit(rng.integers(0, 255, (n, 1, 8, 8)).astype(np.uint8),
                                                         rng.integers(0, 3, n), (0.5,), (0.5,))
                                           for s, n in (("train", 16), ("val", 4), ("test", 4))}
                                       for d in "ab"}, ["0", "1", "2"])


def host_rounds(monkeypatch, clients_per_domain: int, method: str = "fedbn", rounds: int = 2, device=None,
                runtime=None) -> list[dict]:
    """Server and one ClientHost in this process (no Ray): each round's ``to_device`` counts."""
    import raysim.data
    import raysim.engine.host as host_mod
    from raysim.engine.server import Server
    monkeypatch.setattr(raysim.data, "load", lambda *a, **k: tiny_domains())
    if device is not None:
        from raysim.core.seeding import generator_for
        monkeypatch.setattr(host_mod, "pick_device", lambda gpu_ids: device)
        # the stand-in has no generators of its own: the dropout stream (unused by small_cnn) on the CPU
        monkeypatch.setattr(host_mod, "generator_for", lambda *key, **_: generator_for(*key[:4]))
    cfg = load_config(raw={
        "method": method, "rounds": rounds, "seed": 1,
        "data": {"dataset": "rotated_mnist", "partition": {"kind": "per_domain", "clients_per_domain": clients_per_domain}},
        "model": {"name": "small_cnn", "norm": "bn"},
        "train": {"epochs": 1, "batch_size": 8, "lr": 0.05},
        "runtime": {"num_hosts": 1, **(runtime or {})}})
    server, host = Server(cfg), host_mod.ClientHost(0, cfg, num_hosts=1, gpu_ids=[])
    server.start()
    host.start()
    counts = []
    for rnd in range(1, rounds + 1):
        sampled = server.sample(rnd)
        assert len(sampled) == 2 * clients_per_domain
        box, personal = server.broadcast(rnd, sampled)
        TRANSFERS.reset()
        result = host.train_round(rnd, box, sampled, personal)
        counts.append({"calls": dict(TRANSFERS.calls), "tensors": dict(TRANSFERS.tensors)})
        server.aggregate(rnd, result)
    counts.append(host)
    return counts


# what a client owns and must move itself (its state, its own payload): the only moves that may
# grow with the clients
PER_CLIENT = {"state", "personal", "load", "upload"}


def per_host(counts: dict) -> dict:
    return {k: v for k, v in counts["calls"].items() if k not in PER_CLIENT}


def test_host_moves_grow_with_hosts_not_clients(monkeypatch):
    *two, _ = host_rounds(monkeypatch, clients_per_domain=1)
    *eight, _ = host_rounds(monkeypatch, clients_per_domain=4)
    for a, b in zip(two, eight):
        assert per_host(a) == per_host(b) == {"payload": 1, "partial": 1}
        assert sum(a["tensors"].values()) == sum(b["tensors"].values()) == 0  # a CPU host moves nothing


def test_a_client_step_on_the_accelerator_moves_per_host_what_is_per_host(monkeypatch):
    """The same host on the simulated accelerator: the payload crosses once per round (every
    parameter and buffer), the partial once; what grows with the clients is only each client's own
    state (FedBN: its BN layers)."""
    with warnings.catch_warnings(), simulated_accelerator() as device:
        warnings.simplefilter("ignore")
        for k in (1, 4):
            *rounds, host = host_rounds(monkeypatch, clients_per_domain=k, device=device)
            for r in rounds:
                assert per_host(r) == {"payload": 1, "partial": 1}, r
                assert r["tensors"]["payload"] == len(host.method.init_server(host.model)["global"])
            assert set(devices(host._init_sd).values()) == {"accelerator"}  # the initial model lives there


# ----------------------------------------------------------------------------- device-resident state

def test_client_state_stays_on_the_device_within_its_budget_then_spills_to_memory_and_disk(tmp_path):
    """runtime.device_state_mb: what a step copies with ``cpu_copy`` stays on the device; the least
    recently used beyond the budget moves to CPU memory (one move), beyond that to disk."""
    with warnings.catch_warnings(), simulated_accelerator() as device:
        warnings.simplefilter("ignore")
        store = ClientStateStore(memory_budget_bytes=2 * (400 + 128), spill_dir=str(tmp_path),
                                 device_budget_bytes=2 * (400 + 128))
        kept = {}
        for cid in range(5):
            with keep_state_on(device):
                kept[cid] = {"personal": cpu_copy({"w": torch.full((100,), float(cid)).to(device)})}
            store.put(cid, kept[cid])
        where = {cid: set(devices(store.get(cid)).values()) for cid in (4, 3)}
        assert where == {4: {"accelerator"}, 3: {"accelerator"}}
        assert store.bytes_on_device <= store.device_budget and store.spills >= 1
        for cid in range(5):
            got = store.get(cid)
            assert float(got["personal"]["w"][0]) == cid  # the values, wherever they were kept
        assert set(devices(dict(store.items())).values()) == {"cpu"}  # checkpoints read CPU tensors
    with keep_state_on(None):  # the default: the CPU
        assert devices(cpu_copy({"w": torch.ones(2)})) == {"/w": "cpu"}


def test_keep_all_copies_uploads_to_the_cpu_and_weighted_mean_sums_on_the_device():
    with warnings.catch_warnings(), simulated_accelerator() as device:
        warnings.simplefilter("ignore")
        ups = [Upload({"w": torch.full((3,), float(i)).to(device)}, weight=i + 1.0) for i in range(4)]
        mean, keep = WeightedMean(), KeepAll()
        pm, pk = mean.start(), keep.start()
        for i, up in enumerate(ups):
            mean.add(pm, i, up)
            keep.add(pk, i, up)
        assert set(devices(pm.sums).values()) == {"accelerator"} \
            and set(devices({i: u.tensors for i, u in pk.items()}).values()) == {"cpu"}
        TRANSFERS.reset()
        out = mean.leave_device(pm)
        assert TRANSFERS.calls == {"partial": 1} and set(devices(out.sums).values()) == {"cpu"}
        assert torch.equal(mean.reduce([out]).mean["w"], torch.full((3,), 2.0))  # (1*0+2*1+3*2+4*3)/10
