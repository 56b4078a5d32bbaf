"""Summary statistics of one tensor, computed in float64 on the tensor's own device.

Conventions (the compare tool and the tests rely on them):

* ``std`` is the **population** standard deviation (divide by n, ``ddof=0``), so one element has std 0.
* ``min``, ``max``, ``mean``, ``std`` and ``norm`` (L2) are taken over the **finite** elements only. NaN and +-inf
  are counted in ``nan`` and ``inf`` instead of poisoning every other number; a tensor with no finite element has
  ``None`` (JSON ``null``) for those five. A single NaN therefore shows up as a changed ``nan`` count.
* ``zero``, ``pos`` and ``neg`` count all elements by sign: +inf is positive, -inf negative, NaN is in none of them.
* Integer and bool tensors: moments in float64 (True is 1); ``nan``/``inf`` are 0. ``min``/``max`` of integers are
  exact Python ints (float64 would round beyond 2**53).
* Complex tensors get only shape, dtype and numel (there is no order on them); so do meta tensors (no data).

Large tensors are processed in chunks so the float64 temporaries stay bounded (``CHUNK`` elements); chunk results
are merged with Chan's parallel formula, which keeps the variance accurate. Each chunk costs two small
device-to-host transfers (the mean, which also tells whether NaN/inf are present, then a dozen numbers); no copy of
the tensor outlives the call.
"""

from __future__ import annotations

import math
from typing import Any

import torch

CHUNK = 1 << 22  # elements: 32 MiB of float64 temporaries at most
STAT_FIELDS = ("min", "max", "mean", "std", "norm", "nan", "inf", "zero", "pos", "neg")


def tensor_stats(t: torch.Tensor) -> dict[str, Any]:
    """Shape, dtype, numel and the statistics above for ``t`` (gradients and views included)."""
    t = t.detach()
    out: dict[str, Any] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "numel": t.numel()}
    if t.is_complex() or t.is_meta or t.layout != torch.strided:
        return out
    flat = t.reshape(-1)  # a view when contiguous; strided inputs are copied once, chunk by chunk below
    acc = _Accumulator(exact_extremes=not (t.is_floating_point() or t.dtype == torch.bool))
    for start in range(0, flat.numel(), CHUNK):
        acc.add(flat[start : start + CHUNK])
    out.update(acc.result())
    return out


class _Accumulator:
    """Running count/mean/M2 over finite elements plus extremes and sign counts, merged chunk by chunk."""

    def __init__(self, exact_extremes: bool) -> None:
        self.exact_extremes = exact_extremes
        self.n = 0
        self.mean = 0.0
        self.m2 = 0.0
        self.sumsq = 0.0
        self.lo: float | int | None = None
        self.hi: float | int | None = None
        self.counts = dict.fromkeys(("nan", "inf", "zero", "pos", "neg"), 0)

    def add(self, chunk: torch.Tensor) -> None:
        if chunk.numel() == 0:
            return
        device = chunk.device
        # sign counts in two passes: zero = numel - nonzero, neg = nonzero - pos - nan
        nonzero, pos = torch.count_nonzero(chunk), (chunk > 0).sum()
        nan = inf = torch.zeros((), dtype=torch.int64, device=device)
        x = chunk.to(torch.float64)
        mean = x.mean()
        # the float64 mean is finite unless a NaN or inf is present: one host sync instead of an isfinite pass,
        # and the masking (which copies) only when needed
        if chunk.is_floating_point() and not math.isfinite(mean.item()):
            finite = torch.isfinite(chunk)
            nan, inf = torch.isnan(chunk).sum(), torch.isinf(chunk).sum()
            x = x[finite]
            mean = x.mean() if x.numel() else torch.zeros((), dtype=torch.float64, device=device)
        n = x.numel()
        counts = [nan, inf, chunk.numel() - nonzero, pos, nonzero - pos - nan]
        if n:
            centered = x - mean  # two-pass M2: no cancellation when |mean| >> std
            lo, hi = torch.aminmax(x)
            moments = [mean, torch.dot(centered, centered), torch.dot(x, x), lo, hi]
        else:
            moments = [mean] * 5
        values = torch.stack(moments + [c.to(torch.float64) for c in counts]).tolist()
        c_mean, c_m2, c_sumsq, c_lo, c_hi = values[:5]
        for key, value in zip(("nan", "inf", "zero", "pos", "neg"), values[5:]):
            self.counts[key] += int(value)
        if not n:
            return
        if self.exact_extremes:  # integers: exact extremes from the native dtype (float64 rounds beyond 2**53)
            c_lo, c_hi = int(chunk.min()), int(chunk.max())
        self.lo = c_lo if self.lo is None else min(self.lo, c_lo)
        self.hi = c_hi if self.hi is None else max(self.hi, c_hi)
        total = self.n + n
        delta = c_mean - self.mean
        self.mean += delta * n / total
        self.m2 += c_m2 + delta * delta * self.n * n / total
        self.sumsq += c_sumsq
        self.n = total

    def result(self) -> dict[str, Any]:
        if self.n == 0:
            moments: dict[str, Any] = dict.fromkeys(("min", "max", "mean", "std", "norm"))
        else:
            moments = {
                "min": self.lo,
                "max": self.hi,
                "mean": self.mean,
                "std": math.sqrt(max(self.m2, 0.0) / self.n),
                "norm": math.sqrt(self.sumsq),
            }
        return {**moments, **self.counts}


