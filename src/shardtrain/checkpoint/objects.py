"""The non-tensor objects of a checkpoint (param groups, scheduler and scaler states, RNG states, ``client_state``):
how they are stored so that reading them runs no code, and how the pickled objects of format version 1 are read.

[Note: checkpoint objects]
Checkpoints are shared like weights, so opening one must run no code: objects are data formats only. A value that
survives a JSON round trip unchanged is stored inline (encoding ``"json"``); any other as a *tagged* JSON tree, also
inline (encoding ``"tagged"``), where an object with the key ``"$type"`` stands for a value JSON lacks (non-str dict
keys, tuple, nan/inf, bytes, tensor, numpy array or scalar), and tensors and arrays go into one safetensors file per
writer (``objects.safetensors``, ``rank<r>.objects.safetensors``). The decoder builds only those types (the table:
docs/checkpoint-format.md, "Objects"). Anything else (another class's instance, a function, a set) is refused at save,
naming where it sits, rather than writing what could not be read back; subclasses come back as their base type
(``OrderedDict`` as dict, named tuple as tuple, ``nn.Parameter`` as tensor; tensors on the CPU, without grad).

Format version 1 pickled such objects: its files are read through an unpickler that admits only the globals version
1 wrote for these types (:data:`V1_PICKLE_GLOBALS`, [Note: restricted unpickling]); a file naming anything else is
refused by name and nothing in it runs.
"""

from __future__ import annotations

import base64
import binascii
import collections
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import safetensors.torch
import torch

from shardtrain.checkpoint.safe_pickle import TORCH_TENSOR_GLOBALS, restricted_loads
from shardtrain.errors import CheckpointError

try:  # numpy 2 moved its internals to numpy._core; version 1 files may name either
    from numpy._core import multiarray as _np_multiarray
    from numpy._core import numeric as _np_numeric
except ImportError:  # numpy 1
    from numpy.core import multiarray as _np_multiarray  # type: ignore[no-redef]
    from numpy.core import numeric as _np_numeric  # type: ignore[no-redef]

TYPE = "$type"
SUPPORTED = "None, bool, int, float, str, bytes, list, tuple, dict, torch.Tensor and numpy arrays"
_KEY_TYPES = (type(None), bool, int, float, str, bytes)
_NON_FINITE = ("nan", "inf", "-inf")


