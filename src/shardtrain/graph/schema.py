"""The input schema of a call: what must be equal for a captured graph to be reused.

[Note: what the schema holds, and why]
A captured graph is specialized on everything but its tensors' values; reused after one of those facts changed, it
silently returns the old graph's answer (as ORTModule did for a flipped bool input). The schema is those facts, taken
from the call:

* the call's structure, flattened, each leaf named by its path from the bound argument (``batch['labels']``,
  ``cfg.scale``; positionals by the ``forward`` parameter they bind to), walked like :mod:`shardtrain.tree` (pytree
  one level at a time, plus mappings and dataclasses), so nested inputs are named and compared too;
* per tensor leaf: dtype, rank, device, requires_grad; sizes only with ``graph.dynamic_shapes: false`` (by default
  sizes are dynamic, so a new batch size or sequence length reuses the graph);
* every other leaf's type and value (bool, int, str, None, enums, dtypes, ...): the trace branched on or baked them;
* the module's mode (``train()``/``eval()``, anywhere in the tree);
* the set of parameters that require grad (it decides which gradients the backward computes);
* grad mode and autocast (enabled, and its dtype, on the CPU and on CUDA);
* the module hooks of every submodule and the global ones, by handle: Dynamo traces the hooks present at capture and
  by default (``skip_nnmodule_hook_guards``) does not guard on them, so a later hook would never run and a removed
  one would keep running. The engine's own hooks (eager ZeRO-3's unit hooks, inert while tracing) are left out.

Schemas are compared field by field, so a re-capture logs its reasons (``input 'mask': dtype int64 -> bool``).
"""

from __future__ import annotations

import enum
import hashlib
import inspect
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from shardtrain.tree import iter_leaves


@dataclass(frozen=True)
class TensorSpec:
    """The facts about a tensor input a trace depends on (``shape`` only for a static trace: else ``None``, the
    sizes are dynamic)."""

    dtype: torch.dtype
    ndim: int
    device: str
    requires_grad: bool
    shape: tuple[int, ...] | None = None

    def describe(self) -> str:
        sizes = "" if self.shape is None else f" {list(self.shape)}"
        return f"tensor {str(self.dtype).removeprefix('torch.')}, rank {self.ndim}{sizes}, {self.device}"


@dataclass(frozen=True)
class ValueSpec:
    """A non-tensor leaf: its type and (when it can be compared) its value."""

    type_name: str
    value: Any

    def describe(self) -> str:
        return "None" if self.value is None and self.type_name == "NoneType" else f"{self.type_name} {self.value!r}"


Leaf = TensorSpec | ValueSpec


@dataclass(frozen=True)
class Schema:
    """What a captured graph is specialized on; equal schemas may share one graph."""

    leaves: tuple[tuple[str, Leaf], ...]
    """(path, spec) of every leaf of the call, in call order."""
    modes: tuple[tuple[str, bool], ...]
    """(module name, training) of every submodule whose mode differs from the root's, plus the root's as ``''``."""
    trainable: frozenset[str]
    """Names of the parameters that require grad."""
    context: tuple[tuple[str, Any], ...] = ()
    """Global modes the trace depends on: grad mode, autocast."""
    hooks: tuple[tuple[str, tuple[tuple[int, ...], ...]], ...] = ()
    """(module name, handle ids of each kind in ``HOOK_KINDS``) of every module with hooks; ``<global>`` for the
    global module hooks."""

    def portable(self) -> Schema:
        """The same facts in a form another process can compare: devices by their type only (each rank of a node
        runs on its own ``cuda:<local rank>``), inputs that are neither tensors nor plain values by their type only
        (their repr may hold an address), hooks by count (handle ids come from a per-process counter)."""
        leaves = tuple((p, _portable(v)) for p, v in self.leaves)
        hooks = tuple((n, tuple(tuple(range(len(ids))) for ids in kinds)) for n, kinds in self.hooks)
        return Schema(leaves, self.modes, frozenset(self.trainable), self.context, hooks)

    def fingerprint(self) -> int:
        """A 63-bit digest of :meth:`portable`, equal in every process for equal schemas."""
        p = self.portable()
        text = repr((p.leaves, p.modes, sorted(p.trainable), p.context, p.hooks))
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 1


