"""Privacy and compression stages in a real federation (raysim.core.stages): the same metrics on 1
and 2 hosts and after a resume with DP (adaptive clip, noise) and top-k compression on; ε in the
metrics is dp-accounting's; the compressed size is what is charged; methods whose uploads the
stages cannot bound are refused in one line."""
import math
import os

import pyarrow.parquet as pq
import pytest

from raysim.app.experiment import federation, resume_config
from raysim.config import load_config
from raysim.core.errors import Interrupted, UserError
from raysim.engine.backend import InProcess

RAW = {
    "method": "fedavg", "rounds": 3, "seed": 3, "clients_per_round": 4,
    "data": {"dataset": "digits5", "options": {"image_size": 16},
             "partition": {"kind": "per_domain", "train_size": 16, "domains": ["usps", "mnist"],
                           "clients_per_domain": 4}},
    "model": {"name": "small_cnn", "norm": "bn"},
    "train": {"epochs": 1, "batch_size": 8, "lr": 0.05, "momentum": 0.5},
    "eval": {"every": 1, "splits": ["test"], "clients": "all"},
    "runtime": {"num_hosts": 2},
    "checkpoint": {"every": 1, "keep": 3},
    "privacy": {"clip": 0.5, "noise_multiplier": 1.0, "adaptive": {"count_noise": 2.0}},
    "compression": {"kind": "topk", "fraction": 0.05},
}


def cfg(*overrides, **raw):
    return load_config(raw={**RAW, **raw}, overrides=list(overrides))


def metrics(out):
    return pq.read_table(os.path.join(str(out), "metrics.parquet")).to_pandas()


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    out = tmp_path_factory.mktemp("two")
    federation(cfg(), str(out), progress=False, backend=InProcess()).run()
    return metrics(out)


def test_one_host_gives_the_metrics_of_two(two_hosts, tmp_path):
    federation(cfg("runtime.num_hosts=1"), str(tmp_path), progress=False, backend=InProcess()).run()
    assert metrics(tmp_path).equals(two_hosts)


def test_a_resumed_run_gives_the_metrics_of_the_undisturbed_one(two_hosts, tmp_path):
    """The adaptive clip's C (server state) and the top-k residuals (client records) are
    checkpointed: the run interrupted after round 2 resumes to the same metrics."""
    def stop_after_round_2(rnd, summary, evaluation):
        if rnd == 2:
            raise KeyboardInterrupt
    with pytest.raises(Interrupted):
        federation(cfg(), str(tmp_path), progress=False, backend=InProcess(), on_round=stop_after_round_2).run()
    federation(resume_config(str(tmp_path), []), str(tmp_path), progress=False, backend=InProcess()).run(resume=True)
    assert metrics(tmp_path).equals(two_hosts)


def test_epsilon_clip_and_compressed_bytes_in_the_metrics(two_hosts):
    import dp_accounting as dpa
    from dp_accounting import rdp
    server = two_hosts[two_hosts.split == "server"].pivot_table(index="round", columns="metric", values="value")
    for r in (1, 3):  # fixed-size sampling of 4 of 8: replace-one, sensitivity 2C
        acc = rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
        acc.compose(dpa.SampledWithoutReplacementDpEvent(8, 4, dpa.GaussianDpEvent(0.5)), r)
        assert server.loc[r, "epsilon"] == pytest.approx(acc.get_epsilon(1 / 8), rel=1e-12)
    assert server.loc[1, "clip"] == 0.5 and server.loc[2, "clip"] != 0.5  # C_0, then the adaptive update
    comm = two_hosts[two_hosts.split == "comm"].pivot_table(index="round", columns="metric", values="value")
    dense = comm.loc[1, "bytes_down"]  # 4 clients' float32 models (and an int64 buffer each) went down
    assert comm.loc[1, "bytes_up"] < 0.12 * dense  # 5% of the entries, value and index each: ~10%


def test_no_stages_section_leaves_the_config_as_it_was():
    raw = {k: v for k, v in RAW.items() if k not in ("privacy", "compression")}
    d = load_config(raw=raw).to_dict()
    assert "privacy" not in d and "compression" not in d
    assert cfg().to_dict()["privacy"]["clip"] == 0.5


@pytest.mark.parametrize("method, why", [
    ("fdse", "keeps every client's upload"),
    ("scaffold", "control-variate update"),
    ("fpl", "data-derived statistics"),
])
def test_methods_the_stages_cannot_bound_are_refused_in_one_line(tmp_path, method, why):
    from raysim.app.configs import load_checked
    from raysim.testing import config_for
    raw = {**config_for(method), "privacy": {"clip": 1.0, "noise_multiplier": 1.0}, "rounds": 1}
    with pytest.raises(UserError, match=why) as err:
        federation(load_checked(raw=raw), str(tmp_path), progress=False, backend=InProcess()).run()
    assert "\n" not in str(err.value)


def test_sampling_the_accountant_does_not_model_is_refused():
    with pytest.raises(UserError, match="power_of_choice"):
        _build(cfg("clients.selection.kind=power_of_choice"))
    with pytest.raises(UserError, match="deadline"):
        _build(cfg("clients.deadline_s=10"))
    with pytest.raises(UserError, match="pld"):
        _build(cfg("privacy.accountant=pld"))
    assert _build(cfg("privacy.accountant=pld", "clients.selection.kind=poisson")).privacy.accounting.sampling == "poisson"


