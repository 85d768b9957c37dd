"""Client cohorts: K clients' local steps trained as one vectorized step (``runtime.cohort_size``).

On a GPU a small model's SGD step is launch-bound: K clients stepped one after another cost K
launches of every kernel, the same K steps under ``torch.func.vmap`` cost one. A method opts in by
writing its client step as a per-batch loss (:meth:`raysim.core.contract.Method.local_loss`, a
:class:`~raysim.core.contract.LocalLoss`); :func:`train_cohort` then trains the cohort's clients
together, each exactly as ``local_update`` would alone:

* its own parameters, buffers (BN running statistics, updated from its own train-mode batch
  statistics under ``vmap``), and the tensors its loss reads;
* its own batches, drawn by its own ``ctx.batches()`` (its keyed generator, its epochs, its
  train.max_steps), so a client with fewer batches stops updating when its data ends: at every
  step the clients still active are grouped by batch shape, and a group short of the whole cohort
  is gathered from and scattered back into the stacked state (the per-client step mask);
* its own optimizer state: SGD with momentum and weight decay as ``torch.optim.SGD`` computes it
  (first step: the buffer is the gradient), at its own learning rate;
* its own gradient-norm clipping (train.grad_clip over all its parameters, as
  ``nn.utils.clip_grad_norm_``);
* its trainable parameters that its loss never reaches left where they are: alone their
  ``.grad`` stays None and ``torch.optim.SGD`` skips them (no weight decay, no momentum), where
  ``vmap`` would hand them a gradient of zeros. Which ones is found once, from the first client's
  loss on its first batch outside ``vmap``, and kept for the model while the loss, its tensors'
  structure and the trainable parameters stay the same (a ``LocalLoss`` is a pure function of its
  arguments);
* its own dropout masks, drawn outside ``vmap`` from its own keyed generator in the order its
  forward would draw them alone (:mod:`raysim.models.dropout`), and passed in;
* its own compute for the simulated clock: the multiply-accumulates a :class:`ComputeMeter` would
  have charged it (every forward and backward through a conv or linear layer, at the non-zero
  entries of its own weights), returned per client.

Floating-point results equal the per-client path's within rounding (batched kernels sum in
another order): ``tests/engine/test_cohort.py`` holds them to 1e-5 relative.
Not supported (refused): BN with ``momentum=None`` (a cumulative average), a loss whose forward
count varies, random operations other than :class:`~raysim.models.dropout.KeyedDropout`. Not
supported (not detected): a loss that reaches some parameter at some steps only.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap
from torch.utils._pytree import tree_map, tree_structure

from raysim.core.contract import ClientContext, LocalLoss, Method
from raysim.models.dropout import KeyedDropout, cohort_masks
from raysim.config import AUTO_COHORT_MAX
from raysim.engine.compute import METERED_LAYERS


def cohort_ready(method: Method | type[Method]) -> bool:
    """Whether ``method`` (an instance or a class) trains in cohorts: it defines ``local_loss``, in
    a class that also defines (or inherits unchanged) its ``local_update``: ``Method``'s, which runs
    the loss (FedProx, SCAFFOLD, FedDyn), or one written beside the loss (FedWon). A subclass
    overriding the step without restating the loss keeps the per-client path."""
    cls = method if isinstance(method, type) else type(method)
    owner_loss, owner_update = _owner(cls, "local_loss"), _owner(cls, "local_update")
    return owner_loss is not Method and issubclass(owner_loss, owner_update)


def _owner(cls: type, name: str) -> type:
    return next(c for c in cls.__mro__ if name in c.__dict__)


@dataclass
class Member:
    """One client of a cohort: its context (model loaded and ``local_loss`` already called), its
    loss, its starting weights and its dropout generator."""
    ctx: ClientContext
    spec: LocalLoss
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    dropout: torch.Generator | None = None


@torch.no_grad()
def snapshot(model: nn.Module) -> tuple[dict, dict]:
    """The model's parameters and buffers as they are now (copies; made without autograd, so no
    ``detach`` per tensor: one operation each)."""
    return ({n: p.clone() for n, p in model.named_parameters()},
            {n: b.clone() for n, b in model.named_buffers()})


def load_trained(model: nn.Module, params: dict, buffers: dict) -> None:
    """Put one client's trained tensors into ``model`` (in place)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n])
        for n, b in model.named_buffers():
            b.copy_(buffers[n])


@dataclass
class _Layer:
    weight: str  # parameter name
    rows: int  # output rows per sample (positions for a conv)
    backward: int  # passes a backward charges (0: no gradient comes through)