HOOK_KINDS = ("forward pre-hooks", "forward hooks", "backward pre-hooks", "backward hooks")


_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, enum.Enum)


def _portable(spec: Leaf) -> Leaf:
    if isinstance(spec, TensorSpec):
        # sizes may differ between ranks (an uneven last batch) with the same collectives: never compared across ranks
        return replace(spec, device=torch.device(spec.device).type, shape=None)
    if isinstance(spec.value, torch.device):
        return ValueSpec(spec.type_name, torch.device(spec.value.type))
    if isinstance(spec.value, _PLAIN):
        return spec
    return ValueSpec(spec.type_name, f"<{spec.type_name} object>")


def _value_spec(value: Any) -> ValueSpec:
    if isinstance(value, _PLAIN):
        return ValueSpec(type(value).__name__, value)
    try:
        hash(value)
        return ValueSpec(type(value).__qualname__, value)
    except TypeError:  # an unhashable object: the same object is the same input, nothing weaker can be asserted
        return ValueSpec(type(value).__qualname__, _Identity(value))


@dataclass(frozen=True)
class _Identity:
    """Compares by object identity (an unhashable non-tensor input)."""

    obj: Any

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __repr__(self) -> str:
        return f"<{type(self.obj).__qualname__} object at {id(self.obj):#x}>"


