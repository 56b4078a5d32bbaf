"""Step 2 of the save protocol, computed identically on every rank from the gathered piece descriptors: which rank
stores each piece (replicas once, by the lowest rank holding them), the safetensors keys, and, once the files are
written, the tensor entries with their checksums (replicas must agree)."""

from __future__ import annotations

from collections import defaultdict

from shardtrain.checkpoint.format import Piece, Slice, TensorEntry, check_coverage
from shardtrain.errors import CheckpointError


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def plan_pieces(
    gathered: list[list[tuple]], aliases: dict[str, str]
) -> tuple[dict[str, tuple], dict[tuple, list[int]]]:
    """Step 2 on every rank: per tensor (shape, dtype, aliases); per distinct (name, slice) the ranks holding it,
    lowest (the one that stores it) first. Raises when ranks disagree or the pieces do not cover a tensor."""
    shapes: dict[str, tuple[tuple[int, ...], str, int]] = {}
    holders: dict[tuple[str, Slice], list[int]] = defaultdict(list)
    for rank, descs in enumerate(gathered):
        for name, shape, dtype, slc in descs:
            if name in shapes and shapes[name][:2] != (shape, dtype):
                first = shapes[name]
                raise CheckpointError(
                    f"tensor {name!r}: rank {first[2]} saves it as {first[1]} {list(first[0])}, rank {rank} as "
                    f"{dtype} {list(shape)}; every rank must agree on a tensor's global shape and dtype"
                )
            shapes.setdefault(name, (shape, dtype, rank))
            holders[(name, slc)].append(rank)
    by_name: dict[str, list[Slice]] = defaultdict(list)
    for name, slc in holders:
        by_name[name].append(slc)
    for name, slices in by_name.items():
        check_coverage(name, shapes[name][0], slices)
    alias_of: dict[str, list[str]] = defaultdict(list)
    for alias, target in aliases.items():
        if target not in shapes:
            raise CheckpointError(f"alias {alias!r} names tensor {target!r}, which no rank saves")
        if alias in shapes:
            raise CheckpointError(f"alias {alias!r} is also saved as a tensor of its own; save it once")
        alias_of[target].append(alias)
    tensors = {name: (shape, dtype, tuple(alias_of.get(name, ()))) for name, (shape, dtype, _) in shapes.items()}
    return tensors, dict(holders)


def piece_keys(holders: dict[tuple, list[int]]) -> dict[tuple, str]:
    """The safetensors key of each stored piece: the name, with ``@k`` for further pieces of it in the same file."""
    used: dict[tuple[int, str], int] = defaultdict(int)
    keys = {}
    for name, slc in holders:
        owner = holders[(name, slc)][0]
        n = used[(owner, name)]
        used[(owner, name)] += 1
        keys[(name, slc)] = name if n == 0 else f"{name}@{n}"
    return keys


def tensor_entries(
    tensors: dict[str, tuple], holders: dict[tuple, list[int]], keys: dict[tuple, str], sums: list[dict[tuple, str]]
) -> dict[str, TensorEntry]:
    """After step 3 on every rank: the tensor entries; replicas held by several ranks must have equal checksums."""
    pieces: dict[str, list[Piece]] = defaultdict(list)
    for (name, slc), ranks in holders.items():
        values = {r: sums[r][(name, slc)] for r in ranks}
        if len(set(values.values())) > 1:
            raise CheckpointError(
                f"tensor {name!r}: ranks {ranks} hold the same part ({slc}) with different values "
                f"({values}); replicated state has diverged"
            )
        pieces[name].append(Piece(rank_file(ranks[0]), keys[(name, slc)], slc, values[ranks[0]]))
    return {
        name: TensorEntry(name, shape, dtype, tuple(pieces[name]), aliases)
        for name, (shape, dtype, aliases) in tensors.items()
    }