def _probe(model: nn.Module, x: torch.Tensor) -> tuple[list[_Layer], list[tuple[float, tuple, torch.dtype]]]:
    """The conv/linear layers a forward runs (for the clock) and the dropout layers it passes
    through (p, per-sample input shape, dtype), in call order: one eval-mode pass on one sample."""
    names = {id(m): n for n, m in model.named_modules()}
    layers, drops, handles = [], [], []

    def on_layer(mod, inputs, out):
        if not isinstance(out, torch.Tensor):
            return
        rows = out.numel() // out.shape[-1] if isinstance(mod, nn.Linear) else out.shape[2:].numel()
        passes = (1 + int(mod.weight.requires_grad)) if out.requires_grad else 0
        prefix = names[id(mod)]
        layers.append(_Layer(f"{prefix}.weight" if prefix else "weight", int(rows), passes))

    def on_drop(mod, inputs):
        if 0.0 < mod.p < 1.0:
            drops.append((mod.p, tuple(inputs[0].shape[1:]), inputs[0].dtype))

    for mod in model.modules():
        if isinstance(mod, METERED_LAYERS):
            handles.append(mod.register_forward_hook(on_layer))
        elif isinstance(mod, KeyedDropout):
            handles.append(mod.register_forward_pre_hook(on_drop))
    was = model.training
    model.eval()
    try:
        with torch.enable_grad():
            model(x[:1])
    finally:
        model.train(was)
        for h in handles:
            h.remove()
    return layers, drops


# model -> ((loss, its tensors' structure, trainable parameter names), the names its loss never reaches)
_UNREACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _unreached(one: Callable, p: dict, fz: dict, b: dict, batch, tensors, masks) -> frozenset[str]:
    """The trainable parameters (``p``'s names) that the first client's loss on its batch does
    not reach (no gradient, not a zero one), computed outside ``vmap`` on its own tensors (its
    buffers copied: BN's running statistics are updated once, by the step itself)."""
    def first(v):
        return v[0]
    mine = {n: v[0].detach().clone().requires_grad_() for n, v in p.items()}
    if not mine:
        return frozenset()
    with torch.enable_grad():
        loss = one(mine, tree_map(first, fz), {n: v[0].clone() for n, v in b.items()}, tree_map(first, batch),
                   tree_map(first, tensors), tree_map(first, masks))
        if not loss.requires_grad:
            return frozenset(mine)
        grads = torch.autograd.grad(loss, list(mine.values()), allow_unused=True)
    return frozenset(n for n, g in zip(mine, grads) if g is None)


def _refuse_unsupported(model: nn.Module) -> None:
    for n, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats and m.momentum is None:
            raise NotImplementedError(f"client cohorts: BN layer {n!r} has momentum=None (a cumulative "
                                      "average); train it with runtime.cohort_size 0")


