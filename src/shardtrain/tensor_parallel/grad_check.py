"""A one-time check that replicated parameters got the same gradient on every tensor-parallel rank.

[Note: replicated gradients across tensor-parallel ranks]
A parameter the plan leaves replicated gets the same gradient on every tp rank (same batch) unless the model applies
it to a *split* activation (a per-head norm after a column layer, a scale on the MLP's hidden block): then each rank
holds a partial sum, and the replicas drift apart silently. Megatron-LM (``sequence_parallel``) and Hugging Face
plans (``replicated_with_grad_allreduce``) have the user mark such parameters; neither detects a missing mark. Summing
every differing gradient would guess wrong for a parameter used on both kinds of activation, so a missing mark is an
error naming the parameter and the style to add; so is ``partial_grad`` on a gradient already complete (it would
count ``tp`` times).

How, cheaply: in the first backward a hook on each trainable replicated parameter, registered before any hook that
sums gradients, records a sketch (the norm and the dot products with ``_PROJECTIONS`` random vectors, the same on
every rank); the tp ranks exchange the sketches once, at the end (one object all-gather). Two ranks' projection
differences are N(0, ||g_r - g_0||^2), so their root mean square estimates ||g_r - g_0||: rounding stays far below
``max(1e-3, 8 eps)`` of the norm, a partial gradient far above. A hook is removed once its parameter is checked
(later steps cost nothing); a parameter without a gradient in the first backward is checked at its first one.
Graph-mode ZeRO-3 fires no parameter hook inside its graph, so while any such parameter is :func:`unchecked` the
graph runtime runs the training forward and backward eagerly (``graph/runtime.py``).
"""

from __future__ import annotations

import math
import re
import weakref
from collections.abc import Iterable
from functools import partial

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils.weak import WeakIdKeyDictionary

from shardtrain.distributed.communicator import Communicator
from shardtrain.errors import LayoutError

_PROJECTIONS = 4
_SEED = 20_241_117  # any constant: every rank must draw the same projection vectors
_WAITING = WeakIdKeyDictionary()  # parameter -> its name, while a check's hook waits for its first gradient


def unchecked(params: Iterable[nn.Parameter]) -> list[str]:
    """The names of those of ``params`` whose gradient a :class:`ReplicatedGradCheck` has not compared yet."""
    return [name for p in params if (name := _WAITING.get(p)) is not None]


class ReplicatedGradCheck:
    """Hooks on ``params`` (name -> (parameter, marked partial_grad)) comparing their gradients across the group of
    ``comm`` at the end of the backward in which they first get one ([Note: replicated gradients across
    tensor-parallel ranks])."""

    def __init__(self, params: dict[str, tuple[nn.Parameter, bool]], comm: Communicator) -> None:
        self.comm = comm
        self._partial = {name: marked for name, (_, marked) in params.items()}
        self._sketches: dict[str, torch.Tensor] = {}  # this backward's, [norm, rtol, projections...] float64
        self._queued = False
        self._handles = {name: p.register_hook(partial(self._record, name)) for name, (p, _) in params.items()}
        self._params = {name: weakref.ref(p) for name, (p, _) in params.items()}
        for name, (p, _) in params.items():
            _WAITING[p] = name

    def _record(self, name: str, grad: torch.Tensor) -> None:
        sketch = _sketch(grad)
        previous = self._sketches.get(name)
        if previous is not None:  # reached twice in one backward (reentrant checkpointing): the projections add up
            sketch = torch.cat([previous[:1] + sketch[:1], sketch[1:2], previous[2:] + sketch[2:]])  # norm: a bound
        self._sketches[name] = sketch
        if not self._queued:  # compare once this backward is over, on every rank at the same point
            self._queued = True
            Variable._execution_engine.queue_callback(self._compare)

    def _compare(self) -> None:
        self._queued = False
        names = list(self._sketches)
        values = torch.stack([self._sketches[n] for n in names]).cpu().tolist() if names else []
        self._sketches.clear()
        for name in names:
            self._handles.pop(name).remove()
            if (p := self._params.pop(name)()) is not None:
                _WAITING.pop(p, None)
        everyone = self.comm.all_gather_object(
            dict(zip(names, values)), what="sketches of replicated parameters' gradients"
        )
        unmarked: list[tuple[str, float, int]] = []  # (name, relative difference, tp rank)
        overmarked: list[str] = []
        # every rank judges the same names from the same sketches: all raise, or none (no rank left waiting)
        for name in dict.fromkeys(n for theirs in everyone for n in theirs):
            sketches = [theirs.get(name) for theirs in everyone]
            rtol = next(s for s in sketches if s is not None)[1]
            difference, rank = _largest_difference(sketches)
            if not self._partial[name] and difference > rtol:
                unmarked.append((name, difference, rank))
            elif self._partial[name] and difference <= rtol and min(_norm(s) for s in sketches) > 0:
                overmarked.append(name)
        if unmarked:
            raise LayoutError(_unmarked_message(unmarked, self.comm.size))
        if overmarked:
            raise LayoutError(
                f"{overmarked} are marked to have their gradients summed over the tensor-parallel group "
                "(replicated_with_grad_allreduce, or a replicated parameter inside a gather/all_reduce module), but "
                "every tensor-parallel rank computed the same, complete gradient for them: the sum would count it "
                f"{self.comm.size} times. Remove that style from the plan for them (their module uses them on "
                "replicated activations)."
            )


