"""Data with groups (a writer or user per sample) from folders and CSV manifests: group ids on every
split, their names on the dataset, and split_by='group' carving each group's val/test from its own
samples. Real PNG files in tmp_path; one-line UserErrors naming the file and line."""
import os

import numpy as np
import pytest
from PIL import Image

from raysim.data import load
from raysim.core.errors import UserError

CLASSES = {"cat": (200, 30, 30), "dog": (30, 200, 30), "owl": (30, 30, 200)}


def _img(path, colour, size=(12, 10)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path


def _groups_of(split, names):
    return [names[g] for g in split.groups]


def _check_group_carve(ds):
    """split_by='group': every group keeps train samples and, being big enough here, val and test ones;
    no sample is in two splits."""
    for d in ds.domains:
        parts = {s: ds.split(d, s) for s in ("train", "val", "test")}
        for s, sp in parts.items():
            assert sp.groups is not None and len(sp.groups) == len(sp)
        every = np.concatenate([parts[s].groups for s in parts])
        for g in np.unique(every):
            n = int((every == g).sum())
            counts = {s: int((parts[s].groups == g).sum()) for s in parts}
            assert counts["test"] == round(n * 0.25) and counts["val"] == round(n * 0.25), (d, g, counts)
        paths = [p for sp in parts.values() for p in sp.paths]
        assert len(paths) == len(set(paths))


@pytest.fixture
def grouped_tree(tmp_path):
    """ROOT/<domain>/<writer>/<class>/<image>: writer 'w2' exists in both domains, 'w10' sorts after 'w9'."""
    root = tmp_path / "grouped"
    writers = {"day": ["w1", "w2", "w10"], "night": ["w2", "w9"]}
    for d, ws in writers.items():
        for w in ws:
            for c, rgb in CLASSES.items():
                for i in range(4):
                    _img(root / d / w / c / f"{i}.png", rgb)
    return root


def test_imagefolder_grouped_layout_carries_groups_and_carves_within_them(grouped_tree):
    ds = load("imagefolder", root=grouped_tree, layout="domain/group/class", split_by="group", image_size=8,
              val_fraction=0.25, test_fraction=0.25)
    assert ds.domains == ("day", "night") and ds.classes == ("cat", "dog", "owl")
    assert ds.group_names == ("w1", "w10", "w2", "w9")  # not all integers: plain sorted order, once per dataset
    assert ds.info["layout"] == "domain/group/class" and ds.info["split_by"] == "group"
    for d in ds.domains:
        for s in ("train", "val", "test", "all"):
            sp = ds.split(d, s)
            # the group of a sample is the writer folder it came from
            assert _groups_of(sp, ds.group_names) == [p.split(os.sep)[-3] for p in sp.paths]
            assert [ds.classes[y] for y in sp.labels] == [p.split(os.sep)[-2] for p in sp.paths]
    assert set(ds.split("night", "all").groups) == {ds.group_names.index("w2"), ds.group_names.index("w9")}
    _check_group_carve(ds)
    # split_by='class' (the default) on the same tree: still grouped splits, a stratified carve
    by_class = load("imagefolder", root=grouped_tree, layout="domain/group/class", image_size=8)
    te = by_class.split("day", "test")
    assert te.groups is not None and np.bincount(te.labels).tolist() == [2, 2, 2]  # 20% of 12 per class


def test_imagefolder_default_layout_is_unchanged_and_has_no_groups(grouped_tree, tmp_path):
    flat = tmp_path / "flat"
    for c, rgb in CLASSES.items():
        for i in range(5):
            _img(flat / "only" / c / f"{i}.png", rgb)
    ds = load("imagefolder", root=flat, image_size=8)
    assert ds.group_names is None and ds.split("only", "train").groups is None
    assert "layout" not in ds.info and "split_by" not in ds.info
    with pytest.raises(UserError, match="split_by='group' needs a group per sample.*layout='domain/group/class'"):
        load("imagefolder", root=flat, split_by="group")
    with pytest.raises(UserError, match="layout='class/domain': expected one of domain/class, domain/group/class"):
        load("imagefolder", root=flat, layout="class/domain")
    with pytest.raises(UserError, match="split_by='writer': expected 'class'"):
        load("imagefolder", root=grouped_tree, layout="domain/group/class", split_by="writer")


# ------------------------------------------------------------------ CSV manifest


def _manifest(tmp_path, rows, header="path,label,group,domain", name="faces.csv"):
    path = tmp_path / name
    path.write_text("\n".join([header] + [",".join(map(str, r)) for r in rows]) + "\n")
    return path


@pytest.fixture
def manifest_rows(tmp_path):
    """Two domains, users named 1..12 (numbers as names), 4 images each, paths relative and absolute."""
    rows = []
    for user in range(1, 13):
        domain = "indoor" if user <= 6 else "outdoor"
        for i in range(4):
            c = list(CLASSES)[(user + i) % 3]
            rel = f"img/{domain}/u{user}_{i}.png"
            _img(tmp_path / rel, CLASSES[c])
            rows.append((rel if i % 2 else tmp_path / rel, c, user, domain))
    return rows


def test_manifest_labels_groups_domains_and_group_carve(tmp_path, manifest_rows):
    path = _manifest(tmp_path, manifest_rows)
    ds = load("manifest", root=path, image_size=8, split_by="group", val_fraction=0.25, test_fraction=0.25)
    assert ds.domains == ("indoor", "outdoor") and ds.classes == ("cat", "dog", "owl")
    assert ds.group_names == tuple(str(u) for u in range(1, 13))  # numeric names in numeric order
    assert ds.info["split_by"] == "group" and ds.info["groups"] == 12
    by_path = {str(tmp_path / r[0]): r for r in manifest_rows}
    for d in ds.domains:
        assert len(ds.split(d, "all")) == 24
        for s in ("train", "val", "test"):
            sp = ds.split(d, s)
            for p, y, g in zip(sp.paths, sp.labels, sp.groups):
                _, c, user, domain = by_path[p]
                assert (ds.classes[y], ds.group_names[g], domain) == (c, str(user), d)
    _check_group_carve(ds)
    x, y = ds.split("outdoor", "test").tensors(np.arange(2))
    assert x.shape == (2, 3, 8, 8)
    # no domain column: one domain named after the file; no group column: no groups
    plain = _manifest(tmp_path, [(r[0], r[1]) for r in manifest_rows], header="path,label", name="plain.csv")
    ds2 = load("manifest", root=plain, image_size=8)
    assert ds2.domains == ("plain",) and ds2.group_names is None and len(ds2.split("plain", "all")) == 48
    with pytest.raises(UserError, match=r"split_by='group' needs a group per sample.*plain.csv has no group column"):
        load("manifest", root=plain, split_by="group")


def test_manifest_errors_name_the_file_and_line(tmp_path, manifest_rows):
    rows = list(manifest_rows)
    rows[5] = ("img/indoor/not_there.png",) + tuple(rows[5][1:])
    path = _manifest(tmp_path, rows)
    with pytest.raises(UserError, match=r"faces.csv line 7: image file .*not_there.png does not exist"):
        load("manifest", root=path)
    assert sum(len(load("manifest", root=path, missing="skip").split(d, "all")) for d in ("indoor", "outdoor")) == 47
    with pytest.raises(UserError, match=r"header row lacks column\(s\) label.*found path,group"):
        load("manifest", root=_manifest(tmp_path, [("a.png", 1)], header="path,group", name="h.csv"))
    with pytest.raises(UserError, match=r"e.csv line 3: no value for label"):
        load("manifest", root=_manifest(tmp_path, [(rows[0][0], "cat"), (rows[1][0], "")], header="path,label",
                                        name="e.csv"))
    # a file that is there but is no image: the split names the manifest line when it decodes it
    (tmp_path / "img" / "broken.png").write_bytes(b"not a png at all")
    bad = _manifest(tmp_path, manifest_rows[:8] + [("img/broken.png", "cat", 1, "indoor")], name="bad.csv")
    ds = load("manifest", root=bad, image_size=8, val_fraction=0.0, test_fraction=0.0)
    sp = ds.split("indoor", "train")
    k = next(i for i, p in enumerate(sp.paths) if p.endswith("broken.png"))
    with pytest.raises(UserError, match=r"bad.csv line 10: image file .*broken.png cannot be decoded"):
        sp.images([k])
    with pytest.raises(UserError, match="does not exist"):
        load("manifest", root=tmp_path / "absent.csv")


def test_an_image_over_pillows_size_limit_is_one_line_naming_it(tmp_path, monkeypatch):
    """Pillow refuses an image of more than twice Image.MAX_IMAGE_PIXELS pixels (a decompression
    bomb) with its own exception, not an OSError: a user error naming the file, as the Parquet
    split already said."""
    from raysim.data.splits import FileSplit
    path = tmp_path / "huge.png"
    Image.new("RGB", (16, 16), (1, 2, 3)).save(path)
    split = FileSplit([str(path)], [0], image_size=8, mean=(0.5,) * 3, std=(0.5,) * 3)
    assert split.images([0]).shape == (1, 8, 8, 3)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 256 pixels: over twice the limit
    with pytest.raises(UserError, match=r"image file .*huge.png cannot be decoded: Image size \(256 pixels\)"):
        split.images([0])
