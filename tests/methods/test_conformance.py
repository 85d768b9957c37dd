"""Every registered method against the engine's promises, on a tiny federation in this process
(the real round loop, Server and ClientHost; raysim.engine.backend.InProcess instead of actors):

* two rounds give identical metrics with 1 host and one client per host, and with every client
  trained on the other of 2 hosts than its own (its record moved there and back: work stealing);
* a round leaves torch's, numpy's and Python's global random state untouched;
* every client's stored state round-trips through ``torch.load(weights_only=True)``;
* the ``global`` and ``lodo`` protocols run and score the unseen domain;
* with a model that has dropout (cnn6), the metrics are the same for every layout too: its masks
  come from each client's keyed generator (raysim.models.dropout), not from a host's global one.

A method added later is covered by being an entry point (pyproject.toml); a method of a user's
own file (a plugin, ``module:Class``) by being listed in PLUGINS: the example FedNova."""
import io
import random
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from raysim.config import load_config
from raysim.app.experiment import federation
from raysim.engine.store import same_record
from raysim.methods import registry
from raysim.engine.backend import InProcess
from raysim.testing import ElsewherePlan, config_for, run_rounds
from raysim.engine.loop import Callback


class KeepHosts(Callback):
    def on_start(self, run):
        run.kept_hosts = [h.obj for h in run.hosts]


pytestmark = pytest.mark.usefixtures("one_thread")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PLUGINS = ["fednova:FedNova"]  # methods of users' own files (examples/), resolved by module:Class
# FedAvg with another server step (raysim.methods.fedopt): the clients and the layout are FedAvg's, and
# the server step runs once on the server whatever the layout; FedAdam stands for the four here
SAME_PATH_AS_FEDADAM = {"fedavgm", "fedyogi", "fedadagrad"}


@pytest.fixture
def examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))


@pytest.mark.parametrize("method", [m for m in registry.names() if m not in SAME_PATH_AS_FEDADAM] + PLUGINS)
def test_method_conforms(method, tmp_path, ray_session, examples_on_path):
    # a round never draws from (or reseeds) the global generators: the one-host run, also the
    # reference of the layouts below, between two looks at torch's, numpy's and Python's state
    torch.manual_seed(123), np.random.seed(123), random.seed(123)
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    cfg = load_config(raw=config_for(method))
    assert cfg.runtime.num_hosts == 1
    fed = federation(cfg, str(tmp_path / "one_host"), progress=False, backend=InProcess())
    fed.callbacks.append(KeepHosts())
    fed.run()
    assert torch.equal(torch.get_rng_state(), before[0])
    assert np.array_equal(np.random.get_state()[1], before[1]) and random.getstate() == before[2]

    # the same metrics whatever the host layout (two hosts each training its own clients is not
    # run apart: "elsewhere" below is two hosts too)
    one_host = pq.read_table(tmp_path / "one_host" / "metrics.parquet").to_pandas()
    frames = [run_rounds(method, tmp_path / "per_client", "runtime.num_hosts=null", "runtime.clients_per_host=1")]
    # and whichever host trains a client: each on the host after its owner, its record moving both ways
    frames.append(run_rounds(method, tmp_path / "elsewhere", "runtime.num_hosts=2", plan=ElsewherePlan))
    for other in frames:
        assert other.equals(one_host)
    pooled = registry.get(method).pools_clients  # one client holding every client's data (DeepAll)
    domains = {"mnist+usps+svhn"} if pooled else {"mnist", "usps", "svhn"}
    assert set(one_host[one_host.split == "test"].domain) >= domains | {"AVG"}

    # every client record a checkpoint would hold loads back with weights_only=True
    assert fed.kept_hosts
    for host in fed.kept_hosts:
        # a buffered schedule keeps no record equal to the client's initial one (FedBuff's, FedAsync's)
        assert len(host.store) > 0 or fed.buffered
        for cid, record in host.store.items():
            buf = io.BytesIO()
            torch.save(record, buf)
            buf.seek(0)
            back = torch.load(buf, weights_only=True)
            assert same_record(back, record), (method, cid)

    # the global model, and leave-one-domain-out with the unseen domain scored
    glob = run_rounds(method, tmp_path / "global", "eval.protocol=global", "rounds=1")
    assert glob[(glob.split == "test") & (glob.domain == "AVG")].value.notna().all()
    lodo = run_rounds(method, tmp_path / "lodo", "eval.protocol=lodo", "data.partition.holdout=usps", "rounds=1")
    target = lodo[(lodo.split == "test") & (lodo.client >= 0)]
    assert set(target.domain) == {"usps"} and len(target[target.metric == "accuracy"]) == 1


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ditto", "fedbn"])
def test_dropout_draws_the_same_masks_whatever_the_layout(method, tmp_path, ray_session):
    """cnn6 (dropout 0.5 before both hidden FC layers) at 8 px: 1 host, 2 hosts and one client per
    host give identical metrics. Ditto trains a second (personal) copy of the network; FedBN's
    unseen client (leave-one-domain-out) collects its BN statistics in train mode."""
    model = ["model.name=cnn6", "data.options.image_size=8"]
    # (two hosts each training its own clients is not run apart: "elsewhere" below is two hosts too)
    layouts = (["runtime.num_hosts=1"], ["runtime.num_hosts=null", "runtime.clients_per_host=1"])
    protocol = ["eval.protocol=lodo", "data.partition.holdout=usps"] if method == "fedbn" else []
    frames = [run_rounds(method, tmp_path / f"layout{i}", *model, *protocol, *layout)
              for i, layout in enumerate(layouts)]
    for other in frames[1:]:
        assert other.equals(frames[0])
    losses = frames[0][(frames[0].split == "train") & (frames[0].metric == "loss")].value
    assert len(losses) and losses.notna().all()
