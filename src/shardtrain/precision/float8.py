"""FP8 training: the model's ``nn.Linear`` layers converted by torchao's ``convert_to_float8_training``.

torchao owns the float8 casts, the scales and the matmuls (``Float8Linear``); this module decides which layers convert
([Note: which linears convert to float8]) and reports them. The conversion keeps every ``weight`` and ``bias``
Parameter object (``Float8Linear.from_float`` reassigns them), so the optimizer, tied modules and everything built
later over the parameters (the ZeRO layout, masters, checkpoints) see the same fp32 or compute-dtype tensors as
without fp8: the float8 copies exist only inside a forward and backward ([Note: no float8 state]).

[Note: no float8 state]
Float8Linear with dynamic scaling (all of torchao's recipes) holds no float8 tensor between steps: each forward casts
the weight it is given, with a scale from that weight's amax. So master weights and optimizer state stay as they
were (fp32), a checkpoint holds the same keys and dtypes with or without fp8, and a run saved with fp8 loads without
it and back. At ZeRO-3 the cast runs on the whole gathered weight: the converted module is inside its unit, whose
pre-forward hook gathers it before ``Float8Linear.forward`` reads ``self.weight``.

[Note: float8 and the data and sequence axes]
torchao scales an activation and its output gradient by the amax of what the rank computes on. A data-parallel rank
casts its rows, a sequence-parallel (Ulysses) rank its part of the sequence (the linears see whole hidden dimensions),
each with its own scales, as FSDP2 and torchtitan's context parallelism do with torchao: nothing is all-reduced for
them. The weight is whole on every rank (or gathered whole by ZeRO-3), so its scale is one process's. The tests'
reference is torchao's single-process training with each rank's rows or sequence part cast on its own. Tensor
parallelism splits weights and hidden dimensions, whose scales are made whole ([Note: float8 under tensor
parallelism] in ``tensor_parallel/float8.py``).
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from shardtrain.plan.policies import Float8Policy

if TYPE_CHECKING:
    from torchao.float8 import Float8LinearConfig

log = logging.getLogger("shardtrain")

FP8_DIM_MULTIPLE = 16
"""The float8 matmul kernels (``torch._scaled_mm``) need both dimensions of a weight divisible by 16."""


@dataclass(frozen=True)
class Float8Conversion:
    """What :func:`convert_to_float8` did: the converted layers, and each one kept in high precision with why."""

    converted: tuple[str, ...]
    kept: dict[str, str]
    """Module name -> why it stays in the compute dtype (output head, sizes, ``fp8.filter.exclude``)."""
    tensor_parallel: tuple[str, ...] = ()
    """The converted tensor-parallel layers (their local matmul in float8, ``use_float8``), a part of ``converted``;
    the others are torchao's ``Float8Linear``."""
    recipe: str = "tensorwise"
    emulated: bool = False
    gathered_in_float8: tuple[str, ...] = ()
    """The converted layers whose weights ZeRO-3 gathers in float8 ([Note: gathering in float8]); the others' are
    gathered (at stage 3) in the compute dtype: graph mode, a rowwise recipe, hpZ, tensor-parallel layers."""

    def as_dict(self) -> dict:
        """What ``engine.graph_stats()["fp8"]`` reports: the recipe, the layers converted and kept, the gathers."""
        return {
            "recipe": self.recipe,
            "emulated": self.emulated,
            "converted": list(self.converted),
            "kept": dict(self.kept),
            "tensor_parallel": list(self.tensor_parallel),
            "gathered_in_float8": list(self.gathered_in_float8),
        }


