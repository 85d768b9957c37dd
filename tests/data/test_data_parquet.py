"""The ``parquet`` dataset on real files: Parquet folders, Arrow IPC (file and streaming format), a
save_to_disk layout written with pyarrow, and a DatasetDict folder written by Hugging Face ``datasets``
itself (tests/data/fixtures). Images are decoded lazily from only the row groups / record batches that
hold the asked rows, and a pickled split carries no image data."""
import io
import json
import pickle
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from raysim.cli import main
from raysim.data import load
from raysim.core.errors import UserError

FIXTURES = Path(__file__).parent / "fixtures"


def _png(value: int, size=(6, 6)) -> bytes:
    buf = io.BytesIO()
    Image.new("L", size, int(value)).save(buf, "PNG")
    return buf.getvalue()


def _grey(split, idx):
    """The value of each decoded (solid grey) image: resizing keeps a solid colour exact."""
    return split.images(idx)[:, 0, 0, 0].tolist()


def _rows(n_groups=10, per_group=6):
    """Rows sorted by group; row r's image is grey 4 * r, its label r % 3."""
    n = n_groups * per_group
    return {"image": [_png(4 * r) for r in range(n)], "label": [r % 3 for r in range(n)],
            "user_id": np.repeat(np.arange(n_groups) * 7, per_group).tolist()}


