"""Walk the tensors inside a module's nested inputs or outputs, optionally replacing them: the package's one
tree walker (debug subscribers, statistics and the training monitor use it).

Containers torch's pytree knows (tuple, list, dict, OrderedDict, namedtuple, and anything registered with it, such
as ``transformers`` ``ModelOutput``) are taken apart one level at a time with ``torch.utils._pytree`` and rebuilt with
its ``tree_unflatten``. Two kinds pytree leaves opaque are handled here as a fallback, because models return them:
mappings of an unregistered type (an ``OrderedDict`` subclass shaped like ``ModelOutput``) and dataclass instances.
Everything else that is not a tensor is passed through untouched.

A container is rebuilt only if a tensor inside it was replaced, so a callback that returns its input leaves the
original objects (and their identity) in place.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch
import torch.utils._pytree as pytree

# (path, tensor) -> replacement tensor, or the same tensor to keep it
TensorFn = Callable[[str, torch.Tensor], torch.Tensor]
# (path, leaf) of a leaf that is not a tensor; its result is ignored (non-tensor leaves are never replaced)
OtherFn = Callable[[str, Any], None]

_MAX_DEPTH = 64  # a guard against self-referencing containers, far deeper than any real model output


def map_tensors(obj: Any, fn: TensorFn, path: str = "") -> Any:
    """Call ``fn(path, tensor)`` for every tensor in ``obj`` (depth first, in container order); return the result.

    ``path`` strings look like ``[0]``, ``['logits']`` or ``.hidden``; a bare tensor has the empty path.
    """
    return _map(obj, fn, path, 0)


def iter_tensors(obj: Any) -> list[tuple[str, torch.Tensor]]:
    """The ``(path, tensor)`` pairs of ``obj`` in the order :func:`map_tensors` visits them."""
    found: list[tuple[str, torch.Tensor]] = []

    def collect(path: str, t: torch.Tensor) -> torch.Tensor:
        found.append((path, t))
        return t

    _map(obj, collect, "", 0)
    return found


def iter_leaves(obj: Any) -> list[tuple[str, Any]]:
    """Every leaf of ``obj``, tensor or not (``None``, numbers, strings, other objects), as ``(path, leaf)`` in the
    order :func:`map_tensors` visits tensors; what graph capture's input schema is made of."""
    found: list[tuple[str, Any]] = []

    def tensor(path: str, t: torch.Tensor) -> torch.Tensor:
        found.append((path, t))
        return t

    _map(obj, tensor, "", 0, lambda path, leaf: found.append((path, leaf)))
    return found


def _map(obj: Any, fn: TensorFn, path: str, depth: int, other: OtherFn | None = None) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(path, obj)
    if depth >= _MAX_DEPTH or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        if other is not None:
            other(path, obj)
        return obj
    # one level of pytree: every child is a leaf, so we recurse ourselves and reach the fallbacks below at any depth
    children, spec = pytree.tree_flatten_with_path(obj, is_leaf=lambda child: child is not obj)
    if not spec.is_leaf():
        new, changed = [], False
        for keys, child in children:
            out = _map(child, fn, path + pytree.keystr(keys), depth + 1, other)
            changed |= out is not child
            new.append(out)
        return pytree.tree_unflatten(new, spec) if changed else obj
    if isinstance(obj, Mapping):
        return _map_mapping(obj, fn, path, depth, other)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _map_dataclass(obj, fn, path, depth, other)
    if other is not None:
        other(path, obj)
    return obj


def _map_mapping(obj: Mapping, fn: TensorFn, path: str, depth: int, other: OtherFn | None) -> Any:
    replaced = {}
    for key, value in obj.items():
        out = _map(value, fn, f"{path}[{key!r}]", depth + 1, other)
        if out is not value:
            replaced[key] = out
    if not replaced:
        return obj
    if not isinstance(obj, MutableMapping):
        raise TypeError(f"cannot replace values inside an immutable {type(obj).__name__} at {path or 'top level'}")
    new = copy.copy(obj)  # keeps the subclass (ModelOutput-like types set attributes in __setitem__)
    for key, value in replaced.items():
        new[key] = value
    return new


def _map_dataclass(obj: Any, fn: TensorFn, path: str, depth: int, other: OtherFn | None) -> Any:
    replaced = {}
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        out = _map(value, fn, f"{path}.{field.name}", depth + 1, other)
        if out is not value:
            replaced[field.name] = out
    if not replaced:
        return obj
    new = copy.copy(obj)
    for name, value in replaced.items():
        object.__setattr__(new, name, value)  # works for frozen dataclasses too
    return new
