"""raysim's client SGD is torch.optim.SGD's update, bit for bit, without importing torch._dynamo."""
import subprocess
import sys

import pytest
import torch
from torch import nn

from raysim.core.sgd import SGD


def _trained(optimizer_class, steps: int = 6, **settings):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))
    opt = optimizer_class(model.parameters(), lr=0.1, **settings)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 5, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt


@pytest.mark.parametrize("settings", [{}, {"momentum": 0.9}, {"momentum": 0.9, "dampening": 0.1},
                                      {"momentum": 0.5, "nesterov": True, "weight_decay": 1e-3},
                                      {"weight_decay": 5e-4, "maximize": True}])
def test_the_same_update_as_torchs_sgd(settings):
    ours, opt = _trained(SGD, **settings)
    theirs, ref = _trained(torch.optim.SGD, **settings)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    if settings.get("momentum"):  # the momentum buffers a method may keep (gPerXAN) are torch's too
        bufs = lambda o: [o.state[p]["momentum_buffer"] for g in o.param_groups for p in g["params"]]
        assert all(torch.equal(a, b) for a, b in zip(bufs(opt), bufs(ref)))


def test_step_hooks_run():
    seen = []
    model = nn.Linear(2, 1)
    opt = SGD(model.parameters(), lr=0.1)
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: seen.append("post"))
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert seen == ["pre", "post"]


def test_building_and_stepping_it_does_not_import_torch_dynamo():
    code = ("import sys, torch; from raysim.core.sgd import SGD\n"
            "m = torch.nn.Linear(3, 2); o = SGD(m.parameters(), lr=0.1, momentum=0.9)\n"
            "o.zero_grad(); m(torch.ones(1, 3)).sum().backward(); o.step()\n"
            "torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)\n"
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