# -- the same statistics inside a captured graph ---------------------------------------------------------------
# Graph mode at ZeRO stage 3 cannot stop inside the forward to read values (see [Note: statistics inside the graph]
# in shardtrain.debug.traced): there the statistics are computed by torch operations alone, traced into the graph,
# and turned into the dict above on the host once the graph ran. The definitions are the ones above; the
# differences are of method only: the whole tensor at once (the graph holds no Python loop over chunks), and the
# finite elements selected with ``where`` on every call (no host sync to decide whether masking is needed).
_SUMMARY = ("n", "mean", "m2", "sumsq", "min", "max", "nan", "inf", "zero", "pos", "neg")


def summary_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """:func:`tensor_stats`'s numbers of ``t`` as tensors, computed without a host sync or a branch on values (so
    they can be traced into a graph): a float64 vector in the order of ``_SUMMARY``, and for integer tensors a
    second one, int64, with the exact extremes. Empty for tensors that get no statistics (complex, meta, sparse)."""
    if t.requires_grad:  # (not for a gradient: TorchDynamo traces a backward in a mode where detach is banned)
        t = t.detach()
    # (a traced backward may not read layout, and tensors inside a graph are strided)
    if t.is_complex() or t.is_meta or (not torch.compiler.is_compiling() and t.layout != torch.strided):
        return []
    flat = t.reshape(-1)
    numel = flat.numel()
    if numel == 0:  # sizes 0 and 1 are never symbolic in a trace: this branch is decided when tracing
        return [torch.zeros(len(_SUMMARY), dtype=torch.float64, device=t.device)]
    x = flat.to(torch.float64)
    nonzero, pos = torch.count_nonzero(flat), (flat > 0).sum()
    if t.is_floating_point():
        finite = torch.isfinite(flat)
        nan, inf = torch.isnan(flat).sum(), torch.isinf(flat).sum()
        n = finite.sum()
        kept = torch.where(finite, x, 0.0)
        mean = kept.sum() / n.clamp(min=1)
        centered = torch.where(finite, x - mean, 0.0)  # two-pass M2, as above
        lo = torch.where(finite, x, math.inf).amin()
        hi = torch.where(finite, x, -math.inf).amax()
    else:
        nan = inf = torch.zeros((), dtype=torch.int64, device=t.device)
        n = torch.full((), numel, dtype=torch.int64, device=t.device)
        kept = x
        mean = x.mean()
        centered = x - mean
        lo, hi = torch.aminmax(x)
    counts = [n, nan, inf, numel - nonzero, pos, nonzero - pos - nan]
    moments = [mean, torch.dot(centered, centered), torch.dot(kept, kept), lo, hi]
    f64 = [c.to(torch.float64) for c in counts]
    vector = torch.stack([f64[0], *moments, *f64[1:]])  # the order of _SUMMARY
    if t.is_floating_point() or t.dtype == torch.bool:
        return [vector]
    return [vector, torch.stack(list(torch.aminmax(flat))).to(torch.int64)]


def stats_from_summary(shape: list[int], dtype: torch.dtype, values: list[torch.Tensor]) -> dict[str, Any]:
    """The dict :func:`tensor_stats` returns, from what :func:`summary_tensors` computed for a tensor of ``shape``
    and ``dtype``."""
    numel = math.prod(shape)
    out: dict[str, Any] = {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "numel": numel}
    if not values:
        return out
    numbers = dict(zip(_SUMMARY, values[0].tolist()))
    n = int(numbers["n"])
    counts = {key: int(numbers[key]) for key in ("nan", "inf", "zero", "pos", "neg")}
    if numel == 0 or n == 0:
        return {**out, **dict.fromkeys(("min", "max", "mean", "std", "norm")), **counts}
    lo, hi = numbers["min"], numbers["max"]
    if len(values) > 1:  # integers: exact extremes
        lo, hi = values[1].tolist()
    moments = {
        "min": lo,
        "max": hi,
        "mean": numbers["mean"],
        "std": math.sqrt(max(numbers["m2"], 0.0) / n),
        "norm": math.sqrt(numbers["sumsq"]),
    }
    return {**out, **moments, **counts}
