"""One Ray instance for the whole session (Ray takes ~3 s to start): 2 CPUs and one *logical*
GPU, so fractional-GPU placement is exercised for real on a machine without a GPU."""
import os

import pytest


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    import ray

    os.environ.setdefault("RAYSIM_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    if not ray.is_initialized():
        ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, _node_ip_address="127.0.0.1",
                 logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()
