import torch

from raysim.engine.store import ClientStateStore, state_nbytes


def test_idle_clients_spill_to_disk_and_come_back_identical(tmp_path):
    store = ClientStateStore(memory_budget_bytes=3 * (4 * 100 + 128), spill_dir=str(tmp_path))
    states = {c: {"personal": {"w": torch.full((100,), float(c))}, "round": c} for c in range(10)}
    for c, s in states.items():
        store.put(c, s)
    assert store.spills >= 7
    assert store.bytes_in_memory <= store.budget
    assert len(store) == 10 and all(c in store for c in range(10))
    assert len(list(tmp_path.iterdir())) == store.spills - 0  # one file per spilled client
    for c in range(10):
        got = store.get(c)
        assert got["round"] == c and torch.equal(got["personal"]["w"], states[c]["personal"]["w"])
    assert dict((c, s["round"]) for c, s in store.items()) == {c: c for c in range(10)}


def test_unknown_client_has_no_state(tmp_path):
    assert ClientStateStore(1e6, str(tmp_path)).get(3) is None


def test_state_nbytes_counts_tensor_bytes():
    assert state_nbytes(torch.zeros(10, dtype=torch.float64)) == 80


def test_packed_states_come_back_equal_and_mixed_states_stay_as_they_are(tmp_path):
    from raysim.engine.store import Packed, pack, unpack

    state = {"personal": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3).t(),  # non-contiguous
                          "n": torch.tensor(7), "mask": torch.tensor([True, False, True]),
                          "empty": torch.zeros(0, 4), "half": torch.ones(3, dtype=torch.float16)},
             "history": [torch.full((5,), 2.0, dtype=torch.float64), 3, "x", None],
             "pair": (1.5, torch.tensor([1, 2], dtype=torch.int32)), "round": 4}
    packed = pack(state, {})
    assert isinstance(packed, Packed)
    back = unpack(packed)

    def same(a, b):
        if isinstance(a, torch.Tensor):
            return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                    and torch.equal(a, b))
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b

    assert same(state, back) and same(state, unpack(packed, copy=True))
    back["personal"]["w"].add_(1)  # views of the stored buffer: in-place updates persist
    assert same(unpack(packed)["personal"]["w"], state["personal"]["w"] + 1)
    for odd in ({"p": torch.nn.Parameter(torch.ones(2))}, {"g": torch.ones(2, requires_grad=True)},
                {"b": torch.ones(2, dtype=torch.bfloat16)}, {"o": object()}, {"none": 1}):
        assert pack(odd, {}) is None
    store = ClientStateStore(1e9, str(tmp_path))
    store.put(1, state)
    store.put(2, {"p": torch.nn.Parameter(torch.ones(2))})
    assert same(store.get(1), {**state, "personal": {**state["personal"], "w": state["personal"]["w"]}})
    assert isinstance(store.get(2)["p"], torch.nn.Parameter)
    assert same(dict(store.items())[1], state)
