"""Failed trials: a trial whose worker dies (SIGKILL of the process that runs its Tune function and
drives its federation) is retried from its federation's last checkpoint up to ``max_failures``
times; one that keeps dying fails with its cause in trials.parquet and the summary; a rerun of the
search says what it re-runs; Optuna's study agrees with trials.parquet all along.

One real search on the session's Ray (two 2-round trials at once, one epoch each, checkpoint every
round, ``max_failures: 1``): trial 1's worker is killed once, after round 1; trial 2's at both attempts.
Then the same search is run again (it re-runs trial 2), and once more (nothing left to run)."""
import contextlib
import glob
import io
import json
import os
import signal
import threading
import time

import pandas as pd
import pytest

from raysim.tuning.search import (RaysimLimiter, RaysimOptunaSearch, STUDY, resume_plan, run_search,
                                  saved_trials)
from raysim.engine.messages import RoundSummary
from raysim.tuning.spec import load_spec
from raysim.tuning.trial import Tracker

KILLED = "ActorDiedError: The actor died unexpectedly before finishing this task."


class Killer(threading.Thread):
    """Kills trial N's worker up to ``plan[N]`` times, by the pid its run directory records
    (placement.json): the first attempt once it has reported round 1 (so a checkpoint exists),
    later attempts as soon as they start."""

    def __init__(self, out, plan):
        super().__init__(daemon=True)
        self.out, self.plan = out, plan
        self.killed = {n: [] for n in plan}  # trial -> [(attempt, pid)]
        self.done = threading.Event()

    def run(self):
        while not self.done.is_set():
            for n, limit in self.plan.items():
                for d in glob.glob(str(self.out / "trials" / f"{n:03d}_*")):
                    self._maybe_kill(n, limit, d)
            time.sleep(0.05)

    def _maybe_kill(self, n, limit, d):
        try:
            pid = json.load(open(os.path.join(d, "placement.json")))["pid"]
            attempt = int(open(os.path.join(d, "attempts")).read())
        except (OSError, ValueError, KeyError):
            return
        if len(self.killed[n]) >= limit or any(pid == p for _, p in self.killed[n]):
            return
        if attempt == 1 and not os.path.isfile(os.path.join(d, "progress.json")):
            return
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if b"ray::" not in fh.read():  # only ever a Ray worker
                    return
            os.kill(pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            return
        self.killed[n].append((attempt, pid))


def study(out):
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend
    storage = JournalStorage(JournalFileBackend(str(out / "optuna.journal")))
    return optuna.load_study(study_name=STUDY, storage=storage).get_trials(deepcopy=True)


def search_once(spec, out):
    """run_search with everything it prints (its echo and the per-trial lines) captured."""
    lines, printed = [], io.StringIO()
    t0 = time.time()
    with contextlib.redirect_stdout(printed):
        result = run_search(spec, str(out), echo=lines.append)
    print(f"search took {time.time() - t0:.1f} s")
    return result, printed.getvalue().splitlines() + lines


@pytest.fixture(scope="module")
def searches(ray_session, tmp_path_factory, tiny_experiment):
    out = tmp_path_factory.mktemp("tune-failures") / "search"
    exp = tiny_experiment()
    exp["train"]["epochs"] = 1
    exp["checkpoint"] = {"every": 1}
    spec = load_spec(raw={
        "name": "failures-test", "method": "fedprox", "experiment": exp, "trials": 2, "max_concurrent": 2,
        "max_failures": 1, "scheduler": "none", "sampler": {"kind": "random", "seed": 0},
        "space": {"train.lr": {"loguniform": [0.01, 0.1]}}})
    killer = Killer(out, {1: 1, 2: 2})
    killer.start()
    try:
        first, first_lines = search_once(spec, out)
    finally:
        killer.done.set()
        killer.join()
    s = {"out": out, "killed": killer.killed, "first": first, "first_lines": first_lines,
         "first_df": pd.read_parquet(out / "trials.parquet"), "first_study": study(out)}
    s["rerun"], s["rerun_lines"] = search_once(spec, out)
    s["rerun_df"], s["rerun_study"] = pd.read_parquet(out / "trials.parquet"), study(out)
    s["third"], s["third_lines"] = search_once(spec, out)
    return s


@pytest.mark.slow
def test_a_killed_trial_is_retried_from_its_last_checkpoint(searches):
    assert [a for a, _ in searches["killed"][1]] == [1], searches["first_lines"]
    df = searches["first_df"].set_index("trial")
    assert df.loc[1, "stop_reason"] == "completed" and df.loc[1, "rounds_run"] == 2
    assert df.loc[1, "attempts"] == 2 and pd.isna(df.loc[1, "error"])
    # round 1 came from the first attempt, round 2 from the retry: it resumed at the round-1 checkpoint
    progress = json.load(open(os.path.join(df.loc[1, "run_dir"], "progress.json")))["reports"]
    assert [(r["round"], r["attempt"]) for r in progress] == [(1, 1), (2, 2)]
    assert df.loc[1, "val_avg_best"] == max(r["val_avg"] for r in progress)
    metrics = pd.read_parquet(os.path.join(df.loc[1, "run_dir"], "metrics.parquet"))
    assert not metrics.duplicated(["round", "client", "domain", "split", "metric"]).any()  # no round logged twice
    lines = "\n".join(searches["first_lines"])
    assert (f"trial 1 failed (attempt 1): {KILLED} (worker exit type SYSTEM_ERROR); retrying from its "
            "round-1 checkpoint (retry 1 of 1)") in lines, lines
    assert "(completed) after 1 retry" in lines


@pytest.mark.slow
def test_a_trial_that_keeps_failing_shows_its_cause(searches):
    assert [a for a, _ in searches["killed"][2]] == [1, 2]
    df = searches["first_df"].set_index("trial")
    assert df.loc[2, "stop_reason"] == "error" and df.loc[2, "attempts"] == 2
    assert df.loc[2, "error"].startswith(KILLED), df.loc[2, "error"]
    assert df.loc[2, "rounds_run"] == 1  # its round 1 stands (from its ledger if Tune missed the report)
    lines = searches["first_lines"]
    assert f"  trial 2 failed after 2 attempts: {KILLED} (worker exit type SYSTEM_ERROR)" in lines, lines
    summary = lines[lines.index(next(line for line in lines if line.startswith("2 trials: "))):]
    assert any(line.startswith(f"  trial 2 failed after 2 attempts: {KILLED}") for line in summary), summary
    assert not any("unknown error" in line for line in lines)
    # read from Tune's text record: no pickle of an error is left in the search directory
    out = searches["out"]
    assert list(out.rglob("error.txt")) and not list(out.rglob("error.pkl"))
    assert not (out / "raysim.lock").exists()  # each search released its lock
    assert searches["first"]["exit_code"] == 0  # trial 1 gave a best config
    # Optuna: trial 1 complete with its value, trial 2 failed once
    states = [(t.number, t.state.name, t.value) for t in searches["first_study"]]
    assert states == [(0, "COMPLETE", df.loc[1, "objective"]), (1, "FAIL", None)], states


@pytest.mark.slow
def test_a_rerun_says_what_it_reruns_and_optuna_agrees(searches):
    lines = searches["rerun_lines"]
    assert "  search complete: 2 trials; re-running 1 failed trial (trial 2) from its last checkpoint" in lines, lines
    before, df = searches["first_df"].set_index("trial"), searches["rerun_df"].set_index("trial")
    assert list(df["stop_reason"]) == ["completed", "completed"], df.to_string()
    assert df.loc[2, "attempts"] == 3 and pd.isna(df.loc[2, "error"])
    assert df.loc[1, "attempts"] == 2 and df.loc[1, "objective"] == before.loc[1, "objective"]  # not re-run
    progress = json.load(open(os.path.join(df.loc[2, "run_dir"], "progress.json")))["reports"]
    assert [(r["round"], r["attempt"]) for r in progress] == [(1, 1), (2, 3)]
    # Optuna: the failed trial stays failed once; its re-run's value is added as a completed trial
    trials = searches["rerun_study"]
    complete = {t.params["train.lr"]: t.value for t in trials if t.state.name == "COMPLETE"}
    assert complete == {lr: v for lr, v in zip(df["train.lr"], df["objective"])}
    fails = [t for t in trials if t.state.name == "FAIL"]
    assert len(fails) == 1 and fails[0].params["train.lr"] == df.loc[2, "train.lr"]
    rerun = [t for t in trials if t.user_attrs.get("rerun_of") is not None]
    assert [t.user_attrs["rerun_of"] for t in rerun] == [fails[0].number]
    # and a run of the complete search runs nothing
    assert "  search complete: 2 trials; nothing to re-run (rewriting its outputs)" in searches["third_lines"]
    assert len(study(searches["out"])) == 3


# ----------------------------------------------------------------------------- the pieces, no Ray

def test_resume_plan_says_what_runs():
    t = lambda n, status: {"trial": n, "name": f"{n:03d}_x", "status": status}
    done = [t(1, "TERMINATED"), t(2, "TERMINATED")]
    assert resume_plan(done, 2, "/s") == "search complete: 2 trials; nothing to re-run (rewriting its outputs)"
    assert resume_plan([t(1, "ERROR"), t(2, "TERMINATED"), t(3, "ERROR")], 3, "/s") == (
        "search complete: 3 trials; re-running 2 failed trials (trials 1, 3) each from its last checkpoint")
    assert resume_plan([t(1, "TERMINATED"), t(2, "RUNNING"), t(3, "ERROR")], 5, "/s") == (
        "resuming the search in /s: 1 of 5 trials finished; continuing 1 interrupted trial (trial 2), "
        "re-running 1 failed trial (trial 3), sampling 2 more (each from its last checkpoint)")
    assert resume_plan(done, 4, "/s") == "resuming the search in /s: 2 of 4 trials finished; sampling 2 more"


def test_saved_trials_trusts_the_drivers_record_of_a_failure(tmp_path):
    """Tune can save a trial whose worker died and that failed for good as RUNNING; the driver's
    ``finished`` record (written when Tune reported the failure) says it failed."""
    exp = tmp_path / "tune"
    exp.mkdir()
    trial = lambda n, tid, status: [json.dumps({"trial_id": tid, "experiment_tag": f"{n}_lr=0.1", "status": status}), "{}"]
    (exp / "experiment_state-2026-01-01_00-00-00.json").write_text(json.dumps({"trial_data": [
        trial(1, "a", "TERMINATED"), trial(2, "b", "RUNNING"), trial(3, "c", "RUNNING"), trial(4, "d", "RUNNING")]}))
    for name, files in {"002_b": {"finished": "error\n"}, "003_c": {"result.json": "{}"}, "004_d": {}}.items():
        (tmp_path / "trials" / name).mkdir(parents=True)
        for f, text in files.items():
            (tmp_path / "trials" / name / f).write_text(text)
    assert [(t["trial"], t["status"]) for t in saved_trials(str(exp), str(tmp_path))] == [
        (1, "TERMINATED"), (2, "ERROR"), (3, "TERMINATED"), (4, "RUNNING")]


def test_a_resumed_trial_keeps_its_earlier_reports_up_to_where_it_resumed():
    ev = lambda v: {"val": {"AVG": v, "ALL": v}}
    first = Tracker(rounds=4, attempt=1)
    for rnd, v in [(1, 0.5), (2, 0.7), (3, 0.6)]:
        first.update(rnd, RoundSummary(round=rnd, train_loss=1.0), ev(v))
    resumed = Tracker(rounds=4, attempt=2, earlier=first.reports)  # resumed from the round-1 checkpoint
    report = resumed.update(2, RoundSummary(round=2, train_loss=1.0), ev(0.4))  # round 2 again: 0.7 no longer counts
    assert [r["round"] for r in resumed.reports] == [1, 2] and report["val_avg_best"] == 0.5
    assert [r["attempt"] for r in resumed.reports] == [1, 2]


def test_optuna_records_a_trial_once_and_a_rerun_success_beside_its_failure(tmp_path):
    """The searcher (behind the limiter) as Tune drives it: a failure for good is told once; the
    same trial re-run by a rerun (no longer live in the limiter) and completing is added as a
    completed trial with the same parameters; telling it again changes nothing."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    from raysim.tuning import space as sp
    from raysim.tuning.spec import load_spec as _load

    spec = _load(raw={"method": "fedprox", "experiment": {"rounds": 2}, "sampler": "random"})
    storage = JournalStorage(JournalFileBackend(str(tmp_path / "optuna.journal")))
    searcher = RaysimOptunaSearch(space=sp.to_optuna(spec.space), metric="val_avg_best", mode="max",
                                  sampler=optuna.samplers.RandomSampler(seed=0), study_name=STUDY, storage=storage)
    limiter = RaysimLimiter(searcher, max_concurrent=1)
    params = limiter.suggest("t1")
    limiter.on_trial_result("t1", {"val_avg_best": 0.3, "training_iteration": 1})
    limiter.on_trial_complete("t1", error=True)  # failed for good
    limiter.on_trial_result("t1", {"val_avg_best": 0.4, "training_iteration": 2})  # its re-run reports
    limiter.on_trial_complete("t1", result={"val_avg_best": 0.45})
    limiter.on_trial_complete("t1", result={"val_avg_best": 0.45})
    trials = optuna.load_study(study_name=STUDY, storage=storage).trials
    assert [(t.state.name, t.value, t.user_attrs) for t in trials] == [
        ("FAIL", None, {}), ("COMPLETE", 0.45, {"tune_trial_id": "t1", "rerun_of": 0})]
    assert trials[1].params == trials[0].params == pytest.approx(params)
