"""Guarded parameters: ZeRO-3 parameters whose data may only be read while their unit is gathered.

[Note: guarded parameters]
Parameters of units (frozen ones too) become :class:`ShardedParameter` by a class change in place, so the optimizer,
tied modules and hooks keep the same object; it is their only change (:func:`unguard` reverts it, as ``zero.Init`` does
for parameters that end up whole) and intercepts data access without a global mode. Data access while the unit is not
gathered (``.data``, an op, ``state_dict()``) reaches ``__torch_function__``: in a forward it gathers the unit (kept
then for backward too); elsewhere it raises, naming the parameter and ``engine.gathered(...)``. Metadata stays readable.
The guard's knowledge (name, unit) is in a weak map keyed by identity; nothing is set on the parameter.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from shardtrain.zero.units import Unit, UnitState


@dataclass(frozen=True, eq=False)
class Guard:
    name: str
    unit: Unit


_GUARDS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> Guard


def guard(p: nn.Parameter, name: str, unit: Unit) -> None:
    """Make ``p`` a :class:`ShardedParameter` of ``unit`` (same object: optimizers and tied modules keep it)."""
    p.__class__ = ShardedParameter
    _GUARDS[p] = Guard(name, unit)


def unguard(p: nn.Parameter) -> None:
    """Give ``p`` back its plain class; its data must have been made whole (or is left as the caller set it)."""
    _GUARDS.pop(p, None)
    if type(p) is ShardedParameter:
        p.__class__ = nn.Parameter


def guard_of(p: nn.Parameter) -> Guard:
    return _GUARDS[p]


# Tensor attributes and methods that read no parameter data, allowed while a unit is sharded.
_METADATA = frozenset(
    [
        "shape",
        "dtype",
        "device",
        "size",
        "dim",
        "ndim",
        "numel",
        "nelement",
        "element_size",
        "requires_grad",
        "requires_grad_",
        "is_leaf",
        "grad",
        "_grad",
        "grad_fn",
        "_grad_fn",
        "is_floating_point",
        "is_complex",
        "layout",
        "is_sparse",
        "is_cuda",
        "is_meta",
        "__hash__",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "_post_accumulate_grad_hooks",
        "_backward_hooks",
        "retains_grad",
        "_version",
        "_base",
        "_is_view",
        "__len__",
        "names",
        "is_quantized",
        "is_mkldnn",
        "is_nested",
    ]
)


def _op_name(func) -> str:
    if isinstance(func, types.MethodWrapperType):  # attribute access: Tensor.data.__get__
        return getattr(func.__self__, "__name__", "")
    return getattr(func, "__name__", "")


def _sharded_args(args: tuple, kwargs: dict) -> Iterator[ShardedParameter]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, ShardedParameter):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, ShardedParameter))


class ShardedParameter(nn.Parameter):
    """A parameter of a ZeRO-3 unit; see [Note: guarded parameters]."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _op_name(func) in _METADATA:
            return super().__torch_function__(func, types, args, kwargs)
        runtime = None
        for p in _sharded_args(args, kwargs):
            unit = _GUARDS[p].unit
            runtime = unit.runtime
            if unit.state is not UnitState.GATHERED:
                runtime.touch(p)
        # parameters still under zero.Init construction have a construction runtime: nothing to mark yet
        hooks = runtime.hooks_for_op() if runtime is not None else None
        if hooks is None:
            return super().__torch_function__(func, types, args, kwargs)
        with hooks.context:  # inside another saved-tensor hook (a checkpoint): see [Note: gathering for backward]
            return super().__torch_function__(func, types, args, kwargs)

    def __repr__(self) -> str:
        g = _GUARDS.get(self)
        where = f"{g.name!r}, shape={tuple(self.shape)}, {g.unit.state.value}" if g else f"shape={tuple(self.shape)}"
        return f"ShardedParameter({where})"