def train_cohort(model: nn.Module, members: list[Member], meter: bool = False) -> list[float] | None:
    """Train every member's local step at once; afterwards each member's ``params``/``buffers``
    hold its trained tensors and its context its loss sum and steps (``ctx.stats()``). Returns the
    multiply-accumulates each client's training passes ran (``meter``), else None."""
    _refuse_unsupported(model)
    K = len(members)
    ctx0, spec0 = members[0].ctx, members[0].spec
    t = ctx0.train
    device = next(iter(members[0].params.values())).device
    param_names = [n for n, _ in model.named_parameters()]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    P = {n: torch.stack([m.params[n] for m in members]) for n in trainable}
    Fz = {n: torch.stack([m.params[n] for m in members]) for n in param_names if n not in P}
    B = {n: torch.stack([m.buffers[n] for m in members]) for n in members[0].buffers}
    spec_tree = tree_structure(spec0.tensors)
    if any(tree_structure(m.spec.tensors) != spec_tree for m in members):
        raise ValueError("client cohorts: every client's LocalLoss.tensors must have the same structure")
    reach_key = (spec0.loss, spec_tree, tuple(trainable))
    known = _UNREACHED.get(model)
    unreached = known[1] if known is not None and known[0] == reach_key else None
    T = tree_map(lambda *xs: torch.stack(xs), *[m.spec.tensors for m in members])
    lrs = [m.ctx.lr if m.spec.lr is None else m.spec.lr for m in members]
    lr_vec = None if len(set(lrs)) == 1 else torch.tensor(lrs, dtype=torch.float32, device=device)
    mom, wd, clip = t.momentum, t.weight_decay, t.grad_clip
    M = {n: torch.zeros_like(v) for n, v in P.items()} if mom else {}

    def leave_alone(names):
        """Parameters no loss reaches train as frozen ones: not differentiated, never stepped."""
        for n in names:
            Fz[n] = P.pop(n)
            M.pop(n, None)
    if unreached:
        leave_alone(unreached)
    sums = torch.zeros(K, dtype=torch.float64, device=device)
    macs = torch.zeros(K, dtype=torch.float64, device=device) if meter else None
    loss_fn = spec0.loss
    layers = drops = None
    iters = [m.ctx.batches() for m in members]
    active = list(range(K))
    stepped = set()  # members whose running loss is already their view of ``sums``
    step = 0

    calls = [0]  # forward calls in the last step (vmap runs the Python once per step)

    def one(p, fz, b, batch, tensors, masks):
        merged = {n: p[n] if n in p else fz[n] for n in param_names}

        def forward(x):
            calls[0] += 1
            with cohort_masks(list(masks[calls[0] - 1]) if masks else None):
                return functional_call(model, (merged, b), (x,))
        return loss_fn(forward, merged, batch, tensors)

    vstep = vmap(grad_and_value(one), randomness="error")

    while active:
        batches = {}
        for k in active:
            b = next(iters[k], None)
            if b is not None:
                batches[k] = tuple(b)
        active = [k for k in active if k in batches]
        if not active:
            break
        if layers is None:
            layers, drops = _probe(model, batches[active[0]][0])
        groups: dict[tuple, list[int]] = {}
        for k in active:
            groups.setdefault(tuple(tuple(x.shape) for x in batches[k]), []).append(k)
        for shape, idx in groups.items():
            full = len(idx) == K
            ix = None if full else torch.tensor(idx, device=device)

            def sel(v, ix=ix):
                return v if ix is None else v.index_select(0, ix)
            p, fz, b = ({n: sel(v) for n, v in d.items()} for d in (P, Fz, B))
            tens = tree_map(sel, T)
            batch = tuple(torch.stack([batches[k][i] for k in idx]) for i in range(len(shape)))
            bsz = shape[0][0]
            masks = _draw_masks([members[k] for k in idx], drops, bsz)
            if unreached is None:  # the first step's first group: which parameters the loss reaches
                unreached = _unreached(one, p, fz, b, batch, tens, masks)
                _UNREACHED[model] = (reach_key, unreached)
                leave_alone(unreached)
                for n in unreached:
                    fz[n] = p.pop(n)
            if meter:  # the passes' MACs at each client's weights before the step (ComputeMeter's)
                w = {**p, **fz}
                inc = sum(torch.count_nonzero(w[L.weight].flatten(1), dim=1).to(torch.float64) * (L.rows * bsz)
                          * (1 + L.backward) for L in layers)
            calls[0] = 0
            grads, loss = vstep(p, fz, b, batch, tens, masks)
            if calls[0] != 1 and (drops or meter):
                raise NotImplementedError("client cohorts: a LocalLoss must call forward once per batch "
                                          "(dropout masks and the clock assume it)")
            _sgd(p, grads, M, idx, ix, step == 0, mom, wd, clip, lrs[idx[0]] if lr_vec is None else sel(lr_vec))
            if ix is None:
                sums += loss.detach().to(torch.float64)
                if meter:
                    macs += inc
            else:
                for n, v in p.items():
                    P[n].index_copy_(0, ix, v)
                for n, v in b.items():
                    B[n].index_copy_(0, ix, v)
                sums.index_add_(0, ix, loss.detach().to(torch.float64))
                if meter:
                    macs.index_add_(0, ix, inc)
            for k in idx:
                ctx = members[k].ctx
                ctx._steps += 1
                if k not in stepped:  # a view, set at its first step: ctx.batches() checks it once per epoch
                    ctx._loss_sum = sums[k]
                    stepped.add(k)
        step += 1
    for k, m in enumerate(members):  # views into the stacked tensors, read once each (no copy per client)
        m.params = {n: (P[n][k] if n in P else Fz[n][k]) for n in param_names}
        m.buffers = {n: v[k] for n, v in B.items()}
    return None if macs is None else [float(v) for v in macs.tolist()]


def _draw_masks(members: list[Member], drops, bsz: int) -> list[torch.Tensor]:
    """Each dropout layer's keep-mask for each client, drawn from the client's own generator in
    the order (and with the shape, dtype and device) its forward would draw them alone."""
    if not drops:
        return []
    out = []
    for p, shape, dtype in drops:
        per = []
        for m in members:
            g = m.dropout
            if g is None:
                raise RuntimeError("client cohorts: a model with dropout needs each client's dropout generator")
            per.append(torch.empty((bsz, *shape), dtype=dtype, device=g.device).bernoulli_(1.0 - p, generator=g))
        out.append(torch.stack(per))
    return [out]  # one forward call per step


