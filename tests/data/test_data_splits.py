"""Split implementations and generator-driven augmentation."""
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from raysim.data import augment as A
from raysim.data.splits import ArraySplit, ConcatSplit, FileSplit, MultiDomainDataset, stratified_carve
from raysim.core.errors import UserError


def _array_split(n=40, size=16, aug=None, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (n, 3, size, size), dtype=np.uint8)
    y = rng.integers(0, 10, n)
    return ArraySplit(x, y, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), A.make_augment(aug))


def test_array_split_normalises_and_indexes():
    sp = _array_split()
    idx = np.array([3, 3, 0, 39])
    x, y = sp.tensors(idx)
    expect = (torch.from_numpy(sp.uint8[idx]).float() / 255 - 0.5) / 0.5
    assert torch.allclose(x, expect, atol=1e-6) and x.dtype == torch.float32
    assert y.tolist() == sp.labels[idx].tolist() and y.dtype == torch.int64
    assert sp.images(idx).shape == (4, 16, 16, 3)
    with pytest.raises(IndexError):
        sp.tensors(np.array([40]))
    with pytest.raises(IndexError):
        sp.tensors(np.array([-1]))
    # the float cache never travels with the split
    sp.tensors(np.arange(3))
    assert sp._float is not None
    clone = pickle.loads(pickle.dumps(sp))
    assert clone._float is None and torch.equal(clone.tensors(idx)[0], x)


def test_uncached_path_gives_the_same_tensors():
    a = _array_split()
    b = ArraySplit(a.uint8, a.labels, a.mean, a.std, None, cache="none")
    idx = np.arange(0, 40, 3)
    assert torch.allclose(a.tensors(idx)[0], b.tensors(idx)[0], atol=1e-6)


@pytest.mark.parametrize("preset", [p for p in A.PRESETS if p != "none"])
def test_augmentation_is_a_function_of_the_generator(preset):
    sp = _array_split(aug=preset)
    idx = np.arange(16)
    torch.manual_seed(123)  # global RNG state must not matter
    x1, _ = sp.tensors(idx, train=True, generator=torch.Generator().manual_seed(7))
    torch.manual_seed(999)
    torch.rand(100)
    x2, _ = sp.tensors(idx, train=True, generator=torch.Generator().manual_seed(7))
    x3, _ = sp.tensors(idx, train=True, generator=torch.Generator().manual_seed(8))
    plain, _ = sp.tensors(idx, train=False)
    assert torch.equal(x1, x2)
    assert not torch.equal(x1, x3)
    assert not torch.equal(x1, plain)
    assert x1.shape == plain.shape and x1.dtype == torch.float32
    assert x1.min() >= -1 - 1e-5 and x1.max() <= 1 + 1e-5
    # train=False never augments, with or without a generator
    assert torch.equal(sp.tensors(idx, train=False, generator=torch.Generator().manual_seed(7))[0], plain)


def test_augment_ops_do_what_they_say():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(6, 3, 8, 8, generator=g)
    assert torch.equal(A.HFlip(1.0)(x, g), x.flip(-1))
    assert torch.equal(A.HFlip(0.0)(x, g), x)
    assert torch.equal(A.PadCrop(0)(x, g), x)
    shifted = A.PadCrop(2)(x, g)
    assert shifted.shape == x.shape
    assert torch.allclose(A.Rotate(0.0)(x, g), x, atol=1e-6)
    assert torch.allclose(A.ColorJitter()(x, g), x)
    gray = A.RandomGray(1.0)(x, g)
    assert torch.allclose(gray[:, 0], gray[:, 1]) and torch.allclose(gray[:, 1], gray[:, 2])
    full = A.ResizedCrop((1.0, 1.0), (1.0, 1.0))(x, g)
    assert torch.allclose(full, x, atol=1e-5)
    with pytest.raises(UserError, match="augment"):
        A.make_augment("sparkle")


def _png_folder(tmp_path, n=5, size=(20, 12)):
    paths = []
    for i in range(n):
        p = tmp_path / f"img{i}.png"
        Image.new("RGB", size, (10 * i, 100, 200)).save(p)
        paths.append(str(p))
    return paths


def test_file_split_decodes_resizes_and_reports_bad_files(tmp_path):
    paths = _png_folder(tmp_path)
    sp = FileSplit(paths, [0, 1, 2, 3, 4], 8, (0, 0, 0), (1, 1, 1), cache_images=True)
    x, y = sp.tensors(np.array([4, 1]))
    assert x.shape == (2, 3, 8, 8) and y.tolist() == [4, 1]
    assert torch.allclose(x[0, :, 3, 3], torch.tensor([40, 100, 200]) / 255.0, atol=1 / 255)
    assert sp.image_shape == (3, 8, 8)
    assert 4 in sp._decoded
    gray = tmp_path / "gray.png"
    Image.new("L", (9, 9), 77).save(gray)
    missing = str(tmp_path / "gone.png")
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not an image")
    bad = FileSplit([str(gray), missing, str(broken)], [0, 0, 0], 8, (0, 0, 0), (1, 1, 1))
    assert bad.images(np.array([0])).shape == (1, 8, 8, 3)  # grey -> 3 channels
    with pytest.raises(UserError, match="gone.png"):
        bad.tensors(np.array([1]))
    with pytest.raises(UserError, match="broken.png"):
        bad.tensors(np.array([2]))


def test_concat_split_and_all(tmp_path):
    a, b = _array_split(5, seed=1), _array_split(7, seed=2)
    ds = MultiDomainDataset("toy", {"d": {"train": a, "val": b, "test": _array_split(0)}}, list("0123456789"))
    all_ = ds.split("d", "all")
    assert isinstance(all_, ConcatSplit) and len(all_) == 12
    x, y = all_.tensors(np.array([6, 0, 11]))
    assert torch.equal(x[0], b.tensors(np.array([1]))[0][0])
    assert torch.equal(x[1], a.tensors(np.array([0]))[0][0])
    assert y.tolist() == [b.labels[1], a.labels[0], b.labels[6]]
    assert all_.images(np.array([11])).shape == (1, 16, 16, 3)
    with pytest.raises(UserError, match="valid: d"):
        ds.split("e", "train")
    with pytest.raises(UserError, match="split 'dev'"):
        ds.split("d", "dev")


def test_stratified_carve_is_seeded_and_stratified():
    labels = np.repeat(np.arange(4), 50)
    t1 = stratified_carve(labels, 0.1, 0.2, np.random.default_rng(0))
    t2 = stratified_carve(labels, 0.1, 0.2, np.random.default_rng(0))
    t3 = stratified_carve(labels, 0.1, 0.2, np.random.default_rng(1))
    assert all(np.array_equal(a, b) for a, b in zip(t1, t2))
    assert not np.array_equal(t1[0], t3[0])
    tr, va, te = t1
    assert len(tr) == 140 and len(va) == 20 and len(te) == 40
    assert np.bincount(labels[te]).tolist() == [10] * 4
    assert len(set(tr) | set(va) | set(te)) == 200
    with pytest.raises(UserError):
        stratified_carve(labels, 0.6, 0.5, np.random.default_rng(0))
