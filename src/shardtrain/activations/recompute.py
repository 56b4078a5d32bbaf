"""Activation checkpointing of blocks by policy: ``full`` (a block keeps its inputs and runs again in backward) and
``selective`` (it also keeps what is costly to recompute). Built on torch's own pieces: the composable
``checkpoint`` (hooks on the module, so names and ``state_dict`` keys do not change) and
``create_selective_checkpoint_contexts`` with :func:`keep_matmuls` as its per-operation policy.

[Note: the order of a checkpointed block's hooks]
A checkpointed block's forward hooks nest, outermost first: the host offload of its inputs
(:mod:`.host_offload`), stage 3's unit hooks (gather, and saved-tensor hooks that mark what aliases the unit), the
checkpoint. torch's composable ``checkpoint`` appends its pre-forward hook and prepends its forward hook, so applied
after the stage-3 runtime it is innermost: its saved-tensor hooks are pushed last and popped first, as a stack must
be. Inside it the runtime pushes its hooks again per operation over the checkpoint's (see [Note: gathering for
backward]); the checkpoint saves the block's inputs before its own hooks are pushed, so they pass through the unit
hooks to the host offload. The recompute in backward calls the module again with the checkpoint's hooks off: the
unit's pre-forward hook gathers it as a backward need. The offload's hooks are prepended, so they run first and
their forward hook, appended, last.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from shardtrain.activations.host_offload import HostOffload
from shardtrain.activations.partition import TPPartition
from shardtrain.plan.policies import ActivationPolicy

_aten = torch.ops.aten

KEPT_OPS: frozenset[Any] = frozenset(
    getattr(_aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
    )
    if hasattr(_aten, name)  # the fused attention kernels this build of torch has
)
"""What ``selective`` keeps: the outputs of matmuls and of fused attention, whose recompute costs as much as the
forward itself. Everything else (pointwise operations, norms, softmax, views) is recomputed: cheap in FLOPs and
usually as large in bytes."""


def keep_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The per-operation policy of ``selective``: keep the outputs of :data:`KEPT_OPS`, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_checkpointing(
    blocks: Sequence[nn.Module],
    policy: ActivationPolicy,
    offload: HostOffload | None = None,
    partition: TPPartition | None = None,
) -> list[Any]:
    """Checkpoint each of ``blocks`` as ``policy`` says (``budget``: each as its chosen :attr:`per_block`), their
    inputs kept in host memory through ``offload``, or ``1/tp`` of them through ``partition`` (None: kept whole
    where they are); returns the hook handles added besides the checkpoint's own. Called after stage 3's runtime
    installed its hooks ([Note: the order of a checkpointed block's hooks]). The planner applies it to its fake
    models too, so what it measures is this."""
    if not policy.enabled:
        return []
    selective = partial(create_selective_checkpoint_contexts, keep_matmuls)
    handles = []
    for block, recompute in zip(blocks, policy.block_choices(len(blocks)), strict=True):
        if recompute == "none":
            continue
        if recompute == "selective":
            composable_checkpoint(block, context_fn=selective)
        else:
            composable_checkpoint(block)
        if offload is not None:
            handles += offload.install(block)
        if partition is not None:
            handles += partition.install(block)
        handles.append(block.register_forward_pre_hook(_without_cache, with_kwargs=True, prepend=True))
    return handles


def _without_cache(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """A transformers layer that writes a key/value cache would write it again when recomputed: in training the cache
    is dropped for a checkpointed layer, as transformers' own gradient checkpointing does
    (``GradientCheckpointingLayer``; a layer that only reads it says so with ``_can_checkpoint_with_cache``)."""
    if not (module.training and torch.is_grad_enabled()) or getattr(module, "_can_checkpoint_with_cache", False):
        return None
    if kwargs.get("use_cache") or kwargs.get("past_key_values") is not None or kwargs.get("past_key_value") is not None:
        kwargs = dict(kwargs)
        for key in ("past_key_values", "past_key_value"):
            if kwargs.get(key) is not None:
                kwargs[key] = None
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        return args, kwargs
    return None