@torch.no_grad()
def _sgd(p: dict, grads: dict, M: dict, idx: list[int], ix, first: bool, mom: float, wd: float,
         clip: float | None, lr) -> None:
    """``clip_grad_norm_`` then ``torch.optim.SGD.step`` (weight decay, momentum without
    dampening, no Nesterov), per client, on the stacked tensors ``p`` (updated in place)."""
    if clip:
        norms = torch.stack([torch.linalg.vector_norm(g.flatten(1), 2, dim=1) for g in grads.values()], dim=1)
        total = torch.linalg.vector_norm(norms, 2, dim=1)
        coef = torch.clamp(clip / (total + 1e-6), max=1.0)
        grads = {n: g * coef.view(-1, *([1] * (g.dim() - 1))) for n, g in grads.items()}
    for n, g in grads.items():
        d = g.add(p[n], alpha=wd) if wd else g
        if mom:
            if first:
                buf = d.clone()
            else:
                buf = M[n] if ix is None else M[n].index_select(0, ix)
                buf.mul_(mom).add_(d)
            if ix is None:
                M[n] = buf
            else:
                M[n].index_copy_(0, ix, buf)
            d = buf
        if isinstance(lr, torch.Tensor):
            p[n].sub_(lr.view(-1, *([1] * (d.dim() - 1))) * d)
        else:
            p[n].add_(d, alpha=-lr)


@dataclass
class CohortClient:
    """A client to train in a cohort: ``start()`` loads its starting tensors into the shared model
    and returns its context; ``dropout`` is its generator keyed by (seed, round, client, "dropout")."""
    start: Callable[[], ClientContext]
    dropout: torch.Generator | None = None


def run_cohort(method: Method, model: nn.Module, clients: list[CohortClient], after, meter: bool = False) -> None:
    """The cohort's client steps: for each client ``start()`` then ``method.local_loss(ctx)`` (its
    own passes, if any, run here), then all trained at once (:func:`train_cohort`), then for each
    client, in order, its trained tensors loaded into ``model``, the upload (``LocalLoss.finish``)
    and ``after(ctx, upload, macs)`` (macs: every pass the client ran, for the simulated clock;
    None without ``meter``). A client whose ``local_loss`` is None trains alone at its turn."""
    from contextlib import nullcontext

    from raysim.models.dropout import dropout_generator
    from raysim.engine.compute import ComputeMeter

    def scope(c: CohortClient):
        return (ComputeMeter() if meter else nullcontext(),
                dropout_generator(c.dropout) if c.dropout is not None else nullcontext())

    members: list[tuple[CohortClient, Member, float]] = []
    for c in clients:
        ctx = c.start()
        meter_cm, drop_cm = scope(c)
        with meter_cm as m, drop_cm:
            spec = method.local_loss(ctx)
            if spec is None:
                up = method.local_update(ctx)
        if spec is None:
            after(ctx, up, m.macs if meter else None)
            continue
        params, buffers = snapshot(model)
        members.append((c, Member(ctx, spec, params, buffers, c.dropout), m.macs if meter else 0.0))
    if not members:
        return
    trained = train_cohort(model, [mb for _, mb, _ in members], meter=meter)
    for i, (c, mb, pre) in enumerate(members):
        load_trained(model, mb.params, mb.buffers)
        model.train()
        meter_cm, drop_cm = scope(c)
        with meter_cm as m, drop_cm:
            up = mb.spec.finish(mb.ctx) if mb.spec.finish is not None else method.upload(mb.ctx, mb.ctx.stats())
        after(mb.ctx, up, pre + trained[i] + m.macs if meter else None)


def auto_cohort_size(model: nn.Module, device: torch.device, batch_size: int, image_shape,
                     limit: int = AUTO_COHORT_MAX) -> int:
    """``runtime.cohort_size: auto``: as many clients as half the GPU memory free now holds, each
    needing its parameters four times over (weights, gradient, momentum, a loss tensor such as
    FedProx's anchor) and its activations twice (kept for the backward, and their gradients) at the
    batch size; at most ``limit``. 0 (off) on a CPU, where vectorizing gains little. It depends on
    what else holds the GPU, hence refused with ``runtime.deterministic``."""
    if device.type != "cuda":
        return 0
    free, _ = torch.cuda.mem_get_info(device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    acts = [0]

    def count(mod, inputs, out):
        if isinstance(out, torch.Tensor) and not list(mod.children()):
            acts[0] += out.numel() * out.element_size()
    handles = [m.register_forward_hook(count) for m in model.modules()]
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(torch.zeros((1, *image_shape), device=device))
    finally:
        model.train(was)
        for h in handles:
            h.remove()
    per_client = 4 * weights + 2 * acts[0] * batch_size
    return max(1, min(limit, int(0.5 * free // max(per_client, 1))))
