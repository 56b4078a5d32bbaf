"""Phase agreement: before an engine call's first collective, every rank says where it is in training.

[Note: phase agreement]
A rank that runs an extra micro-step, skips ``step()`` or calls ``full_state_dict()`` alone issues other collectives
than its peers: gloo then times out, pairs equal sizes into a silently wrong sum, or aborts. ZeRO-3's unit-order
check ([Note: unit order check]) covers gathers only. So every engine call that communicates (``forward`` at ZeRO-3
or with TP, ``backward`` on every micro-step, ``step`` at a boundary unless stage 0 without TP, ``gathered``,
``(load_)full_state_dict``, ``save/load_checkpoint``) starts with one synchronous world all-gather of a fixed-size
descriptor (marker, call, global step, micro-step, detail). As every such call starts with it, the first collective
of two diverging ranks is always this check, same size on the same group: it completes and every rank raises the
same :class:`~shardtrain.errors.RankMismatchError` naming each rank's call.

The micro-step count is needed because an extra micro-step or a skipped non-boundary ``step()`` issues the same calls,
shifted. ``backward`` is checked on every micro-step (even where it does not communicate) to catch an extra
micro-batch before it enters the update; an extra full micro-step only shows when ranks stop training
(``save_checkpoint``, ``full_state_dict``). Its own Communicator (``engine.world_comm``) keeps it out of
``engine.comm_stats()``. It runs on the host-side world group ([Note: the engine's groups] in
:mod:`shardtrain.distributed.mesh`): an NCCL exchange would copy back from the GPU, waiting for all queued kernels.
Cost: 1-3 host all-gathers of ``5 * 8 * world`` bytes per micro-step, each a wait for the slowest rank (measured in
docs/reliability.md, "Ranks out of step"); ``desync_check: false`` removes it. Not caught: a peer that calls nothing
(the lone check times out, or raises ``PeerLostError`` if it exited); ``engine.module(x)`` (unit-order check only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardtrain.distributed.communicator import Communicator
from shardtrain.distributed.mesh import exchanges_on_host
from shardtrain.errors import RankMismatchError

CALLS = (
    "forward",
    "backward",
    "step",
    "gathered",
    "full_state_dict",
    "load_full_state_dict",
    "save_checkpoint",
    "load_checkpoint",
    "train_batch",
    "eval_batch",
)
"""The engine calls that are checked; a call's index is its code in the descriptor."""
TRAINING_CALLS = frozenset({"forward", "backward", "step", "train_batch"})
_MARKER = 0x53_48_44_53_59_4E_43  # "SHDSYNC": a descriptor, not another collective's payload
_FIELDS = 5  # marker, call, global step, micro-step, detail (graph-mode ZeRO-3: the input schema's fingerprint)


@dataclass(frozen=True)
class Phase:
    """Where one rank is: the engine call it is entering, ``engine.global_step`` and ``engine.micro_steps``."""

    call: str
    global_step: int
    micro_step: int
    detail: int = 0

    def __str__(self) -> str:
        return f"{self.call}() at global step {self.global_step}, micro step {self.micro_step}"


