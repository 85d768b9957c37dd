"""benchmarks/chaos.py's named scenarios and its command line, without running a federation: every
scenario is listed and can be named, a wrong name is one usage error, and the kill schedule stays
the default."""
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks import chaos  # noqa: E402


def test_every_scenario_of_issue_39_is_there_once_and_listed(capsys):
    names = [s.name for s in chaos.SCENARIOS]
    assert len(names) == len(set(names))
    for needed in ("driver-before-checkpoint", "driver-during-checkpoint", "driver-mid-round", "driver-supervised",
                   "host-kill", "server-kill", "host-hang", "server-hang", "raylet-loss", "gcs-loss", "sigterm",
                   "disk-full", "disk-permission", "disk-readonly"):
        assert needed in names
    assert chaos.main(["--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in listed] == names
    assert all("expected: " in ln for ln in listed)


def test_scenario_names_parse_and_a_wrong_one_is_a_usage_error(capsys):
    ns = chaos.parse_args(["--scenario", "host-hang", "--scenario", "sigterm,raylet-loss", "--scenario", "sigterm"])
    assert ns.scenario == ["host-hang", "sigterm", "raylet-loss"]
    assert chaos.parse_args(["--scenario", "all"]).scenario == [s.name for s in chaos.SCENARIOS]
    assert chaos.parse_args([]).scenario is None  # the kill schedule of issue 32
    with pytest.raises(SystemExit) as usage:
        chaos.parse_args(["--scenario", "host-hung"])
    assert usage.value.code == 2 and "unknown scenario 'host-hung'" in capsys.readouterr().err


def test_the_hang_scenarios_set_a_short_deadline_and_expectations_are_consistent():
    by = chaos.BY_NAME
    assert all("runtime.stall_timeout_s={stall}" in by[n].extra for n in ("host-hang", "server-hang"))
    assert by["raylet-loss"].driver_rc == by["gcs-loss"].driver_rc == 75
    assert by["sigterm"].driver_rc == by["sigterm"].first_rc == 143
    disk = ("disk-full", "disk-permission", "disk-readonly")
    assert all(by[n].driver_rc == 1 and by[n].needs == "root" for n in disk)
    assert chaos._status(-9) == 137 and chaos._status(75) == 75
