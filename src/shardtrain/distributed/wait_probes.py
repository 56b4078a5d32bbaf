"""The wait probes: checks that run while a rank waits for a collective, to end a wait no peer will ever pair.

A probe raises a :class:`~shardtrain.errors.ShardtrainError` naming why no peer will come (ZeRO-3's departure from
a trusted unit order, :mod:`shardtrain.zero.departure`). Two waits run them: a gloo wait that blocks the host, in
slices ([Note: probes while waiting] in :mod:`shardtrain.distributed.communicator`), and the watchdog's probe of a
collective that does not block the host ([Note: failures under NCCL] in :mod:`shardtrain.distributed.watchdog`).
The registry is its own module so that both read it without importing each other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

_wait_probes: list[Callable[[], None]] = []


def add_wait_probe(probe: Callable[[], None]) -> None:
    """Run ``probe`` every :data:`~shardtrain.distributed.communicator.WAIT_PROBE_S` while a collective's wait blocks
    this host (see [Note: probes while waiting] in :mod:`shardtrain.distributed.communicator`); it raises a
    :class:`~shardtrain.errors.ShardtrainError` to end the wait."""
    _wait_probes.append(probe)


def remove_wait_probe(probe: Callable[[], None]) -> None:
    with contextlib.suppress(ValueError):
        _wait_probes.remove(probe)


def registered_wait_probes() -> list[Callable[[], None]]:
    """The probes registered now: the registry itself, which callers iterate over a copy of."""
    return _wait_probes
