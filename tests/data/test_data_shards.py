"""Parquet shards: write a partition, read one client back, on several pyarrow filesystems."""
import json

import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import torch

from raysim.data import load
from raysim.data.partition import client_data, leave_one_domain_out, make_partition
from raysim.data.shards import read_index, read_manifest, read_shard, write_shards
from raysim.core.errors import UserError


@pytest.fixture(scope="module")
def small(data_cache):
    """rotated_mnist (fast, in memory) split over 2 clients per domain, with augmentation."""
    ds = load("rotated_mnist", seed=0, augment="crop_flip", normalize="half")
    return ds, make_partition(ds, {"kind": "per_domain", "clients_per_domain": 2, "domains": ["0", "45"]}, 0)


def check_round_trip(ds, part, root, fs=None):
    m = read_manifest(root, fs)
    assert m["num_clients"] == part.num_clients and m["image_shape"] == list(ds.image_shape)
    index = read_index(root, fs)  # every client's counts, for a server that reads no image
    assert index["client_id"].to_pylist() == list(range(part.num_clients))
    for s in ("train", "val", "test"):
        assert index[s].to_pylist() == part.all_num_samples(s).tolist()
    for cid in range(part.num_clients):
        back = read_shard(root, cid, filesystem=fs, manifest=m)
        shard = part.shard(cid)
        assert back.client_id == cid and back.domain == shard.domain
        for s in ("train", "val", "test"):
            split, pos = client_data(ds, shard, s)
            got = back.split(s)
            assert np.array_equal(back.positions[s], pos)
            assert np.array_equal(got.labels, split.labels[pos])
            assert np.array_equal(got.uint8, split.images(pos).transpose(0, 3, 1, 2))
            if pos.size:
                x0, y0 = split.tensors(pos)
                x1, y1 = got.tensors(np.arange(pos.size))
                assert torch.allclose(x0, x1) and torch.equal(y0, y1)
                g0, g1 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
                assert torch.allclose(split.tensors(pos, True, g0)[0], got.tensors(np.arange(pos.size), True, g1)[0])


def test_round_trip_local_path(small, tmp_path):
    ds, part = small
    root = write_shards(ds, part, tmp_path / "shards")
    files = sorted(p.name for p in (tmp_path / "shards").iterdir())
    assert files == ["clients-0000000.parquet", "clients-0000001.parquet", "clients-0000002.parquet",
                     "clients-0000003.parquet", "index.parquet", "manifest.json"]
    check_round_trip(ds, part, root)
    assert json.loads((tmp_path / "shards" / "manifest.json").read_text())["augment"] == "crop_flip"


def test_round_trip_png_and_row_groups(small, tmp_path):
    ds, part = small
    root = write_shards(ds, part, tmp_path / "png", image_format="png", clients_per_file=3)
    names = sorted(p.name for p in (tmp_path / "png").iterdir())
    assert names == ["clients-0000000.parquet", "clients-0000003.parquet", "index.parquet", "manifest.json"]
    meta = pq.ParquetFile(tmp_path / "png" / "clients-0000000.parquet").metadata
    assert meta.num_row_groups == 3  # one row group per client: a reader fetches only its own
    check_round_trip(ds, part, root)


def test_round_trip_subtree_and_mock_filesystems(small, tmp_path):
    ds, part = small
    sub = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    write_shards(ds, part, "fed/run1", filesystem=sub)
    assert (tmp_path / "fed" / "run1" / "manifest.json").exists()
    check_round_trip(ds, part, "fed/run1", sub)
    mock = pafs._MockFileSystem()
    write_shards(ds, part, "bucket/shards", filesystem=mock, clients_per_file=2)
    check_round_trip(ds, part, "bucket/shards", mock)
    assert not (tmp_path / "bucket").exists()


def test_lodo_target_and_uri(tmp_path, data_cache):
    ds = load("rotated_mnist", seed=1)
    src, tgt = leave_one_domain_out(ds, "75", {"kind": "per_domain", "domains": ["0", "75"]}, 0)
    write_shards(ds, tgt, f"file://{tmp_path}/target")
    back = read_shard(f"file://{tmp_path}/target", 0)
    assert back.domain == "75" and len(back.test) == len(ds.split("75", "all"))
    with pytest.raises(UserError, match="client 1 outside 0..0"):
        read_shard(tmp_path / "target", 1)
    with pytest.raises(UserError, match="manifest.json cannot be read"):
        read_shard(tmp_path / "nowhere", 0)
