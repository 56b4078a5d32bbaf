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
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from shardtrain.distributed.communicator import Communicator
from shardtrain.distributed.placement import shard_block
from shardtrain.errors import ShardtrainError

if TYPE_CHECKING:
    from shardtrain.zero.layout import ShardLayout
    from shardtrain.zero.optimizer import ShardedOptimizer


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
    """For a tensor split by tensor parallelism: this rank's block of it (``shape`` is the full shape; target starts
    index the flattened block)."""

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
        if record is not None and record.tp_split:
            block = TPBlock(record.tp, layout.tp_rank, layout.tp)
            dests.append(Destination(names, torch.Size(record.global_shape), targets, block=block))
        else:
            dests.append(Destination(names, t.shape, targets))
    return dests


@dataclass(frozen=True)
class TPBlock:
    """This rank's block (``index`` of ``count``) of a tensor split as ``placement`` says (a ``TPPlacement``)."""

    placement: Any
    index: int
    count: int

    def cut(self, full: torch.Tensor) -> torch.Tensor:
        return shard_block(full, self.placement, self.index, self.count)


def state_tensors(module: torch.nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """Each distinct parameter and buffer with all its state-dict names (a tied parameter has several)."""
    grouped: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        grouped.setdefault(id(t), ([], t))[0].append(name)
    return list(grouped.values())


def load_state_dict_from_rank0(
    dests: list[Destination], state: Mapping[str, torch.Tensor] | None, comm: Communicator, strict: bool
) -> None:
    if comm.rank == 0 and state is None:
        raise ShardtrainError("load_full_state_dict: rank 0 must pass the state dict (other ranks pass None)")
    # every rank learns rank 0's keys and shapes, so that every rank takes the same decisions (no hang)
    shapes = {k: tuple(v.shape) for k, v in state.items()} if comm.rank == 0 and state is not None else None
    shapes = comm.all_gather_object(shapes, what="state-dict keys and shapes from rank 0")[0]
    picked = _match(dests, set(shapes), strict)
    for dest, key in picked:
        _check_shape(key, shapes[key], dest, "the state dict")
    for dest, key in picked:
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


def load_safetensors(dests: list[Destination], files: list[Path], strict: bool) -> None:
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open has keys(), not iteration)
                where[key] = f
    picked = _match(dests, set(where), strict)
    for dest, key in picked:  # every rank checks every shape (headers only) before anything is written
        with safe_open(str(where[key]), framework="pt") as handle:
            _check_shape(key, tuple(handle.get_slice(key).get_shape()), dest, where[key].name)
    for dest, key in picked:
        if dest.block is not None:  # split by tensor parallelism: read this rank's block only
            if any(t.numel() for t, _ in dest.targets):
                with safe_open(str(where[key]), framework="pt") as handle:
                    dest.write_block(_read_block(handle.get_slice(key), dest.block))
            continue
        lo, hi = dest.needed_range()
        if lo == hi:
            continue
        with safe_open(str(where[key]), framework="pt") as handle:
            part = handle.get_slice(key)
            values, first = _read_rows(part, tuple(part.get_shape()), lo, hi)
        dest.write_slice(values.reshape(-1), first)


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


def _match(dests: list[Destination], keys: set[str], strict: bool) -> list[tuple[Destination, str]]:
    picked, missing, used = [], [], set()
    for dest in dests:
        key = next((n for n in dest.names if n in keys), None)
        if key is None:
            missing.append(dest.names[0])
            continue
        used.update(n for n in dest.names if n in keys)
        picked.append((dest, key))
    unexpected = sorted(keys - used)
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
        if unexpected:
            parts.append(f"unexpected: {', '.join(unexpected[:8])}{' ...' if len(unexpected) > 8 else ''}")
        raise ShardtrainError(
            f"weights do not match the model ({'; '.join(parts)}); pass strict=False to load the rest"
        )
    return picked