def test_one_client_reads_only_its_row_groups_and_pickles_without_images(tmp_path):
    pq.write_table(pa.table(_rows()), tmp_path / "users.parquet", row_group_size=4)
    ds = load("parquet", root=tmp_path, image_size=8, split_by="group", val_fraction=1 / 6, test_fraction=1 / 6)
    assert ds.domains == (tmp_path.name,) and ds.classes == ("0", "1", "2")
    assert ds.group_names == tuple(str(7 * g) for g in range(10))  # user ids, numeric order
    assert ds.info["chunks"] == 15 and ds.info["columns"] == {"image": "image", "label": "label", "group": "user_id"}
    train = ds.split(tmp_path.name, "train")
    assert len(train) == 40 and not train.chunk_reads  # opening read no image
    mine = np.flatnonzero(train.groups == 3)  # the natural partition's client of user 21
    rows = train.file_row[mine]
    assert len(mine) == 4 and set(rows) <= set(range(18, 24))  # its rows, carved within the group
    assert _grey(train, mine) == [4 * r for r in rows]
    assert set(train.chunk_reads) == {(0, int(r) // 4) for r in rows} <= {(0, 4), (0, 5)}
    assert sum(train.chunk_reads.values()) == len(set(train.chunk_reads)) and train.rows_decoded == 4
    train.images(mine)  # a second pass finds those row groups cached
    assert sum(train.chunk_reads.values()) == len(set(train.chunk_reads)) and train.rows_decoded == 8
    # every group keeps 1 val and 1 test row of its own 6
    for s in ("val", "test"):
        assert np.bincount(ds.split(tmp_path.name, s).groups).tolist() == [1] * 10
    # shipped to an actor: paths and indices only; the copy reads its own rows
    blob = pickle.dumps(train)
    assert b"\x89PNG" not in blob and len(blob) < 6000
    copy = pickle.loads(pickle.dumps(train))
    assert not copy.chunk_reads and _grey(copy, [0, len(copy) - 1]) == [4 * train.file_row[0], 4 * train.file_row[-1]]
    x, y = ds.split(tmp_path.name, "all").tensors(np.arange(3))
    assert x.shape == (3, 3, 8, 8) and y.tolist() == ds.split(tmp_path.name, "all").labels[:3].tolist()


def test_split_files_string_labels_domains_and_named_columns(tmp_path):
    def table(first, n):
        r = np.arange(first, first + n)
        return pa.table({"jpg": [_png(r_ % 250) for r_ in r], "cls": np.where(r % 2, "zebra", "ant").tolist(),
                         "writer": [f"w{r_ % 4}" for r_ in r], "site": np.where(r < first + n // 2, "b", "a").tolist()})
    (tmp_path / "data").mkdir()
    pq.write_table(table(0, 40), tmp_path / "data" / "train-00000-of-00001.parquet", row_group_size=10)
    pq.write_table(table(100, 8), tmp_path / "data" / "test-00000-of-00001.parquet")
    ds = load("parquet", root=tmp_path, image_size=8, image_column="jpg", label_column="cls",
              group_column="writer", domain_column="site", split_by="group", val_fraction=0.25)
    assert ds.domains == ("a", "b") and ds.classes == ("ant", "zebra") and ds.group_names == ("w0", "w1", "w2", "w3")
    assert ds.info["split"] == "official+carve" and ds.info["split_by"] == "group"
    for d in ds.domains:
        te = ds.split(d, "test")
        assert len(te) == 4 and _grey(te, np.arange(4)) == [int(r) + 100 for r in te.file_row]  # the test file whole
        tr, va = ds.split(d, "train"), ds.split(d, "val")
        assert len(tr) + len(va) == 20 and np.bincount(va.groups, minlength=4).tolist() == [1, 1, 1, 1]
        assert [ds.classes[y] for y in tr.labels] == ["zebra" if r % 2 else "ant" for r in tr.file_row]
    pq.write_table(pa.table(_rows(2, 3)), tmp_path / "other.parquet")
    with pytest.raises(UserError, match=r"has no column 'cls' \(label_column\); its columns: image, label, user_id"):
        load("parquet", root=tmp_path / "other.parquet", label_column="cls")


def _save_to_disk_layout(folder: Path, rows: dict, batch_rows: int) -> Path:
    """What ``Dataset.save_to_disk`` writes, with pyarrow: an Arrow *stream*, state.json, dataset_info.json
    (ClassLabel names), the image as HF's struct {bytes, path}."""
    folder.mkdir(parents=True)
    image = pa.array([{"bytes": b, "path": None} for b in rows["image"]],
                     pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    t = pa.table({"image": image, "label": rows["label"], "user_id": rows["user_id"]})
    with pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, t.schema) as w:
            for b in t.to_batches(max_chunksize=batch_rows):
                w.write_batch(b)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (folder / "dataset_info.json").write_text(json.dumps({"features": {
        "image": {"_type": "Image"}, "label": {"names": ["cat", "dog", "emu"], "_type": "ClassLabel"}}}))
    return folder


def test_arrow_ipc_stream_and_file_formats(tmp_path):
    rows = _rows(n_groups=5)
    hf = load("parquet", root=_save_to_disk_layout(tmp_path / "hf", rows, 6), image_size=8, split_by="group")
    assert hf.info["layout"] == "save_to_disk" and hf.classes == ("cat", "dog", "emu")
    # a plain IPC file (random-access format) of the same rows, image bytes as binary
    with pa.OSFile(str(tmp_path / "plain.arrow"), "wb") as sink:
        t = pa.table(rows)
        with pa.ipc.new_file(sink, t.schema) as w:
            for b in t.to_batches(max_chunksize=6):
                w.write_batch(b)
    plain = load("parquet", root=tmp_path / "plain.arrow", image_size=8, split_by="group")
    assert plain.domains == ("plain",) and plain.classes == ("0", "1", "2")
    for ds, d in ((hf, "hf"), (plain, "plain")):
        assert ds.info["chunks"] == 5
        sp = ds.split(d, "test")
        assert np.array_equal(sp.labels, sp.file_row % 3)
        one = np.flatnonzero(sp.groups == 2)  # rows 12..17: record batch 2 only
        assert _grey(sp, one) == [4 * r for r in sp.file_row[one]] and set(sp.chunk_reads) == {(0, 2)}
        assert b"\x89PNG" not in pickle.dumps(sp)


def test_real_hugging_face_dataset_dict(tmp_path):
    ds = load("parquet", root=FIXTURES / "hf_dataset_dict", image_size=8, val_fraction=0.25)
    assert ds.info["layout"] == "dataset_dict" and ds.info["split"] == "official+carve"
    assert ds.classes == ("zero", "one", "two") and ds.group_names == ("w0", "w1", "w2")
    d = ds.domains[0]
    te = ds.split(d, "test")
    assert te.labels.tolist() == [0, 1, 2] and _grey(te, [0, 1, 2]) == [0, 10, 20]
    tr, va = ds.split(d, "train"), ds.split(d, "val")
    assert len(tr) == 9 and len(va) == 3 and np.bincount(va.labels).tolist() == [1, 1, 1]
    assert _grey(tr, np.arange(9)) == [10 * r for r in tr.file_row]
    assert [ds.group_names[g] for g in tr.groups] == [f"w{r // 4}" for r in tr.file_row]
    assert main(["data", "show", "parquet", "--root", str(FIXTURES / "hf_dataset_dict"),
                 "--grid", str(tmp_path / "grid.png")]) == 0
    assert (tmp_path / "grid.png").stat().st_size > 0


def test_bad_files_give_one_line_naming_file_row_and_column(tmp_path):
    rows = _rows(n_groups=2, per_group=4)
    t = pa.table({"img": rows["image"], "label": rows["label"]})
    pq.write_table(t, tmp_path / "a.parquet")
    with pytest.raises(UserError, match=r"split_by='group' needs a group column, and .*a.parquet has none.*"
                                        r"its columns: img, label"):
        load("parquet", root=tmp_path, split_by="group")
    pq.write_table(t.drop_columns(["label"]), tmp_path / "b.parquet")
    with pytest.raises(UserError, match=r"b.parquet has no column 'label' \(label\), which .*a.parquet has; "
                                        r"its columns: img"):
        load("parquet", root=tmp_path)
    (tmp_path / "b.parquet").unlink()
    pq.write_table(t.rename_columns(["pic", "label"]), tmp_path / "c.parquet")
    with pytest.raises(UserError, match=r"c.parquet has no image column \(looked for image, img; name it with "
                                        r"image_column\); its columns: pic, label"):
        load("parquet", root=tmp_path / "c.parquet")
    (tmp_path / "c.parquet").unlink()
    broken = t.set_column(0, "img", pa.array(rows["image"][:5] + [b"garbage"] + rows["image"][6:]))
    pq.write_table(broken, tmp_path / "a.parquet")
    sp = load("parquet", root=tmp_path, image_size=8, val_fraction=0.0, test_fraction=0.0).split(tmp_path.name,
                                                                                                  "train")
    with pytest.raises(UserError, match=r"the image in .*a.parquet row 5 \(counting from 0\) cannot be decoded"):
        sp.images(np.arange(len(sp)))
    pq.write_table(pa.table({"image": ["pics/0.png", "pics/gone.png"], "label": [0, None]}), tmp_path / "a.parquet")
    with pytest.raises(UserError, match=r"a.parquet row 1 \(counting from 0\) has no label"):
        load("parquet", root=tmp_path)
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "0.png").write_bytes(_png(9))
    pq.write_table(pa.table({"image": ["pics/0.png", "pics/gone.png"], "label": [0, 1]}), tmp_path / "a.parquet")
    sp = load("parquet", root=tmp_path, image_size=8, val_fraction=0.0, test_fraction=0.0).split(tmp_path.name,
                                                                                                  "train")
    assert _grey(sp, [0]) == [9]  # an image path, relative to the file's folder
    with pytest.raises(UserError, match=r"a.parquet row 1 \(counting from 0\) names image file .*pics/gone.png, "
                                        "which does not exist"):
        sp.images([1])
    with pytest.raises(UserError, match="holds no .parquet or .arrow files"):
        load("parquet", root=tmp_path / "pics")


def test_a_ray_worker_reads_its_client_from_the_shipped_split(ray_session, tmp_path):
    """The split goes to a Ray worker as paths and indices; the worker opens the file itself and reads
    only the row groups of its client."""
    import ray

    pq.write_table(pa.table(_rows()), tmp_path / "users.parquet", row_group_size=4)
    train = load("parquet", root=tmp_path, image_size=8, normalize="none", split_by="group").split(
        tmp_path.name, "train")
    mine = np.flatnonzero(train.groups == 7)

    @ray.remote(num_cpus=0.1)
    def read(split, positions):
        x, y = split.tensors(positions)
        return x[:, 0, 0, 0].tolist(), y.tolist(), dict(split.chunk_reads), split.rows_decoded

    grey, labels, reads, decoded = ray.get(read.remote(train, mine))
    rows = train.file_row[mine]
    assert [round(v * 255) for v in grey] == [4 * r for r in rows] and labels == [r % 3 for r in rows]
    assert set(reads) == {(0, int(r) // 4) for r in rows} and decoded == len(mine)
    assert not train.chunk_reads  # the driver read nothing


def test_a_file_per_user_keeps_few_files_open(tmp_path, monkeypatch):
    """A dataset of one Parquet file per user: a process keeps at most MAX_OPEN_FILES of them open
    (least recently read closed), and a closed file is opened again when it is read again."""
    import raysim.data.arrow as arrow
    monkeypatch.setattr(arrow, "MAX_OPEN_FILES", 2)
    monkeypatch.setattr(arrow, "CHUNK_CACHE_BYTES", 0)  # every read goes to its file
    for u in range(5):
        rows = {"image": [_png(40 * u + r) for r in range(4)], "label": [r % 2 for r in range(4)], "user_id": [u] * 4}
        pq.write_table(pa.table(rows), tmp_path / f"user-{u}.parquet")
    ds = load("parquet", root=tmp_path, image_size=8, split_by="group", val_fraction=0.0, test_fraction=0.0)
    train = ds.split(tmp_path.name, "train")
    files = train.files
    order = np.argsort(train.groups, kind="stable")
    for _ in range(2):  # every user's rows in turn, twice: files 0..4, closed and opened again
        for u in range(5):
            mine = order[train.groups[order] == u]
            assert len(mine) == 4 and _grey(train, mine) == [40 * u + int(train.file_row[i]) for i in mine]
            assert len(files._open) <= 2
    assert sum(train.chunk_reads.values()) == 10  # five files' one row group, read twice