def _build(c):
    from raysim.core.stages import from_config
    from raysim.engine.federation import Federation
    fed = Federation(c)
    return from_config(c, fed.method, population=fed.num_clients, per_round=4)


def test_the_checkpoint_holds_the_residuals_and_the_adaptive_clip(tmp_path):
    """What a resume needs and the resume test alone would not miss: each trained client's
    error-feedback residual in its record, the adaptive clip's C in the server's state."""
    import torch
    from raysim.engine import checkpoint
    federation(cfg("rounds=2"), str(tmp_path), progress=False, backend=InProcess()).run()
    saved = checkpoint.read(str(tmp_path), 1, cfg("rounds=2"))
    records = saved["clients"]
    trained = [c for c, r in records.items() if "residual" in r]
    assert len(trained) == 4  # the 4 clients of round 1
    residual = records[trained[0]]["residual"]
    assert any(torch.count_nonzero(v) > 0 for v in residual.values())
    assert saved["server"]["stages"]["clip"] != 0.5  # C after round 1's update


def test_cohorts_give_the_metrics_of_clients_trained_one_by_one(two_hosts, tmp_path):
    """Each host's two clients of a round in one cohort (``balance: owner`` hands a host all of
    them at once): the metrics of the per-client run to the cohort's float32 rounding
    (raysim.engine.cohort: 1e-5 relative per client; 7e-6 here after 3 rounds)."""
    import numpy as np
    federation(cfg("runtime.cohort_size=2", "runtime.balance=owner"), str(tmp_path), progress=False,
               backend=InProcess()).run()
    got = metrics(tmp_path)
    assert got.drop(columns="value").equals(two_hosts.drop(columns="value"))
    assert np.allclose(got["value"], two_hosts["value"], rtol=5e-5, atol=0)
    assert not got["value"].equals(two_hosts["value"])  # the cohorts did train: not the per-client path


def test_a_buffered_federation_runs_through_the_stages_alike_on_one_and_two_hosts(tmp_path):
    """FedBuff with DP and top-k: the folded deltas are the clipped, compressed ones, the step's
    noise keyed by the step; ε accounted per step (stated approximate)."""
    buffered = ("method=fedbuff", "clients.profiles.levels=2", "schedule.buffer=2", "schedule.concurrency=4",
                "privacy.adaptive=null")
    runs = []
    for hosts in (1, 2):
        out = tmp_path / str(hosts)
        federation(cfg(*buffered, f"runtime.num_hosts={hosts}"), str(out), progress=False, backend=InProcess()).run()
        runs.append(metrics(out))
    assert runs[0].equals(runs[1])
    server = runs[0][runs[0].split == "server"].pivot_table(index="round", columns="metric", values="value")
    assert list(server.index) == [1, 2, 3] and server.epsilon.is_monotonic_increasing


def test_a_buffered_adaptive_clip_counts_each_arrival_once_whatever_its_staleness(tmp_path):
    """Andrew et al.'s count of unclipped updates over a buffered step's K arrivals: with no noise,
    the step's share is a whole number of arrivals over K, stale ones counting 1 like fresh ones
    (the fold weights an upload's statistics by w, not by w·s(τ), which would make it a fraction)."""
    k = 2
    buffered = ("method=fedbuff", "clients.profiles.levels=2", f"schedule.buffer={k}", "schedule.concurrency=6",
                "clients_per_round=6", "privacy.noise_multiplier=0", "compression=null", "rounds=8", "eval.every=8")
    federation(cfg(*buffered), str(tmp_path), progress=False, backend=InProcess()).run()
    df = metrics(tmp_path)
    stale = df[(df.metric == "staleness") & (df.client >= 0) & (df.value > 0)]
    assert len(stale) >= 2  # stale arrivals folded
    unclipped = df[(df.split == "server") & (df.metric == "unclipped")].value.to_numpy()
    assert len(unclipped) == 8 and all(abs(u * k - round(u * k)) < 1e-12 for u in unclipped), unclipped
    assert 0 < unclipped.mean() < 1  # some clipped, some not: the count is not trivially constant


def test_summary_and_progress_say_the_privacy_spent(two_hosts, tmp_path, capsys):
    from raysim.app.progress import Progress
    from raysim.app.report import privacy_section
    text = privacy_section({"fedavg": [two_hosts, two_hosts]})  # two seeds alike: one value each
    eps = two_hosts[(two_hosts.split == "server") & (two_hosts.metric == "epsilon")].value.iloc[-1]
    assert "## Privacy spent" in text and f"| fedavg       | 3        | {eps:.3g} |" in text
    Progress(3, "fedavg").update(2, 0.5, {}, epsilon=1.234)
    assert "ε 1.23" in capsys.readouterr().err


@pytest.mark.slow
def test_ray_actors_give_the_metrics_of_the_in_process_run(two_hosts, ray_session, tmp_path):
    """The same federation with its server and two hosts as Ray actors (the stages built in each
    actor, the clip sent with the broadcast): the metrics of the in-process run."""
    federation(cfg(), str(tmp_path), progress=False).run()
    assert metrics(tmp_path).equals(two_hosts)


def test_a_mistake_inside_a_section_names_its_key():
    with pytest.raises(UserError, match=r"^config key 'compression.kind' = 'zip': expected 'topk' or 'quantize'$"):
        cfg("compression.kind=zip")
    with pytest.raises(UserError, match="privacy: give 'clip'"):
        load_config(raw={**RAW, "privacy": {"noise_multiplier": 1.0}})
