"""The collectives a fake run issues, recorded for the time model (:mod:`.timing`).

The shape-only communicators of the fake run (tensor parallelism's ``ShapeOnlyComm``, Ulysses' ``ShapeOnlyGroup``,
the experts' balanced exchange) move nothing; while :func:`recording` is active each also notes what the engine's
:class:`~shardtrain.distributed.communicator.Communicator` would have counted for the same call: its kind, the axis
of its group, the group's size and the bytes in the bus-bandwidth convention (``communicator.py``'s module
docstring: all-reduce ``2 S (N-1)/N``, all-gather and all-to-all ``S (N-1)/N``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Collective:
    """One collective of a fake run, as the communicator would count it."""

    kind: str
    """``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all`` or ``p2p``."""
    axis: str
    """The mesh axis of its group: ``tp``, ``sp``, ``ep`` (``zero``, ``replicate``, ``pp``, ``cp`` come from the
    planner's arithmetic, not from the fake run)."""
    size: int
    nbytes: int
    """Bus-bandwidth convention bytes (what one rank sends with a ring algorithm)."""
    backward: bool = False


_RECORDS: list[list[Collective]] = []
_PHASE = {"backward": False}


@contextmanager
def recording() -> Iterator[list[Collective]]:
    """Collect the collectives the fake run issues while active (nested recordings each see every call)."""
    calls: list[Collective] = []
    _RECORDS.append(calls)
    try:
        yield calls
    finally:
        _RECORDS.remove(calls)


def set_backward(backward: bool) -> None:
    """Mark the collectives recorded from now on as backward's (the time model overlaps phases differently)."""
    _PHASE["backward"] = backward


def note(kind: str, axis: str, size: int, full_bytes: int) -> None:
    """Record one collective over a group of ``size`` ranks whose full (gathered, or reduced) tensor has
    ``full_bytes``; nothing when no recording is active or the group is one rank."""
    if not _RECORDS or size <= 1:
        return
    factor = 2 if kind == "all_reduce" else 1
    call = Collective(kind, axis, size, factor * full_bytes * (size - 1) // size, _PHASE["backward"])
    for calls in _RECORDS:
        calls.append(call)
