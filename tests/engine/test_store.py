import torch

from raysim.runtime.store import ClientStateStore, state_nbytes


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
