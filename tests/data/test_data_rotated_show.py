"""rotated_mnist and ``raysim data show``."""
import numpy as np
from PIL import Image

from raysim.data import load
from raysim.data.show import show
from raysim.data.sources import mnist5k


def test_rotated_mnist_domainbed_recipe(data_cache):
    ds = load("rotated_mnist", seed=0)
    assert ds.domains == ("0", "15", "30", "45", "60", "75")
    assert ds.image_shape == (3, 28, 28) and ds.num_classes == 10
    totals = [sum(v.values()) for v in ds.sizes().values()]
    assert totals == [834, 834, 833, 833, 833, 833]  # interleaved i::6 of 5,000
    x0 = ds.split("0", "all").images(np.arange(834))  # N, H, W, C
    assert np.array_equal(x0[..., 0], x0[..., 1])  # grey replicated to 3 channels
    digits = {d.tobytes() for d in mnist5k()[0]}
    assert all(img[..., 0].tobytes() in digits for img in x0[:50])  # angle 0 = untouched real digits
    x45 = ds.split("45", "all").images(np.arange(50))
    assert not any(img[..., 0].tobytes() in digits for img in x45)
    one = load("rotated_mnist", seed=0, channels=1)
    assert one.image_shape == (1, 28, 28)
    assert np.array_equal(one.split("30", "test").uint8[:, 0], ds.split("30", "test").uint8[:, 0])
    csac = load("rotated_mnist", recipe="csac", val_fraction=0.0, test_fraction=0.0)
    assert all(len(csac.split(d, "train")) == 1000 for d in csac.domains)
    assert np.bincount(csac.split("60", "train").labels).tolist() == [100] * 10


def test_show_table_and_grid(data_cache, tmp_path):
    text = show("rotated_mnist", grid=tmp_path / "grid.png", per_domain=6)
    assert "dataset rotated_mnist: 6 domains, 10 classes, image 3x28x28" in text
    lines = [ln.split() for ln in text.splitlines()]
    assert ["0", "train", "667", "10/10", "28x28"] in lines or any(r[:2] == ["0", "train"] for r in lines)
    assert sum(1 for r in lines if len(r) == 5 and r[1] in ("train", "val", "test")) == 18
    assert lines[-1][0] == "total" and int(lines[-1][1]) == 5000
    im = Image.open(tmp_path / "grid.png")
    assert im.size[0] > 300 and im.size[1] > 300
