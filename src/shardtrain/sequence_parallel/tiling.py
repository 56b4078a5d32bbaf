"""Tiled compute on the sequence (ALST's tiled loss and tiled MLP; docs/sequence-parallel.md).

At long context two activations outgrow everything else a rank holds: the logits (``tokens x vocab`` in fp32, 4 GiB
at 8k tokens of a 128k vocabulary) and the MLP's intermediate (``tokens x 4d`` or more per layer). Both are computed
token by token, so they can be computed one tile of the sequence at a time, recomputing each tile in backward
instead of keeping it (Bekman et al., "Arctic Long Sequence Training", 2025: ``TiledFusedLogitsLoss`` and
``TiledMLP`` in ``deepspeed.runtime.sequence_parallel.ulysses_sp``; Liger's fused linear cross-entropy).

* :func:`tiled_fused_logits_loss`: ``cross_entropy(hidden @ weight.T + bias, targets)`` with only one tile's
  logits alive at any time, in forward and in backward (see [Note: the tiled cross-entropy]).
* :class:`TiledMLP`: an MLP run tile by tile; forward keeps only its input, backward recomputes one tile at a time.
* :func:`enable_tiled_logits_loss` / :func:`enable_tiled_mlp_compute`: apply them to a model instance (a
  transformers causal LM, the project's GPT); the config keys ``tiled_logits_loss`` and ``tiled_mlp_compute``
  (ArcticTraining's name) do it at ``initialize`` (:func:`install`).

[Note: the tiled cross-entropy]
One autograd Function over ``(hidden [N, d], weight [V, d], bias [V])`` returns the *sum* of the token losses (the
caller divides by its count). Forward, tile by tile under ``no_grad``, keeps each token's fp32 log-sum-exp and target
logit. Backward recomputes each tile's logits, writes ``(softmax - onehot) * g`` (zero on ignored targets) and
accumulates ``d W``, ``d b`` in fp32, returned once: ZeRO's reducer sees one gradient per parameter (DeepSpeed's version
calls backward per tile and needs ``ds_grad_is_ready``). Hidden states and weight go through ``save_for_backward`` so
ZeRO-3 gathers the weight's unit for backward ([Note: gathering for backward] in :mod:`shardtrain.runtime.eager`);
autograd sums a tied weight's two gradients.

[Note: the tiled MLP]
:class:`TiledMLP` runs ``fn(module, x)`` over tiles of the token dimension (``-2``) under ``no_grad`` and saves
only ``x`` and the module's parameters. Backward re-runs each tile with gradients and takes ``autograd.grad`` of it
with respect to the tile and the parameters, adding the parameters' gradients over tiles and returning them once
(the same one-gradient-per-backward contract as above; the parameters are inputs of the Function for that reason,
and saved so that ZeRO-3 gathers them). Only one tile's intermediate activations exist at a time. ``fn`` must be
a per-token function without randomness (a recompute must equal the forward): an MLP whose dropout is active is
refused. Under activation checkpointing the Function is re-run like any other operation (its forward once more).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from shardtrain.errors import ConfigError
from shardtrain.plan.policies import TilingPolicy

IGNORE_INDEX = -100
LOGITS_TILE_BYTES = 1 << 30
"""ALST's default tile of fp32 logits (1 GiB): the number of tiles is the logits' fp32 bytes over this."""


def logits_loss_shards(tokens: int, vocab: int) -> int:
    """ALST's tile count for the loss: fp32 logits in tiles of at most 1 GiB."""
    return max(1, math.ceil(tokens * vocab * 4 / LOGITS_TILE_BYTES))


def mlp_shards(tokens: int, hidden: int) -> int:
    """ALST's tile count for the MLP: tiles of ``hidden`` tokens (an intermediate of ``hidden x intermediate``)."""
    return max(1, math.ceil(tokens / hidden))


# -- the loss --------------------------------------------------------------------------------------------------------
def _bounds(n: int, shards: int) -> list[tuple[int, int]]:
    step = math.ceil(n / shards) if n else 1
    return [(a, min(a + step, n)) for a in range(0, n, step)]


