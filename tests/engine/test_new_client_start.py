"""A new client's start loads only what can be read (raysim.engine.host._training_record): with
the contract's own ``init_client_state`` and ``load_client_model`` and a payload whose shared
tensors cover the rest of the model, the initial model's personal tensors alone; otherwise the
whole initial model, as before. Either way the client trains from the same model."""
import math

import pytest
import torch

from raysim.config import load_config
from raysim.core.tensors import load_tensors
from raysim.engine.messages import unbox


def _host(method: str):
    from raysim.engine.host import ClientHost
    from raysim.engine.server import Server
    cfg = load_config(raw={
        "method": method, "rounds": 1, "seed": 3, "clients_per_round": 4,
        "data": {"dataset": "digits5", "options": {"image_size": 16},
                 "partition": {"kind": "per_domain", "train_size": 16, "clients_per_domain": 2,
                               "domains": ["mnist", "usps"]}},
        "model": {"name": "small_cnn", "norm": "bn"},
        "train": {"epochs": 1, "batch_size": 8, "lr": 0.05},
        "runtime": {"num_hosts": 1}})
    server, host = Server(cfg), ClientHost(0, cfg, num_hosts=1, gpu_ids=[])
    server.start()
    host.start()
    box, _ = server.broadcast(1, [0])
    return host, unbox(box)


def _spoil(model) -> None:
    """A previous client's leftovers, made loud: every tensor NaN (integer ones -1)."""
    with torch.no_grad():
        for t in model.state_dict().values():
            t.fill_(-1 if not t.is_floating_point() else math.nan)


def _finite(tensors) -> bool:
    return all(bool(torch.isfinite(t.float()).all()) for t in tensors.values())


@pytest.mark.parametrize("method", ["fedavg", "fedbn"])
def test_with_the_contracts_own_start_only_the_personal_tensors_are_loaded(method):
    host, payload = _host(method)
    personal = set(host.method.personal_keys(host.model))
    assert bool(personal) == (method == "fedbn") and host._contract_start
    _spoil(host.model)
    record = host._training_record(0, None, payload)
    sd = host.model.state_dict()
    assert _finite({k: sd[k] for k in personal}) and not _finite({k: v for k, v in sd.items() if k not in personal})
    for k in personal:  # the client's state is its initial personal tensors
        assert torch.equal(record["state"]["personal"][k], host._init_sd[k])
    host.method.load_client_model(host.model, payload, record["state"])  # and the payload covers the rest
    expected = {**payload["global"], **{k: host._init_sd[k] for k in personal}}
    assert all(torch.equal(v, expected[k]) for k, v in host.model.state_dict().items())


def test_a_method_that_reads_more_of_the_model_gets_the_whole_initial_model():
    host, payload = _host("fedavg")

    class ReadsTheModel(type(host.method)):
        def init_client_state(self, client_id, model):
            return {"first_weight": model.state_dict()["features.conv1.weight"].clone()}

    host.method.__class__ = ReadsTheModel
    assert not host._contract_start
    _spoil(host.model)
    record = host._training_record(0, None, payload)
    assert torch.equal(record["state"]["first_weight"], host._init_sd["features.conv1.weight"])
    assert _finite(host.model.state_dict())


def test_a_payload_that_leaves_part_of_the_model_out_gets_the_whole_initial_model():
    host, payload = _host("fedavg")
    left_out = "features.conv1.bias"
    partial = {**payload, "global": {k: v for k, v in payload["global"].items() if k != left_out}}
    _spoil(host.model)
    host._training_record(0, None, partial)
    assert _finite(host.model.state_dict())
    host.store.put(0, {"state": {"personal": {}}})  # a client with a record: nothing is loaded
    _spoil(host.model)
    assert host._training_record(0, None, payload) == {"state": {"personal": {}}}
    load_tensors(host.model, host._init_sd)
    assert _finite(host.model.state_dict())


def test_only_a_hosts_first_call_is_flagged_as_its_warm_up():
    """The driver leaves that call out of the host's pace (raysim.engine.balance.Paces)."""
    host, payload = _host("fedavg")
    box = [payload]  # without Ray a box holds the object itself
    first = host.train_clients(1, box, [0])
    second = host.train_clients(1, box, [1])
    assert first.first and not second.first and second.examples == {1: 16}
