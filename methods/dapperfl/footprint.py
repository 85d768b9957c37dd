"""DapperFL's footprint (Tables 5-6): the parameters and FLOPs each capability tier's pruned model
keeps, measured, beside the paper's nominal (1 - rho) x dense; the summary.md section of a run."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from torch import nn

from raysim.core.errors import UserError
from raysim.methods.dapperfl.masks import prune_masks
from raysim.methods.lib.masks import apply_masks

if TYPE_CHECKING:
    import pandas as pd

PAPER_LEVELS = (0.0, 0.2, 0.4, 0.6, 0.8)  # rho of capability tiers C_1..C_5 (Sec. 4.2)


def measure_footprint(model: nn.Module, rho: float, input_shape: tuple, masks: dict | None = None) -> dict:
    """Non-zero parameters and FLOPs of a masked model, and the paper's nominal figures.

    ``kept_params``: parameters the masks keep (exact whatever the weight values);
    ``nonzero_params``: parameters that are not exactly zero (also misses, e.g., a BN shift still
    at its initial 0). FLOPs follow the paper's (thop) convention: conv/linear multiply-accumulates
    plus 2 per norm output element; ``flops`` counts only MACs whose weight is not zero.
    """
    from raysim.models import count_flops, count_params
    params = count_params(model)
    flops_dense = count_flops(model, input_shape, count_norm=True)
    pruned = sum(int((~m).sum()) for m in masks.values()) if masks is not None else 0
    return {"params": float(params), "kept_params": float(params - pruned),
            "nonzero_params": float(count_params(model, nonzero_only=True)),
            "flops_dense": float(flops_dense),
            "flops": float(count_flops(model, input_shape, nonzero_only=True, count_norm=True)),
            "nominal_params": (1.0 - rho) * params, "nominal_flops": (1.0 - rho) * flops_dense}


def footprint_table(model: str | nn.Module = "resnet10", levels=PAPER_LEVELS, *, num_classes: int = 10,
                    in_channels: int = 3, input_size: int = 32, scheme: str = "filters",
                    seed: int = 0, show: bool = True) -> list[dict]:
    """Per-tier footprint of the pruned local model: measured non-zero parameters and FLOPs next to
    the paper's nominal (1 - rho) x dense (Tables 5-6). The mask sizes do not depend on the weight
    values, so a freshly initialised model gives the exact counts of any round."""
    if isinstance(model, str):
        from raysim.models import build
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            net = build(model, num_classes=num_classes, in_channels=in_channels, input_size=input_size)
        label = f"{model} ({in_channels}x{input_size}x{input_size}, {num_classes} classes, {scheme} masks)"
    else:
        net, label = model, type(model).__name__
    dense = {k: v.detach().clone() for k, v in net.state_dict().items()}
    shape = (in_channels, input_size, input_size)
    rows = []
    for tier, rho in enumerate(levels, start=1):
        net.load_state_dict(dense)
        masks = prune_masks(net, rho, scheme)
        apply_masks(net, masks)
        f = measure_footprint(net, rho, shape, masks)
        rows.append({"tier": f"C{tier}", "rho": rho, **f,
                     "params_frac": f["kept_params"] / f["params"], "flops_frac": f["flops"] / f["flops_dense"]})
    net.load_state_dict(dense)
    if show:
        print(format_footprint(rows, label))
    return rows


def format_footprint(rows: list[dict], label: str = "") -> str:
    head = (f"{'tier':<5}{'rho':>5} | {'nominal #Para':>14}{'measured #Para':>16}{'frac':>7} | "
            f"{'nominal FLOPs':>14}{'measured FLOPs':>16}{'frac':>7}")
    lines = [f"DapperFL footprint per tier: {label}" if label else "DapperFL footprint per tier", head,
             "-" * len(head)]
    for r in rows:
        lines.append(f"{r['tier']:<5}{r['rho']:>5.1f} | {r['nominal_params'] / 1e6:>13.3f}M"
                     f"{r['kept_params'] / 1e6:>15.3f}M{r['params_frac']:>7.3f} | "
                     f"{r['nominal_flops'] / 1e6:>13.2f}M{r['flops'] / 1e6:>15.2f}M{r['flops_frac']:>7.3f}")
    lines.append("nominal = (1 - rho) x dense (the paper's Tables 5-6); measured #Para = parameters the masks "
                 "keep; measured FLOPs = MACs with a non-zero weight + 2 per norm output (thop convention)")
    return "\n".join(lines)


def footprint_from_run(metrics: pd.DataFrame, config=None, *, show: bool = True, scheme: str = "filters") -> list[dict]:
    """The footprint table of a run, from the per-client metrics its clients reported (``metrics``:
    a DapperFL federation's metrics in raysim's long format, as ``raysim.app.rundir.read_metrics``
    reads them; ``config``: its ExperimentConfig, for the label): one row per tier, at the run's own
    input size, with the clients of the tier and their domains. UserError without footprint rows."""
    df = metrics[(metrics.split == "train") & (metrics.client >= 0)]
    if "kept_params" not in set(df.metric):
        raise UserError("the metrics hold no DapperFL footprint (kept_params): not a DapperFL run, or nothing "
                        "trained yet")
    round_ = int(df["round"].max())
    last = df[df["round"] == round_]
    wide = last.pivot_table(index="client", columns="metric", values="value", aggfunc="first")
    domains = dict(zip(last.client, last.domain))
    rows = []
    for tier, g in wide.groupby("tier", sort=True):
        f = g.iloc[0]
        clients = ", ".join(f"{int(c)} ({domains[c]})" for c in g.index)
        compute = {k: float(g[k].mean()) for k in ("fwd_flops_train", "fwd_flops_bn_pass") if k in g}
        rows.append({"tier": f"C{int(tier) + 1}", "rho": float(f["rho"]), "clients": clients, "round": round_, **compute,
                     **{k: float(f[k]) for k in ("params", "kept_params", "nonzero_params", "flops_dense", "flops",
                                                 "nominal_params", "nominal_flops")},
                     "params_frac": float(f["kept_params"] / f["params"]),
                     "flops_frac": float(f["flops"] / f["flops_dense"])})
    if show:
        print(format_footprint(rows, run_label(config, round_, scheme)))
        for r in rows:
            print(f"  {r['tier']}: clients {r['clients']}")
    return rows


def summary_section(config, metrics: pd.DataFrame, hp) -> str:
    """What a DapperFL run's summary.md ends with: the footprint its clients measured per tier,
    and which BN statistics it uploaded ("" before anything trained). ``config``, ``metrics``: the
    federation's (see ``Method.report_markdown``); ``hp``: its Hparams."""
    try:
        rows = footprint_from_run(metrics, config, show=False)
    except UserError:  # nothing trained yet
        return ""
    note = (f"BN statistics of the upload: `bn_stats: {hp.bn_stats}`"
            + (" (re-estimated on the client's Eq.-6-recovered dense model: one extra dense forward pass over "
               "D_i per round, counted in the table)" if hp.bn_stats == "recovered" else
               " (those the pruned epochs leave: the paper's literal reading)"))
    label = run_label(config, rows[0]["round"], hp.use_prune_scheme)
    return footprint_markdown(rows, label) + "\n" + note + "\n"


