"""``raysim new dataset NAME``: the two files it writes pass their own tests as written, the loader
keeps raysim's contract (two domains, every split, per-sample writer ids, the seed deciding the
data) and resolves as ``NAME:load_NAME``, and nothing is ever overwritten."""
from __future__ import annotations

import subprocess
import sys

import numpy as np

from raysim import data
from raysim.cli import main
from raysim.data.splits import SPLITS


def test_the_generated_loader_passes_its_generated_test_and_loads(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "mine"
    assert main(["new", "dataset", "my_writers", "--dir", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "raysim run configs/quickstart.yaml data.dataset=my_writers:load_my_writers" in out
    assert "raysim data show my_writers:load_my_writers" in out and "python -m pytest test_my_writers.py" in out
    assert sorted(p.name for p in folder.iterdir()) == ["my_writers.py", "test_my_writers.py"]
    assert "your reading code goes here" in (folder / "my_writers.py").read_text()

    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_my_writers.py"],
                       cwd=folder, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "4 passed" in r.stdout, r.stdout + r.stderr

    # as a config names it, from the folder (the current directory, as `raysim run` there)
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "my_writers", raising=False)
    try:
        ds = data.load("my_writers:load_my_writers", seed=0)
        assert ds.domains == ("paper", "screen") and ds.num_classes == 3 and ds.image_shape == (3, 24, 24)
        for domain in ds.domains:
            sizes = [len(ds.split(domain, s)) for s in SPLITS]
            assert sizes == [448, 64, 128]  # 8 writers x 80 images, 10% val and 20% test within each writer
            assert len(np.unique(ds.split(domain, "train").groups)) == 8
        assert ds.split("paper", "train").groups.max() < ds.split("screen", "train").groups.min()
        # the quickstart's partition fits it: 400 training images per domain
        assert min(len(ds.split(d, "train")) for d in ds.domains) >= 400
        assert data.options("my_writers:load_my_writers")["image_size"] == 24
    finally:
        sys.modules.pop("my_writers", None)


def test_it_never_overwrites_and_names_must_be_identifiers(tmp_path, capsys):
    (tmp_path / "test_taken.py").write_text("# mine\n")
    for name in ("taken", "my-data", "2nd", "class", "digits5", "json"):
        assert main(["new", "dataset", name, "--dir", str(tmp_path)]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and err[0].startswith("raysim: error: "), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test_taken.py"]  # neither file written
    assert (tmp_path / "test_taken.py").read_text() == "# mine\n"