class TaggedEncoder:
    """Encodes the objects of one file: :meth:`encode` returns each object's tree and collects its tensors, keyed
    ``<object key>#<n>``, in :attr:`tensors` (host copies, contiguous)."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def encode(self, key: str, value: Any) -> Any:
        self._key = key
        try:
            return self._value(value, key)
        except RecursionError:
            raise CheckpointError(
                f"object {key!r} is nested too deeply or contains itself; it cannot be stored in a checkpoint"
            ) from None

    def _store(self, t: torch.Tensor) -> str:
        name = f"{self._key}#{len(self.tensors)}"
        self.tensors[name] = t
        return name

    def _value(self, v: Any, where: str) -> Any:
        if isinstance(v, torch.Tensor):
            return {TYPE: "tensor", "key": self._store(_host_tensor(v, where))}
        if isinstance(v, (np.ndarray, np.generic)):
            tree = {TYPE: "ndarray", "key": self._store(_host_array(v, where))}
            return {**tree, "scalar": True} if isinstance(v, np.generic) else tree
        if v is None or isinstance(v, bool):
            return v
        if isinstance(v, str):
            return str(v)
        if isinstance(v, int):
            return int(v)
        if isinstance(v, float):
            v = float(v)
            return v if math.isfinite(v) else {TYPE: "float", "value": repr(v)}
        if isinstance(v, (bytes, bytearray)):
            return {TYPE: "bytes", "base64": base64.b64encode(v).decode("ascii")}
        if isinstance(v, tuple):
            return {TYPE: "tuple", "items": [self._value(x, f"{where}[{i}]") for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [self._value(x, f"{where}[{i}]") for i, x in enumerate(v)]
        if isinstance(v, dict):
            if all(isinstance(k, str) for k in v) and TYPE not in v:
                return {str(k): self._value(x, f"{where}[{k!r}]") for k, x in v.items()}
            items = []
            for k, x in v.items():
                _check_key(k, where)
                items.append([self._value(k, where), self._value(x, f"{where}[{k!r}]")])
            return {TYPE: "dict", "items": items}
        raise CheckpointError(
            f"{where}: a {type(v).__module__}.{type(v).__qualname__} cannot be stored in a checkpoint; objects may "
            f"hold only {SUPPORTED}: store its plain data instead (e.g. its state_dict(), or a list for a set)"
        )


def _check_key(k: Any, where: str) -> None:
    if isinstance(k, tuple):
        for x in k:
            _check_key(x, where)
    elif not isinstance(k, _KEY_TYPES):
        raise CheckpointError(
            f"{where}: a dict key of type {type(k).__qualname__} cannot be stored in a checkpoint; keys may be "
            "None, bool, int, float, str, bytes or tuples of these"
        )


def _host_tensor(t: torch.Tensor, where: str) -> torch.Tensor:
    if t.layout != torch.strided or t.is_quantized or t.is_complex() or t.device.type == "meta":
        what = "complex" if t.is_complex() else f"{t.layout} {t.device.type}"
        raise CheckpointError(
            f"{where}: a {what} tensor cannot be stored in a checkpoint's objects; store a dense real tensor"
        )
    # a copy: the caller may change the tensor while the save runs, and safetensors refuses shared storages
    return t.detach().to("cpu", copy=True).contiguous()


def _host_array(a: np.ndarray | np.generic, where: str) -> torch.Tensor:
    arr = np.asarray(a)
    try:
        if arr.dtype.kind not in "biuf":  # bool, signed, unsigned, floating: what safetensors holds
            raise TypeError(arr.dtype)
        return torch.from_numpy(arr.astype(arr.dtype.newbyteorder("="), order="C", copy=True))
    except (TypeError, ValueError):  # also float128 and other widths torch lacks
        raise CheckpointError(
            f"{where}: a numpy array of dtype {arr.dtype} cannot be stored in a checkpoint; real numeric and bool "
            "arrays can"
        ) from None


def decode(tree: Any, tensors: Mapping[str, torch.Tensor], where: str) -> Any:
    """The value a :class:`TaggedEncoder` tree stands for; a malformed tree raises :class:`CheckpointError`."""
    try:
        return _decode(tree, tensors)
    except CheckpointError as err:
        raise CheckpointError(f"{where}: {err}") from None
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, binascii.Error, RecursionError) as err:
        raise CheckpointError(
            f"{where}: malformed tagged object ({type(err).__name__}: {err}); the checkpoint is damaged"
        ) from None


def _decode(tree: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    if isinstance(tree, list):
        return [_decode(x, tensors) for x in tree]
    if not isinstance(tree, dict):
        raise TypeError(f"unexpected {type(tree).__name__}")
    if TYPE not in tree:
        return {k: _decode(x, tensors) for k, x in tree.items()}
    kind = tree[TYPE]
    if kind == "tuple":
        return tuple(_decode(x, tensors) for x in _items(tree))
    if kind == "dict":
        return {_decode(k, tensors): _decode(x, tensors) for k, x in _items(tree)}
    if kind == "float":
        if tree["value"] not in _NON_FINITE:
            raise ValueError(f"non-finite float {tree['value']!r}")
        return float(tree["value"])
    if kind == "bytes":
        return base64.b64decode(tree["base64"], validate=True)
    if kind in ("tensor", "ndarray"):
        key = tree["key"]
        if not isinstance(key, str) or key not in tensors:
            raise CheckpointError(f"tensor {key!r} is not in the object file")
        if kind == "tensor":
            return tensors[key]
        arr = tensors[key].numpy()
        return arr[()] if tree.get("scalar") else arr
    raise CheckpointError(f"unknown tagged value {kind!r}; the checkpoint is damaged or from a newer shardtrain")


def _items(tree: dict) -> list:
    items = tree["items"]
    if not isinstance(items, list):
        raise TypeError(f"'items' is a {type(items).__name__}")
    return items


def encode_tensor_file(tensors: dict[str, torch.Tensor]) -> bytes:
    return safetensors.torch.save(tensors, metadata={"format": "pt"})


def decode_tensor_file(data: bytes, source: str) -> dict[str, torch.Tensor]:
    """The tensors of an object file, parsed by ``safetensors`` (a format that holds data only)."""
    try:
        return safetensors.torch.load(data)
    except Exception as err:  # SafetensorError, or a header torch cannot map
        raise CheckpointError(f"{source}: not a readable safetensors file ({err}); the file is damaged") from None


# Everything format version 1 pickled for the supported types, in its files' ``module.name`` spelling: tensors (RNG
# states), numpy arrays and scalars (numpy's RNG state) under numpy 1's and 2's module names, the OrderedDict of a
# tensor's backward hooks, and the builtins that pickle protocols may call for complex numbers and sets.
V1_PICKLE_GLOBALS: dict[str, Any] = {
    **TORCH_TENSOR_GLOBALS,
    "collections.OrderedDict": collections.OrderedDict,
    "numpy.dtype": np.dtype,
    "numpy.ndarray": np.ndarray,
    **{
        f"{package}.{module}.{name}": getattr(source, name)
        for package in ("numpy.core", "numpy._core")
        for module, source, names in (
            ("numeric", _np_numeric, ("_frombuffer",)),
            ("multiarray", _np_multiarray, ("_reconstruct", "scalar")),
        )
        for name in names
    },
    "builtins.complex": complex,
    "builtins.set": set,
    "builtins.frozenset": frozenset,
    "builtins.bytearray": bytearray,
}
V1_EXPECTED = (
    "the pickled objects of a shardtrain checkpoint hold only containers, numbers, strings, tensors, numpy arrays "
    "and RNG states"
)


def load_v1_pickle(data: bytes, source: str) -> dict[str, Any]:
    """The objects of a format-version-1 pickle file, read through :data:`V1_PICKLE_GLOBALS`."""
    objects = restricted_loads(data, V1_PICKLE_GLOBALS, source=source, expected=V1_EXPECTED)
    if not isinstance(objects, dict):
        raise CheckpointError(f"{source}: holds a {type(objects).__name__}, not a dict of objects; the file is damaged")
    return objects
