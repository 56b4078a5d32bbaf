"""ZeRO-3's gather of float8-converted weights in float8 (issue 50, part 3), run by the gather service
(``zero/gather.py``) for forward and backward gathers.

[Note: gathering in float8]
A converted weight (torchao's ``Float8Linear``, tensorwise scaling) is cast to float8 by the matmul with the scale
``max_float8 / amax`` of the whole weight. Gathering the weight in the compute dtype and casting it there moves 2
bytes per element (bf16); casting before the gather moves 1, as FSDP2's float8 all-gather does
(torchao/float8/fsdp_utils.py, ``WeightWithDynamicFloat8CastTensor``):
1. each rank takes the amax of its fragment of every converted weight of the bucket (0 for an empty one);
2. one all-reduce (MAX) of those amaxes over the shard group gives every rank each whole weight's amax;
3. torchao's ``amax_to_scale`` makes the scales, and each rank casts its fragments with them (torchao's
   ``hp_tensor_and_scale_to_float8``) into a 1-byte shard;
4. one all-gather of the 1-byte shards fills the unit's float8 buffer, which each weight views as a
   ``Float8TrainingTensor`` with its scale: the matmul takes it as already cast (``tensor_already_casted_to_fp8``).
The max is exact and the cast is element-wise, so the bytes and scales are those of casting the whole gathered weight:
the numerics are exactly the bf16 gather's (tests/zero/test_float8_gather.py proves it bit for bit). The gradient of
the pre-cast weight passes through to the parameter (:class:`_PreCastWeight`), as torchao's cast does, so the reducer
sees it as before. Autograd saves the pre-cast weight for the input gradient: the eager runtime's saved-tensor hooks
index the float8 buffer as a unit storage, so a unit released after forward is gathered in float8 again for backward.
Reads of the weights (``engine.gathered()``, checkpoints) gather them in the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary

import torch
from torch import nn

from shardtrain.distributed.communicator import Communicator, Reduce
from shardtrain.zero.layout import Bucket


@dataclass(frozen=True)
class Float8Gathered:
    """One bucket gathered in float8: each converted slot's weight as torchao's ``Float8TrainingTensor``."""

    weights: dict[int, Any]
    """Slot index -> the whole weight, pre-cast (a view of ``data``)."""
    data: torch.Tensor
    """The full 1-byte buffer (``padded_numel`` elements) the all-gather filled."""
    scales: torch.Tensor
    """One fp32 scale per converted slot, in the order of ``weights``."""


def start_float8_gather(bucket: Bucket, comm: Communicator, async_op: bool = False) -> Any:
    """Steps 1-3 of [Note: gathering in float8] for ``bucket`` (its ``float8`` slots), and the all-gather of step 4
    into ``bucket.float8_data`` (storage made here); returns the all-gather's handle with ``async_op``. Collective
    over ``comm`` (the bucket's shard group): one all-reduce of one fp32 amax per converted slot, one all-gather of
    ``bucket.padded_numel`` bytes. :func:`precast_weights` reads the result once it is complete."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
    from torchao.float8.float8_utils import amax_to_scale

    modules = bucket.float8 or {}
    slots = sorted(modules)
    configs = [modules[i].config for i in slots]
    if any(c.cast_config_weight.scaling_granularity is not ScalingGranularity.TENSORWISE for c in configs):
        raise ValueError("a float8 gather casts with one scale per weight: the tensorwise recipe only")
    dtypes = {c.cast_config_weight.target_dtype for c in configs}
    if len(dtypes) != 1:
        raise ValueError(f"the converted weights of a bucket cast to one float8 dtype, got {sorted(map(str, dtypes))}")
    (float8_dtype,) = dtypes
    pieces = []
    for i in slots:
        f = bucket.fragments[i]
        pieces.append(bucket.shard[f.shard_offset : f.shard_offset + f.length])
    # the amax in fp32 holds a bf16 or fp32 amax exactly, and every backend reduces fp32
    amax = torch.stack(
        [p.abs().max().float() if p.numel() else torch.zeros((), device=bucket.shard.device) for p in pieces]
    )
    comm.all_reduce(amax, Reduce.MAX, what=f"amax of the float8 weights of bucket {bucket.index}")
    power_of_2 = [c.round_scales_to_power_of_2 for c in configs]
    bucket.float8_scales = torch.stack([amax_to_scale(a, float8_dtype, p2) for a, p2 in zip(amax, power_of_2)])
    shard = torch.zeros(bucket.shard_numel, dtype=torch.uint8, device=bucket.shard.device)
    for (i, piece), scale in zip(zip(slots, pieces), bucket.float8_scales):
        if piece.numel():
            f = bucket.fragments[i]
            cast = hp_tensor_and_scale_to_float8(piece.detach(), scale, float8_dtype)._data
            shard[f.shard_offset : f.shard_offset + f.length] = cast.view(torch.uint8)
    if bucket.float8_data is None:
        bucket.float8_data = torch.empty(bucket.padded_numel, dtype=torch.uint8, device=bucket.shard.device)
    bucket.float8_data.untyped_storage().resize_(bucket.padded_numel)
    return comm.all_gather(
        bucket.float8_data,
        shard,
        what=f"float8 weights of bucket {bucket.index}",
        async_op=async_op,
        kind="all_gather_float8",  # counted apart: the bytes the float8 gather moves (1 per element)
    )


def precast_weights(bucket: Bucket) -> dict[int, Any]:
    """Each converted slot's whole weight as torchao's ``Float8TrainingTensor``, a view of ``bucket.float8_data``
    (complete: :func:`start_float8_gather` and its handle waited for)."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

    modules = bucket.float8 or {}
    weights = {}
    for i, scale in zip(sorted(modules), bucket.float8_scales):
        s, m = bucket.slots[i], modules[i]
        data = bucket.float8_data[s.offset : s.offset + s.numel]
        weight = data.view(m.config.cast_config_weight.target_dtype).view(s.shape)
        weights[i] = Float8TrainingTensor(weight, scale, bucket.dtype, m.linear_mm_config, GemmInputRole.WEIGHT)
    return weights


def gather_in_float8(bucket: Bucket, modules: dict[int, nn.Module], comm: Communicator) -> Float8Gathered:
    """:func:`start_float8_gather` and :func:`precast_weights` at once, for ``modules`` (slot index -> the torchao
    ``Float8Linear`` whose weight the slot is)."""
    bucket.float8 = modules
    start_float8_gather(bucket, comm)
    return Float8Gathered(precast_weights(bucket), bucket.float8_data, bucket.float8_scales)


# The pre-cast weight each module's next matmul takes (set when its unit's float8 gather completes, dropped when the
# unit is released); weak keys: a module freed with its model leaves nothing behind.
PRECAST: WeakKeyDictionary = WeakKeyDictionary()


def set_precast(bucket: Bucket) -> None:
    """Hand ``bucket``'s complete float8 gather to its modules' next forwards."""
    for i, weight in precast_weights(bucket).items():
        PRECAST[bucket.float8[i]] = weight


def drop_precast(bucket: Bucket) -> None:
    for m in (bucket.float8 or {}).values():
        PRECAST.pop(m, None)


_PRECAST_CLASSES: dict[type, type] = {}


def take_precast_weights(module: nn.Module) -> None:
    """Make ``module`` (a torchao ``Float8Linear``) take the pre-cast weight of :data:`PRECAST` when one is there,
    by a class change in place (the same object: its unit and hooks keep it), as [Note: guarded parameters] does for
    parameters. Without one it runs torchao's own forward."""
    cls = type(module)
    if cls in _PRECAST_CLASSES.values():
        return
    if cls not in _PRECAST_CLASSES:

        def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
            cast = PRECAST.get(self)
            return cls.forward(self, x) if cast is None else linear_with_precast_weight(self, x, cast)

        _PRECAST_CLASSES[cls] = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__})
    module.__class__ = _PRECAST_CLASSES[cls]


class _PreCastWeight(torch.autograd.Function):
    """The pre-cast weight in the graph of its parameter: its gradient passes through, as torchao's own cast's
    does (``_ToFloat8ConstrFunc``)."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, cast: torch.Tensor) -> torch.Tensor:
        return cast

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def linear_with_precast_weight(module: nn.Module, x: torch.Tensor, cast: torch.Tensor) -> torch.Tensor:
    """``module`` (a torchao ``Float8Linear``) applied to ``x`` with its weight already cast (``cast``, from
    :func:`gather_in_float8`): ``Float8Linear.forward`` with the pre-cast weight in place of ``self.weight``; the
    weight's gradient reaches ``module.weight``."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    weight = _PreCastWeight.apply(module.weight, cast)
    out = matmul_with_hp_or_float8_args.apply(x, weight.t(), module.linear_mm_config, module.config)
    return out if module.bias is None else out + module.bias.to(out.dtype)


__all__ = [
    "PRECAST",
    "Float8Gathered",
    "drop_precast",
    "gather_in_float8",
    "linear_with_precast_weight",
    "precast_weights",
    "set_precast",
    "start_float8_gather",
    "take_precast_weights",
]
