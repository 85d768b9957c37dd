"""The search directory: resume checks, Tune state backups, and the command line's errors (no Ray)."""
import os

import pytest
import yaml

from raysim.cli import main as cli_main
from raysim.core.errors import UserError
from raysim.tuning.search import backup_state, prepare_dir, repair_state
from raysim.tuning.spec import load_spec


def spec_of(tiny_experiment, *overrides):
    return load_spec(raw={"method": "fedprox", "experiment": tiny_experiment()}, overrides=list(overrides))


def test_a_new_directory_gets_search_yaml(tmp_path, tiny_experiment):
    out = tmp_path / "s"
    assert prepare_dir(str(out), spec_of(tiny_experiment, "trials=2")) is False
    rec = yaml.safe_load((out / "search.yaml").read_text())
    assert rec["trials"] == 2 and rec["experiment"]["rounds"] == 2 and rec["method"] == "fedprox"
    # the same search again, before Tune saved anything: a fresh start, not an error
    assert prepare_dir(str(out), spec_of(tiny_experiment, "trials=2")) is False


def test_a_different_search_in_the_same_directory_is_refused(tmp_path, tiny_experiment):
    out = tmp_path / "s"
    prepare_dir(str(out), spec_of(tiny_experiment, "trials=2"))
    with pytest.raises(UserError) as err:
        prepare_dir(str(out), spec_of(tiny_experiment, "trials=3", "rounds=4"))
    assert "trials: 2 -> 3" in str(err.value) and "experiment.rounds: 2 -> 4" in str(err.value)


def test_a_foreign_directory_is_refused(tmp_path, tiny_experiment):
    (tmp_path / "thing.txt").write_text("x")
    with pytest.raises(UserError, match="not a raysim search directory"):
        prepare_dir(str(tmp_path), spec_of(tiny_experiment))


def _write_state(d, stamp, ok=True):
    os.makedirs(d, exist_ok=True)
    (d / f"experiment_state-{stamp}.json").write_text('{"trial_data": []}' if ok else "")
    (d / f"search_gen_state-{stamp}.json").write_bytes(b"\x80\x04K\x01.")
    (d / f"searcher-state-{stamp}.pkl").write_bytes(b"\x80\x04K\x02.")


def test_state_backup_and_repair(tmp_path):
    exp, bak = tmp_path / "tune", tmp_path / "tune-backup"
    _write_state(exp, "2026-01-01_00-00-00")
    sig = backup_state(str(exp), str(bak))
    assert sig is not None and len(os.listdir(bak)) == 3
    assert backup_state(str(exp), str(bak), sig) == sig  # unchanged: nothing copied
    # a kill during Tune's copy leaves an empty state: the backup replaces it
    (exp / "experiment_state-2026-01-01_00-00-00.json").write_text("")
    assert backup_state(str(exp), str(bak), None) is None  # an unreadable state is never backed up
    assert repair_state(str(exp), str(bak))
    assert (exp / "experiment_state-2026-01-01_00-00-00.json").read_text() == '{"trial_data": []}'
    # a newer, truncated session is dropped in favour of the backed-up one
    _write_state(exp, "2026-01-02_00-00-00", ok=False)
    assert repair_state(str(exp), str(bak))
    assert not (exp / "experiment_state-2026-01-02_00-00-00.json").exists()
    # nothing readable and no backup: nothing to restore
    empty = tmp_path / "other"
    _write_state(empty, "2026-01-03_00-00-00", ok=False)
    assert not repair_state(str(empty), str(tmp_path / "none"))


@pytest.mark.parametrize("args, fragment", [
    (["tune"], "raysim tune needs a CONFIG file"),
    (["tune", "missing.yaml"], "config file not found: missing.yaml"),
    (["tune", "{cfg}", "metric=test_avg"], "never selects on a test metric"),
    (["tune", "{cfg}", "space.train.lr={{loguniform: [0, 1]}}"], "loguniform needs low > 0"),
    (["tune", "{cfg}", "sampler.bogus=1"], "unexpected keyword argument 'bogus'"),
    (["tune", "{cfg}", "scheduler.brackets=0"], "scheduler asha: brackets must be positive"),
])
def test_user_errors_are_one_line_with_exit_code_2(args, fragment, tmp_path, capsys, monkeypatch, tiny_experiment):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.yaml").write_text(yaml.safe_dump({"method": "fedprox", "experiment": tiny_experiment()}))
    code = cli_main([a.format(cfg="t.yaml") for a in args])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("raysim: error: ") and fragment in lines[0], err
    assert not (tmp_path / "runs").exists()  # nothing started
