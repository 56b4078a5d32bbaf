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

[Note: Muon's matrices under tensor parallelism]
Under tensor parallelism a ZeRO bucket holds each tp rank's *block* of a split matrix (column-parallel: a block of
rows, row-parallel: of columns, a fused QKV / gate_up weight one block of each of its ``stride`` groups). Muon
orthogonalizes the whole logical matrix, so the owner all-gathers the matrix's blocks over the tensor-parallel group,
assembles them as the placement lays them out (``assemble_blocks``), orthogonalizes, and keeps its own block
(``shard_block``). Every tp rank holds the same buckets (same local shapes) and assigns owners by the same rule, so
a matrix's owners on the tp ranks share one data-parallel index and form exactly one tensor-parallel group: each tp
group gathers the matrices its ranks own, in bucket order. Block-wise orthogonalization (each block on its own) is
not offered: it is another algorithm (tests/zero/test_muon_owners.py shows it fails parity's bound).
"""

from __future__ import annotations

import torch

from shardtrain.distributed.communicator import Communicator, Reduce
from shardtrain.distributed.placement import TPPlacement, assemble_blocks, shard_block
from shardtrain.optim.muon import Orthogonalize
from shardtrain.zero.layout import Bucket
from shardtrain.zero.owner_staging import OwnerStaging


def _cost(shape: torch.Size) -> int:
    *stacked, rows, cols = shape  # [experts, rows, cols]: one Newton-Schulz per expert
    return rows * cols * min(rows, cols) * (stacked[0] if stacked else 1)


class TensorParallelBlocks:
    """The split Muon matrices under tensor parallelism ([Note: Muon's matrices under tensor parallelism]).
    ``placements``: for each stepped tensor of a split matrix (by id), how tensor parallelism cuts it."""

    def __init__(self, comm: Communicator, placements: dict[int, TPPlacement]) -> None:
        self.comm, self.placements = comm, placements

    def orthogonalize(self, key: int, block: torch.Tensor, orthogonalize: Orthogonalize) -> torch.Tensor:
        """This tp rank's block of ``orthogonalize`` applied to the whole logical matrix ``block`` is part of;
        collective over the tensor-parallel group (its ranks call it for the same matrices in the same order)."""
        placement = self.placements.get(key)
        if placement is None:  # held whole by every tp rank
            return orthogonalize(block)
        stacked = self.comm.all_gather_dim(block.unsqueeze(0), 0, what="a Muon matrix's tensor-parallel blocks")
        whole = assemble_blocks(list(stacked.unbind(0)), placement)  # [*placement.global_shape]
        return shard_block(orthogonalize(whole), placement, self.comm.rank, self.comm.size).contiguous()


class MuonOwners:
    """The ``whole_matrices`` of :class:`shardtrain.optim.muon.MuonWithAdamW` under ZeRO 1-3 ([Note: one owner per
    matrix]). ``places``: for each stepped tensor of a Muon group (by id), its bucket and slot index; ``blocks``:
    under tensor parallelism, the split matrices' placements."""

    def __init__(
        self,
        comm: Communicator,
        places: dict[int, tuple[Bucket, int]],
        blocks: TensorParallelBlocks | None = None,
        expert_comm: Communicator | None = None,
        staging: OwnerStaging | None = None,
    ) -> None:
        """``expert_comm``: under expert parallelism, the expert-data-parallel group that expert buckets are sharded
        over; their matrices get owners there ([Note: experts' matrices] in optim/muon.py). ``staging``: where the
        communicator's device is not the host, the copies that put a host step's updates on it ([Note: the owners'
        collectives on the device] in zero/owner_staging.py)."""
        self.comm, self.places, self.blocks, self.expert_comm = comm, places, blocks, expert_comm
        self.staging = staging
        self.owner: dict[int, int] = {}
        loads: dict[str, list[int]] = {}
        for kind in ("dense", "expert"):
            keys = [k for k in places if (places[k][0].expert and expert_comm is not None) == (kind == "expert")]
            group = self.comm if kind == "dense" or expert_comm is None else expert_comm
            load = [0] * group.size
            # by the local shape: the same on every tp rank, so a matrix's owners share a data-parallel index
            for key in sorted(keys, key=lambda k: -_cost(self._slot_shape(k))):
                rank = min(range(len(load)), key=lambda r: load[r])
                self.owner[key] = rank
                load[rank] += _cost(self._slot_shape(key))
            loads[kind] = load
        self.load, self.expert_load = loads["dense"], loads["expert"]
        """Newton-Schulz cost (rows x cols x min, per expert) per rank of the shard group, and of the expert shard
        group for experts' matrices."""

    def _comm_of(self, bucket: Bucket) -> Communicator:
        return self.expert_comm if bucket.expert and self.expert_comm is not None else self.comm

    def _slot_shape(self, key: int) -> torch.Size:
        b, i = self.places[key]
        return b.slots[i].shape

    def shape_of(self, stepped: torch.Tensor) -> torch.Size:
        """The logical matrix's shape (its tensor-parallel blocks together)."""
        placement = self.blocks.placements.get(id(stepped)) if self.blocks is not None else None
        return torch.Size(placement.global_shape) if placement is not None else self._slot_shape(id(stepped))

    def __call__(
        self, stepped: list[torch.Tensor], pieces: list[torch.Tensor], orthogonalize: Orthogonalize
    ) -> list[torch.Tensor]:
        # by bucket, in the order of the stepped tensors (the same on every rank)
        by_bucket: dict[int, tuple[Bucket, list[int]]] = {}
        for n, s in enumerate(stepped):
            b = self.places[id(s)][0]
            by_bucket.setdefault(id(b), (b, []))[1].append(n)
        out: list[torch.Tensor | None] = [None] * len(stepped)
        landing: list[tuple[list[int], Bucket, torch.Tensor, object]] = []  # results still being copied to the host
        for b, members in by_bucket.values():
            comm = self._comm_of(b)
            me = comm.rank
            dtype, device = pieces[members[0]].dtype, pieces[members[0]].device
            # a host step's collectives run on the communicator's device ([Note: the owners' collectives on the
            # device] in zero/owner_staging.py)
            staged = self.staging is not None and device.type == "cpu"
            full = torch.zeros(b.padded_numel, dtype=dtype, device=self.staging.device if staged else device)
            chunk = full.view(b.world, -1)[b.rank]
            written = torch.zeros(chunk.shape, dtype=dtype) if staged else chunk
            for n in members:
                f = b.fragments[self.places[id(stepped[n])][1]]
                written[f.shard_offset : f.shard_offset + f.length].copy_(pieces[n].reshape(-1))
            if staged:
                self.staging.up(chunk, written)
            comm.all_gather(full, chunk, what="Muon updates to their owners")
            result = torch.zeros_like(full)
            for n in members:
                slot = b.slots[self.places[id(stepped[n])][1]]
                if self.owner[id(stepped[n])] == me:
                    whole = full[slot.offset : slot.offset + slot.numel].view(slot.shape)
                    if self.blocks is not None:
                        whole = self.blocks.orthogonalize(id(stepped[n]), whole, orthogonalize)
                    else:
                        whole = orthogonalize(whole)
                    result[slot.offset : slot.offset + slot.numel].copy_(whole.reshape(-1))
            mine = torch.empty_like(chunk)
            comm.reduce_scatter(mine, result, Reduce.SUM, what="orthogonalized Muon updates from their owners")
            event = None
            if staged:  # waited for after every bucket's collectives are queued: the buckets' work overlaps
                mine, event = self.staging.down(mine)
            landing.append((members, b, mine, event))
        for members, b, mine, event in landing:
            if event is not None:
                self.staging.wait(event)
            for n in members:
                f = b.fragments[self.places[id(stepped[n])][1]]
                out[n] = mine[f.shard_offset : f.shard_offset + f.length]
        return out  # type: ignore[return-value]
