"""Aggregation as an object: the part that runs on a host (fold a client's upload into the host's
partial result) and the part that runs on the server (reduce the hosts' partials).

A method declares its aggregator (``Method.aggregator``) and its server step (``aggregate``)
receives what the aggregator reduced to:

* :class:`WeightedMean` (FedAvg and most methods) -> :class:`Mean`: the weight-weighted mean of
  the round's uploaded tensors, summed in float64 on each host, on the uploads' device (a float32
  value times an integer weight is exact in float64), so 1 host or 8 give the same float32 result;
  the sums leave the device once per host per round (:meth:`Aggregator.leave_device`); the
  uploads' ``statistics`` (non-model vectors: SCAFFOLD's control-variate updates) folded the same
  way, with the same weights, into ``Mean.statistics``; plus every client's ``extras`` (anything
  else, such as class prototypes) by client id.
* :class:`KeepAll` (FDSE, CSAC, DapperFL) -> :class:`AllUploads`: every client's upload.

:func:`weighted_mean` is the one float64 weighted mean: methods whose own server step averages
(DapperFL's Eq. 7, CSAC's fusion, FDSE's statistics) call it rather than writing their own.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Iterable

import torch

from raysim.core.tensors import ReadOnlyTensors, Tensors, to_device, wait_for


# ----------------------------------------------------------------------------- the weighted mean

_NARROW = (torch.float32, torch.float16, torch.bfloat16)  # significands of at most 24 bits


def exact_product(dtype: torch.dtype, weight: float) -> bool:
    """Whether every ``dtype`` value times ``weight`` is exact in float64: a significand of at
    most 24 bits times one of at most 29 bits fits float64's 53 (an integer weight up to 2^29,
    n_k or 1.0, always does; 0.1 does not). Then one fused multiply-add rounds exactly like a
    rounded product followed by a rounded sum: the product has nothing to round."""
    if dtype not in _NARROW or not math.isfinite(weight):
        return False
    if weight == 0.0:
        return True
    mantissa, exponent = math.frexp(abs(weight))
    if not -800 < exponent < 800:  # far from float64's overflow and subnormals
        return False
    bits = int(mantissa * 2**53)
    return 53 - ((bits & -bits).bit_length() - 1) <= 29


def accumulate(sums: dict[str, torch.Tensor], tensors: Tensors, weight: float, keys=None) -> None:
    """``sums[k] += weight * tensors[k]`` in float64 on the tensors' own device (a GPU host's
    uploads are summed on the GPU: nothing per client crosses to the CPU).

    The first tensor starts its sum as ``t * w`` in float64 (a copy times w: -0.0 stays -0.0). Each later one is added with one fused ``add_(t, alpha=w)`` where that is provably
    the same as the rounded product then the rounded sum (:func:`exact_product`: a float32 upload
    times an integer weight) or the device is not the CPU; otherwise (a fractional weight on the
    CPU, where the fused kernel's FMA rounds once instead of twice) as a float64 product then a
    sum: CPU sums are bit for bit those of the float64 product then sum
    (``tests/engine/test_device_hot_path.py``)."""
    weight = float(weight)
    for k in (tensors if keys is None else keys):
        t = tensors[k]
        if t.requires_grad:  # an upload's tensors are detached already (state_dict's): no operation per tensor then
            t = t.detach()
        s = sums.get(k)
        if s is None:
            sums[k] = t.to(torch.float64, copy=True).mul_(weight)
            continue
        if t.device != s.device:
            t = to_device(t, s.device, what="accumulate")
        if t.is_floating_point() and (t.device.type != "cpu" or exact_product(t.dtype, weight)):
            s.add_(t, alpha=weight)
        else:
            s.add_(t.to(torch.float64, copy=True).mul_(weight))


def cast_like(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float64 result back to the tensor's own dtype (integers rounded)."""
    return value.to(dtype) if dtype.is_floating_point else value.round().to(dtype)


def weighted_mean(pairs: Iterable[tuple[Tensors, float]], like: Tensors | None = None,
                  total: float | None = None) -> Tensors:
    """sum_i w_i t_i / sum_i w_i over ``pairs`` of (tensors, w_i), streamed one at a time, in
    float64, cast back to each entry's dtype (``like``'s, else the first's; integers rounded).
    Only ``like``'s keys are averaged when it is given. ``total``: divide by it instead of the sum
    of the weights (weights already normalised)."""
    sums: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {k: v.dtype for k, v in like.items()} if like is not None else {}
    weight = 0.0
    for tensors, w in pairs:
        weight += float(w)
        accumulate(sums, tensors, w, keys=None if like is None else like.keys())
        for k, v in tensors.items():
            dtypes.setdefault(k, v.dtype)
    denominator = weight if total is None else total
    return {k: cast_like(s / denominator if denominator > 0 else s, dtypes[k]) for k, s in sums.items()}


# ----------------------------------------------------------------------------- what the server receives

def update_bank(bank: dict, uploads, key: str) -> dict:
    """A server-side bank of per-client statistics (ELCFS's amplitude spectra, CCST's styles):
    each client that uploaded ``extras[key]`` this round replaces its entry; the others keep theirs."""
    return {**bank, **{k: e[key] for k, e in uploads.extras.items() if key in e}}


@dataclass
class Mean:
    """The round's uploads as :class:`WeightedMean` reduces them."""
    mean: Tensors  # weighted mean of Upload.tensors over the round's clients
    total_weight: float
    clients: list[int]  # the round's client ids, ascending
    extras: dict[int, dict] = field(default_factory=dict)  # each client's Upload.extras (if any)
    statistics: Tensors = field(default_factory=dict)  # weighted mean of Upload.statistics, the same weights


@dataclass
class AllUploads:
    """The round's uploads as :class:`KeepAll` reduces them: every client's, by ascending id."""
    each: dict  # client id -> Upload

    @property
    def clients(self) -> list[int]:
        return list(self.each)

    @property
    def total_weight(self) -> float:
        return float(sum(u.weight for u in self.each.values()))


# ----------------------------------------------------------------------------- aggregators

class Aggregator:
    """``start()`` a host's partial, ``add`` each client's upload to it (on the host), ``reduce``
    the hosts' partials (on the server, in host order)."""

    def start(self):
        raise NotImplementedError

    def add(self, partial, client_id: int, upload) -> None:
        raise NotImplementedError

    def reduce(self, partials: list):
        raise NotImplementedError

    def leave_device(self, partial):
        """The host's partial as it leaves the host, on the CPU (the server reduces on the CPU):
        one device-to-CPU transfer per host per round; the partial itself on a CPU host."""
        return to_device(partial, "cpu", what="partial")


@dataclass
class MeanPartial:
    sums: dict = field(default_factory=dict)  # float64 weighted sums of Upload.tensors
    weight: float = 0.0
    dtypes: dict = field(default_factory=dict)
    clients: list = field(default_factory=list)
    extras: dict = field(default_factory=dict)
    statistics: dict = field(default_factory=dict)  # float64 weighted sums of Upload.statistics
    statistic_dtypes: dict = field(default_factory=dict)


class WeightedMean(Aggregator):
    """n_k-weighted FedAvg mean (the weight is ``Upload.weight``) of the uploads' tensors, and of
    their statistics with the same weights."""

    def start(self) -> MeanPartial:
        return MeanPartial()

    def add(self, partial: MeanPartial, client_id: int, upload) -> None:
        for sums, dtypes, tensors in ((partial.sums, partial.dtypes, upload.tensors),
                                      (partial.statistics, partial.statistic_dtypes, upload.statistics)):
            accumulate(sums, tensors, upload.weight)
            for k, v in tensors.items():
                dtypes.setdefault(k, v.dtype)
        partial.weight += upload.weight
        partial.clients.append(client_id)
        if upload.extras:
            partial.extras[client_id] = upload.extras

    def leave_device(self, partial: MeanPartial) -> MeanPartial:
        """The float64 sums (on the uploads' device during the round) and the clients' extras to
        the CPU in one move."""
        moved = to_device({"sums": partial.sums, "statistics": partial.statistics, "extras": partial.extras},
                          "cpu", what="partial")
        return dataclasses.replace(partial, sums=ReadOnlyTensors(moved["sums"]),
                                   statistics=ReadOnlyTensors(moved["statistics"]), extras=moved["extras"])

    def reduce(self, partials: list[MeanPartial]) -> Mean:
        total = sum(p.weight for p in partials)
        mean = reduce_sums([(p.sums, p.dtypes) for p in partials], total)
        statistics = reduce_sums([(p.statistics, p.statistic_dtypes) for p in partials], total)
        extras = dict(sorted(((c, e) for p in partials for c, e in p.extras.items()), key=lambda ce: ce[0]))
        return Mean(mean, total, sorted(c for p in partials for c in p.clients), extras, statistics)


def reduce_sums(partials: list[tuple[dict, dict]], total: float) -> Tensors:
    """The hosts' float64 sums (``(sums, dtypes)`` in host order) added up, divided by ``total``
    and cast back to each key's dtype: the server's half of :class:`WeightedMean`."""
    sums: dict[str, torch.Tensor] = {}
    owned: set[str] = set()  # keys whose sum is a buffer of our own (the hosts' partials are only read)
    dtypes: dict[str, torch.dtype] = {}
    for part, part_dtypes in partials:
        for k, v in part.items():
            if k in owned:
                sums[k].add_(v)  # in place: the same sums as ``sums[k] + v``, one buffer per key
            elif k in sums:
                sums[k] = sums[k] + v
                owned.add(k)
            else:
                sums[k] = v  # no copy: the first new buffer is the second host's sum or the division's
        dtypes.update(part_dtypes)

    def mean(k: str, v: torch.Tensor) -> torch.Tensor:
        if total > 0:
            return v.div_(total) if k in owned else v / total
        return v if k in owned else v.clone()

    return {k: cast_like(mean(k, v), dtypes[k]) for k, v in sums.items()}


class KeepAll(Aggregator):
    """Every upload, for methods whose server step needs each client's tensors."""

    def start(self) -> dict:
        return {}

    def add(self, partial: dict, client_id: int, upload) -> None:
        """A CPU copy of the upload's tensors and statistics (its tensors are the model's, which the
        next client overwrites): on a GPU host a non-blocking copy into pinned memory, so the next
        client starts at once (the device's stream orders it before that client's writes)."""
        moved = to_device({"tensors": upload.tensors, "statistics": upload.statistics}, "cpu", what="upload",
                          copy=True, non_blocking=True)
        partial[client_id] = dataclasses.replace(upload, tensors=moved["tensors"], statistics=moved["statistics"])

    def leave_device(self, partial: dict) -> dict:
        """Every upload is on the CPU already: wait for the copies still in flight."""
        wait_for(partial)
        return partial

    def reduce(self, partials: list[dict]) -> AllUploads:
        return AllUploads(dict(sorted(((c, u) for p in partials for c, u in p.items()), key=lambda cu: cu[0])))
