"""Checkpoints (raysim.engine.checkpoint): damaged bytes that still load, truncated files, NaN state,
failed writes, another config's checkpoint, and only the newest kept.

Every checkpoint's meta.json records the SHA-256 of its other files; a mismatch (or NaN/inf in
the loaded state) makes that checkpoint unreadable, and a resume falls back to the previous one
with a one-line warning naming the file, then replays to the same metrics as an undisturbed run.
"""
import errno
import json
import os
import shutil
import zipfile

import pyarrow.parquet as pq
import pytest
import torch

from raysim.engine import checkpoint
from raysim.config import load_config
from raysim.core.errors import UserError
from raysim.app.experiment import federation, resume_config
from raysim.engine.metrics import MetricsLog

SMALL = {
    "method": "fedbn", "rounds": 4, "seed": 5,
    "data": {"dataset": "digits5", "options": {"image_size": 16},
             "partition": {"kind": "per_domain", "train_size": 16}},
    "model": {"name": "small_cnn"},
    "train": {"batch_size": 16, "lr": 0.05, "momentum": 0.9},
    "eval": {"every": 2},
    "runtime": {"num_hosts": 1, "cpus_per_host": 1},
    "checkpoint": {"every": 1, "keep": 3},
}


def small():
    return load_config(raw=SMALL)


def cfg(*overrides):
    return load_config(raw=SMALL, overrides=list(overrides))


def metrics(run_dir):
    return pq.read_table(os.path.join(run_dir, "metrics.parquet")).to_pandas()


def _write_two(tmp_path, nan_at=None):
    c = small()
    log = MetricsLog()
    log.add(1, -1, "ALL", "test", "accuracy", 0.5)
    for rnd in (2, 4):
        w = torch.full((64,), float(rnd))
        if rnd == nan_at:
            w[3] = float("nan")
        checkpoint.write(str(tmp_path), rnd, c, {"global": {"w": w}},
                         {0: {"state": {"b": torch.ones(3) * rnd}, "trained": True}}, log.table(), keep=2)
    return c


