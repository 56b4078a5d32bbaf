"""Loading full weights into a (possibly sharded) model without any rank holding the whole model.

Two sources:

* a state dict held by rank 0 (the other ranks pass ``None``): tensors are broadcast one at a time, so each
  rank holds at most its fragments plus the largest single tensor;
* safetensors files (one file, a list of files, or a directory with ``model.safetensors`` or a
  ``model.safetensors.index.json``): every rank reads what it needs itself; for a parameter split across
  data-parallel ranks it reads only the rows that cover its fragment, and for one split by tensor parallelism
  only its block (``safe_open(...).get_slice``), so no rank ever reads a whole split tensor.

Each parameter is written through a :class:`Destination` that knows whether this rank holds it whole
(stages 0-2, persistent, frozen, buffers) or only a fragment of it (stage-3 units).

Which checkpoint tensors make which model tensor is a :class:`KeyMap`: by default each key is the model name it
names; a layer above may pass another (``compat.hf_keys`` builds one from transformers' own key conversion, where
checkpoint keys are renamed and per-expert tensors are stacked into one fused tensor, [Note: converted rows]).
"""

from __future__ import annotations

import json
import logging
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from shardtrain.distributed.communicator import Communicator
from shardtrain.distributed.placement import shard_block
from shardtrain.errors import ShardtrainError
from shardtrain.zero.layout import state_tensors

if TYPE_CHECKING:
    from shardtrain.zero.layout import ShardLayout
    from shardtrain.zero.optimizer import ShardedOptimizer

log = logging.getLogger("shardtrain")