class PhaseCheck:
    """The check of [Note: phase agreement] over ``comm`` (the whole world; a host-side group, see the note);
    ``comm=None`` disables it."""

    def __init__(self, comm: Communicator | None, tp: int, device: torch.device, sp: int = 1, cp: int = 1) -> None:
        self.comm = comm if comm is not None and comm.size > 1 else None
        self.tp, self.sp, self.cp = tp, sp, cp
        # the descriptor's device: the CPU over a host-side group; a device group (NCCL) needs it on the device
        on_host = self.comm is None or exchanges_on_host(self.comm.backend)
        self.device = torch.device("cpu") if on_host else device

    def __call__(
        self, call: str, global_step: int, micro_step: int, detail: int = 0, explain: Callable[[], str] | None = None
    ) -> None:
        """``detail``: a further fact every rank must agree on (a fingerprint below 2**63); when the ranks agree on
        the rest but not on it, ``explain()`` (collective: every rank calls it) says how they differ."""
        if self.comm is None:
            return
        phase = Phase(call, global_step, micro_step, detail)
        mine = torch.tensor(
            [_MARKER, CALLS.index(call), global_step, micro_step, detail], dtype=torch.int64, device=self.device
        )
        everyone = mine.new_empty(self.comm.size * _FIELDS)
        self.comm.all_gather(everyone, mine, what=f"this rank's position ({phase})", kind="desync_check")
        rows = everyone.view(self.comm.size, _FIELDS).tolist()  # a CPU tensor over a host-side group: no device sync
        if all(row == rows[0] for row in rows):
            return
        if explain is not None and all(row[:4] == rows[0][:4] for row in rows):
            raise RankMismatchError(explain())
        raise RankMismatchError(self.message([_decode(row) for row in rows]))

    def name(self, rank: int) -> str:
        """The rank and its mesh coordinates (rank = ((dp_rank * cp + cp_rank) * sp + sp_rank) * tp + tp_rank,
        shardtrain.distributed.mesh)."""
        if self.tp == 1 and self.sp == 1 and self.cp == 1:
            return f"rank {rank}"
        block, tp_rank = divmod(rank, self.tp)
        block, sp_rank = divmod(block, self.sp)
        dp_rank, cp_rank = divmod(block, self.cp)
        axes = [f"dp {dp_rank}"] + [f"cp {cp_rank}"] * (self.cp > 1) + [f"sp {sp_rank}"] * (self.sp > 1)
        axes += [f"tp {tp_rank}"] * (self.tp > 1)
        return f"rank {rank} ({', '.join(axes)})"

    def names(self, ranks: list[int]) -> str:
        return ", ".join(self.name(r) for r in ranks)

    def message(self, phases: list[Phase | None]) -> str:
        """The same text on every rank: each group of ranks and where it is, then what the pattern suggests."""
        groups: dict[Phase | None, list[int]] = {}
        for r, p in enumerate(phases):
            groups.setdefault(p, []).append(r)
        where = "; ".join(
            f"{self.names(rs)} in {p}"
            if p is not None
            else f"{self.names(rs)} in another collective (not a desync check: a call the check does not cover)"
            for p, rs in groups.items()
        )
        hints = self._hints({p: rs for p, rs in groups.items() if p is not None})
        return (
            f"ranks are at different points of training (desync): {where}. {''.join(h + ' ' for h in hints)}Every rank "
            "must make "
            "the same engine calls in the same order: forward, backward and step for each micro-batch, and "
            "full_state_dict(), save_checkpoint(), load_checkpoint() on every rank (see [Note: phase agreement]; "
            "desync_check: false turns this check off)."
        )

    def _hints(self, groups: dict[Phase, list[int]]) -> list[str]:
        hints: list[str] = []
        calls = {p.call for p in groups}
        for call in sorted(calls - TRAINING_CALLS, key=CALLS.index):
            callers = sorted(r for p, rs in groups.items() if p.call == call for r in rs)
            others = sorted(r for p, rs in groups.items() if p.call != call for r in rs)
            hints.append(f"{call}() is collective: {self.names(callers)} called it and {self.names(others)} did not.")
        steps = [p for p in groups if p.call == "step"]
        for p in groups:
            if p.call in ("forward", "backward") and any(s.micro_step == p.micro_step for s in steps):
                hints.append(
                    f"{self.names(groups[p])} called {p.call}() where the others step(): a skipped step() after "
                    "the previous backward()?"
                )
        training = sorted(r for p, rs in groups.items() if p.call in TRAINING_CALLS for r in rs)
        if training and len(training) < sum(len(rs) for rs in groups.values()):
            hints.append(
                f"{self.names(training)} {'is' if len(training) == 1 else 'are'} still training: more micro-steps "
                "there than on the others (an extra micro-step?), or the others called the collective early."
            )
        micro = {p.micro_step for p in groups}
        if len(micro) > 1:
            lo, hi = min(micro), max(micro)
            ahead = sorted(r for p, rs in groups.items() if p.micro_step == hi for r in rs)
            behind = sorted(r for p, rs in groups.items() if p.micro_step == lo for r in rs)
            n = hi - lo
            hints.append(
                f"{self.names(ahead)} took {n} micro-step{'s' if n > 1 else ''} more than {self.names(behind)}: an "
                f"extra micro-step on {'those' if len(ahead) > 1 else 'that'} rank{'s' if len(ahead) > 1 else ''}, "
                "or a skipped step() on the others."
            )
        return hints


def _decode(row: list[int]) -> Phase | None:
    marker, code, global_step, micro_step, detail = row
    if marker != _MARKER or not 0 <= code < len(CALLS):
        return None
    return Phase(CALLS[code], global_step, micro_step, detail)