class _TiledLinearCrossEntropy(torch.autograd.Function):
    """``sum_i CE(hidden_i @ W.T + b, target_i)`` over non-ignored targets, tile by tile; see [Note: the tiled
    cross-entropy]."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, shards: int, ignore_index: int):
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.no_grad():
            for a, b in _bounds(n, shards):
                logits = F.linear(hidden[a:b], weight, bias).float()  # [tile, V]: the one tile alive
                t = targets[a:b]
                keep = t != ignore_index
                lse[a:b] = torch.logsumexp(logits, dim=-1)
                picked = logits.gather(1, torch.where(keep, t, 0)[:, None])[:, 0]
                total += torch.where(keep, lse[a:b] - picked, 0.0).sum()
                del logits
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.shards, ctx.ignore_index = shards, ignore_index
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        with torch.no_grad():
            for a, b in _bounds(hidden.shape[0], ctx.shards):
                h, t = hidden[a:b], targets[a:b]
                keep = t != ctx.ignore_index
                g = F.linear(h, weight, bias).float()  # the tile's logits, recomputed ...
                g.sub_(lse[a:b, None]).exp_()  # ... -> softmax
                g.scatter_add_(1, torch.where(keep, t, 0)[:, None], -keep[:, None].float())  # - onehot
                g.mul_((keep.float() * grad_total)[:, None])  # ignored targets: no gradient
                g = g.to(hidden.dtype)  # the matmuls in the compute dtype, as autograd's would be
                if need_h:
                    grad_h[a:b] = g @ weight
                if need_w:
                    grad_w.addmm_(g.t().float(), h.float())  # summed over tiles in fp32
                if need_b:
                    grad_b.add_(g.float().sum(0))
                del g
        return (
            grad_h,
            grad_w.to(weight.dtype) if need_w else None,
            grad_b.to(bias.dtype) if need_b else None,
            None,
            None,
            None,
        )


def tiled_fused_logits_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    shards: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross-entropy of the logits ``hidden @ weight.T + bias`` against ``targets`` (already aligned with their
    tokens: shift transformers' ``labels`` first) without the whole logits ever existing (see [Note: the tiled
    cross-entropy]). ``hidden [..., d]`` and ``targets [...]`` are flattened together; ``shards`` tiles (default:
    :func:`logits_loss_shards`). ``reduction``: ``"mean"`` over the targets that are not ``ignore_index`` (or over
    ``num_items_in_batch`` when given, as transformers' loss), or ``"sum"``. Returns an fp32 scalar."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction {reduction!r}: use 'mean' or 'sum'")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"hidden states {list(hidden.shape)} and targets {list(targets.shape)} do not match: one target per "
            "token (hidden [..., d], targets [...])"
        )
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden size {hidden.shape[-1]} but the weight is {list(weight.shape)} ([vocab, hidden])")
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1).to(torch.long)
    if shards is None:
        shards = logits_loss_shards(h.shape[0], weight.shape[0])
    if shards < 1:
        raise ValueError(f"shards {shards}: give at least 1")
    total = _TiledLinearCrossEntropy.apply(h, weight, bias, t, int(shards), ignore_index)
    if reduction == "sum":
        return total
    if num_items_in_batch is not None:
        return total / num_items_in_batch
    return total / (t != ignore_index).sum()  # 0/0 = NaN when nothing is real, as F.cross_entropy's mean


# -- the MLP ---------------------------------------------------------------------------------------------------------
class TiledMLP(torch.autograd.Function):
    """``fn(module, x)`` computed over ``shards`` tiles of the token dimension (``-2``) of ``x``, each recomputed
    in backward (see [Note: the tiled MLP]). ALST's call, ``TiledMLP.apply(fn, module, x, shards, compute_params)``;
    ``compute_params`` (default: the module's parameters) are the parameters whose gradients it returns."""

    @staticmethod
    def forward(ctx, fn, module, x, shards, compute_params, *params):
        ctx.fn, ctx.module, ctx.shards = fn, module, shards
        ctx.params = params  # the objects the recompute's graph holds: what its gradients are taken against
        ctx.save_for_backward(x, *params)  # saved too, so that ZeRO-3 gathers their unit for backward
        with torch.no_grad():
            out = torch.cat([fn(module, tile) for tile in x.chunk(shards, dim=-2)], dim=-2)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, *_ = ctx.saved_tensors  # unpacking the parameters gathers them under ZeRO-3
        params = ctx.params
        wanted = [p for p, need in zip(params, ctx.needs_input_grad[5:]) if need]
        grad_x = torch.zeros_like(x) if ctx.needs_input_grad[2] else None
        grads = [torch.zeros_like(p, dtype=torch.float32) for p in wanted]
        step = math.ceil(x.shape[-2] / ctx.shards)
        for a in range(0, x.shape[-2], step):
            tile = x[..., a : a + step, :].detach().requires_grad_(grad_x is not None)
            with torch.enable_grad():
                out = ctx.fn(ctx.module, tile)
            inputs = ([tile] if grad_x is not None else []) + wanted
            got = torch.autograd.grad(out, inputs, grad_out[..., a : a + step, :], allow_unused=True)
            if grad_x is not None:
                grad_x[..., a : a + step, :] = got[0]
                got = got[1:]
            for acc, g in zip(grads, got):
                if g is not None:
                    acc.add_(g)
        it = iter(grads)
        param_grads = [next(it).to(p.dtype) if need else None for p, need in zip(params, ctx.needs_input_grad[5:])]
        return (None, None, grad_x, None, None, *param_grads)

    @classmethod
    def apply(cls, fn, module, x, shards, compute_params=None):  # type: ignore[override]
        params = list(module.parameters()) if compute_params is None else list(compute_params)
        return super().apply(fn, module, x, int(shards), None, *params)


def tiled_mlp(module: nn.Module, x: torch.Tensor, shards: int | None = None, fn: Callable | None = None):
    """``fn(module, x)`` (default ``module(x)``) over tiles of ``x``'s token dimension; ``shards`` default
    :func:`mlp_shards`."""
    if shards is None:
        shards = mlp_shards(x.shape[-2], x.shape[-1])
    return TiledMLP.apply(fn or (lambda m, t: m(t)), module, x, shards)


# -- applying them to a model ----------------------------------------------------------------------------------------
def _mlps(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] == "mlp" and list(m.parameters())]