def run_label(config, round: int, scheme: str) -> str:
    """``resnet10 at 32 px, filters masks, measured by the clients (round 5)``: the model and input
    size from the run's config (left out without one)."""
    what = f"{scheme} masks, measured by the clients (round {round})"
    if config is None:
        return what
    size = config.data.options.get("image_size")
    return f"{config.model.name}{f' at {size} px' if size else ''}, {what}"


def footprint_markdown(rows: list[dict], label: str) -> str:
    """The per-tier footprint as a markdown section (appended to a run's summary.md)."""
    compute = all("fwd_flops_train" in r for r in rows)
    out = [f"## DapperFL footprint per capability tier: {label}", "",
           "| tier | rho | clients | nominal #Para | measured #Para | fraction | nominal FLOPs | measured FLOPs "
           "| fraction |" + (" round fwd FLOPs (training) | + BN pass (share of the round) |" if compute else ""),
           "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if compute else "")]
    for r in rows:
        line = (f"| {r['tier']} | {r['rho']:.1f} | {r.get('clients', '')} | {r['nominal_params'] / 1e6:.3f}M "
                f"| {r['kept_params'] / 1e6:.3f}M | {r['params_frac']:.3f} | {r['nominal_flops'] / 1e6:.2f}M "
                f"| {r['flops'] / 1e6:.2f}M | {r['flops_frac']:.3f} |")
        if compute:
            train, bn = r["fwd_flops_train"], r["fwd_flops_bn_pass"]
            line += f" {train / 1e9:.2f}G | {bn / 1e9:.2f}G ({100 * bn / (3 * train + bn):.1f}%) |"
        out.append(line)
    out += ["", "nominal = (1 - rho) x dense, the paper's Tables 5-6; measured #Para = parameters the masks keep; "
            "measured FLOPs = multiply-accumulates with a non-zero weight + 2 per norm output (thop convention)."]
    if compute:
        out += ["Round fwd FLOPs: forward FLOPs of one client's round (dense fine-tune epoch + pruned epochs, mean "
                "over the tier's clients); + BN pass: the extra dense forward pass over D_i of bn_stats: recovered; "
                "its share counts a training step as 3 forward passes (forward + backward)."]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    # python -m raysim.methods.dapperfl.footprint [resnet10|resnet18] [input_size]   the per-tier table of a model
    import sys
    if len(sys.argv) > 1 and os.path.isdir(sys.argv[1]):  # a method reads no run folder: the app does
        sys.exit(f"the footprint a run's clients measured ends its summary.md: raysim report {sys.argv[1]}")
    name = sys.argv[1] if len(sys.argv) > 1 else "resnet10"
    size = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    footprint_table(name, input_size=size)
    footprint_table(name, input_size=size, scheme="official")
