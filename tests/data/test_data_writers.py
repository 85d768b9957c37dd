"""The generated ``writers`` benchmark (natural groups = writers) and ``data show``'s group statistics.

One small instance (3 domains x 10 writers, ~30 samples each) is generated once for the module.
"""
import hashlib

import numpy as np
import pytest

from raysim.core.errors import UserError
from raysim.data import load
from raysim.data.show import group_stats, table
from raysim.data.splits import SPLITS, ArraySplit, MultiDomainDataset
from raysim.data.writers import CLASSES, DOMAINS, TEST_FRACTION, VAL_FRACTION, generate

SMALL = dict(num_writers=10, samples_mean=30)


def digest(arrays: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(arrays):
        h.update(k.encode() + np.ascontiguousarray(arrays[k]).tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def small(data_cache):
    return load("writers", seed=0, **SMALL)


def test_shapes_classes_and_cache(small):
    assert small.domains == DOMAINS == ("pen", "pencil", "tablet")
    assert small.num_classes == 36 and small.classes[:11] == tuple("0123456789A") and small.classes[-1] == "Z"
    assert small.image_shape == (1, 28, 28)
    again = load("writers", seed=0, **SMALL)
    assert again.info["source"] == "cache"
    for d in DOMAINS:
        for s in SPLITS:
            a, b = small.split(d, s), again.split(d, s)
            assert a.uint8.dtype == np.uint8 and a.uint8.shape == (len(a), 1, 28, 28)
            assert np.array_equal(a.uint8, b.uint8) and np.array_equal(a.groups, b.groups)


def test_groups_are_writers_consistent_across_splits(small):
    w = SMALL["num_writers"]
    for k, d in enumerate(DOMAINS):
        ids = [set(small.split(d, s).groups.tolist()) for s in SPLITS]
        # every writer of the domain trains and tests, with ids unique to the domain
        assert ids[0] == ids[2] == set(range(k * w, (k + 1) * w)), d
        assert ids[1] <= ids[0]
        assert np.array_equal(small.split(d, "all").groups,
                              np.concatenate([small.split(d, s).groups for s in SPLITS]))


def test_each_writer_is_carved_on_its_own(small):
    """70/10/20 within each writer (group_carve): a writer's test samples are its own, in its share."""
    for d in DOMAINS:
        counts = {s: np.bincount(small.split(d, s).groups, minlength=3 * SMALL["num_writers"]) for s in SPLITS}
        n = sum(counts.values())
        for g in np.flatnonzero(n):
            assert n[g] >= 5  # MIN_SAMPLES
            assert counts["test"][g] == round(n[g] * TEST_FRACTION)
            assert counts["val"][g] == min(round(n[g] * VAL_FRACTION), n[g] - 1 - counts["test"][g])
        # no image in two splits of a domain (each sample drew its own warp and noise)
        rows = [{r.tobytes() for r in small.split(d, s).uint8} for s in SPLITS]
        assert sum(map(len, rows)) == len(set.union(*rows)) == int(n.sum())


def test_writers_have_skewed_labels(small):
    rng = np.random.default_rng(0)
    for d in DOMAINS:
        sp = small.split(d, "all")
        own = group_stats(sp.groups, sp.labels, len(CLASSES))
        shuffled = group_stats(rng.permutation(sp.groups), sp.labels, len(CLASSES))
        # a writer (Dirichlet(0.5) over 36 classes) uses fewer classes, and its label mix is farther
        # from its domain's, than the same sample counts dealt out at random (seed 0: 13 vs 17
        # classes, TV 0.61 vs 0.47)
        assert own["classes"].mean() < shuffled["classes"].mean() - 2, d
        assert own["tv"].mean() > shuffled["tv"].mean() + 0.08, d


def test_same_bytes_for_a_seed_and_writers_independent_of_their_number(data_cache):
    a, b = generate(seed=3, num_writers=4, samples_mean=8), generate(seed=3, num_writers=4, samples_mean=8)
    assert digest(a) == digest(b)
    assert digest(generate(seed=4, num_writers=4, samples_mean=8)) != digest(a)
    # writer w is the same images and carve whether 3 or 4 writers are drawn (ids shift by domain)
    fewer = generate(seed=3, num_writers=3, samples_mean=8)
    for k, d in enumerate(DOMAINS):
        for s in SPLITS:
            keep = a[f"{d}__{s}__g"] - 4 * k < 3
            assert np.array_equal(fewer[f"{d}__{s}__g"] - 3 * k, a[f"{d}__{s}__g"][keep] - 4 * k)
            assert np.array_equal(fewer[f"{d}__{s}__x"], a[f"{d}__{s}__x"][keep])


def test_colour_size_and_option_errors(data_cache):
    rgb = load("writers", seed=0, num_writers=2, samples_mean=6, channels=3, image_size=20, cache=False)
    assert rgb.image_shape == (3, 20, 20)
    x = rgb.split("pen", "train").uint8
    assert (x[:, 2].astype(int) - x[:, 0]).std() > 1  # coloured ink/paper, not grey copies
    for bad, says in (({"channels": 2}, "channels=2"), ({"num_writers": 0}, "num_writers=0"),
                      ({"image_size": 100}, "image_size=100"), ({"samples_mean": 2}, "samples_mean=2"),
                      ({"root": "/x"}, "takes no root")):
        with pytest.raises(UserError, match=says) as e:
            load("writers", **bad)
        assert "\n" not in str(e.value)


def _tiny(groups_a, labels_a, groups_b=None, labels_b=None):
    def split(g, y):
        return ArraySplit(np.zeros((len(y), 1, 2, 2), np.uint8), y, (0.5,), (0.5,), groups=g)

    def domain(g, y):  # every sample in train; val and test empty
        empty = np.zeros(0, np.int64)
        return {"train": split(g, y), "val": split(empty, empty), "test": split(empty, empty)}

    doms = {"a": domain(groups_a, labels_a)}
    if groups_b is not None:
        doms["b"] = domain(groups_b, labels_b)
    return MultiDomainDataset("tiny", doms, ["x", "y", "z"])


def test_show_group_statistics_by_hand():
    # domain a: group 1 holds labels 0,0,1, group 2 holds 1,1; domain b: group 7 holds 2,2,2,2
    ds = _tiny([1, 1, 1, 2, 2], [0, 0, 1, 1, 1], [7, 7, 7, 7], [2, 2, 2, 2])
    lines = table(ds).splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("domain") and "groups" in ln)
    rows = {ln.split()[0]: ln.split() for ln in lines[start + 2:] if ln and not ln.startswith("-")}
    # a: sizes 3, 2 -> 2.5 +- 0.5, median 2.5; classes 2, 1 -> 1.5; domain mix (0.4, 0.6, 0):
    # TV of (2/3, 1/3, 0) is 0.2667, of (0, 1, 0) is 0.4 -> 0.333
    assert rows["a"] == ["a", "2", "2.5", "±", "0.5", "2", "2.5", "3", "1.5", "0.333"]
    assert rows["b"] == ["b", "1", "4.0", "±", "0.0", "4", "4", "4", "1.0", "0.000"]
    # total: sizes 3, 2, 4 (mean 3, std 0.8165); each group against its own domain: TV 0.2667, 0.4, 0
    assert rows["total"] == ["total", "3", "3.0", "±", "0.8", "2", "3", "4", "1.3", "0.222"]
    assert max(len(ln) for ln in lines) <= 80


def test_show_without_groups_keeps_the_plain_table():
    ds = _tiny([1, 1, 2], [0, 1, 2])
    plain = MultiDomainDataset("tiny", {"a": {s: ArraySplit(ds.split("a", s).uint8, ds.split("a", s).labels,
                                                            (0.5,), (0.5,)) for s in SPLITS}}, ["x", "y", "z"])
    with_groups, without = table(ds), table(plain)
    assert with_groups.startswith(without + "\n\ngroups (the clients of a natural partition)")
    assert "groups" not in without and without.splitlines()[-1].split() == ["total", "3"]
