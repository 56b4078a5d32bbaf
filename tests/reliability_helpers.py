"""Shared pieces of the reliability tests: killing a rank at a chosen point, and what every survivor must show."""

from __future__ import annotations

import os
import re
import signal

from shardtrain.checkpoint.durable import KILL_ENV
from shardtrain.testing import RankOutcome

SURVIVOR_LIMIT_S = 30.0
"""Every survivor must have exited this long after the killed rank at most (the default collective timeout is
1800 s; measured: well under a second)."""


def die(*args, **kwargs) -> None:
    """Used as a hook or in place of a method: the process is killed as the OOM killer would."""
    os.kill(os.getpid(), signal.SIGKILL)


def arm(engine, point: str) -> None:
    """Make this rank kill itself at ``point`` of its next training step or save: ``forward`` (entering the second
    block), ``backward`` (the second block's backward, after the first reductions launched), ``step`` (the torch
    optimizer's step, between gradient reduction and the parameter all-gather) or a save crash point
    (:data:`shardtrain.checkpoint.durable.CRASH_POINTS`)."""
    if point == "forward":
        engine.module.blocks[1].register_forward_pre_hook(die)
    elif point == "backward":
        engine.module.blocks[1].register_full_backward_pre_hook(die)
    elif point == "step":
        engine.optimizer.step = die
    else:
        os.environ[KILL_ENV] = point


def last_error(outcome: RankOutcome) -> str:
    """The final line of a rank's traceback: ``module.Class: message``."""
    assert outcome.error is not None, f"rank {outcome.rank} raised nothing (returned {outcome.value!r})"
    return outcome.error.strip().splitlines()[-1]


def check_rank_death(outcomes: list[RankOutcome], victim: int, tp: int = 1) -> dict[int, tuple[float, str]]:
    """The killed rank died of SIGKILL; no process was left for the harness to kill; every survivor raised a
    PeerLostError naming the killed rank, without the word timeout, and exited on its own within
    :data:`SURVIVOR_LIMIT_S` of it. Returns {survivor: (seconds after the killed rank, message)}.

    On a (dp, tp) mesh (``tp`` > 1, world > tp) a survivor that shares neither its tensor-parallel nor its
    data-parallel group with the killed rank may fail in a collective of its own groups when a peer there leaves
    (rather than in a world collective such as the desync check); its survey covers the group of the failing
    collective only, so it then names that peer ("rank(s) [1] failed in the same way", or "rank 0 (...) is gone" when
    that peer hosted the rendezvous store and has exited already) and not the killed rank: see docs/reliability.md
    (limits)."""
    dead = outcomes[victim]
    assert dead.exitcode == -signal.SIGKILL, f"rank {victim} was to be killed: {dead}"
    assert not [o.rank for o in outcomes if o.killed_by_harness], "processes left behind"
    out = {}
    for o in outcomes:
        if o.rank == victim:
            continue
        line = last_error(o)
        assert line.startswith("shardtrain.errors.PeerLostError: "), line
        message = line.removeprefix("shardtrain.errors.PeerLostError: ")
        assert message.startswith(f"rank {o.rank}: "), message
        if victim == 0:  # rank 0 hosts the rendezvous store of run_ranks: its loss is what the others see
            named = "store no longer answers" in message and "gone: rank 0, which hosts it" in message
        else:
            # "rank 1 (pid 42 on h) is gone: killed ...", or with the others gone by then (the store's host exited
            # first, see [Note: naming the rank that vanished]) "rank 0 (...), rank 1 (...) are gone: killed ..."
            named = f"rank {victim} (pid " in message and re.search(r"\) (is|are) gone: killed", message)
        isolated = tp > 1 and o.rank // tp != victim // tp and o.rank % tp != victim % tp  # no group with the victim
        if isolated and not named:  # it failed in a collective of its own groups (not the world's desync check)
            peer = r"rank\(s\) \[[\d, ]+\] failed in the same way|\) (is|are) gone: killed"  # the peer that left
            assert re.search(peer, message), message
        else:
            assert named, message
        assert "timeout" not in message.lower() and "timed out" not in message.lower(), message
        assert " in Engine." in message, message  # where this rank was
        seconds = o.exited_after - dead.exited_after
        assert seconds < SURVIVOR_LIMIT_S, (o.rank, seconds)
        out[o.rank] = (seconds, message)
    return out