def _sketch(grad: torch.Tensor) -> torch.Tensor:
    """``[norm, tolerance, <g, w_1>, ..., <g, w_K>]`` in float64 on the gradient's device (no host sync here)."""
    g = (grad.to_dense() if grad.layout != torch.strided else grad).detach().reshape(-1).float()
    generator = torch.Generator(device=g.device)
    out = [torch.linalg.vector_norm(g, dtype=torch.float64)]
    out.append(torch.tensor(max(1e-3, 8 * torch.finfo(grad.dtype).eps), dtype=torch.float64, device=g.device))
    for k in range(_PROJECTIONS):
        generator.manual_seed(_SEED + k)
        w = torch.randn(g.numel(), generator=generator, device=g.device, dtype=torch.float32)
        out.append(torch.dot(g, w).double())
    return torch.stack(out)


def _norm(sketch: list[float] | None) -> float:
    return 0.0 if sketch is None else sketch[0]


def _largest_difference(sketches: list[list[float] | None]) -> tuple[float, int]:
    """The largest estimated ``||g_r - g_0|| / max_r ||g_r||`` over the ranks, and that rank (0: all agree)."""
    scale = max(_norm(s) for s in sketches)
    if scale == 0:
        return 0.0, 0
    zero = [0.0] * (_PROJECTIONS + 2)
    base = (sketches[0] or zero)[2:]
    worst, worst_rank = 0.0, 0
    for rank, s in enumerate(sketches[1:], start=1):
        p = (s or zero)[2:]
        estimate = math.sqrt(sum((a - b) ** 2 for a, b in zip(p, base)) / _PROJECTIONS) / scale
        if s is None or sketches[0] is None:
            estimate = math.inf  # a gradient on one rank and none on another
        if estimate > worst:
            worst, worst_rank = estimate, rank
    return worst, worst_rank


def _unmarked_message(unmarked: list[tuple[str, float, int]], size: int) -> str:
    names = [n for n, _, _ in unmarked]
    name, difference, rank = unmarked[0]
    patterns = sorted({re.sub(r"(?<=\.)\d+(?=\.)", "*", n) for n in names})
    return (
        f"the replicated parameters {names} got different gradients on the {size} tensor-parallel ranks (e.g. "
        f"{name}: tp rank {rank} differs from tp rank 0 by {difference:.2g} of the gradient's norm). The model "
        "applies them to activations that tensor parallelism splits (after a colwise layer, inside the attention "
        "heads), so each rank's gradient covers only its own block and the replicas would drift apart. Add "
        f"{', '.join(repr(p) for p in patterns)}: 'replicated_with_grad_allreduce' to the plan so that their "
        "gradients are summed over the tensor-parallel group (Megatron-LM's sequence_parallel mark), or split them "
        "with the activation. If every replicated parameter is named here, the tensor-parallel ranks probably got "
        "different batches instead."
    )
