"""An interrupted search continues where it stopped: `raysim tune` is killed (SIGKILL, its whole
process tree) after its second trial; the same command then finishes the remaining trials
without running the finished ones again."""
import glob
import json
import os
import subprocess

import pandas as pd
import pytest
import yaml

from tunehelp import RAY_START_TIMEOUT, kill_tree, raysim_cmd, run_retrying_ray_start, wait_for


@pytest.mark.slow
def test_killed_search_resumes_without_repeating_finished_trials(tmp_path, cache_env, tiny_experiment):
    exp = tiny_experiment()
    exp["rounds"] = 1
    config = tmp_path / "resume.yaml"
    config.write_text(yaml.safe_dump({
        "method": "fedprox", "trials": 3, "max_concurrent": 1, "scheduler": "none",
        "sampler": {"kind": "random", "seed": 0},
        "space": {"train.lr": {"loguniform": [0.01, 0.1]}}, "experiment": exp}))
    out = tmp_path / "search"
    cmd = raysim_cmd("tune", str(config), "--out", str(out))
    finished = lambda: sorted(glob.glob(str(out / "trials" / "*" / "result.json")))

    log = tmp_path / "first.log"
    for attempt in range(3):  # again only if Ray itself failed to start (an overloaded machine)
        with open(log, "w") as fh:
            proc = subprocess.Popen(cmd, env=cache_env, cwd=tmp_path, stdout=fh, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            wait_for(lambda: len(finished()) >= 2, timeout=600, proc=proc, what="two finished trials")
        except AssertionError:
            kill_tree(proc)
            if RAY_START_TIMEOUT in log.read_text() and attempt < 2:
                continue
            raise AssertionError(log.read_text()[-3000:]) from None
        kill_tree(proc)
        break
    first_log = log.read_text()
    done_before = {p: (os.path.getmtime(p), open(p).read()) for p in finished()}
    assert len(done_before) >= 2, first_log
    assert not (out / "trials.parquet").exists()  # it really was cut short

    rerun = run_retrying_ray_start(cmd, env=cache_env, cwd=tmp_path, timeout=900)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "resuming the search" in rerun.stdout

    df = pd.read_parquet(out / "trials.parquet")
    assert len(df) == 3 and set(df["stop_reason"]) == {"completed"}, df.to_string()
    assert df["train.lr"].nunique() == 3
    for path, (mtime, text) in done_before.items():  # finished trials: not run again
        assert os.path.getmtime(path) == mtime and open(path).read() == text
        run_dir = os.path.dirname(path)
        assert json.load(open(path))["attempt"] == 1
        assert open(os.path.join(run_dir, "attempts")).read().strip() == "1"
        assert df.set_index("run_dir").loc[run_dir, "attempts"] == 1
    assert len(finished()) == 3
    for name in ("best.yaml", "search.png"):
        assert (out / name).is_file()
