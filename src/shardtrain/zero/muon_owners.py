"""Muon's orthogonalization on whole matrices under ZeRO 1-3: each matrix on one owner rank ([Note: Muon on owners]
in optim/muon.py).

[Note: one owner per matrix]
Per bucket holding Muon parameters, two collectives over the shard group, in bucket order on every rank: (1) each rank
writes its fragments of the Muon updates into a chunk-sized scratch at their shard offsets and the chunks are
all-gathered, so the owner of each matrix reads it whole (every rank receives the bucket, as a parameter all-gather
does: the bytes of one, and no gather-to-one primitive is needed); (2) each owner orthogonalizes its matrices with
torch's function and writes them at their offsets of a zeroed bucket-sized buffer, and a reduce-scatter (sum) hands
every rank its chunk: each element is one owner's value plus zeros, so exact. Owners are assigned once, largest
matrix first to the least-loaded rank (Newton-Schulz costs about rows x cols x min(rows, cols)), so the
orthogonalizations run in parallel across the ranks instead of all on every rank.
"""

from __future__ import annotations

import torch

from shardtrain.distributed.communicator import Communicator, Reduce
from shardtrain.optim.muon import Orthogonalize
from shardtrain.zero.layout import Bucket


def _cost(shape: torch.Size) -> int:
    rows, cols = shape
    return rows * cols * min(rows, cols)


class MuonOwners:
    """The ``whole_matrices`` of :class:`shardtrain.optim.muon.MuonWithAdamW` under ZeRO 1-3 ([Note: one owner per
    matrix]). ``places``: for each stepped tensor of a Muon group (by id), its bucket and slot index."""

    def __init__(self, comm: Communicator, places: dict[int, tuple[Bucket, int]]) -> None:
        self.comm, self.places = comm, places
        load = [0] * comm.size
        self.owner: dict[int, int] = {}
        for key in sorted(places, key=lambda k: -_cost(self._slot_shape(k))):
            rank = min(range(comm.size), key=lambda r: load[r])
            self.owner[key] = rank
            load[rank] += _cost(self._slot_shape(key))
        self.load = load
        """Newton-Schulz cost (rows x cols x min) per rank of the shard group."""

    def _slot_shape(self, key: int) -> torch.Size:
        b, i = self.places[key]
        return b.slots[i].shape

    def shape_of(self, stepped: torch.Tensor) -> torch.Size:
        return self._slot_shape(id(stepped))

    def __call__(
        self, stepped: list[torch.Tensor], pieces: list[torch.Tensor], orthogonalize: Orthogonalize
    ) -> list[torch.Tensor]:
        # by bucket, in the order of the stepped tensors (the same on every rank)
        by_bucket: dict[int, tuple[Bucket, list[int]]] = {}
        for n, s in enumerate(stepped):
            b = self.places[id(s)][0]
            by_bucket.setdefault(id(b), (b, []))[1].append(n)
        out: list[torch.Tensor | None] = [None] * len(stepped)
        me = self.comm.rank
        for b, members in by_bucket.values():
            dtype, device = pieces[members[0]].dtype, pieces[members[0]].device
            full = torch.zeros(b.padded_numel, dtype=dtype, device=device)
            chunk = full.view(b.world, -1)[b.rank]
            for n in members:
                f = b.fragments[self.places[id(stepped[n])][1]]
                chunk[f.shard_offset : f.shard_offset + f.length].copy_(pieces[n].reshape(-1))
            self.comm.all_gather(full, chunk, what="Muon updates to their owners")
            result = torch.zeros_like(full)
            for n in members:
                slot = b.slots[self.places[id(stepped[n])][1]]
                if self.owner[id(stepped[n])] == me:
                    whole = full[slot.offset : slot.offset + slot.numel].view(slot.shape)
                    result[slot.offset : slot.offset + slot.numel].copy_(orthogonalize(whole).reshape(-1))
            mine = torch.empty_like(chunk)
            self.comm.reduce_scatter(mine, result, Reduce.SUM, what="orthogonalized Muon updates from their owners")
            for n in members:
                f = b.fragments[self.places[id(stepped[n])][1]]
                out[n] = mine[f.shard_offset : f.shard_offset + f.length]
        return out  # type: ignore[return-value]