@dataclass
class Destination:
    """Where one model tensor's values go on this rank: targets, each covering elements ``[start, start + numel)``
    of the flattened tensor: the whole tensor (``start`` 0, in its own shape and strides, so a non-contiguous
    buffer or a 0-dim parameter is written in place), or a 1-D stage-3 fragment or fp32 master of a fragment.
    Targets may live on any device; values are copied (and converted) into them."""

    names: list[str]  # every state-dict name of the tensor (tied parameters have several)
    shape: torch.Size
    targets: list[tuple[torch.Tensor, int]]
    block: TPBlock | None = None
    """For a tensor split by tensor or expert parallelism: this rank's block of it (``shape`` is the full shape;
    target starts index the flattened block)."""

    def write_slice(self, flat_values: torch.Tensor, first: int) -> None:
        """Write values of the flattened tensor starting at element ``first`` (covering what we need)."""
        if self.block is not None:  # the whole tensor was read: keep this rank's block
            self.write_block(self.block.cut(flat_values.view(self.shape)))
            return
        self._write(flat_values, first)

    def write_block(self, block: torch.Tensor) -> None:
        """Write this rank's tensor-parallel block (read as such from a checkpoint)."""
        self._write(block.reshape(-1), 0)

    def readable_target(self, first: int, last: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A target that elements ``[first, last)`` of the flattened tensor can be read straight into: a host
        tensor of that dtype, contiguous, covering exactly that range (None when there is none: read, then write)."""
        if self.block is not None:
            return None
        for target, start in self.targets:
            if (
                start == first
                and target.numel() == last - first
                and target.dtype == dtype
                and target.device.type == "cpu"
                and target.is_contiguous()
            ):
                return target
        return None

    def _write(self, flat_values: torch.Tensor, first: int) -> None:
        with torch.no_grad():
            for target, start in self.targets:
                if target.numel() and target.data_ptr() != flat_values.data_ptr():  # not the one read into
                    a = start - first
                    target.copy_(flat_values[a : a + target.numel()].view(target.shape))

    def needed_range(self) -> tuple[int, int]:
        if self.block is not None:
            return 0, math.prod(self.shape)
        spans = [(start, start + t.numel()) for t, start in self.targets if t.numel()]
        if not spans:
            return 0, 0
        return min(a for a, _ in spans), max(b for _, b in spans)

    @property
    def dtype(self) -> torch.dtype:
        """The widest target dtype: a broadcast in it loses nothing for any target."""
        return max((t.dtype for t, _ in self.targets), key=lambda d: torch.finfo(d).bits if d.is_floating_point else 0)

    @property
    def device(self) -> torch.device:
        return self.targets[0][0].device


def weight_destinations(module: torch.nn.Module, layout: ShardLayout, optimizer: ShardedOptimizer) -> list[Destination]:
    """Where each parameter's and buffer's values go on this rank, read from the layout: the tensor itself
    when held whole, this rank's fragment of a stage-3 unit, and the fp32 master of the fragment."""
    dests = []
    sharded = layout.policy.shard_optimizer_state
    for names, t in state_tensors(module):
        targets: list[tuple[torch.Tensor, int]] = []
        record = layout.record_of(t)
        if record is None or record.held_whole:
            targets.append((t.data, 0))
        if record is not None and record.bucket is not None:
            bucket, f = record.bucket, record.fragment
            start = f.start if sharded else 0
            if not bucket.gather_after_step:  # a stage-3 unit: this rank's fragment only
                targets.append((bucket.shard[f.shard_offset : f.shard_offset + f.length], start))
            master = optimizer.master_of(t)
            if master is not None:
                targets.append((master.view(-1), start))
        split = layout.block_of(record)
        if split is not None and record.ep is not None:
            # a rank's experts are rows [index * n/E, (index + 1) * n/E) of dim 0: elements [first, first + numel /
            # E) of the whole tensor, read as that range, so that a rank reads only its experts (from per-expert
            # files too: [Note: converted rows])
            first = split.index * (math.prod(record.global_shape) // split.count)
            dests.append(Destination(names, torch.Size(record.global_shape), [(x, first + a) for x, a in targets]))
        elif split is not None:  # [Note: split parameters]
            block = TPBlock(split.placement, split.index, split.count)
            dests.append(Destination(names, torch.Size(record.global_shape), targets, block=block))
        else:
            dests.append(Destination(names, t.shape, targets))
    return dests


@dataclass(frozen=True)
class TPBlock:
    """This rank's block (``index`` of ``count``) of a tensor split as ``placement`` says (a ``TPPlacement``): its
    tensor-parallel block, or its experts."""

    placement: Any
    index: int
    count: int

    def cut(self, full: torch.Tensor) -> torch.Tensor:
        return shard_block(full, self.placement, self.index, self.count)


# -- which checkpoint tensors make which model tensor ------------------------------------------------------------


@dataclass(frozen=True)
class TensorHeader:
    """One checkpoint tensor as its file's header describes it (nothing read)."""

    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype


Loader = Callable[[], torch.Tensor]


@dataclass(frozen=True)
class Conversion:
    """Model tensors made from several checkpoint tensors by a conversion's operations (transformers stacks the
    per-expert ``experts.N.w1`` / ``experts.N.w3`` tensors and concatenates them into one ``experts.gate_up_proj``).

    ``sources``: per source pattern, its checkpoint keys in the order the conversion takes them. ``run`` turns one
    loader per key (the same patterns, each list in that order, possibly a run of it) into tensors by model name.
    ``shapes``: the model names it makes and their shapes (found by running it on ``meta`` tensors).
    ``stacked``: row ``i`` of the one tensor it makes comes from entry ``i`` of each pattern's list only, so rows
    ``[r0, r1)`` are made from entries ``[r0, r1)`` ([Note: converted rows])."""

    sources: tuple[tuple[str, tuple[str, ...]], ...]
    run: Callable[[Mapping[str, Sequence[Loader]]], Mapping[str, torch.Tensor]]
    shapes: Mapping[str, tuple[int, ...]]
    stacked: bool = False

    @property
    def keys(self) -> list[str]:
        return [k for _, keys in self.sources for k in keys]


@dataclass(frozen=True)
class KeyMap:
    """How a checkpoint's keys become the model's names: plain data, the same on every rank.

    ``renamed``: model name -> the checkpoint key holding it as is. ``converted``: model tensors made by a
    :class:`Conversion`. ``unmapped``: checkpoint key -> the name the mapping gave it, a name the model does not have.
    ``ignored``: likewise, for keys the model's class says to ignore (stale buffers such as ``attention.bias``):
    not loaded, logged. ``may_miss``: model names the class lets a checkpoint lack: they keep their initial values
    with a warning, even with ``strict``. ``by``: who mapped them, for messages (e.g. transformers' conversion for
    ``MixtralForCausalLM``)."""

    renamed: Mapping[str, str]
    converted: tuple[Conversion, ...] = ()
    unmapped: Mapping[str, str] = field(default_factory=dict)
    ignored: Mapping[str, str] = field(default_factory=dict)
    may_miss: frozenset[str] = frozenset()
    by: str = ""

    @classmethod
    def identity(cls, keys: Sequence[str]) -> KeyMap:
        """Each checkpoint key is the model name it names."""
        return cls(renamed={k: k for k in keys})


KeyMapper = Callable[[Mapping[str, TensorHeader]], KeyMap]
"""Builds the :class:`KeyMap` from the checkpoint's tensor headers (``compat.hf_keys.hf_key_mapper`` is one)."""


def load_state_dict_from_rank0(
    dests: list[Destination], state: Mapping[str, torch.Tensor] | None, comm: Communicator, strict: bool
) -> None:
    if comm.rank == 0 and state is None:
        raise ShardtrainError("load_full_state_dict: rank 0 must pass the state dict (other ranks pass None)")
    # every rank learns rank 0's keys and shapes, so that every rank takes the same decisions (no hang)
    shapes = {k: tuple(v.shape) for k, v in state.items()} if comm.rank == 0 and state is not None else None
    shapes = comm.all_gather_object(shapes, what="state-dict keys and shapes from rank 0")[0]
    picked = _match(dests, KeyMap.identity(list(shapes)), strict)
    for p in picked:
        _check_shape(p.key, shapes[p.key], p.dest, "the state dict")
    for p in picked:
        dest, key = p.dest, p.key
        if comm.rank == 0:
            buf = state[key].detach().to(device=dest.device, dtype=dest.dtype, copy=True).contiguous()
        else:
            buf = torch.empty(dest.shape, dtype=dest.dtype, device=dest.device)
        comm.broadcast(buf, 0, what=f"weights of {key!r}")
        dest.write_slice(buf.reshape(-1), 0)


def _check_shape(key: str, shape: tuple[int, ...], dest: Destination, where: str) -> None:
    if tuple(shape) != tuple(dest.shape):
        raise ShardtrainError(f"{key!r}: shape {tuple(shape)} in {where}, {tuple(dest.shape)} in the model")


def safetensors_files(path: str | Path | list[str | Path]) -> list[Path]:
    if isinstance(path, (list, tuple)):
        return [Path(p) for p in path]
    path = Path(path)
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [path / s for s in shards]
        single = path / "model.safetensors"
        if single.is_file():
            return [single]
        raise ShardtrainError(f"{str(path)!r} holds neither model.safetensors nor model.safetensors.index.json")
    if not path.is_file():
        raise ShardtrainError(f"no safetensors file at {str(path)!r}")
    return [path]


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def checkpoint_headers(files: list[Path]) -> dict[str, TensorHeader]:
    """Every tensor of the files, from their headers: where it is, its shape and dtype."""
    headers = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open has keys(), not iteration)
                part = handle.get_slice(key)
                dtype = _SAFETENSORS_DTYPES.get(part.get_dtype(), torch.float32)  # others: only meta runs see it
                headers[key] = TensorHeader(f, tuple(part.get_shape()), dtype)
    return headers


def load_safetensors(
    dests: list[Destination], files: list[Path], strict: bool, key_map: KeyMapper | None = None
) -> None:
    headers = checkpoint_headers(files)
    keys = key_map(headers) if key_map is not None else KeyMap.identity(list(headers))
    picked = _match(dests, keys, strict)
    for p in picked:  # every rank checks every shape (headers only) before anything is written
        if p.conversion is None:
            _check_shape(p.key, headers[p.key].shape, p.dest, headers[p.key].file.name)
        else:
            made_from = f"the checkpoint (made from {p.conversion.keys[0]} ...)"
            _check_shape(p.name, p.conversion.shapes[p.name], p.dest, made_from)
    groups: dict[int, list[_Picked]] = {}
    for p in picked:
        if p.conversion is not None:
            groups.setdefault(id(p.conversion), []).append(p)
            continue
        dest, key, where = p.dest, p.key, headers[p.key].file
        if dest.block is not None:  # split by tensor parallelism: read this rank's block only
            if any(t.numel() for t, _ in dest.targets):
                with safe_open(str(where), framework="pt") as handle:
                    dest.write_block(_read_block(handle.get_slice(key), dest.block))
            continue
        lo, hi = dest.needed_range()
        if lo == hi:
            continue
        with safe_open(str(where), framework="pt") as handle:
            part = handle.get_slice(key)
            values, first = _read_rows(part, tuple(part.get_shape()), lo, hi)
        dest.write_slice(values.reshape(-1), first)
    for group in groups.values():
        _load_converted(group, headers)


# [Note: converted rows]
# A conversion that stacks one tensor per expert (transformers' MergeModulelist(dim=0), then operations on the
# other dimensions only, such as Concatenate(dim=1)) makes row i of the fused tensor from expert i's tensors alone.
# A rank that holds elements [lo, hi) of the flattened fused tensor (a stage-3 fragment) therefore reads the experts
# of the rows covering them, and runs the conversion, transformers' own operations, on those experts only: no rank
# reads every expert. Any other conversion reads all its sources, runs once, and each destination keeps its part
# (a tensor-parallel block is cut from the whole), one converted tensor at a time.


def _load_converted(group: list[_Picked], headers: Mapping[str, TensorHeader]) -> None:
    """Load the model tensors one :class:`Conversion` makes ([Note: converted rows])."""
    conv = group[0].conversion
    needed = [p for p in group if _holds_any(p.dest)]
    if not needed:
        return
    if _rows_readable(conv) and len(group) == 1 and needed[0].dest.block is None:
        p = needed[0]
        shape = conv.shapes[p.name]
        lo, hi = p.dest.needed_range()
        row = max(1, math.prod(shape[1:]))
        r0, r1 = lo // row, -(-hi // row)
        loaders = {pattern: [_loader(headers[k].file, k) for k in keys[r0:r1]] for pattern, keys in conv.sources}
        p.dest.write_slice(conv.run(loaders)[p.name].reshape(-1), r0 * row)
        return
    made = conv.run({pattern: [_loader(headers[k].file, k) for k in keys] for pattern, keys in conv.sources})
    for p in needed:
        p.dest.write_slice(made[p.name].reshape(-1), 0)


def _holds_any(dest: Destination) -> bool:
    """Whether this rank keeps any element of the tensor (of its tensor-parallel block, or of its range)."""
    if dest.block is not None:
        return any(t.numel() for t, _ in dest.targets)
    lo, hi = dest.needed_range()
    return lo < hi


def _rows_readable(conv: Conversion) -> bool:
    """Whether rows of the converted tensor can be made from the matching entries alone (``stacked``, one tensor
    made, as many rows as each pattern has entries)."""
    if not conv.stacked or len(conv.shapes) != 1:
        return False
    (shape,) = conv.shapes.values()
    return len(shape) > 0 and all(len(keys) == shape[0] for _, keys in conv.sources)


def _loader(file: Path, key: str) -> Loader:
    def load() -> torch.Tensor:
        with safe_open(str(file), framework="pt") as handle:
            return handle.get_tensor(key)

    return load


def _read_block(part, block: TPBlock) -> torch.Tensor:
    """This rank's tensor-parallel block, read as ``stride`` slices of the split dimension (one per fused group,
    [Note: strided blocks]): no rank reads the whole tensor."""
    shape = tuple(part.get_shape())
    dim, stride = block.placement.dim, block.placement.stride
    group = shape[dim] // stride
    per = group // block.count
    pieces = []
    for g in range(stride):
        start = g * group + block.index * per
        pieces.append(part[tuple(slice(start, start + per) if d == dim else slice(None) for d in range(len(shape)))])
    return pieces[0] if stride == 1 else torch.cat(pieces, dim)


def _read_rows(part, shape: tuple[int, ...], lo: int, hi: int) -> tuple[torch.Tensor, int]:
    """Read the whole rows (first dimension) covering flattened elements [lo, hi)."""
    if len(shape) == 0:
        return part[...].reshape(1), 0
    row = max(1, int(torch.Size(shape[1:]).numel()))
    r0, r1 = lo // row, -(-hi // row)
    return part[r0:r1].reshape(-1), r0 * row


@dataclass(frozen=True)
class _Picked:
    """A model tensor and where its values come from: the checkpoint ``key`` holding it as is, or a conversion."""

    dest: Destination
    name: str  # the model name it is loaded under
    key: str = ""
    conversion: Conversion | None = None


def _match(dests: list[Destination], keys: KeyMap, strict: bool) -> list[_Picked]:
    made = {name: conv for conv in keys.converted for name in conv.shapes}
    picked, missing, used = [], [], set()
    for dest in dests:
        name = next((n for n in dest.names if n in keys.renamed or n in made), None)
        if name is None:
            missing.append(dest.names[0])
            continue
        for n in dest.names:  # a tied tensor consumes the checkpoint tensors of each of its names
            if n in keys.renamed:
                used.add(keys.renamed[n])
            if n in made:
                used.update(made[n].keys)
        if name in keys.renamed:
            picked.append(_Picked(dest, name, key=keys.renamed[name]))
        else:
            picked.append(_Picked(dest, name, conversion=made[name]))
    unexpected = {k: k for k in keys.renamed.values() if k not in used}
    unexpected.update({k: k for conv in keys.converted for k in conv.keys if k not in used})
    unexpected.update(keys.unmapped)
    if keys.ignored:
        log.info("load_full_state_dict: not loaded, as %s says to ignore them: %s", keys.by, ", ".join(keys.ignored))
    allowed = [n for n in missing if n in keys.may_miss]
    if allowed:
        warnings.warn(
            f"load_full_state_dict: {len(allowed)} model tensor(s) are not in the checkpoint, which {keys.by} allows; "
            f"they keep their initial values: {_listed(allowed, None)}",
            stacklevel=4,
        )
    missing = [n for n in missing if n not in keys.may_miss]
    if missing or unexpected:
        _report(missing, unexpected, keys.by, strict)
    return picked


def _listed(names: Sequence[str], limit: int | None = 8) -> str:
    shown = names if limit is None else names[:limit]
    more = f" ... ({len(names)} in all)" if limit is not None and len(names) > limit else ""
    return ", ".join(shown) + more


def _report(missing: list[str], unexpected: Mapping[str, str], by: str, strict: bool) -> None:
    """What a checkpoint and a model disagree on, never silently ([Note: no silent initial values])."""
    renamed = [k if v == k else f"{k} (mapped to {v})" for k, v in sorted(unexpected.items())]
    unmapped = f"which {by} could not map" if by else "and no key conversion was given"
    under = f" under {by}" if by else ""
    if not strict:
        parts = []
        if missing:
            parts.append(f"{len(missing)} model tensor(s) keep their initial values: {_listed(missing, None)}")
        if unexpected:
            parts.append(f"{len(unexpected)} checkpoint tensor(s) are not loaded: {_listed(renamed, None)}")
        warnings.warn(f"load_full_state_dict(strict=False): {'; '.join(parts)}", stacklevel=4)
        return
    if missing and unexpected:
        raise ShardtrainError(
            f"weights do not match the model (missing: {_listed(missing)}; unexpected: {_listed(renamed)}): the "
            f"checkpoint likely holds the missing weights under other names, {unmapped}. Load it with the model "
            "class that saved it, with a transformers version whose conversion knows this layout, or map the names "
            "yourself (from_pretrained's key_mapping)"
        )
    if missing:
        raise ShardtrainError(
            f"weights do not match the model (missing: {_listed(missing)}): the checkpoint holds no tensor under "
            "another name either; pass strict=False to load the rest and train these from their initial values"
        )
    raise ShardtrainError(
        f"weights do not match the model (unexpected: {_listed(renamed)}): the model has no tensor of that "
        f"name{under}; pass strict=False to load the rest and leave these out"
    )


# [Note: no silent initial values]
# A model tensor that no checkpoint tensor maps to keeps the value it was built with (random, for a model built
# from its config). With strict (the default) that is an error; with strict=False a warning names every such tensor
# and every checkpoint tensor left unloaded, so that a router or head trained from scratch is never a surprise.
