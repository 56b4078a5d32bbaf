"""DeepSpeed 0.19.8's ``"optimizer": {"type": "Muon"}``: its parameter split, its Newton-Schulz and its Adam half,
as :class:`DeepSpeedMuon` (a :class:`shardtrain.optim.muon.MuonWithAdamW`, so ZeRO 1-3 serve it on owner ranks).

[Note: DeepSpeed's Muon is not torch's]
Built from DeepSpeed 0.19.8's ``engine._muon_param_groups``, ``set_optimizer_flags`` and ``muon_update``, so that a
DeepSpeed config trains the numbers its users expect. What differs from ``torch.optim.Muon`` + ``AdamW``:
- the split is by name and shape (``set_optimizer_flags``): a trainable parameter of 2 or more dimensions whose name
  (lower-cased) holds neither "embed" nor "lm_head" is Muon's; everything else is Adam's (a head named otherwise,
  e.g. ``head.weight``, is Muon's, as in DeepSpeed);
- Newton-Schulz: ``ns_method`` "gram" (default) iterates on the Gram matrix X Xᵀ (restarted at iteration 2) in fp16
  where the accelerator has fp16 (CUDA; CPU only with mkldnn's fp16), else fp32, after normalising in the input's
  dtype; "standard" is the quintic iteration in bf16. Both divide by ``norm + 1e-7`` (torch: ``clamp(min=eps)``), 5
  steps, the coefficients (3.4445, -4.775, 2.0315), Nesterov always;
- the aspect ratio sqrt(rows / cols) (rows > cols) multiplies the update in the iteration's dtype; torch scales the
  learning rate by it instead (same value, other rounding);
- defaults: Muon lr 0.02, momentum 0.95, weight decay 0; Adam lr 3e-4, betas (0.9, 0.95), eps 1e-10, weight
  decay 0, decoupled (``adam_w_mode``) unless ``adam_w_mode: false`` (then L2: the decay added to the gradient);
  ``muon_lr`` / ``adam_lr`` override ``lr`` for their half, a param group's own keys override both.
The Adam half steps as torch's AdamW (Adam with ``adam_w_mode: false``): DeepSpeed's FusedAdam, torch AdamW
(``torch_adam``) and its inline fallback are the same formula up to rounding. One thing is not copied: DeepSpeed
guards the momentum against a non-finite gradient; shardtrain skips an overflowed step before the optimizer runs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from shardtrain.optim.muon import _ADAMW_DEFAULTS, MuonWithAdamW, Orthogonalize

NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
GRAM_RESTART = 2
"""The Gram iteration rebuilds X and its Gram matrix from scratch at this step (half precision drifts otherwise)."""
NS_METHODS = ("gram", "standard")
MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method")
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
CONFIG_KEYS = (*{*MUON_KEYS, *ADAM_KEYS}, "muon_lr", "adam_lr", "adam_w_mode", "torch_adam", "per_head_muon")
"""``optimizer.params`` keys of DeepSpeed's Muon type that shardtrain reads (``torch_adam`` picks DeepSpeed's Adam
implementation, the same formula; ``per_head_muon`` is served only false)."""


def is_deepspeed_muon_parameter(name: str, shape: Sequence[int]) -> bool:
    """DeepSpeed's split ([Note: DeepSpeed's Muon is not torch's]): 2 or more dims, no "embed" or "lm_head"."""
    lowered = name.lower()
    return len(shape) >= 2 and "embed" not in lowered and "lm_head" not in lowered


def newton_schulz_dtype(method: str, device: torch.device) -> torch.dtype:
    """The dtype DeepSpeed's iteration runs in on ``device``'s accelerator (``ns_compute_dtype``)."""
    if method == "gram":
        if device.type == "cuda":
            return torch.float16
        return torch.float16 if device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_fp16_supported() else torch.float32
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float32
    return torch.bfloat16


def _quintic(x: torch.Tensor, steps: int) -> torch.Tensor:
    """X <- a X + (b A + c A²) X with A = X Xᵀ, ``steps`` times (X has no more rows than columns)."""
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x