def enable_tiled_mlp_compute(model: nn.Module, shards: int | None = None) -> int:
    """Run every MLP of ``model`` (the modules named ``mlp``: transformers' decoder layers, the project's GPT's
    blocks) as a :class:`TiledMLP` while training; ``shards`` tiles (default ALST's ``ceil(tokens / hidden)``).
    Returns how many; refuses a model without one, and an MLP with active dropout."""
    found = _mlps(model)
    if not found:
        raise ConfigError(
            f"tiled_mlp_compute: {type(model).__name__} has no submodule named 'mlp' (built for transformers decoder "
            "layers and shardtrain's GPT); tile your MLP yourself with shardtrain.sequence_parallel.tiling.TiledMLP"
        )
    for name, mlp in found:
        if getattr(mlp.forward, "__shardtrain_tiled__", False):
            raise ConfigError(f"tiled_mlp_compute: {name!r} is tiled already; enable it once")
        drop = [n for n, m in mlp.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
        if drop:
            raise ConfigError(
                f"tiled_mlp_compute: {name!r} has dropout {drop}: backward recomputes each tile, which would draw "
                "another dropout mask; set its dropout to 0 or leave tiled_mlp_compute off"
            )
        original = mlp.forward

        def per_token(module: nn.Module, tile: torch.Tensor, _original=original, _name=name) -> torch.Tensor:
            out = _original(tile)
            if not torch.is_tensor(out):
                raise ConfigError(
                    f"tiled_mlp_compute: {_name!r} returns {type(out).__name__}, not a tensor (a mixture of experts "
                    "with router outputs?): only a per-token MLP returning its hidden states can be tiled"
                )
            return out

        @functools.wraps(original)
        def forward(x, *args, _mlp=mlp, _original=original, _fn=per_token, **kwargs):
            if args or kwargs or not torch.is_grad_enabled() or not torch.is_tensor(x) or x.dim() < 2:
                return _original(x, *args, **kwargs)  # evaluation needs no recompute: run it whole
            return tiled_mlp(_mlp, x, shards, _fn)

        forward.__shardtrain_tiled__ = True
        mlp.forward = forward
    return len(found)


def enable_tiled_logits_loss(model: nn.Module, shards: int | None = None) -> str:
    """Compute ``model``'s training loss with :func:`tiled_fused_logits_loss`, so the logits never exist whole: a
    transformers causal LM (its forward, in training mode and given ``labels`` or ``shift_labels``, returns the
    loss and ``logits=None``) or the project's GPT (its ``head_loss``). Returns which of the two."""
    from shardtrain.models.gpt import GPT

    if isinstance(model, GPT):
        _enable_gpt(model, shards)
        return "gpt"
    config = getattr(model, "config", None)
    if config is not None and hasattr(model, "get_output_embeddings") and hasattr(model, "base_model"):
        _enable_hf(model, shards)
        return "transformers"
    raise ConfigError(
        f"tiled_logits_loss: {type(model).__name__} is neither a transformers causal LM nor shardtrain's GPT; compute "
        "your loss with shardtrain.sequence_parallel.tiling.tiled_fused_logits_loss(hidden, lm_head.weight, targets)"
    )


def _enable_gpt(model: nn.Module, shards: int | None) -> None:
    from shardtrain.models.gpt import TokenCrossEntropy

    if not isinstance(model.loss, TokenCrossEntropy) or type(model.head) is not nn.Linear:
        raise ConfigError(
            "tiled_logits_loss with a GPT whose head or loss was replaced (tensor parallelism's vocabulary-parallel "
            "loss?): the tiled loss needs the whole vocabulary's head on each rank; leave tiled_logits_loss off"
        )
    if "head_loss" in vars(model):
        raise ConfigError("tiled_logits_loss: this GPT's loss is tiled already; enable it once")
    head = model.head

    def head_loss(h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return tiled_fused_logits_loss(h, head.weight, targets, head.bias, shards=shards)

    model.head_loss = head_loss


# transformers configs whose causal LM changes the logits between lm_head and the loss (soft-capping, scaling):
# the plain tiled cross-entropy would compute another loss
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def _enable_hf(model: nn.Module, shards: int | None) -> None:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    head = model.get_output_embeddings()
    if type(head) is not nn.Linear:
        raise ConfigError(
            f"tiled_logits_loss: {type(model).__name__}'s output embedding is {type(head).__name__}, not a Linear "
            "(no causal LM head?)"
        )
    transforms = [k for k in _LOGIT_TRANSFORMS if getattr(model.config, k, None) not in (None, 1, 1.0)]
    if transforms or getattr(model, "loss_type", "ForCausalLM") not in ("ForCausalLM", None):
        what = ", ".join(transforms) or f"loss_type {model.loss_type!r}"
        raise ConfigError(
            f"tiled_logits_loss: {type(model).__name__} transforms its logits before the loss ({what}); the tiled "
            "cross-entropy computes the plain causal-LM loss: leave tiled_logits_loss off"
        )
    if getattr(model.forward, "__shardtrain_tiled__", False):
        raise ConfigError(f"tiled_logits_loss: {type(model).__name__}'s loss is tiled already; enable it once")
    original = model.forward
    base = model.base_model

    @functools.wraps(original)
    def forward(*args, labels=None, shift_labels=None, num_items_in_batch=None, logits_to_keep=0, **kwargs):
        if not model.training or (labels is None and shift_labels is None):
            extra = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
            return original(
                *args, labels=labels, shift_labels=shift_labels, logits_to_keep=logits_to_keep, **kwargs, **extra
            )
        kwargs.pop("return_dict", None)
        out = base(*args, **kwargs)
        hidden = out.last_hidden_state  # [b, s, d]
        if shift_labels is None:  # transformers' causal shift: the target of token i is label i + 1
            shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        loss = tiled_fused_logits_loss(
            hidden, head.weight, shift_labels, head.bias, shards=shards, num_items_in_batch=num_items_in_batch
        )
        return CausalLMOutputWithPast(
            loss=loss,
            logits=None,
            past_key_values=out.past_key_values,
            hidden_states=out.hidden_states,
            attentions=out.attentions,
        )

    forward.__shardtrain_tiled__ = True
    model.forward = forward


def install(model: nn.Module, tiling: TilingPolicy) -> None:
    """The plan's tiling at ``initialize``: ``tiled_logits_loss`` and ``tiled_mlp_compute`` (and their ``*_shards``;
    refused with graph mode by the plan)."""
    if tiling.logits_loss:
        enable_tiled_logits_loss(model, tiling.logits_loss_shards)
    if tiling.mlp:
        enable_tiled_mlp_compute(model, tiling.mlp_shards)


__all__: Sequence[str] = [
    "TiledMLP",
    "enable_tiled_logits_loss",
    "enable_tiled_mlp_compute",
    "install",
    "logits_loss_shards",
    "mlp_shards",
    "tiled_fused_logits_loss",
    "tiled_mlp",
]
