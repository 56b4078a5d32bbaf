"""Read pickled files without running code from them: only the globals an allow-list names are resolved.

[Note: restricted unpickling]
A pickle is a program for a small stack machine. The only instructions that reach code outside the pickle look up a
global (``GLOBAL``, ``STACK_GLOBAL``, ``INST``, ``OBJ`` and the extension-registry codes, all resolved through
``Unpickler.find_class``) or a persistent id (``Unpickler.persistent_load``); everything else builds containers,
numbers and strings. An unpickler that answers ``find_class`` only from an allow-list, and refuses persistent ids
unless the caller handles them, can call nothing but the allowed callables (and, through ``BUILD``, the
``__setstate__`` of the objects they return). The allow-list is therefore the whole trust boundary: an entry maps
``"module.name"`` to the real object when calling it with any arguments is harmless, or to a stand-in (a safer
function with the same signature, a plain class that only records its state) when it is not; the latter is how a
foreign format's classes are read without importing its code. Anything else is refused by name before it is
resolved, so nothing in a refused file has run.

``torch.load(weights_only=True)`` is this idea for ``torch.save`` files; a tensor pickled with plain ``pickle``
carries its storage as ``torch.save`` bytes, which :data:`TORCH_TENSOR_GLOBALS` hands to exactly that loader.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch._utils

from shardtrain.errors import CheckpointError, UnsafePickleError


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler whose ``find_class`` answers only from ``allowed`` (``{"module.name": object}``).

    ``source`` names the file in errors; ``expected`` says what the format's pickles hold (it ends the refusal
    message). ``persistent_load``: how to resolve persistent ids (``None``: refused, as plain ``pickle.dumps``
    never writes them)."""

    def __init__(
        self,
        file: io.BufferedIOBase,
        allowed: Mapping[str, Any],
        *,
        source: str,
        expected: str,
        persistent_load: Callable[[Any], Any] | None = None,
    ) -> None:
        super().__init__(file)
        self._allowed = allowed
        self._source = source
        self._expected = expected
        self._persistent = persistent_load

    def find_class(self, module: str, name: str) -> Any:
        qualified = f"{module}.{name}"
        try:
            return self._allowed[qualified]
        except KeyError:
            raise UnsafePickleError(
                f"{self._source}: refused to unpickle {qualified!r}: {self._expected}; a file referring to anything "
                "else was not written that way or was altered, and unpickling it could run code (nothing from it "
                "was run)"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise UnsafePickleError(
                f"{self._source}: refused to unpickle a persistent id ({type(pid).__name__}): {self._expected}"
            )
        return self._persistent(pid)


def restricted_loads(
    data: bytes,
    allowed: Mapping[str, Any],
    *,
    source: str,
    expected: str,
    persistent_load: Callable[[Any], Any] | None = None,
) -> Any:
    """Unpickle ``data`` with :class:`RestrictedUnpickler`. A refused global raises :class:`UnsafePickleError`;
    bytes that are not a valid pickle (or that an allowed callable rejects) raise :class:`CheckpointError`, both
    naming ``source``."""
    unpickler = RestrictedUnpickler(
        io.BytesIO(data), allowed, source=source, expected=expected, persistent_load=persistent_load
    )
    try:
        return unpickler.load()
    except UnsafePickleError as err:
        if str(err).startswith(source):
            raise
        raise UnsafePickleError(f"{source}: {err}") from None  # refused by a stand-in, which knows no file name
    except CheckpointError:
        raise
    except Exception as err:  # UnpicklingError, EOFError, or an allowed callable refusing its arguments
        raise CheckpointError(
            f"{source}: cannot be unpickled ({type(err).__name__}: {err}); the file is damaged"
        ) from None


def _storage_from_bytes(data: bytes) -> Any:
    """Stand-in for ``torch.storage._load_from_bytes``, which runs ``torch.load(..., weights_only=False)`` on the
    bytes a pickled storage carries: the same bytes through torch's own restricted loader."""
    if not isinstance(data, bytes):
        raise TypeError(f"a pickled tensor storage holds {type(data).__name__}, not bytes")
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as err:  # torch's allow-list refused a global inside the storage bytes
        # torch's message opens with advice to retry with weights_only=False; keep only the line naming the global
        lines = str(err).splitlines()
        named = next((line for line in lines if "GLOBAL" in line or "Unsupported" in line), "")
        raise UnsafePickleError(
            f"a pickled tensor's storage holds what torch.load(weights_only=True) refuses ({named.strip()}); nothing "
            "from it was run"
        ) from None


# What ``pickle.dumps`` of a dense CPU tensor writes: a rebuild call (in torch's own weights_only allow-list) over a
# storage serialized with ``torch.save``.
TORCH_TENSOR_GLOBALS: dict[str, Any] = {
    "torch._utils._rebuild_tensor_v2": torch._utils._rebuild_tensor_v2,
    "torch.storage._load_from_bytes": _storage_from_bytes,
}
