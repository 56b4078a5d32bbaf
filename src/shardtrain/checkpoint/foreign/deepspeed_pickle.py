"""Read the ``.pt`` files DeepSpeed writes without DeepSpeed and without running code from them.

A DeepSpeed checkpoint file is a ``torch.save`` zip whose pickle holds plain containers and tensors plus instances of
a few DeepSpeed classes: the ZeRO stage (an ``int`` enum), the loss scaler (``LossScaler`` / ``DynamicLossScaler``,
plain attributes) and, at stages 1-2, ``fragment_address`` records. ``torch.load(weights_only=True)`` is torch's own
restricted unpickler ([Note: restricted unpickling] in ``safe_pickle.py``); it is given exactly these names, each
mapped to a stand-in defined here that only records its state, so DeepSpeed need not be installed and nothing of
DeepSpeed's runs. Any other global is refused by name: :func:`load_deepspeed_file` raises
:class:`~shardtrain.errors.UnsafePickleError` naming it.

Files are opened with ``mmap=True``: tensors are views of the mapped file and a read touches only the pages of the
elements it copies.
"""

from __future__ import annotations

import enum
import pickle
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardtrain.errors import CheckpointError, UnsafePickleError


class ZeroStage(int, enum.Enum):
    """Stand-in for ``deepspeed.runtime.zero.config.ZeroStageEnum`` (pickled as a call with the stage number)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class LossScalerState:
    """Stand-in for DeepSpeed's loss scalers: an object without methods whose attributes are the pickled state
    (``cur_scale``, ``dynamic``, and for the dynamic one ``cur_iter``, ``last_overflow_iter``, ``scale_window``,
    ``cur_hysteresis``, ...)."""

    def __setstate__(self, state: dict) -> None:
        if not isinstance(state, dict):
            raise UnsafePickleError(f"a DeepSpeed loss scaler's state is a {type(state).__name__}, not a dict")
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"LossScalerState({self.__dict__})"


@dataclass
class FragmentAddress:
    """Stand-in for ``deepspeed.utils.tensor_fragment.fragment_address`` (where a parameter sits in a partition)."""

    numel: int = 0
    start: int = 0


# module.name as DeepSpeed's files spell them -> stand-in
DEEPSPEED_GLOBALS: dict[str, Any] = {
    "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStage,
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": LossScalerState,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": LossScalerState,
    "deepspeed.utils.tensor_fragment.fragment_address": FragmentAddress,
}

# numpy scalars (a client_state may hold them): the reconstruct function and the dtype classes, which only build
# values
_NUMPY_GLOBALS: list[tuple[Any, str]] = []
try:
    from numpy._core import multiarray as _np_multiarray

    _NUMPY_GLOBALS.append((_np_multiarray.scalar, "numpy._core.multiarray.scalar"))
    _NUMPY_GLOBALS.append((_np_multiarray.scalar, "numpy.core.multiarray.scalar"))
except ImportError:  # numpy 1
    _NUMPY_GLOBALS.append((np.core.multiarray.scalar, "numpy.core.multiarray.scalar"))
_NUMPY_GLOBALS.append((np.dtype, "numpy.dtype"))
for _name in ("Float64DType", "Float32DType", "Float16DType", "Int64DType", "Int32DType", "BoolDType"):
    if hasattr(np, "dtypes") and hasattr(np.dtypes, _name):
        _NUMPY_GLOBALS.append((getattr(np.dtypes, _name), f"numpy.dtypes.{_name}"))

_SAFE_GLOBALS = [(obj, name) for name, obj in DEEPSPEED_GLOBALS.items()] + _NUMPY_GLOBALS

EXPECTED = (
    "DeepSpeed checkpoint files hold only containers, numbers, strings, tensors, numpy scalars and DeepSpeed's "
    f"{', '.join(n.rsplit('.', 1)[1] for n in DEEPSPEED_GLOBALS)}"
)

_REFUSED = re.compile(r"GLOBAL ([\w.]+) was not an allowed global|Unsupported global: GLOBAL ([\w.]+)")


def load_deepspeed_file(path: Path) -> dict[str, Any]:
    """The top-level dict of one DeepSpeed ``.pt`` file, memory-mapped, through the allow-list above."""
    if not path.is_file():
        raise CheckpointError(f"{path}: file is missing")
    try:
        with torch.serialization.safe_globals(_SAFE_GLOBALS):
            data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        text = str(err)
        found = _REFUSED.search(text)
        if found:
            name = found.group(1) or found.group(2)
            raise UnsafePickleError(
                f"{path}: refused to unpickle {name!r}: {EXPECTED}; a file referring to anything else was not "
                "written by DeepSpeed's save_checkpoint or was altered, and unpickling it could run code (nothing "
                "from it was run)"
            ) from None
        detail = next((line.strip() for line in text.splitlines() if "WeightsUnpickler error" in line), text[:300])
        raise CheckpointError(f"{path}: cannot be unpickled ({detail}); the file is damaged") from None
    except (RuntimeError, zipfile.BadZipFile, EOFError, OSError, ValueError) as err:
        raise CheckpointError(
            f"{path}: not a readable torch.save file ({type(err).__name__}: {str(err)[:300]}); the file is damaged "
            "or truncated"
        ) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: holds a {type(data).__name__}, not the dict DeepSpeed saves")
    return data
