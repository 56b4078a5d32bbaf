"""What a torch.distributed.checkpoint (DCP) directory holds, read without running code from it, and how its
entries map onto a shardtrain checkpoint's names.

[Note: DCP checkpoints]
``torch.distributed.checkpoint.save`` (FSDP2 scripts, torchtitan) writes ``.metadata`` (a pickled ``Metadata``) and
``__<rank>_<n>.distcp`` files of ``torch.save``-serialized tensor chunks and values. The state dict is flattened to
dotted keys first; ``Metadata.planner_data`` keeps each key's path, which tells model names with dots from nesting.
Per tensor the metadata gives global shape, dtype and chunks (n-D boxes); storage records locate each chunk's bytes.
torch reads ``.metadata`` with plain ``pickle.load``; we use ``safe_pickle.py``'s restricted unpickler admitting only
DCP's metadata classes (:func:`dcp_metadata_globals`), and ``torch.load(weights_only=True)`` for chunks and values.

Two layouts are recognised (:func:`interpret`):

* **FSDP2 scripts**: ``{"model": ..., "optimizer" or "optim": ...}``, possibly inside one wrapper key (the DCP
  tutorial's ``{"app": AppState(...)}``); the optimizer as torch returns it (``state`` by parameter name,
  ``param_groups`` listing names) or flattened (``state.<name>.<key>``, ``param_groups.<name>.<hyperparameter>``);
* **torchtitan**: model names at the top level, the optimizer flattened, ``lr_scheduler``, ``train_state`` (``step``,
  ``ntokens_seen``) and ``dataloader`` (per-rank positions, which do not carry over).

Model tensors become ``model/<name>``, optimizer states ``optim/<name>/<key>`` (what the engine's load reads); any
other top-level entry is the client state.
"""

from __future__ import annotations

import functools
import pathlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardtrain.checkpoint.format import DTYPES, LATEST_NAME, MANIFEST_NAME, SizedTensor, dtype_name
from shardtrain.checkpoint.safe_pickle import restricted_loads
from shardtrain.errors import CheckpointError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

METADATA_NAME = ".metadata"
MODEL, OPTIMIZER, SCHEDULER, TRAIN_STATE, DATALOADER = "model", "optimizer", "lr_scheduler", "train_state", "dataloader"
_KNOWN_TOP = (MODEL, OPTIMIZER, SCHEDULER, TRAIN_STATE, DATALOADER)
_NESTED = {MODEL, OPTIMIZER, "optim"}  # the keys of a Stateful wrapping model and optimizer (``optim``: the tutorial's)


def _path_text(*parts: Any) -> str:
    """Stand-in for ``pathlib.PosixPath``/``WindowsPath`` (``StorageMeta.checkpoint_id``, informative only): the
    path as text, so that a Windows path reads on Linux and no path object is built from the file."""
    return str(pathlib.PurePosixPath(*map(str, parts)))


@functools.cache
def dcp_metadata_globals() -> dict[str, Any]:
    """Every global a DCP ``.metadata`` pickle names (torch 2.x), each harmless to call with any arguments:
    dataclasses and an enum that only store what they are given, torch.Size, a layout lookup by name, torch's dtypes
    (objects, not called). Old torch kept TensorProperties in ``torch.distributed._shard``; the state it pickled is
    the same. (Built on first use: opening a shardtrain checkpoint does not import torch.distributed.checkpoint.)"""
    import torch.distributed.checkpoint.filesystem as dcp_filesystem
    import torch.distributed.checkpoint.metadata as dcp_metadata
    import torch.serialization

    return {
        **{
            f"torch.distributed.checkpoint.metadata.{name}": getattr(dcp_metadata, name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "StorageMeta",
                "_MEM_FORMAT_ENCODING",
            )
        },
        "torch.distributed._shard.sharded_tensor.metadata.TensorProperties": dcp_metadata.TensorProperties,
        "torch.distributed._shard.sharded_tensor.metadata.MEM_FORMAT_ENCODING": dcp_metadata._MEM_FORMAT_ENCODING,
        "torch.distributed.checkpoint.filesystem._StorageInfo": dcp_filesystem._StorageInfo,
        "torch.Size": torch.Size,
        "torch.serialization._get_layout": torch.serialization._get_layout,
        **{f"torch.{name}": getattr(torch, name) for name in DTYPES},
        **{f"torch.{name}": getattr(torch, name) for name in ("complex64", "complex128", "uint16", "uint32", "uint64")},
        **{f"{m}.{c}": _path_text for m in ("pathlib", "pathlib._local") for c in ("PosixPath", "WindowsPath", "Path")},
    }


