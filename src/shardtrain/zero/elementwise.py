"""Whether an optimizer's step is element-wise, so that stepping ZeRO's flat fragments equals stepping whole tensors.

[Note: optimizers that need the whole tensor]
At ZeRO stages 1-3 the optimizer steps 1-D fragments, flat slices of a bucket, not matrices; under tensor parallelism
it steps each rank's block of a split matrix. That equals one process's step only when each element's update reads its
own gradient and state (see [Note: element-wise optimizers] in zero/optimizer.py). An optimizer that orthogonalizes a
matrix (Muon), factors its second moment (Adafactor), scales by a per-tensor norm (LAMB, LARS) or preconditions by a
matrix (Shampoo, SOAP) is another algorithm on a slice, silently, or fails deep in its step. Two checks keep that out:

- :data:`NOT_ELEMENTWISE`, the classes known to need whole tensors, by qualified name so that no library is imported
  to ask; a class with one of them in its MRO is refused, ``zero_allow_untested_optimizer`` notwithstanding;
- :func:`slice_mismatch`, for a class in neither list: a copy of the optimizer, sharing nothing it writes, steps a
  small matrix whole and, beside it, the same matrix cut the way the engine would cut it (flat, uneven halves; row
  blocks under tensor parallelism) for a few steps of random gradients. A step that fails on the pieces or ends
  elsewhere is not element-wise, and is refused. A probe that agrees is evidence, not proof: such a class still needs
  ``zero_allow_untested_optimizer``, as in DeepSpeed.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Callable

import torch

NOT_ELEMENTWISE: dict[str, str] = {
    "torch.optim._muon.Muon": "it orthogonalizes each 2-D matrix as a whole (Newton-Schulz on the momentum)",
    "deepspeed.runtime.zero.muon.muon_optimizer.MuonWithAuxAdam": "its Muon half orthogonalizes each matrix whole",
    "deepspeed.runtime.zero.muon.original_muon.MuonWithAuxAdam": "its Muon half orthogonalizes each matrix whole",
    "deepspeed.runtime.zero.muon.original_muon.SingleDeviceMuonWithAuxAdam": "its Muon half orthogonalizes each "
    "matrix whole",
    "deepspeed.runtime.zero.muon.original_muon.Muon": "it orthogonalizes each 2-D matrix as a whole",
    "torch.optim._adafactor.Adafactor": "it factors each matrix's second moment into row and column means",
    "transformers.optimization.Adafactor": "it factors each matrix's second moment into row and column means, and "
    "scales each update by the tensor's RMS",
    "deepspeed.ops.lamb.fused_lamb.FusedLamb": "its trust ratio divides two norms of the whole tensor",
    "deepspeed.runtime.fp16.onebit.lamb.OnebitLamb": "its trust ratio divides two norms of the whole tensor",
    "torch_optimizer.lamb.Lamb": "its trust ratio divides two norms of the whole tensor",
    "torch_optimizer.shampoo.Shampoo": "it preconditions each tensor by matrices built from all of it",
    "torch.optim.lbfgs.LBFGS": "its step reads every parameter at once (line search over the flat vector)",
    "torch.optim.sparse_adam.SparseAdam": "it takes sparse gradients, and ZeRO reduces dense ones",
}
"""Optimizer classes (``module.qualname``) whose step needs whole tensors: see [Note: optimizers that need the whole
tensor]. torch's own are named by the module that defines them (``torch.optim.Muon`` says ``torch.optim``)."""


def qualified_name(cls: type) -> str:
    """``module.qualname`` of the module that defines ``cls`` (torch re-labels its optimizers ``torch.optim``)."""
    module = getattr(cls, "__module__", "")
    defined_in = getattr(getattr(cls, "step", None), "__module__", None)
    # torch sets ``Muon.__module__ = "torch.optim"``; the functions of the class keep the defining module's name
    if module == "torch.optim" and defined_in and defined_in.startswith("torch.optim."):
        module = defined_in
    return f"{module}.{cls.__qualname__}"


