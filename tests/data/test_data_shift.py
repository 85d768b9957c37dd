"""digits5 has real domain shift: a classifier is clearly best on the domain it was trained on.

Features are a small HOG (gradient-orientation histograms, 8x8-pixel cells, 2x2-block
normalised) computed with numpy; the classifier is a ridge classifier (closed form, fast).
Raw-pixel linear models cannot learn the rendered domains (references/data.md 3.1).
"""
import numpy as np
from sklearn.linear_model import RidgeClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler


def hog(u8: np.ndarray, cell: int = 8, bins: int = 9) -> np.ndarray:
    g = u8.astype(np.float32).mean(1)  # (N, H, W) grey
    gx = np.zeros_like(g)
    gy = np.zeros_like(g)
    gx[:, :, 1:-1] = g[:, :, 2:] - g[:, :, :-2]
    gy[:, 1:-1] = g[:, 2:] - g[:, :-2]
    mag = np.hypot(gx, gy)
    b = np.minimum((np.mod(np.arctan2(gy, gx), np.pi) / np.pi * bins).astype(np.int64), bins - 1)
    n, h, w = g.shape
    cells = np.stack([(mag * (b == k)).reshape(n, h // cell, cell, w // cell, cell).sum((2, 4))
                      for k in range(bins)], -1)
    blocks = np.concatenate([cells[:, :-1, :-1], cells[:, 1:, :-1], cells[:, :-1, 1:], cells[:, 1:, 1:]], -1)
    blocks /= np.sqrt((blocks ** 2).sum(-1, keepdims=True) + 1e-6)
    return blocks.reshape(n, -1)


def test_each_domain_is_best_on_itself(digits5):
    ds = digits5
    feats = {(d, s): hog(ds.split(d, s).uint8) for d in ds.domains for s in ("train", "test")}
    acc = np.zeros((len(ds.domains),) * 2)
    for i, src in enumerate(ds.domains):
        clf = make_pipeline(StandardScaler(), RidgeClassifier(alpha=10.0))
        clf.fit(feats[src, "train"], ds.split(src, "train").labels)
        for j, dst in enumerate(ds.domains):
            acc[i, j] = clf.score(feats[dst, "test"], ds.split(dst, "test").labels)
    width = max(map(len, ds.domains)) + 2
    print("\ndigits5 domain shift (rows: train domain, columns: test domain; HOG + ridge)")
    print(" " * width + "".join(f"{d:>9}" for d in ds.domains))
    for i, src in enumerate(ds.domains):
        print(f"{src:<{width}}" + "".join(f"{a:9.3f}" for a in acc[i]))
    for i, src in enumerate(ds.domains):
        own = acc[i, i]
        clearly_lower = sum(own - acc[i, j] >= 0.1 for j in range(len(ds.domains)) if j != i)
        assert own > 0.6, (src, own)
        assert clearly_lower >= 3, (src, acc[i])