def float8_config(policy: Float8Policy) -> Float8LinearConfig:
    """torchao's config of ``policy``'s recipe, emulated or not."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(policy.recipe)
    return dataclasses.replace(config, emulate=policy.emulate) if policy.emulate else config


def output_heads(model: nn.Module) -> set[int]:
    """Ids of the linear layers that project onto the vocabulary (or a model's declared output): the model's
    ``get_output_embeddings()`` (transformers), a linear whose weight is an embedding's (tied), and a linear whose
    outputs are as many as the largest embedding's rows when the model names no head and ties none (a size alone
    would also catch an inner layer whose width happens to equal a position table's or the vocabulary's).

    [Note: which linears convert to float8]
    A linear converts unless (1) it is the output head: the logits feed a softmax over the vocabulary, where
    float8's 3-bit mantissa costs most loss, and a tied head shares its weight with an embedding that does not convert
    (torchtitan keeps it in high precision too); (2) a dimension of its weight is not a multiple of
    :data:`FP8_DIM_MULTIPLE`, which ``torch._scaled_mm`` refuses; (3) its name matches a pattern of
    ``fp8.filter.exclude``. Each kept layer is logged by name with its reason.
    """
    heads: set[int] = set()
    getter = getattr(model, "get_output_embeddings", None)
    declared = getter() if callable(getter) else None
    if isinstance(declared, nn.Module):
        heads.add(id(declared))
    # a tensor-parallel embedding or linear layer is an embedding or a linear of its global sizes
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding) or _is_parallel(m, "num_embeddings")]
    tied = {id(e.weight) for e in embeddings}
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) or _is_parallel(m, "out_features")]
    heads |= {id(m) for m in linears if id(m.weight) in tied}
    if not heads and embeddings:
        vocab = max(e.num_embeddings for e in embeddings)
        heads |= {id(m) for m in linears if m.out_features == vocab}
    return heads


def _is_parallel(module: nn.Module, size: str) -> bool:
    """Whether ``module`` is one of shardtrain's tensor-parallel layers (a ``comm`` and the global ``size``)."""
    return hasattr(module, "comm") and isinstance(getattr(module, size, None), int) and hasattr(module, "weight")


def why_kept(name: str, module: nn.Module, heads: set[int], exclude: tuple[str, ...]) -> str | None:
    """Why the linear layer ``name`` stays in high precision ([Note: which linears convert to float8]); None: it
    converts. A tensor-parallel layer's sizes are its block's: what the kernels get."""
    if id(module) in heads:
        return "output head"
    out_features, in_features = module.weight.shape
    if out_features % FP8_DIM_MULTIPLE or in_features % FP8_DIM_MULTIPLE:
        return f"weight [{out_features}, {in_features}] not divisible by {FP8_DIM_MULTIPLE}"
    pattern = next((p for p in exclude if fnmatch.fnmatchcase(name, p)), None)
    if pattern is not None:
        return f"fp8.filter.exclude {pattern!r}"
    return None


def convert_to_float8(
    model: nn.Module, policy: Float8Policy, parallel_linears: tuple[type, ...] = ()
) -> Float8Conversion:
    """``model``'s linear layers swapped in place for torchao's ``Float8Linear`` of ``policy``'s recipe, except those
    [Note: which linears convert to float8] keeps; the kept ones are logged by name. ``parallel_linears``: the
    tensor-parallel layer classes (with a ``use_float8(config)`` method), converted in place by the same rules: their
    local matmul runs through torchao's float8 matmul ([Note: float8 under tensor parallelism])."""
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    heads = output_heads(model)
    kept: dict[str, str] = {}
    chosen: set[str] = set()
    parallel: list[str] = []
    config = float8_config(policy)
    for name, m in model.named_modules():
        if parallel_linears and isinstance(m, parallel_linears):
            reason = why_kept(name, m, heads, policy.exclude)
            if reason is None:
                m.use_float8(config)
                parallel.append(name)
            else:
                kept[name] = reason
        elif type(m) is nn.Linear:
            reason = why_kept(name, m, heads, policy.exclude)
            if reason is None:
                chosen.add(name)
            else:
                kept[name] = reason
        elif isinstance(m, nn.Linear):  # torchao would swap it too, and its own forward would be lost
            kept[name] = f"{type(m).__name__}, a subclass of nn.Linear with a forward of its own"
    convert_to_float8_training(model, module_filter_fn=lambda m, name: name in chosen, config=config)
    converted = tuple(n for n, m in model.named_modules() if isinstance(m, Float8Linear) or n in set(parallel))
    log.info(
        "fp8 (%s%s): %d linear layers converted; kept in high precision: %s",
        policy.recipe,
        ", emulated" if policy.emulate else "",
        len(converted),
        "; ".join(f"{n} ({why})" for n, why in kept.items()) or "none",
    )
    return Float8Conversion(converted, kept, tuple(parallel), policy.recipe, policy.emulate)


__all__ = ["FP8_DIM_MULTIPLE", "Float8Conversion", "convert_to_float8", "float8_config", "output_heads", "why_kept"]