def _zero_middle(path):
    """Zero a run of bytes in the middle of a file, keeping its size."""
    data = bytearray(path.read_bytes())
    n = len(data)
    data[n // 3: 2 * n // 3] = bytes(2 * n // 3 - n // 3)
    path.write_bytes(bytes(data))


def _zero_largest_tensor(path):
    """Zero the stored bytes of the largest tensor in a torch.save archive: the zip's headers stay
    intact, so torch.load still succeeds (with zeros where the weights were)."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as fh:
        fh.seek(info.header_offset + 26)
        name_len, extra_len = int.from_bytes(fh.read(2), "little"), int.from_bytes(fh.read(2), "little")
        fh.seek(info.header_offset + 30 + name_len + extra_len)
        fh.write(bytes(info.compress_size))


def _as_format_2(ckpt_dir):
    """Rewrite a checkpoint's meta.json as the previous format (no checksums)."""
    meta_path = os.path.join(ckpt_dir, "meta.json")
    with open(meta_path, encoding="utf-8") as fh:
        meta = json.load(fh)
    meta.pop("sha256", None)
    meta["format_version"] = 2
    with open(meta_path, "w", encoding="utf-8") as fh:
        json.dump(meta, fh)


# ---------------------------------------------------------------- without Ray

def test_meta_json_records_every_files_sha256(tmp_path):
    _write_two(tmp_path)
    d = tmp_path / "checkpoints" / "round-000004"
    meta = json.loads((d / "meta.json").read_text())
    assert meta["format_version"] == checkpoint.FORMAT_VERSION == 3
    assert sorted(meta["sha256"]) == ["clients.pt", "metrics.parquet", "server.pt"]
    import hashlib
    for name, digest in meta["sha256"].items():
        assert hashlib.sha256((d / name).read_bytes()).hexdigest() == digest


@pytest.mark.parametrize("victim", ["server.pt", "clients.pt", "metrics.parquet"])
def test_zeroed_bytes_fail_the_checksum_and_the_previous_checkpoint_loads(tmp_path, victim):
    c = _write_two(tmp_path)
    _zero_middle(tmp_path / "checkpoints" / "round-000004" / victim)
    with pytest.raises(UserError, match=f"round-000004/{victim} is unreadable: damaged .*SHA-256"):
        checkpoint.read(str(tmp_path), 4, c)
    warnings = []
    got = checkpoint.latest(str(tmp_path), c, warn=warnings.append)
    assert got["round"] == 2 and torch.equal(got["server"]["global"]["w"], torch.full((64,), 2.0))
    assert len(warnings) == 1 and victim in warnings[0] and "trying the previous checkpoint" in warnings[0]


def test_nan_in_an_unverified_checkpoint_is_reported_as_damage_not_divergence(tmp_path):
    c = _write_two(tmp_path, nan_at=4)
    _as_format_2(tmp_path / "checkpoints" / "round-000004")
    with pytest.raises(UserError, match=r"checkpoint damaged: .*round-000004/server\.pt \(round 4\) holds NaN "
                                        r"or infinite values at \['global'\]\['w'\]") as err:
        checkpoint.read(str(tmp_path), 4, c)
    assert "train.lr" not in str(err.value) and "diverged" not in str(err.value)
    warnings = []
    assert checkpoint.latest(str(tmp_path), c, warn=warnings.append)["round"] == 2
    assert "unverified" in warnings[0] and "checkpoint damaged" in warnings[1]


def test_nan_written_into_a_checkpoint_is_told_apart_from_damage(tmp_path):
    c = _write_two(tmp_path, nan_at=4)  # checksums match: the state was NaN when written
    with pytest.raises(UserError, match="holds NaN or infinite values .* although its checksum matches"):
        checkpoint.read(str(tmp_path), 4, c)
    assert checkpoint.latest(str(tmp_path), c, warn=lambda _: None)["round"] == 2


def test_format_2_checkpoint_loads_with_one_warning(tmp_path):
    c = _write_two(tmp_path)
    _as_format_2(tmp_path / "checkpoints" / "round-000004")
    warnings = []
    got = checkpoint.latest(str(tmp_path), c, warn=warnings.append)
    assert got["round"] == 4 and torch.equal(got["server"]["global"]["w"], torch.full((64,), 4.0))
    assert len(warnings) == 1 and "format 2, without checksums" in warnings[0] and "\n" not in warnings[0]


def test_no_readable_checkpoint_left_says_the_run_starts_again(tmp_path):
    c = _write_two(tmp_path)
    for rnd in (2, 4):
        _zero_middle(tmp_path / "checkpoints" / f"round-{rnd:06d}" / "server.pt")
    warnings = []
    assert checkpoint.latest(str(tmp_path), c, warn=warnings.append) is None
    assert "trying the previous checkpoint" in warnings[0]
    assert "no checkpoint left: starting again from round 1" in warnings[1]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES, errno.EROFS])
def test_a_failed_write_removes_its_tmp_folder_and_reraises_the_same_error(tmp_path, monkeypatch, code):
    c = _write_two(tmp_path)
    failure = OSError(code, os.strerror(code))

    def full_disk(table, where, **kw):
        with open(where, "wb") as fh:
            fh.write(b"PAR1 partial")  # something on disk, as a real failure leaves
        raise failure

    monkeypatch.setattr(checkpoint.pq, "write_table", full_disk)
    with pytest.raises(OSError) as err:
        checkpoint.write(str(tmp_path), 6, c, {"w": torch.ones(2)}, {}, MetricsLog().table(), keep=2)
    assert err.value is failure
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["round-000002", "round-000004"]
    monkeypatch.undo()
    assert checkpoint.latest(str(tmp_path), c, warn=pytest.fail)["round"] == 4


