"""Muon for the 2-D hidden weights and AdamW for the rest, in one optimizer that ZeRO can serve exactly.

[Note: Muon on owners]
torch's Muon step is element-wise except for one operation: the momentum (``buf.lerp_(grad, 1 - momentum)``), the
Nesterov blend, the weight decay and the final ``add_`` read each element alone; only the Newton-Schulz
orthogonalization reads the whole matrix. So :class:`MuonWithAdamW` keeps its momentum sharded like any element-wise
state (checkpoints, resharding and stage changes need nothing new) and asks its ``whole_matrices`` for the one
operation that needs the matrix: in one process (or ZeRO stage 0) the tensors are whole and it calls torch's own
``_zeropower_via_newtonschulz``; under ZeRO 1-3 the engine binds :class:`shardtrain.zero.muon_owners.MuonOwners`,
which gathers each matrix's update fragments to one owner rank (owners spread over the shard group by size), runs the
same function there and scatters the result back. The numbers are torch's: the same function on the same matrix.
The AdamW groups step through ``torch.optim.AdamW.step`` itself, on those groups alone.

[Note: experts' matrices]
A mixture-of-experts layer stores its experts' weights as one 3-D parameter ``[experts, rows, cols]`` (transformers'
fused experts). Muon orthogonalizes each expert's matrix on its own (as torch's Muon on each expert as a separate
parameter would) and scales the learning rate by one matrix's ``rows / cols``. Under expert parallelism a rank holds
a block of whole experts (dim 0), so its owner orthogonalizes whole matrices without any other expert group's help.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

Orthogonalize = Callable[[torch.Tensor], torch.Tensor]


class WholeMatrices(Protocol):
    """Runs ``orthogonalize`` on the whole matrices that ``pieces`` (what the optimizer steps) are parts of."""

    def shape_of(self, stepped: torch.Tensor) -> torch.Size:
        """The whole parameter's shape (``_adjust_lr`` reads it)."""

    def __call__(
        self, stepped: list[torch.Tensor], pieces: list[torch.Tensor], orthogonalize: Orthogonalize
    ) -> list[torch.Tensor]:
        """Each piece's part of ``orthogonalize(its whole matrix)``; collective over the shard group."""


_MUON_DEFAULTS: dict[str, Any] = dict(
    momentum=0.95, nesterov=True, ns_coefficients=(3.4445, -4.775, 2.0315), eps=1e-7, ns_steps=5, adjust_lr_fn=None
)
_ADAMW_DEFAULTS: dict[str, Any] = dict(
    betas=(0.9, 0.999),
    eps=1e-8,
    amsgrad=False,
    maximize=False,
    foreach=None,
    capturable=False,
    differentiable=False,
    fused=None,
    decoupled_weight_decay=True,
)


class MuonWithAdamW(torch.optim.Optimizer):
    """Param groups with ``use_muon: True`` (2-D parameters, or 3-D stacks of experts' matrices: [Note: experts'
    matrices]) step as ``torch.optim.Muon``, the others as
    ``torch.optim.AdamW``, each group with its own hyperparameters (DeepSpeed's ``MuonWithAuxAdam`` split). Muon's
    keys: ``lr``, ``weight_decay``, ``momentum``, ``nesterov``, ``ns_coefficients``, ``ns_steps``, ``eps``,
    ``adjust_lr_fn``; AdamW's: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``amsgrad``. See [Note: Muon on owners]."""

    _init_group = torch.optim.Adam._init_group  # what AdamW's step (run on the AdamW groups) calls on its optimizer
    muon_defaults: dict[str, Any] = _MUON_DEFAULTS
    """What a ``use_muon`` group that does not say gets (torch.optim.Muon's defaults but ``lr``)."""
    adam_defaults: dict[str, Any] = _ADAMW_DEFAULTS
    """What an AdamW group that does not say gets (torch.optim.AdamW's defaults but ``lr``, ``weight_decay``)."""

    def __init__(self, param_groups: Iterable[dict], lr: float = 1e-3, weight_decay: float = 0.1) -> None:
        groups = [dict(g) for g in param_groups]
        for i, g in enumerate(groups):
            if "use_muon" not in g:
                raise ValueError(f"param_groups[{i}] has no 'use_muon': say which groups Muon steps")
            defaults = self.muon_defaults if g["use_muon"] else self.adam_defaults
            for k, v in defaults.items():
                g.setdefault(k, v)
            if g["use_muon"]:
                flat = [tuple(p.shape) for p in g["params"] if p.ndim not in (2, 3)]
                if flat:
                    raise ValueError(
                        f"param_groups[{i}]: Muon steps 2-D parameters (or 3-D stacks of experts' matrices) only, "
                        f"got shapes {flat}"
                    )
        super().__init__(groups, {"lr": lr, "weight_decay": weight_decay, "differentiable": False})
        self.whole_matrices: WholeMatrices | None = None

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.param_groups
        adam = [g for g in groups if not g["use_muon"]]
        if adam:
            self.param_groups = adam  # AdamW's own step on its groups (the state dict is shared)
            try:
                torch.optim.AdamW.step(self)
            finally:
                self.param_groups = groups
        for group in groups:
            if group["use_muon"]:
                self._muon_step(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        """``torch.optim._muon._single_tensor_muon``, line by line, with the orthogonalization on whole matrices."""
        params = [p for p in group["params"] if p.grad is not None]
        lr, momentum = float(group["lr"]), group["momentum"]
        updates = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - momentum)
            updates.append(p.grad.lerp(buf, momentum) if group["nesterov"] else buf)

        orthogonalize = self._orthogonalizer(group)
        if self.whole_matrices is None:
            updates = [orthogonalize(u) for u in updates]
            shapes = [p.shape for p in params]
        else:
            updates = self.whole_matrices(params, updates, orthogonalize)
            shapes = [self.whole_matrices.shape_of(p) for p in params]
        for p, update, shape in zip(params, updates, shapes):
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(update.view_as(p), alpha=-self._step_size(group, shape))

    def _orthogonalizer(self, group: dict) -> Orthogonalize:
        """What replaces a whole matrix's update: torch's Newton-Schulz with the group's coefficients."""

        def orthogonalize(matrix: torch.Tensor) -> torch.Tensor:
            if matrix.ndim == 3:  # [Note: experts' matrices]
                return torch.stack([orthogonalize(m) for m in matrix.unbind(0)])
            return _zeropower_via_newtonschulz(matrix, group["ns_coefficients"], group["ns_steps"], group["eps"])

        return orthogonalize

    def _step_size(self, group: dict, shape: torch.Size) -> float:
        """torch's learning rate for a matrix of ``shape`` (``_adjust_lr``: sqrt(max(1, rows / cols)) by default)."""
        return _adjust_lr(float(group["lr"]), group["adjust_lr_fn"], shape[-2:])  # one expert's matrix
