"""Every registered method on an accelerator, on a machine without one: its model on the simulated
accelerator of ``accelerator.py`` (``torch.device("meta")`` with real values, a GPU's placement
rules), the server's and the clients' tensors where the engine keeps them: the placement rule
written once in ``raysim/core/contract.py``'s module docstring.

Between rounds the engine keeps the server's state and every client's state (and the model a
client leaves training, for ``eval.point: post_train``) on the CPU (``runtime.device_state_mb`` at
its default 0); during a round the payload is on the host's device, moved there once per round as
the host does (``raysim.core.tensors.to_device``). So ``init_server``, ``broadcast``,
``init_client_state`` and two rounds of ``local_update`` (the second one from the state the first
left) must neither mix a CPU tensor into the device's arithmetic (a GPU host would crash) nor leave
a device tensor in what is kept. A method added later is covered by being registered."""
import warnings

import pytest
import torch

from accelerator import devices, on_accelerator, simulated_accelerator
from raysim.config import load_config
from raysim.core.contract import ClientContext
from raysim.methods import registry
from raysim.engine.federation import Federation
from raysim.core.seeding import generator_for
from raysim.core.tensors import to_device

TINY = {
    "seed": 3,
    "data": {"dataset": "digits5", "options": {"image_size": 8},
             "partition": {"kind": "per_domain", "train_size": 8, "domains": ["mnist", "usps"]}},
    "model": {"name": "small_cnn", "norm": "bn"},
    "train": {"epochs": 1, "batch_size": 8, "lr": 0.05, "momentum": 0.5, "grad_clip": 10.0},
    "hp": {"csac": {"stage1_epochs": 1}, "fdse": {"adapt_epochs": 1}, "fedadg": {"ce_epochs": 1}},
}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def dataset():
    cfg = load_config(raw={**TINY, "method": "fedavg"})
    return Federation(cfg).dataset


def not_on_cpu(**trees) -> dict[str, str]:
    return {f"{name}{path}": where for name, tree in trees.items()
            for path, where in devices(tree).items() if where != "cpu"}


@pytest.mark.parametrize("method", registry.names())
def test_method_keeps_its_state_on_the_cpu_when_it_trains_on_an_accelerator(method, dataset):
    cfg = load_config(raw={**TINY, "method": method})
    fed = Federation(cfg, dataset=dataset)
    m = fed.method
    with warnings.catch_warnings(), simulated_accelerator() as device:
        warnings.simplefilter("ignore")  # torch warns that loading into a "meta" parameter is a no-op: not here
        model = on_accelerator(fed.initial_model())
        server = m.init_server(model)
        payload = m.broadcast(server, 1)
        state = m.init_client_state(0, model)
        assert not not_on_cpu(server=server, payload=payload, state=state)
        payload = to_device(payload, device, what="payload")  # as the host does, once per round
        for rnd in (1, 2):
            m.load_client_model(model, payload, state)
            ctx = ClientContext(client_id=0, domain=fed.domain(0), round=rnd, model=model, payload=payload,
                                state=state, data=fed.client_data(0).for_method(), train=cfg.train, lr=cfg.train.lr,
                                generator=generator_for(cfg.seed, rnd, 0, "train"), device=device,
                                profile=fed.profile(0))
            m.local_update(ctx)
            state = ctx.state
            trained = m.post_train_state(ctx)
            assert not not_on_cpu(state=state, trained=trained), rnd


def test_the_simulated_accelerator_enforces_a_gpus_rules():
    """The stand-in itself: values survive, mixing fails, moves copy."""
    with warnings.catch_warnings(), simulated_accelerator() as device:
        warnings.simplefilter("ignore")
        net = on_accelerator(torch.nn.Linear(2, 1))
        x = torch.tensor([[1.0, 2.0]]).to(device)
        with torch.no_grad():
            net.weight.copy_(torch.tensor([[3.0, 4.0]]))  # a CPU source may be copied in
            net.bias.zero_()
        assert float(net(x)) == 11.0 and devices(net(x)) == {"": "accelerator"}
        with pytest.raises(RuntimeError, match="same device"):
            net.weight + torch.ones(1, 2)  # a CPU operand: a GPU refuses it
        assert devices(net.weight * torch.tensor(2.0)) == {"": "accelerator"}  # a CPU scalar is fine
        back = net.weight.detach().cpu()
        assert devices(back) == {"": "cpu"} and back.tolist() == [[3.0, 4.0]]
        back.zero_()
        assert net.weight.detach().cpu().tolist() == [[3.0, 4.0]]  # .cpu() copied