class _Capped:
    """A binary file that runs out of space after ``limit`` bytes, as a full disk does."""

    def __init__(self, fh, limit):
        self.fh, self.left = fh, limit

    def write(self, data):
        n = memoryview(data).nbytes
        if n > self.left:
            self.fh.write(bytes(memoryview(data).cast("B")[: self.left]))
            self.left = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.left -= n
        return self.fh.write(data)

    def __getattr__(self, name):
        return getattr(self.fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.fh.close()


def test_disk_full_inside_torch_save_is_the_os_error_not_torchs(tmp_path, monkeypatch):
    """torch.save reports a write that fails mid-archive as its own RuntimeError ("unexpected
    pos ..."); the checkpoint writer raises the file system's OSError instead."""
    c = _write_two(tmp_path)
    real_open = open
    monkeypatch.setattr(checkpoint, "open", lambda path, mode="r", *a, **kw: (
        _Capped(real_open(path, mode, *a, **kw), 5000) if mode == "wb" else real_open(path, mode, *a, **kw)),
        raising=False)
    with pytest.raises(OSError) as err:
        checkpoint.write(str(tmp_path), 6, c, {"w": torch.ones(50_000)}, {}, MetricsLog().table(), keep=2)
    assert err.value.errno == errno.ENOSPC
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["round-000002", "round-000004"]


@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.5, 0.99])
@pytest.mark.parametrize("victim", ["server.pt", "clients.pt", "metrics.parquet", "meta.json"])
def test_truncated_checkpoint_is_a_clear_error_and_the_previous_one_loads(tmp_path, victim, fraction):
    c = _write_two(tmp_path)
    path = tmp_path / "checkpoints" / "round-000004" / victim
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(UserError, match=f"checkpoint file .*round-000004/{victim} is unreadable"):
        checkpoint.read(str(tmp_path), 4, c)
    warnings = []
    got = checkpoint.latest(str(tmp_path), c, warn=warnings.append)
    assert got["round"] == 2 and torch.equal(got["server"]["global"]["w"], torch.full((64,), 2.0))
    assert len(warnings) == 1 and victim in warnings[0]


def test_checkpoint_of_another_config_is_refused(tmp_path):
    _write_two(tmp_path)
    with pytest.raises(UserError, match="written by a different config"):
        checkpoint.read(str(tmp_path), 4, cfg("train.lr=0.2"))


def test_keep_only_the_newest(tmp_path):
    _write_two(tmp_path)
    c = cfg()
    checkpoint.write(str(tmp_path), 6, c, {}, {}, MetricsLog().table(), keep=2)
    assert checkpoint.list_rounds(str(tmp_path)) == [4, 6]


def test_pruning_keeps_this_runs_checkpoints_beside_another_configs_higher_numbered_ones(tmp_path):
    """Pruning went by round number: another run's rounds 6-8 in the folder outranked this run's
    newest checkpoint, which was deleted as soon as it was written. Now only this config's
    checkpoints older than the one just written are pruned (the run refuses such a folder before
    it starts anyway: tests/app/test_rundir.py)."""
    other, c = cfg("seed=0"), small()
    for rnd in (6, 7, 8):
        checkpoint.write(str(tmp_path), rnd, other, {}, {}, MetricsLog().table(), keep=3)
    for rnd in (1, 2, 3):
        checkpoint.write(str(tmp_path), rnd, c, {}, {}, MetricsLog().table(), keep=2)
        assert rnd in checkpoint.list_rounds(str(tmp_path))
    assert checkpoint.list_rounds(str(tmp_path)) == [2, 3, 6, 7, 8]
    checkpoint.write(str(tmp_path), 1, c, {}, {}, MetricsLog().table(), keep=2)  # a replay: never a newer one
    assert checkpoint.list_rounds(str(tmp_path)) == [1, 2, 3, 6, 7, 8]
    assert [checkpoint.recorded_config(str(tmp_path), r) for r in (3, 8)] == [
        checkpoint.config_fingerprint(c), checkpoint.config_fingerprint(other)]