_EXPECTED = (
    "a torch.distributed.checkpoint .metadata file holds only DCP's metadata classes, torch sizes and dtypes "
    "(a custom planner's planner_data is not supported)"
)


_NO_STORAGE = (
    "has no storage records (written by a storage writer other than torch's FileSystemWriter); only file-system DCP "
    "checkpoints are read"
)


def load_metadata(
    ckpt: Path,
    allowed: dict[str, Any] | None = None,
    expected: str = _EXPECTED,
    what: str = "the DCP metadata",
    no_storage: str = _NO_STORAGE,
) -> Metadata:
    """``ckpt/.metadata`` through ``allowed`` (default :func:`dcp_metadata_globals`); anything else in it is refused
    by name. ``expected``, ``what`` and ``no_storage`` word the errors for a format built on DCP's (Megatron's)."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = ckpt / METADATA_NAME
    try:
        data = path.read_bytes()
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read {what}: {err}") from None
    allowed = allowed if allowed is not None else dcp_metadata_globals()
    md = restricted_loads(data, allowed, source=str(path), expected=expected)
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise CheckpointError(f"{path}: holds a {type(md).__name__}, not DCP metadata; the file is damaged")
    if not isinstance(md.storage_data, dict):
        raise CheckpointError(f"{path}: {no_storage}")
    return md


def find_dcp_checkpoint(path: str | Path, tag: str | None) -> Path | None:
    """The DCP checkpoint directory ``path`` (with ``tag``: ``path/tag``) names, or None when it is none.

    Without a tag, a directory holding neither a shardtrain manifest nor ``latest`` but ``step-<N>`` directories
    with DCP metadata (a torchtitan checkpoint folder) names its highest step, as torchtitan resumes."""
    path = Path(path)
    if tag is not None:
        return path / tag if (path / tag / METADATA_NAME).is_file() else None
    if (path / METADATA_NAME).is_file():
        return path
    if not path.is_dir() or (path / MANIFEST_NAME).exists() or (path / LATEST_NAME).exists():
        return None
    steps = [
        (int(m.group(1)), p)
        for p in path.iterdir()
        if (m := re.fullmatch(r"step-(\d+)", p.name)) and (p / METADATA_NAME).is_file()
    ]
    return max(steps)[1] if steps else None


@dataclass(frozen=True)
class DcpTensorEntry(SizedTensor):
    """A logical tensor of a DCP checkpoint under a shardtrain name: DCP's flat ``key`` and its chunks
    (``(offsets, sizes)`` boxes of the global tensor)."""

    name: str
    global_shape: tuple[int, ...]
    dtype: str
    key: str
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class DcpManifest:
    """The part of :class:`~shardtrain.checkpoint.format.Manifest` that loading reads: ``model/`` and ``optim/``
    tensors by name, and the saving world size (from the ranks in the data files' names)."""

    tag: str
    world_size: int
    tensors: dict[str, DcpTensorEntry]

    def resolve(self, name: str) -> DcpTensorEntry:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(
                f"tensor {name!r} is not in DCP checkpoint {self.tag!r} ({len(self.tensors)} tensors)"
            ) from None


@dataclass
class DcpContents:
    """:func:`interpret`'s answer: what each DCP entry is for."""

    manifest: DcpManifest
    layout: str  # "model" (under a "model" key) or "top-level" (torchtitan)
    groups_nested: list[tuple[tuple, str]] = field(default_factory=list)  # (path below param_groups, key)
    groups_flat: dict[str, dict[str, str]] = field(default_factory=dict)  # name -> hyperparameter -> key
    scheduler: list[tuple[tuple, str]] = field(default_factory=list)  # (path below lr_scheduler, key)
    train_state: list[tuple[tuple, str]] = field(default_factory=list)
    client: list[tuple[tuple, str]] = field(default_factory=list)  # (path, key) of everything else
    tensors_by_key: dict[str, DcpTensorEntry] = field(default_factory=dict)  # every tensor, by DCP key
    not_carried: list[str] = field(default_factory=list)


def _paths(md: Metadata) -> dict[str, tuple]:
    """Each flat key's path in the saved state dict: from ``planner_data`` (DCP's default planner records it),
    else split after a known top-level key."""
    planned = md.planner_data if isinstance(md.planner_data, dict) else {}
    out = {}
    for key in md.state_dict_metadata:
        p = planned.get(key)
        if isinstance(p, (tuple, list)) and p and all(isinstance(x, (str, int)) for x in p):
            out[key] = tuple(p)
            continue
        head, dot, rest = key.partition(".")
        out[key] = (head, rest) if dot and head in _KNOWN_TOP else (key,)
    return out


def _world_size(md: Metadata) -> int:
    ranks = [
        int(m.group(1))
        for info in md.storage_data.values()
        if (m := re.fullmatch(r"__(\d+)_\d+\.distcp", str(getattr(info, "relative_path", ""))))
    ]
    return max(ranks) + 1 if ranks else 1


def _entry(name: str, key: str, meta: Any, source: Path) -> DcpTensorEntry:
    try:
        dtype = dtype_name(meta.properties.dtype)
    except CheckpointError:
        raise CheckpointError(
            f"{source}: tensor {key!r} has dtype {meta.properties.dtype}, which shardtrain cannot load "
            f"(supported: {sorted(DTYPES)})"
        ) from None
    chunks = tuple((tuple(map(int, c.offsets)), tuple(map(int, c.sizes))) for c in meta.chunks)
    return DcpTensorEntry(name, tuple(map(int, meta.size)), dtype, key, chunks)


def interpret(ckpt: Path, md: Metadata) -> DcpContents:
    """Sort the entries of a DCP checkpoint (see [Note: DCP checkpoints])."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    paths = _paths(md)
    heads = {p[0] for p in paths.values()}
    if len(heads) == 1 and all(len(p) > 2 for p in paths.values()) and {p[1] for p in paths.values()} & _NESTED:
        paths = {k: p[1:] for k, p in paths.items()}  # one wrapper (the DCP tutorial's {"app": AppState})
    is_tensor = {k: isinstance(m, TensorStorageMetadata) for k, m in md.state_dict_metadata.items()}
    nested_model = any(p[0] == MODEL and len(p) > 1 and is_tensor[k] for k, p in paths.items())
    out = DcpContents(DcpManifest(ckpt.name, _world_size(md), {}), "model" if nested_model else "top-level")
    tensors = out.manifest.tensors
    unknown_optim: list[str] = []
    for key, p in paths.items():
        meta = md.state_dict_metadata[key]
        if is_tensor[key]:
            out.tensors_by_key[key] = _entry(key, key, meta, ckpt)
        head = p[0]
        if (nested_model and head == MODEL and len(p) > 1) or (not nested_model and len(p) == 1 and is_tensor[key]):
            name = ".".join(map(str, p[1:] if nested_model else p))
            if is_tensor[key]:
                tensors[f"model/{name}"] = _entry(f"model/{name}", key, meta, ckpt)
            else:
                out.not_carried.append(f"model entry {name!r} (not a tensor)")
        elif head in (OPTIMIZER, "optim") and len(p) > 1:
            target = _optimizer_target(p)
            if target is None:
                unknown_optim.append(key)
            elif target[0] == "state" and is_tensor[key]:
                name = f"optim/{target[1]}/{target[2]}"
                tensors[name] = _entry(name, key, meta, ckpt)
            elif target[0] == "state":
                out.not_carried.append(f"optimizer state {target[2]!r} of {target[1]!r} (not a tensor)")
            elif target[0] == "group":
                out.groups_nested.append((target[1], key))
            else:
                out.groups_flat.setdefault(target[1], {})[target[2]] = key
        elif head == SCHEDULER:
            out.scheduler.append((p[1:], key))
        elif head == TRAIN_STATE:
            out.train_state.append((p[1:], key))
        elif head == DATALOADER:
            if not any(n.startswith("'dataloader'") for n in out.not_carried):
                out.not_carried.append("'dataloader' (the data loaders' positions: start the data where you resume)")
        else:
            out.client.append((p, key))
    if unknown_optim:
        shown = ", ".join(map(repr, unknown_optim[:3])) + (" ..." if len(unknown_optim) > 3 else "")
        out.not_carried.append(f"optimizer entries of no known form ({shown})")
    return out


def _optimizer_target(p: tuple) -> tuple | None:
    """``("state", name, key)``, ``("group", path below param_groups)`` or ``("flat_group", name, hyper)`` for a
    path under ``optimizer``; None for anything else."""
    if len(p) >= 4 and p[1] == "state":
        return ("state", str(p[2]), ".".join(map(str, p[3:])))
    if len(p) >= 4 and p[1] == "param_groups" and isinstance(p[2], int):
        return ("group", p[2:])
    if len(p) == 2 and isinstance(p[1], str):
        kind, _, rest = p[1].partition(".")
        name, dot, key = rest.rpartition(".")
        if kind == "state" and dot and name:
            return ("state", name, key)
        if kind == "param_groups" and dot and name:
            return ("flat_group", name, key)
    return None
