"""cluster/supervise.sh's exit-code contract, with a stub command in place of ``raysim run`` (the
supervisor is the thing under test): 75 (try later) is run again after a delay that doubles up to
RAYSIM_RETRY_MAX_DELAY; 0, 2, 130 and 143 stop it at once with that status; any other failure is
run again after RAYSIM_RETRY_DELAY; every run counts toward RAYSIM_MAX_TRIES."""
import os
import re
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUPERVISE = os.path.join(REPO, "cluster", "supervise.sh")

# exits with the next status of $STUB_CODES (one per run), logging the time it started
STUB = """#!/bin/bash
n=$(wc -l < "$STUB_DIR/starts")
date +%s.%N >> "$STUB_DIR/starts"
codes=($STUB_CODES)
exit "${codes[$n]}"
"""


def supervise(tmp_path, codes, **env):
    stub = tmp_path / "stub.sh"
    stub.write_text(STUB)
    (tmp_path / "starts").write_text("")
    run = subprocess.run(["bash", SUPERVISE, "bash", str(stub), "--out", "x"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "STUB_DIR": str(tmp_path),
                                          "STUB_CODES": " ".join(map(str, codes)), **env})
    starts = [float(t) for t in (tmp_path / "starts").read_text().split()]
    waits = [float(w) for w in re.findall(r"running it again in ([\d.]+)s", run.stderr)]
    return run, starts, waits


def test_try_later_is_retried_with_a_growing_delay_up_to_the_cap(tmp_path):
    run, starts, waits = supervise(tmp_path, [75, 75, 75, 75, 0],
                                   RAYSIM_RETRY_DELAY="0.1", RAYSIM_RETRY_MAX_DELAY="0.4")
    assert run.returncode == 0, run.stderr
    assert len(starts) == 5 and waits == [0.1, 0.2, 0.4, 0.4], run.stderr
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert all(gap >= wait for gap, wait in zip(gaps, waits)) and gaps[2] > gaps[0], gaps
    assert "asked to be run again later (status 75, try 1 of 10); running it again in 0.1s" in run.stderr


def test_another_failure_waits_the_base_delay_and_starts_the_backoff_again(tmp_path):
    run, starts, waits = supervise(tmp_path, [75, 75, 1, 75, 0], RAYSIM_RETRY_DELAY="0.05")
    assert run.returncode == 0 and len(starts) == 5, run.stderr
    assert waits == [0.05, 0.1, 0.05, 0.05], run.stderr
    assert "the command exited with status 1 (try 3 of 10); running it again in 0.05s" in run.stderr


@pytest.mark.parametrize("code", [0, 2, 130, 143])
def test_finished_usage_errors_and_stops_on_purpose_end_it_with_that_status(tmp_path, code):
    run, starts, waits = supervise(tmp_path, [75, code, 0], RAYSIM_RETRY_DELAY="0.05")
    assert run.returncode == code and len(starts) == 2 and waits == [0.05], run.stderr


def test_every_run_counts_toward_the_tries(tmp_path):
    run, starts, waits = supervise(tmp_path, [75, 1, 75, 0], RAYSIM_RETRY_DELAY="0.05", RAYSIM_MAX_TRIES="3")
    assert run.returncode == 75 and len(starts) == 3, run.stderr
    assert run.stderr.splitlines()[-1] == "raysim supervise: the command failed 3 times (last exit status 75); giving up"