def bind_arguments(module: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by the names of ``module.forward``'s parameters (positional ones too), defaults filled
    in (passing a default explicitly is the same call); extra positional arguments are named ``<name>[i]`` after the
    ``*args`` parameter and extra keywords by their own names."""
    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
    except (TypeError, ValueError):  # a signature inspect cannot read, or a call forward will refuse anyway
        return {**{f"args[{i}]": a for i, a in enumerate(args)}, **kwargs}
    bound.apply_defaults()
    named: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = bound.signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            named.update({f"{name}[{i}]": v for i, v in enumerate(value)})
        elif kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        else:
            named[name] = value
    return named


def schema_of(
    module: nn.Module, args: tuple, kwargs: dict, own_hooks: frozenset[int] = frozenset(), sizes: bool = False
) -> Schema:
    """``own_hooks``: handle ids of hooks the engine installed itself and never changes (eager ZeRO-3's unit hooks,
    inert while a graph is traced): not part of the schema, which holds the user's. ``sizes``: tensor sizes are
    part of the schema (static shapes)."""
    leaves: list[tuple[str, Leaf]] = []
    for name, value in bind_arguments(module, args, kwargs).items():
        for path, leaf in iter_leaves(value):
            full = name + path
            if isinstance(leaf, torch.Tensor):
                shape = tuple(leaf.shape) if sizes else None
                spec: Leaf = TensorSpec(leaf.dtype, leaf.dim(), str(leaf.device), leaf.requires_grad, shape)
            else:
                spec = _value_spec(leaf)
            leaves.append((full, spec))
    root = module.training
    modes = [("", root)]
    hooks = [("<global>", _hook_ids(*_GLOBAL_HOOKS))]
    for n, m in module.named_modules():
        if n and m.training != root:
            modes.append((n, m.training))
        kinds = (m._forward_pre_hooks, m._forward_hooks, m._backward_pre_hooks, m._backward_hooks)
        hooks.append((n, _hook_ids(*kinds, skip=own_hooks)))
    trainable = frozenset(n for n, p in module.named_parameters(remove_duplicate=False) if p.requires_grad)
    hooks = [(n, ids) for n, ids in hooks if any(ids)]
    return Schema(tuple(leaves), tuple(modes), trainable, _context(), tuple(hooks))


_GLOBAL_HOOKS = (
    nn.modules.module._global_forward_pre_hooks,
    nn.modules.module._global_forward_hooks,
    nn.modules.module._global_backward_pre_hooks,
    nn.modules.module._global_backward_hooks,
)


def _hook_ids(*kinds: dict, skip: frozenset[int] = frozenset()) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(i for i in kind if i not in skip) for kind in kinds)


def _context() -> tuple[tuple[str, Any], ...]:
    context: list[tuple[str, Any]] = [("grad mode", torch.is_grad_enabled())]
    for device in ("cpu", "cuda"):
        on = torch.is_autocast_enabled(device)
        context.append(
            (f"autocast({device})", str(torch.get_autocast_dtype(device)).removeprefix("torch.") if on else "off")
        )
    return tuple(context)


def _mode(training: bool) -> str:
    return "train()" if training else "eval()"


def differences(old: Schema, new: Schema) -> list[str]:
    """Why ``new`` cannot reuse the graph captured for ``old``: one line per difference, in call order."""
    reasons: list[str] = []
    before, after = dict(old.leaves), dict(new.leaves)
    for path, spec in new.leaves:
        was = before.get(path)
        if was is None:
            reasons.append(f"input {path!r} added ({spec.describe()})")
        elif was != spec:
            reasons.append(f"input {path!r}: {_leaf_change(was, spec)}")
    reasons += [f"input {path!r} removed (was {spec.describe()})" for path, spec in old.leaves if path not in after]
    if [p for p, _ in old.leaves if p in after] != [p for p, _ in new.leaves if p in before]:
        reasons.append("inputs reordered: " + ", ".join(p for p, _ in new.leaves))
    modes_old, modes_new = dict(old.modes), dict(new.modes)
    root_old, root_new = modes_old[""], modes_new[""]
    if root_old != root_new:
        reasons.append(f"module.{_mode(root_old)} -> {_mode(root_new)}")
    for name in sorted(set(modes_old) | set(modes_new)):
        a, b = modes_old.get(name, root_old), modes_new.get(name, root_new)
        if name and a != b:
            reasons.append(f"module '{name}'.{_mode(a)} -> {_mode(b)}")
    for name in sorted(old.trainable ^ new.trainable):
        was = name in old.trainable
        reasons.append(f"parameter {name!r} requires_grad {was} -> {not was}")
    before_context = dict(old.context)
    reasons += [f"{k} {before_context.get(k)} -> {v}" for k, v in new.context if before_context.get(k) != v]
    hooks_old, hooks_new = dict(old.hooks), dict(new.hooks)
    none = ((),) * len(HOOK_KINDS)
    for name in sorted(set(hooks_old) | set(hooks_new)):
        a, b = hooks_old.get(name, none), hooks_new.get(name, none)
        if a == b:
            continue
        changes = [
            f"{kind} {len(x)} -> {len(y)}" if len(x) != len(y) else f"{kind} replaced"
            for kind, x, y in zip(HOOK_KINDS, a, b)
            if x != y
        ]
        where = "global module hooks" if name == "<global>" else f"module '{name}'" if name else "module"
        reasons.append(f"{where}: {', '.join(changes)}")
    return reasons


def _leaf_change(was: Leaf, now: Leaf) -> str:
    if isinstance(was, TensorSpec) and isinstance(now, TensorSpec):
        parts = []
        if was.dtype != now.dtype:
            parts.append(f"dtype {str(was.dtype).removeprefix('torch.')} -> {str(now.dtype).removeprefix('torch.')}")
        if was.ndim != now.ndim:
            parts.append(f"rank {was.ndim} -> {now.ndim}")
        if was.device != now.device:
            parts.append(f"device {was.device} -> {now.device}")
        if was.requires_grad != now.requires_grad:
            parts.append(f"requires_grad {was.requires_grad} -> {now.requires_grad}")
        if was.shape != now.shape and was.ndim == now.ndim:
            parts.append(f"shape {list(was.shape or ())} -> {list(now.shape or ())} (static shapes)")
        return ", ".join(parts)
    if isinstance(was, ValueSpec) and isinstance(now, ValueSpec) and was.type_name == now.type_name:
        return f"value {was.value!r} -> {now.value!r}"
    return f"{was.describe()} -> {now.describe()}"