def known_not_elementwise(cls: type) -> tuple[str, str] | None:
    """(qualified name, why) of the class in ``cls``'s MRO that :data:`NOT_ELEMENTWISE` names; None if none does."""
    for base in cls.__mro__:
        name = qualified_name(base)
        if name in NOT_ELEMENTWISE:
            return name, NOT_ELEMENTWISE[name]
    return None


PROBE_SHAPE = (6, 10)
PROBE_STEPS = 3


def detached_copy(optimizer: torch.optim.Optimizer, group: dict, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """A copy of ``optimizer`` stepping ``params`` with ``group``'s hyperparameters: the class and every attribute
    shared (not ``copy.copy``: ``__setstate__`` would touch the shared state); its own state, group and hooks."""
    cls = type(optimizer)
    probe = cls.__new__(cls)
    probe.__dict__.update(optimizer.__dict__)
    probe.state = defaultdict(dict)
    probe.param_groups = [{**group, "params": params}]
    probe._optimizer_step_pre_hooks = OrderedDict()
    probe._optimizer_step_post_hooks = OrderedDict()
    return probe


def _steps(optimizer: torch.optim.Optimizer, group: dict, pieces: list[torch.Tensor], grads: list[torch.Tensor]):
    """Step a copy of ``optimizer`` on ``pieces`` (leaf tensors) with each of ``grads`` cut like them."""
    probe = detached_copy(optimizer, group, pieces)
    for grad in grads:
        for piece, g in zip(pieces, grad):
            piece.grad = g.clone()
        with torch.no_grad():
            # the class's step: an LR scheduler replaces the instance's ``step`` by one bound to the original
            type(optimizer).step(probe)


def slice_mismatch(optimizer: torch.optim.Optimizer, tp: int = 1, flat: bool = True) -> str | None:
    """How stepping pieces of a tensor differs from stepping it whole for ``optimizer`` (per param group, with its
    hyperparameters); None where they agree or where the whole step itself cannot run on a probe (the caller decides
    what an unprobed class gets). ``flat``: the pieces ZeRO steps (1-D, cut unevenly); ``tp > 1``: the row blocks
    tensor parallelism steps. See [Note: optimizers that need the whole tensor]."""
    generator = torch.Generator().manual_seed(0)
    for gi, group in enumerate(optimizer.param_groups):
        like = group["params"][0] if group["params"] else torch.zeros(())
        dtype = like.dtype if like.dtype.is_floating_point else torch.float32
        start = torch.randn(PROBE_SHAPE, generator=generator)
        grads = [torch.randn(PROBE_SHAPE, generator=generator) for _ in range(PROBE_STEPS)]
        whole = start.to(like.device, dtype, copy=True).requires_grad_()
        try:
            _steps(optimizer, group, [whole], [[g.to(like.device, dtype)] for g in grads])
        except Exception:
            return None  # cannot probe (needs a closure, sparse gradients, ...): not evidence either way
        cuts: list[tuple[str, Callable[[torch.Tensor], tuple[torch.Tensor, ...]]]] = []
        if flat:  # the flat halves of two ranks, cut inside a row
            cuts.append(("flat 1-D fragments", lambda t: t.reshape(-1).split([23, t.numel() - 23])))
        if tp > 1:
            cuts.append(("tensor-parallel row blocks", lambda t: t.split(PROBE_SHAPE[0] // 2)))
        for label, cut in cuts:
            pieces = [p.to(like.device, dtype).clone().requires_grad_() for p in cut(start)]
            try:
                _steps(optimizer, group, pieces, [[x.to(like.device, dtype) for x in cut(g)] for g in grads])
            except Exception as err:
                return f"param group {gi}: its step fails on {label} ({type(err).__name__}: {err})"
            stepped = torch.cat([p.detach().reshape(-1) for p in pieces])
            expected = whole.detach().reshape(-1)
            if not torch.allclose(stepped, expected, rtol=1e-5, atol=1e-6):
                worst = (stepped - expected).abs().max().item()
                return (
                    f"param group {gi}: {PROBE_STEPS} steps on {label} of a {PROBE_SHAPE[0]}x{PROBE_SHAPE[1]} "
                    f"tensor end up to {worst:.3g} away from the same steps on the whole tensor"
                )
    return None
