"""runtime.deterministic: deterministic kernels on every host, the cuBLAS variable in each host
actor's environment from its start, and a one-line error for an operation torch has no
deterministic kernel for (``put_`` is one even on the CPU)."""
import os

import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

from raysim.config import load_config
from raysim.core.errors import UserError
from raysim.app.experiment import federation
from raysim.models import registry
from raysim.models.registry import register
from raysim.engine.backend import InProcess
from raysim.engine.determinism import ENV, actor_options, configure, nondeterministic_error

RAW = {
    "method": "fedavg", "rounds": 2, "seed": 2,
    "data": {"dataset": "digits5", "options": {"image_size": 16},
             "partition": {"kind": "per_domain", "train_size": 24, "domains": ["usps", "mnist"]}},
    "model": {"name": "small_cnn", "norm": "bn"},
    "train": {"epochs": 1, "batch_size": 8, "lr": 0.05, "momentum": 0.5},
    "eval": {"every": 1, "splits": ["test"], "clients": "all"},
    "runtime": {"num_hosts": 2},
}


def cfg_of(*overrides, **raw):
    return load_config(raw={**RAW, **raw}, overrides=list(overrides))


@pytest.fixture
def restore_torch_flags():
    """In one process (InProcess backend) configure() changes this process's torch flags: put them back."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark, {k: os.environ.get(k) for k in ENV})
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1], before[2]
    for k, v in before[3].items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_off_by_default_and_actor_env_only_when_on():
    assert cfg_of().runtime.deterministic is False
    assert actor_options(cfg_of().runtime) == {}
    on = cfg_of("runtime.deterministic=true").runtime
    assert actor_options(on) == {"runtime_env": {"env_vars": {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}}}


def test_configure_sets_torch_flags(restore_torch_flags):
    torch.use_deterministic_algorithms(False)
    configure(False)
    assert not torch.are_deterministic_algorithms_enabled()
    configure(True)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"]


def _metrics(out):
    df = pq.read_table(os.path.join(out, "metrics.parquet")).to_pandas()
    return df[df.split != "comm"].reset_index(drop=True)


def test_deterministic_run_gives_the_same_metrics_on_cpu(tmp_path, restore_torch_flags):
    torch.use_deterministic_algorithms(False)
    federation(cfg_of(), str(tmp_path / "a"), progress=False, backend=InProcess()).run()
    assert not torch.are_deterministic_algorithms_enabled()  # off: the hosts leave torch's defaults
    federation(cfg_of("runtime.deterministic=true"), str(tmp_path / "b"), progress=False, backend=InProcess()).run()
    assert torch.are_deterministic_algorithms_enabled()  # the in-process hosts configured this process
    a, b = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    assert len(a) and set(a.metric) >= {"accuracy", "loss"}
    pd.testing.assert_frame_equal(a, b)


@pytest.mark.slow
def test_host_actors_start_with_the_cublas_variable(ray_session):
    """The variable is in the host process's environment from its start (/proc/PID/environ is the
    environment the process was started with), put there by the actor's runtime_env."""
    import ray

    from raysim.engine.cluster import create_pool, stop_pool

    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ  # not inherited from this process
    cfg = cfg_of("runtime.deterministic=true", "runtime.num_hosts=1", "runtime.cpus_per_host=0.5")
    hosts, _, pg = create_pool(cfg, 1, 2)
    try:
        pid = ray.get(hosts[0].ready.remote())["pid"]
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = dict(kv.split(b"=", 1) for kv in fh.read().split(b"\0") if b"=" in kv)
    finally:
        stop_pool(hosts, pg)
    assert env.get(b"CUBLAS_WORKSPACE_CONFIG") == b":4096:8"


class _PutProbe(nn.Module):
    """A linear classifier whose forward also writes with ``Tensor.put_`` (no deterministic kernel,
    on any device)."""

    def __init__(self, num_classes: int, in_channels: int, input_size: int):
        super().__init__()
        self.fc = nn.Linear(in_channels * input_size * input_size, num_classes)

    def forward(self, x):
        mark = torch.zeros(2, device=x.device)
        mark.put_(torch.tensor([0], device=x.device), torch.ones(1, device=x.device))
        return self.fc(x.flatten(1)) + 0 * mark[0]


@pytest.fixture
def put_probe_model():
    """The probe registered for this test only (the zoo's tests sweep every registered model)."""
    def _det_put_probe(*, num_classes: int = 10, in_channels: int = 3, input_size: int = 16, norm: str = "none"):
        return _PutProbe(num_classes, in_channels, input_size)
    register("det_put_probe")(_det_put_probe)
    try:
        yield "det_put_probe"
    finally:
        registry._BUILDERS.pop("det_put_probe", None)


def test_operation_without_deterministic_kernel_is_one_line_user_error(tmp_path, restore_torch_flags,
                                                                       put_probe_model):
    model = {"name": "det_put_probe", "norm": "none"}
    federation(cfg_of(model=model), str(tmp_path / "off"), progress=False, backend=InProcess()).run()  # runs when off
    with pytest.raises(UserError) as err:
        federation(cfg_of("runtime.deterministic=true", model=model), str(tmp_path / "on"), progress=False,
                   backend=InProcess()).run()
    msg = str(err.value)
    assert "\n" not in msg
    assert "put_" in msg and "'det_put_probe'" in msg and "runtime.deterministic=false" in msg


def test_translation_of_torch_messages():
    cuda = RuntimeError("adaptive_avg_pool2d_backward_cuda does not have a deterministic implementation, but you "
                        "set 'torch.use_deterministic_algorithms(True)'. You can turn off determinism just for "
                        "this operation, or you can use the 'warn_only=True' option, if that's acceptable for "
                        "your application.")
    e = nondeterministic_error(cuda, "resnet10")
    assert isinstance(e, UserError) and "\n" not in str(e)
    assert "adaptive_avg_pool2d_backward_cuda" in str(e) and "'resnet10'" in str(e)
    cublas = RuntimeError("Deterministic behavior was enabled with either `torch.use_deterministic_algorithms(True)` "
                          "or `at::Context::setDeterministicAlgorithms(true)`, but this operation is not "
                          "deterministic because it uses CuBLAS and you have CUDA >= 10.2. To enable "
                          "deterministic behavior in this case, you must set an environment variable before "
                          "running your PyTorch application: CUBLAS_WORKSPACE_CONFIG=:4096:8 or "
                          "CUBLAS_WORKSPACE_CONFIG=:16:8.")
    assert "cuBLAS" in str(nondeterministic_error(cublas, "cnn6"))
    assert nondeterministic_error(RuntimeError("CUDA out of memory"), "cnn6") is None
    assert nondeterministic_error(ValueError("put_ does not have a deterministic implementation"), "x") is None


def test_ray_backend_translates_the_error_of_a_remote_call(ray_session):
    """The error as a host actor's call returns it to the driver (a RayTaskError around torch's)."""
    import ray

    from raysim.engine.backend import RayActors

    @ray.remote(num_cpus=0.1)
    def flagged_op():
        torch.use_deterministic_algorithms(True)
        torch.zeros(2).put_(torch.tensor([0]), torch.ones(1))

    backend = RayActors()
    backend.model = "cnn6"
    with pytest.raises(UserError, match=r"operation put_ in model 'cnn6'"):
        backend.get(flagged_op.remote())
