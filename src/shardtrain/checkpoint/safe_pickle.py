"""Read pickled files without running code from them: only the globals an allow-list names are resolved.

[Note: restricted unpickling]
The only pickle instructions that reach code outside the pickle look up a global (``GLOBAL``, ``STACK_GLOBAL``,
``INST``, ``OBJ``, extension codes: all via ``Unpickler.find_class``) or a persistent id (``persistent_load``). An
unpickler answering ``find_class`` from an allow-list only, refusing persistent ids the caller does not handle, calls
nothing but the allowed callables (and, via ``BUILD``, their results' ``__setstate__``). So the allow-list is the whole
trust boundary: ``"module.name"`` maps to the real object when calling it with any arguments is harmless, else to a
stand-in (a safer function of the same signature, a plain class recording its state). Anything else is refused by name.
Tensors' ``torch.save`` bytes go to ``torch.load(weights_only=True)`` (:data:`TORCH_TENSOR_GLOBALS`).
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