# ---------------------------------------------------------------- a real run resumed

@pytest.fixture(scope="module")
def undisturbed(ray_session, tmp_path_factory):
    """A finished 4-round run; its checkpoints of rounds 1-3 stay on disk."""
    out = str(tmp_path_factory.mktemp("integrity"))
    federation(small(), out, progress=False).run()
    assert checkpoint.list_rounds(out) == [1, 2, 3]
    return out


def test_status_metrics_and_checkpoints_carry_the_configs_fingerprint(undisturbed):
    from raysim.engine.metrics import recorded_config
    from raysim.engine.runstate import recorded
    fingerprint = checkpoint.config_fingerprint(small())
    assert json.loads(open(os.path.join(undisturbed, "status.json")).read())["config"] == fingerprint
    assert recorded_config(os.path.join(undisturbed, "metrics.parquet")) == fingerprint
    assert recorded(undisturbed) == {"status.json": fingerprint, "metrics.parquet": fingerprint,
                                     **{f"checkpoints/round-00000{r}": fingerprint for r in (1, 2, 3)}}


def _copy_unfinished(src, dst):
    shutil.copytree(src, dst)
    for name in ("metrics.parquet", "status.json"):
        os.remove(os.path.join(dst, name))
    return dst


@pytest.mark.slow
def test_damaged_checkpoints_are_skipped_and_the_resumed_run_equals_the_undisturbed_one(undisturbed, tmp_path,
                                                                                       capsys):
    """One resumed run, two kinds of damage (one run, not two: the suite's time is tight).
    Round 3's server.pt has a tensor's bytes zeroed: it still loads, only the checksum tells
    (before: loaded silently, metrics off). Round 2 is a pre-checksum (format 2) checkpoint whose
    bytes make NaNs (before: "training diverged ... try a lower train.lr"). Both are named and
    skipped; the run replays from round 1 to the undisturbed metrics. The folder is also one that
    a raysim before the config fingerprints left: its metrics.parquet carries none (its checkpoints
    always did); it resumes, and what the run writes now carries one."""
    from raysim.engine.loop import finished
    from raysim.engine.metrics import recorded_config
    out = _copy_unfinished(undisturbed, str(tmp_path / "run"))
    old_metrics = os.path.join(out, "metrics.parquet")
    pq.write_table(pq.read_table(os.path.join(undisturbed, "metrics.parquet")).replace_schema_metadata(None),
                   old_metrics)
    assert recorded_config(old_metrics) is None
    zeroed = os.path.join(out, "checkpoints", "round-000003", "server.pt")
    _zero_largest_tensor(zeroed)
    before = torch.load(zeroed, weights_only=True)  # still loadable: only a checksum tells
    assert any(torch.count_nonzero(t) == 0 for t in before["global"].values() if t.numel() > 100)

    d = os.path.join(out, "checkpoints", "round-000002")
    state = torch.load(os.path.join(d, "server.pt"), weights_only=True)
    key = max(state["global"], key=lambda k: state["global"][k].numel())
    state["global"][key].view(-1)[:8] = float("nan")
    torch.save(state, os.path.join(d, "server.pt"))
    _as_format_2(d)

    c = resume_config(out, [])
    assert not finished(out, c)
    federation(c, out, progress=False).run(resume=True)
    assert finished(out, c) and recorded_config(old_metrics) == checkpoint.config_fingerprint(c)
    err = capsys.readouterr().err
    assert "round-000003/server.pt is unreadable: damaged" in err and "trying the previous checkpoint" in err
    assert "checkpoint damaged:" in err and "round-000002/server.pt (round 2)" in err
    assert "train.lr" not in err
    assert metrics(out).equals(metrics(undisturbed))
