"""Check that every rank of a tensor-parallel group got the same batch.

Tensor-parallel ranks compute pieces of *one* forward; they must all see the same inputs. Feeding them
different batches (a data loader sharded over every rank instead of over the data-parallel ranks only) is a
common mistake that produces no error, only a model that trains badly. :func:`check_same_batch` costs one pass
over the inputs, one device-to-host copy per device holding inputs (of two integers per tensor), and one small
object all-gather over the tensor-parallel ranks' host-side group (gloo: see [Note: the engine's groups] in
:mod:`shardtrain.distributed.mesh`), so that the exchange adds no device round trip; the engine calls it at the first
step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardtrain.distributed.communicator import Communicator
from shardtrain.errors import RankMismatchError
from shardtrain.tree import iter_tensors

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def batch_digest(args: tuple, kwargs: dict[str, Any]) -> list[tuple[str, str, tuple[int, ...], int, int]]:
    """``(path, dtype, shape, sum, weighted sum)`` of every tensor in the inputs: exact on the bit patterns.

    The sums run over the tensor's bits read as integers (int64 arithmetic, wrapping), the weighted one with
    position weights so that a permutation of the same values is noticed too."""
    entries, sums = [], []
    tensors = [("args" + p, t) for p, t in iter_tensors(tuple(args))]
    tensors += [("kwargs" + p, t) for p, t in iter_tensors(dict(kwargs))]
    for path, t in tensors:  # the sums stay where the inputs are: nothing is read back yet
        flat = t.detach()
        if flat.is_complex():
            flat = torch.view_as_real(flat)
        flat = flat.reshape(-1)
        if flat.dtype == torch.bool:
            bits = flat.to(torch.uint8)
        elif flat.is_floating_point():
            bits = flat.contiguous().view(_BITS[flat.element_size()])
        else:
            bits = flat
        v = bits.to(torch.int64)  # [n]
        w = torch.arange(v.numel(), device=v.device) % 65521 + 1  # [n] position weights
        sums.append(torch.stack([v.sum(), (v * w).sum()]) if v.numel() else v.new_zeros(2))
        entries.append((path, str(t.dtype), tuple(t.shape)))
    # one copy to the host per device, not per tensor (inputs may live on several devices: the CPU and a GPU)
    by_device: dict[torch.device, list[int]] = {}
    for i, pair in enumerate(sums):
        by_device.setdefault(pair.device, []).append(i)
    values: list[list[int]] = [[]] * len(sums)
    for indices in by_device.values():
        for i, v in zip(indices, torch.stack([sums[i] for i in indices]).tolist()):
            values[i] = v
    return [(*e, int(a), int(b)) for e, (a, b) in zip(entries, values)]


def check_same_batch(
    args: tuple, kwargs: dict[str, Any], tp_comm: Communicator, host_group: dist.ProcessGroup | None = None
) -> None:
    """Raise :class:`RankMismatchError` naming the tensor-parallel ranks whose inputs differ from rank 0's.

    ``host_group``: the host-side group of ``tp_comm``'s ranks (``Topology.host_tp_group``), where the digests are
    exchanged (None: over ``tp_comm``)."""
    comm = tp_comm
    if host_group is not None and host_group is not tp_comm.group:
        comm = Communicator(host_group, tp_comm.timeout_s)
    mine = (tp_comm.global_rank, batch_digest(args, kwargs))
    every = comm.all_gather_object(mine, what="tensor-parallel batch check")
    reference = every[0][1]
    differ = [(r, g) for r, (g, digest) in enumerate(every) if digest != reference]
    if not differ:
        return
    first = next(r for r, _ in differ)
    where = first_difference(reference, every[first][1], "tp rank 0", f"tp rank {first}")
    ranks = ", ".join(f"tp rank {r} (global rank {g})" for r, g in differ)
    raise RankMismatchError(
        f"the ranks of a tensor-parallel group must all get the same batch, but {ranks} got inputs different "
        f"from tp rank 0 (global rank {every[0][0]}): {where}. Shard the data over the data-parallel ranks only "
        "(e.g. DistributedSampler(num_replicas=dp_size, rank=dp_rank)), not over every rank."
    )


def first_difference(a: list, b: list, first: str, other: str) -> str:
    """Where two :func:`batch_digest` lists part (``a`` from rank ``first``, ``b`` from ``other``): the first input
    whose dtype, shape or values differ."""
    for x, y in zip(a, b):
        if x[:3] != y[:3]:
            return f"input {x[0]} is {x[1]} {list(x[2])} on {first} but {y[1]} {list(y[2])} on {other}"
        if x != y:
            return f"input {x[0]} ({x[1]} {list(x[2])}) holds different values on {first} and {other}"
    return f"{first} passed {len(a)} tensors, {other} {len(b)}"