def standard_newton_schulz(update: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's "standard" orthogonalization: cast, normalise and iterate in the standard dtype."""
    x = update.to(newton_schulz_dtype("standard", update.device))
    tall = update.size(-2) > update.size(-1)
    x = x.mT if tall else x
    x = _quintic(x / (x.norm(dim=(-2, -1), keepdim=True) + NS_EPS), NS_STEPS)
    return x.mT if tall else x


def gram_newton_schulz(update: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's "gram" orthogonalization. The quintic step is X <- (a I + b R + c R²) X with R = X Xᵀ, so X_k =
    Q_k X_0 for a product Q_k of polynomials in R, and R itself follows R <- P R P with P = a I + b R + c R² (P and
    R commute): the n x n Gram matrix is iterated, never the n x m X, except once at the restart."""
    a, b, c = NS_COEFFICIENTS
    wide = update.size(-2) <= update.size(-1)
    # normalised in a dtype wide enough for the input (an fp16 gradient's norm can overflow fp16)
    x = update.to(torch.float32 if update.dtype == torch.float16 else update.dtype)
    x = x if wide else x.mT
    rows, cols = x.size(-2), x.size(-1)
    x = (x / (x.norm(dim=(-2, -1), keepdim=True) + NS_EPS)).to(newton_schulz_dtype("gram", update.device))
    if cols <= rows:  # square: no saving, the plain iteration
        x = _quintic(x, NS_STEPS)
        return x if wide else x.mT
    gram = x @ x.mT
    q = None  # the product of the polynomials applied since the last restart
    for step in range(NS_STEPS):
        if step == GRAM_RESTART:
            x = q @ x
            gram, q = x @ x.mT, None
        poly_without_identity = b * gram + c * gram @ gram
        if q is None:
            q = poly_without_identity.clone()
            q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            q = a * q + poly_without_identity @ q
        if step < NS_STEPS - 1 and step + 1 != GRAM_RESTART:  # R <- P R P, unless it is rebuilt or unused
            half = a * gram + poly_without_identity @ gram
            gram = a * half + poly_without_identity @ half
    x = q @ x
    return x if wide else x.mT


def aspect_ratio_scale(rows: int, cols: int) -> float:
    """sqrt(rows / cols) for a tall matrix, 1 otherwise (torch's ``_adjust_lr`` ratio)."""
    return math.sqrt(rows / cols) if rows > cols else 1.0


def deepspeed_orthogonalize(update: torch.Tensor, method: str) -> torch.Tensor:
    """DeepSpeed's ``muon_update`` after the momentum: Newton-Schulz, the aspect ratio applied in the iteration's
    dtype, back to the update's dtype."""
    ortho = gram_newton_schulz(update) if method == "gram" else standard_newton_schulz(update)
    ortho = ortho * aspect_ratio_scale(update.size(-2), update.size(-1))
    return ortho.to(update.dtype)


_DS_MUON_DEFAULTS: dict[str, Any] = dict(lr=0.02, momentum=0.95, weight_decay=0.0, ns_method="gram", nesterov=True)
_DS_ADAM_DEFAULTS: dict[str, Any] = {**_ADAMW_DEFAULTS, "lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10}
_DS_ADAM_DEFAULTS["weight_decay"] = 0.0


class DeepSpeedMuon(MuonWithAdamW):
    """DeepSpeed's Muon type ([Note: DeepSpeed's Muon is not torch's]): ``use_muon`` groups with ``lr``,
    ``momentum``, ``weight_decay``, ``ns_method``; the others Adam's with ``lr``, ``betas``, ``eps``,
    ``weight_decay`` and ``decoupled_weight_decay`` (``adam_w_mode``). Build it from a config with
    :meth:`from_config`."""

    muon_defaults = _DS_MUON_DEFAULTS
    adam_defaults = _DS_ADAM_DEFAULTS

    def __init__(self, param_groups: Iterable[dict]) -> None:
        groups = [dict(g) for g in param_groups]
        for i, g in enumerate(groups):
            if g.get("use_muon") and g.get("ns_method", "gram") not in NS_METHODS:
                raise ValueError(f"param_groups[{i}]: ns_method must be one of {NS_METHODS}, got {g['ns_method']!r}")
        super().__init__(groups)

    @classmethod
    def from_config(
        cls, model: nn.Module, model_parameters: Iterable[Any] | None, params: dict[str, Any]
    ) -> DeepSpeedMuon:
        """The optimizer ``deepspeed.initialize`` builds for ``{"type": "Muon", "params": params}``: each param
        group (or the loose parameters, default the model's) split into its Muon and Adam halves, each half's keys
        from the config (``muon_lr`` / ``adam_lr`` over ``lr``), then from the group."""
        unknown = [k for k in params if k not in CONFIG_KEYS]
        if unknown:
            raise ValueError(
                f"optimizer.params.{unknown[0]} is not a key of DeepSpeed's Muon type (it reads {sorted(CONFIG_KEYS)})"
            )
        if params.get("per_head_muon", False):
            raise ValueError(
                "optimizer.params.per_head_muon: DeepSpeed's per-head orthogonalization of attention projections is "
                "not served (docs/muon.md); leave it false (each matrix orthogonalized whole)"
            )
        adam_w_mode = params.get("adam_w_mode", True)
        if not isinstance(adam_w_mode, bool):
            raise ValueError(f"optimizer.params.adam_w_mode: expected true or false, got {adam_w_mode!r}")
        names = {id(p): n for n, p in model.named_parameters()}
        items = list(model_parameters) if model_parameters is not None else list(model.parameters())
        groups = [g for g in items if isinstance(g, dict)]
        loose = [p for p in items if not isinstance(p, dict)]
        if loose or not groups:
            groups.append({"params": loose})
        halves = (
            (True, MUON_KEYS, "muon_lr"),
            (False, ADAM_KEYS, "adam_lr"),
        )
        out = []
        for group in groups:
            trainable = [p for p in group["params"] if p.requires_grad]
            unnamed = [tuple(p.shape) for p in trainable if id(p) not in names]
            if unnamed:
                raise ValueError(
                    f"DeepSpeed's Muon splits parameters by their names in the model, and parameters of shapes "
                    f"{unnamed} are not the model's: pass the model's own parameters"
                )
            for use_muon, keys, lr_key in halves:
                half = [p for p in trainable if is_deepspeed_muon_parameter(names[id(p)], p.shape) is use_muon]
                if not half:
                    continue
                settings = {k: params[k] for k in keys if k in params}
                if lr_key in params:
                    settings["lr"] = params[lr_key]
                settings.update({k: v for k, v in group.items() if k in keys})
                if "betas" in settings:
                    settings["betas"] = tuple(settings["betas"])
                if not use_muon:
                    settings["decoupled_weight_decay"] = adam_w_mode
                out.append(dict(params=half, use_muon=use_muon, **settings))
        return cls(out)

    def _orthogonalizer(self, group: dict) -> Orthogonalize:
        method = group["ns_method"]
        return lambda matrix: deepspeed_orthogonalize(matrix, method)

    def _step_size(self, group: dict, shape: torch.Size) -> float:
        return float(group["lr"])  # the aspect ratio is in the update already
