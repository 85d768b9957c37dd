"""The offline digits5 benchmark: shapes, sizes, labels, determinism, cache."""
import hashlib

import numpy as np
import pytest
import torch

from raysim.data import load
from raysim.data.digits5 import DOMAINS, cache_path, generate
from raysim.core.errors import UserError


def digest(arrays: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(arrays):
        a = np.ascontiguousarray(arrays[k])
        h.update(k.encode() + str(a.dtype).encode() + str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def test_domains_sizes_shapes_labels(digits5):
    ds = digits5
    assert ds.name == "digits5"
    assert ds.domains == ("mnist", "mnistm", "usps", "synth", "svhn")
    assert ds.num_classes == 10 and ds.image_shape == (3, 32, 32)
    sizes = ds.sizes()
    for d in ds.domains:
        assert sizes[d]["train"] >= 1000, (d, sizes[d])
        assert sizes[d]["val"] > 0 and sizes[d]["test"] > 0
        for s in ("train", "val", "test"):
            sp = ds.split(d, s)
            assert sp.labels.dtype == np.int64 and sp.labels.min() >= 0 and sp.labels.max() <= 9
            assert set(np.unique(sp.labels)) == set(range(10))  # stratified: every class everywhere
            assert sp.uint8.shape == (len(sp), 3, 32, 32) and sp.uint8.dtype == np.uint8
    assert sizes["mnist"] == {"train": 3500, "val": 500, "test": 1000}
    assert sum(sizes["usps"].values()) == 1797


def test_splits_are_disjoint_and_mnistm_mirrors_mnist(digits5):
    ds = digits5
    # mnist-m blends the same digits in the same splits (as FedBN's copies do)
    for s in ("train", "val", "test"):
        assert np.array_equal(ds.split("mnist", s).labels, ds.split("mnistm", s).labels)
    # no image repeated across a domain's splits
    for d in ds.domains:
        seen = set()
        for s in ("train", "val", "test"):
            rows = {r.tobytes() for r in ds.split(d, s).uint8}
            assert not (rows & seen), d
            seen |= rows


def test_tensors_normalised_and_cheap_index(digits5):
    sp = digits5.split("svhn", "train")
    idx = np.array([5, 0, 17])
    x, y = sp.tensors(idx)
    assert x.dtype == torch.float32 and x.shape == (3, 3, 32, 32) and y.dtype == torch.int64
    expect = (torch.from_numpy(sp.uint8[idx]).float() / 255 - 0.5) / 0.5
    assert torch.allclose(x, expect, atol=1e-6)
    assert torch.equal(y, torch.from_numpy(sp.labels[idx]))
    # digits5 has no augmentation: train=True is the same tensor
    x2, _ = sp.tensors(idx, train=True, generator=torch.Generator().manual_seed(1))
    assert torch.equal(x, x2)


def test_same_seed_same_bytes_different_seed_differs(digits5, tmp_path, monkeypatch):
    """A fresh generation (empty cache) reproduces the session's dataset byte for byte."""
    monkeypatch.setenv("RAYSIM_CACHE", str(tmp_path))
    again = load("digits5", seed=0, cache=False)
    assert again.info["source"] == "generated"

    def arrays(ds):
        return {f"{d}/{s}/{k}": (sp.uint8 if k == "x" else sp.labels)
                for d in ds.domains for s in ("train", "val", "test")
                for sp in [ds.split(d, s)] for k in ("x", "y")}

    assert digest(arrays(again)) == digest(arrays(digits5))
    assert not list(tmp_path.iterdir())  # cache=False neither reads nor writes

    other = generate(seed=1, image_size=32, n_render=1500)
    base = generate(seed=0, image_size=32, n_render=1500)
    assert digest(other) != digest(base)
    for d in DOMAINS:  # every domain's draw depends on the seed
        assert digest({k: v for k, v in other.items() if k.startswith(d + "__")}) != \
            digest({k: v for k, v in base.items() if k.startswith(d + "__")})


def test_cache_written_atomically_and_reused(digits5, data_cache):
    path = cache_path(0, 32, 5000)
    assert path.exists() and path.parent == data_cache
    assert not [p for p in data_cache.iterdir() if p.name.endswith(".tmp")]
    again = load("digits5", seed=0)
    assert again.info["source"] == "cache"
    assert np.array_equal(again.split("synth", "test").uint8, digits5.split("synth", "test").uint8)


def test_corrupt_cache_is_regenerated(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYSIM_CACHE", str(tmp_path))
    path = cache_path(3, 16, 1500)
    path.write_bytes(b"not a zip file")
    ds = load("digits5", seed=3, image_size=16, n_render=1500)
    assert ds.info["source"] == "generated" and ds.image_shape == (3, 16, 16)
    assert load("digits5", seed=3, image_size=16, n_render=1500).info["source"] == "cache"


def test_bad_options():
    with pytest.raises(UserError, match="takes no root"):
        load("digits5", root="/somewhere")
    with pytest.raises(UserError, match="image_size"):
        load("digits5", image_size=4)
    with pytest.raises(UserError, match="no option"):
        load("digits5", colour="red")
