"""The files of a Megatron-Core ``torch_dist`` checkpoint and their metadata, read without running code from them.

[Note: Megatron torch_dist checkpoints]
Megatron-LM saves ``<save>/iter_<7 digits>/`` (and ``<save>/latest_checkpointed_iteration.txt``); the directory is a
torch DCP checkpoint (``.metadata``, ``__<rank>_<n>.distcp``) plus ``common.pt`` (``torch.save`` of what is not
sharded: ``args``, ``iteration``, ...) and ``metadata.json`` (``"sharded_backend": "torch_dist"``). Each tensor is
stored under its ``ShardedTensor`` key with its *global* shape, whatever tp x pp x ep wrote it (how those keys map
onto a Hugging Face model: [Note: Megatron tensor layout] in ``megatron_names.py``).
The model's shape (heads, query groups, experts) comes from Megatron-LM's ``args`` in ``common.pt``, read through
``torch.load(weights_only=True)`` with inert stand-ins for ``argparse.Namespace`` and megatron's enums
(:func:`load_common`); the ``.metadata`` pickle through ``safe_pickle.py`` with DCP's classes plus the save plans
megatron caches in it (:func:`load_megatron_metadata`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import pickle
import re
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from shardtrain.checkpoint.foreign.dcp_format import METADATA_NAME, dcp_metadata_globals, load_metadata
from shardtrain.checkpoint.format import dtype_name
from shardtrain.errors import CheckpointError, UnsafePickleError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

COMMON_NAME, MEGATRON_METADATA_NAME = "common.pt", "metadata.json"
LATEST_ITERATION_NAME = "latest_checkpointed_iteration.txt"
LEGACY_RANK_FILE = "model_optim_rng.pt"  # in iter_N/mp_rank_<tp:02d>[_<pp:03d>][_<ep:03d>]/, --ckpt-format torch
LEGACY_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?")
OPTIMIZER_STATE = "optimizer.state."  # + "<state key>.<model key>": megatron's optimizer state in model space


def find_megatron_checkpoint(path: str | Path, tag: str | None) -> Path | None:
    """The Megatron checkpoint directory ``path`` names, or None when it is none: a ``torch_dist`` directory or a
    legacy iteration directory ([Note: legacy Megatron checkpoints] in ``megatron_legacy.py``) itself, ``path/tag``,
    the iteration one legacy rank directory belongs to, or (a Megatron-LM save directory) the ``iter_*`` directory
    its ``latest_checkpointed_iteration.txt`` names."""
    path = Path(path)
    if tag is not None:
        path = path / tag
    if _is_torch_dist(path) or is_legacy_checkpoint(path):
        return path
    if (
        LEGACY_RANK_DIR.fullmatch(path.name) and (path / LEGACY_RANK_FILE).is_file()
    ):  # one rank's directory: its iteration
        return path.parent
    latest = path / LATEST_ITERATION_NAME
    if tag is None and latest.is_file():
        text = latest.read_text().strip()
        if not text.isdigit():
            raise CheckpointError(
                f"{latest}: holds {text[:40]!r}, not an iteration number (release checkpoints are not read)"
            )
        ckpt = path / f"iter_{int(text):07d}"
        if not (_is_torch_dist(ckpt) or is_legacy_checkpoint(ckpt)):
            raise CheckpointError(
                f"{latest} names iteration {text}, but {ckpt} is neither a complete torch_dist checkpoint "
                "(no .metadata or metadata.json) nor a legacy one (no mp_rank_*/model_optim_rng.pt)"
            )
        return ckpt
    return None


def is_legacy_checkpoint(path: Path) -> bool:
    """Whether ``path`` is an iteration directory of legacy ``mp_rank_*/model_optim_rng.pt`` files."""
    return path.is_dir() and any(
        LEGACY_RANK_DIR.fullmatch(d.name) and (d / LEGACY_RANK_FILE).is_file() for d in path.iterdir()
    )


def _is_torch_dist(path: Path) -> bool:
    meta = path / MEGATRON_METADATA_NAME
    if not (meta.is_file() and (path / METADATA_NAME).is_file()):
        return False
    try:
        backend = json.loads(meta.read_text()).get("sharded_backend")
    except (OSError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{meta}: not readable JSON ({err}); the checkpoint is damaged") from None
    if backend != "torch_dist":
        raise CheckpointError(f"{path}: a Megatron {backend!r} checkpoint; only the 'torch_dist' backend is read")
    return True


@functools.cache
def _metadata_globals() -> dict[str, Any]:
    """DCP's metadata classes plus the save plans megatron caches in ``Metadata.all_local_plans`` (dataclasses
    and an enum that only store what they are given)."""
    import torch.distributed.checkpoint.planner as planner

    names = ("SavePlan", "WriteItem", "TensorWriteData", "WriteItemType", "BytesIOWriteData")
    extra = {f"torch.distributed.checkpoint.planner.{n}": getattr(planner, n) for n in names if hasattr(planner, n)}
    return {**dcp_metadata_globals(), **extra}


def load_megatron_metadata(ckpt: Path) -> Metadata:
    """``ckpt/.metadata`` through the allow-list above (DCP's reading, :func:`load_metadata`); anything else is
    refused by name."""
    return load_metadata(
        ckpt,
        _metadata_globals(),
        expected="a Megatron torch_dist .metadata file holds only DCP's metadata and save-plan classes, sizes, dtypes",
        what="the checkpoint metadata",
        no_storage="has no storage records; the checkpoint is incomplete",
    )


class MegatronArgs:
    """Stand-in for ``argparse.Namespace`` (Megatron-LM's ``args``): records its attributes, runs nothing."""

    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise UnsafePickleError(f"Megatron's args hold a {type(state).__name__}, not a dict of attributes")
        self.__dict__.update(state)


class MegatronValue:
    """Stand-in for a megatron enum or record in ``args`` (``AttnBackend.auto``, ...): keeps its arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"{type(self).__name__}{self.args}"


_REFUSED = re.compile(r"GLOBAL ([\w.]+)")  # how torch's weights-only unpickler names the global it refused


def load_common(ckpt: Path) -> dict[str, Any]:
    """``common.pt`` through :func:`load_megatron_pickle`."""
    path = ckpt / COMMON_NAME
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; a Megatron torch_dist checkpoint keeps its common state there")
    return load_megatron_pickle(path, "common state")


# What a legacy ``model_optim_rng.pt`` adds to the common state's names: its RNG states (numpy's array and dtype
# records, kept as inert values, never rebuilt) and the exit signal in ``args``.
RNG_STATE_NAMES = (
    "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray._reconstruct",
    "numpy.ndarray",
    "numpy.dtype",
    "signal.Signals",
)


def load_megatron_pickle(path: Path, what: str, *, inert: tuple[str, ...] = (), mmap: bool = False) -> dict[str, Any]:
    """A ``torch.save`` file of Megatron's through ``torch.load(weights_only=True)``: ``argparse.Namespace``
    becomes :class:`MegatronArgs`, each ``megatron.*`` name (and each of ``inert``) an inert :class:`MegatronValue`
    subclass; any other global is refused by name. ``mmap``: the tensors stay in the file until read."""
    allowed: list[tuple[Any, str]] = [(MegatronArgs, "argparse.Namespace")]
    allowed += [(type(name.rsplit(".", 1)[1], (MegatronValue,), {}), name) for name in inert]
    for _ in range(64):  # each round admits one more megatron name; a file naming more is refused
        try:
            with _without_process_safe_globals(), torch.serialization.safe_globals(allowed):
                data = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            break
        except pickle.UnpicklingError as err:
            found = _REFUSED.search(str(err))
            name = found.group(1) if found else None
            if name is None or not name.startswith("megatron."):
                named = name or next((ln.strip() for ln in str(err).splitlines() if "GLOBAL" in ln), "an object")
                raise UnsafePickleError(
                    f"{path}: refused to unpickle {named!r}: Megatron's {what} holds only containers, numbers, "
                    "strings, tensors, argparse.Namespace and megatron's own enums (nothing from it was run)"
                ) from None
            allowed.append((type(name.rsplit(".", 1)[1], (MegatronValue,), {}), name))
        except (RuntimeError, zipfile.BadZipFile, EOFError, OSError, ValueError) as err:
            raise CheckpointError(
                f"{path}: not a readable torch.save file ({type(err).__name__}: {str(err)[:200]}); the file is "
                "damaged or truncated"
            ) from None
    else:
        raise UnsafePickleError(f"{path}: names more than 64 megatron classes; not a Megatron {what}")
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: holds a {type(data).__name__}, not the dict megatron saves")
    return data


@contextlib.contextmanager
def _without_process_safe_globals() -> Iterator[None]:
    """[Note: process-wide safe globals shadow the inert ones]
    ``torch.serialization.add_safe_globals`` entries (megatron-core's ``safe_globals.py`` adds numpy's real
    ``_reconstruct`` and ``ndarray`` on import) are looked up before a ``safe_globals`` context's; with them the
    RNG state's arrays are rebuilt by numpy from our inert records and the load fails (``TypeError: _reconstruct``).
    They are set aside for the load and put back after it, so a process that imported megatron reads the same."""
    saved = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        yield
    finally:
        torch.serialization.add_safe_globals(saved)


@dataclass(frozen=True)
class MegatronSource:
    """One Megatron tensor as the checkpoint stores it: DCP ``key``, global shape, dtype, chunks."""

    key: str
    global_shape: tuple[int, ...]
    dtype: str
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]


def sources_of(md: Metadata, ckpt: Path) -> dict[str, MegatronSource]:
    """The tensors of the metadata (optimizer state and megatron's ``_extra_state`` objects aside)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = {}
    for key, meta in md.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata) or (
            key.startswith(("optimizer.", "rng_state")) and not key.startswith(OPTIMIZER_STATE)
        ):
            continue
        try:
            dtype = dtype_name(meta.properties.dtype)
        except CheckpointError:
            raise CheckpointError(
                f"{ckpt}: tensor {key!r} has dtype {meta.properties.dtype}, which shardtrain cannot load"
            ) from None
        chunks = tuple((tuple(map(int, c.offsets)), tuple(map(int, c.sizes))) for c in meta.chunks)
        out[key] = MegatronSource(key, tuple(map(int, meta.size)), dtype, chunks)
    return out
