"""The only module that calls ``torch.distributed`` collectives.

Every collective goes through a :class:`Communicator`, which

* counts calls and bytes per collective kind (``engine.comm_stats()`` reads them; tests assert them);
* turns a failure into an error that names this rank, what it was waiting for and where it was called from, instead
  of a bare gloo/NCCL traceback: :class:`PeerLostError` naming the rank whose process is gone (see [Note: naming the
  rank that vanished] in :mod:`shardtrain.distributed.failure`), :class:`CollectiveTimeoutError` only when the
  collective really waited for the configured timeout, :class:`CollectiveError` otherwise.

Bytes are counted with the bus-bandwidth convention of nccl-tests, i.e. what one rank sends over the
wire for a ring algorithm, with ``S`` the size of the full (unsharded) tensor and ``N`` the group size:

================  ====================
all_reduce        ``2 * S * (N-1)/N``
all_gather        ``S * (N-1)/N``
reduce_scatter    ``S * (N-1)/N``
broadcast         ``S`` (0 when N == 1)
================  ====================

With this convention one ZeRO-3 step moves ``3 * P * (N-1)/N`` bytes and a DDP step ``2 * P * (N-1)/N``,
the figures the ZeRO paper uses. Counts are exact integers when ``S`` divides by ``N`` (ZeRO buffers are
padded so that it does); otherwise they are rounded down.

Beside ``bytes`` (the convention above, the same whatever the backend does), ``stats()`` reports ``sent``: the
bytes the collective really puts on the wire, per rank (the group's total divided by ``N``; for the symmetric
algorithms used here each rank sends that much). See [Note: bytes on the wire].

[Note: bytes on the wire]
On gloo ``reduce_scatter_tensor`` moves an all-reduce's bytes, twice the convention's (a ZeRO-3 step would move 4P, not
3P; measured in docs/benchmarks.md, issue 15, and ``tests/distributed/test_comm_ring.py``). So on gloo the
reduce-scatter is ours (``reduce_scatter_impl == "pairwise"``, which ``"auto"`` picks for gloo; NCCL keeps its own):
each rank ``isend``s chunk ``j`` to rank ``j`` and ``irecv``s its own from its ``N-1`` peers, all posted at once so
transfers run on gloo's threads while the caller computes; ``wait()`` sums the ``N`` chunks in rank order,
deterministic. A ring would need a reduction per dependent round (a thread per handle). ``sent``: the pairwise bytes,
gloo's loopback factor, NCCL's convention (unmeasured).

[Note: a group of one]
A group of one rank has nothing to exchange: its collectives are copies (or nothing) and are counted with 0 bytes.
With ``SHARDTRAIN_FORCE_COLLECTIVES=1`` they are issued to the backend all the same, asynchronously where the caller
asks, waited for through the same :class:`Handle`: a one-GPU machine then runs NCCL's streams, the waits and the
buffer frees that follow them, which a world-1 run otherwise never reaches (``bench/gpu_validate.py``'s ``:nccl``
variants). The results are the same; the steps are slower by the backend's launches.
"""

from __future__ import annotations

import datetime
import os
import pickle
import time
import weakref
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
import torch.distributed as dist

from shardtrain.distributed import failure, watchdog
from shardtrain.distributed.wait_probes import registered_wait_probes
from shardtrain.errors import CollectiveError, CollectiveTimeoutError, PeerLostError, ShardtrainError
from shardtrain.tree import iter_tensors

# torch 2.13 renamed the flat-tensor collectives; keep working on the older names too.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

FORCE_ENV = "SHARDTRAIN_FORCE_COLLECTIVES"
"""Set to ``1``: a group of one issues its collectives too (see [Note: a group of one])."""


class Reduce(StrEnum):
    """The reduction of a reducing collective: the one vocabulary every caller of the communicator uses. Its values
    are the names torch's functional collectives take (``_c10d_functional.all_reduce(t, "sum", group)``)."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"


_OPS = {Reduce.SUM: dist.ReduceOp.SUM, Reduce.AVG: dist.ReduceOp.AVG, Reduce.MAX: dist.ReduceOp.MAX}


def _reduction(op: Reduce | str) -> Reduce:
    try:
        return Reduce(op)
    except ValueError:
        raise ValueError(f"unknown reduction {op!r}: one of {', '.join(r.value for r in Reduce)}") from None


@dataclass
class CollectiveCount:
    calls: int = 0
    bytes: int = 0  # the bus-bandwidth convention (module docstring)
    sent: int = 0  # what this rank put on the wire (see [Note: bytes on the wire])
    wait_s: float = 0.0  # time this process was blocked in the collectives (synchronous ones: all of it)


class Handle:
    """An in-flight collective; ``wait()`` re-raises failures with the rank and what was awaited."""

    def __init__(
        self,
        comm: Communicator,
        work: Any,
        kind: str,
        what: str,
        started: float | None = None,
        watched: watchdog.Pending | None = None,
    ) -> None:
        """``watched``: the watchdog's entry for ``work``, told when the wait has returned (it then lets the
        ``Work`` go, see [Note: failures under NCCL] in :mod:`shardtrain.distributed.watchdog`)."""
        self._comm, self._work, self.kind, self.what = comm, work, kind, what
        self.started = time.monotonic() if started is None else started
        self._watched = watched

    def wait(self) -> None:
        if self._work is None:
            return
        t0 = time.perf_counter()
        try:
            self._wait_work()
        except ShardtrainError as err:  # a wait probe named why no peer will come ([Note: probes while waiting])
            self._comm.break_group(err)  # its collective stays in flight, unpaired: nothing more on the group
            raise
        except RuntimeError as err:
            raise self._comm.describe_failure(self.kind, self.what, err, started=self.started) from err
        finally:
            self._work = None
            self._comm._counts[self.kind].wait_s += time.perf_counter() - t0
        if self._watched is not None:  # the collective is waited for: the watchdog lets its Work go
            self._comm._watchdog.waited(self._watched)
            self._watched = None

    def _wait_work(self) -> None:
        if registered_wait_probes() and self._comm.backend == "gloo":  # see [Note: probes while waiting]
            _wait_probing(self._work)
        else:
            self._work.wait()


_broken_groups: dict[int, tuple[weakref.ref, ShardtrainError]] = {}
"""Process groups with a collective in flight that no peer will pair, and why (see :meth:`Communicator.break_group`):
by ``id``, with a weak reference that tells the group from a later one given the same ``id``."""

WAIT_PROBE_S = 0.5
"""How long a wait that blocks the host runs before the wait probes look, and then between their looks (the probes:
:mod:`shardtrain.distributed.wait_probes`)."""


# [Note: probes while waiting]
# On gloo a wait() blocks the host until every peer joins or the group's timeout fires, so a peer alive but never
# coming (a rank that departed from ZeRO-3's trusted unit order, [Note: unit order check] in
# shardtrain.runtime.eager) would cost the whole collective timeout. So while a probe is registered, a wait on a
# host-blocking backend waits in slices of WAIT_PROBE_S (gloo's timed ``Work.wait`` raises and leaves the collective
# in flight and the group usable) and runs the probes (a few store reads) between slices; a wait done within the
# first slice costs a plain wait. A probe that raises ends the wait and marks the group failed ([Note: no collective
# after a failure]): its collective is still in flight. Point-to-point waits (the pairwise reduce-scatter) are not
# sliced: gloo aborts the process when a timed wait on a receive expires.
def _wait_probing(work: Any) -> None:
    step = datetime.timedelta(seconds=WAIT_PROBE_S)
    while True:
        try:
            work.wait(step)
            return
        except RuntimeError:
            if work.is_completed():  # completed as the slice ended, or failed: wait() returns or raises its error
                work.wait()
                return
        for probe in list(registered_wait_probes()):
            probe()


# backends whose reduce-scatter takes ReduceOp.AVG (gloo's does not; NCCL's has since NCCL 2.10)
_AVG_BACKENDS = frozenset({"nccl"})


def graph_reduce_op(backend: str) -> Reduce:
    """The reduce op of a graph's backend reduce-scatter on ``backend`` (see [Note: collectives in graphs]):
    ``AVG`` where the backend averages on the wire, else ``SUM`` (the caller divides by the group size)."""
    return Reduce.AVG if backend in _AVG_BACKENDS else Reduce.SUM


class _PairwiseHandle(Handle):
    """The pairwise reduce-scatter of [Note: bytes on the wire]: waits for every transfer, then adds the ``N``
    chunks in rank order into ``out``."""

    def __init__(self, comm: Communicator, works: list, parts: list[torch.Tensor], out: torch.Tensor, op: Reduce,
                 what: str, started: float) -> None:  # fmt: skip
        super().__init__(comm, works, "reduce_scatter", what, started)
        self._parts, self._out, self._op = parts, out, op

    def _wait_work(self) -> None:
        for w in self._work:
            w.wait()
        parts, out = self._parts, self._out
        self._parts = []
        torch.add(parts[0], parts[1], out=out)
        for part in parts[2:]:
            out.add_(part)
        if self._op == Reduce.AVG:
            out.div_(len(parts))


class _PointToPointHandle(Handle):
    """A ring step's send and receive, waited without slices ([Note: probes while waiting]: gloo aborts the process
    when a timed wait on a receive expires)."""

    def _wait_work(self) -> None:
        for w in self._work:
            w.wait()


def _backend_timeout_s(group: dist.ProcessGroup) -> float | None:
    """The timeout ``group``'s CUDA backend was created with (NCCL's watchdog fires at it), when it says."""
    try:
        return group._get_backend(torch.device("cuda")).options._timeout.total_seconds()
    except Exception:
        return None


def merge_stats(*stats: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Several communicators' :meth:`Communicator.stats` added up per collective kind (what one rank sent over all
    of their groups; hybrid sharding's groups, for instance)."""
    total: dict[str, dict[str, int]] = {}
    for one in stats:
        for kind, counts in one.items():
            into = total.setdefault(kind, {"calls": 0, "bytes": 0, "sent": 0})
            for k, v in counts.items():
                into[k] += v
    return dict(sorted(total.items()))


_collectors: list[list[Communicator]] = []
"""The lists :func:`collecting` fills, innermost last."""


@contextmanager
def collecting() -> Iterator[list[Communicator]]:
    """Every :class:`Communicator` built inside the block, in a list: what an engine releases at ``close()`` (see
    [Note: what the engine starts and who joins it] in :mod:`shardtrain.engine.shutdown`)."""
    made: list[Communicator] = []
    _collectors.append(made)
    try:
        yield made
    finally:
        _collectors.remove(made)


class Communicator:
    """Collectives over one process group, counted and guarded."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float, reduce_scatter_impl: str = "auto") -> None:
        self._group: dist.ProcessGroup | None = group
        if _collectors:
            _collectors[-1].append(self)
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.global_rank = dist.get_rank()
        self.timeout_s = timeout_s
        # a group of one skips its collectives, unless FORCE_ENV asks to issue them (see [Note: a group of one])
        self.alone = self.size == 1 and os.environ.get(FORCE_ENV, "") != "1"
        self.backend = dist.get_backend(group) if not self.alone else ""
        if reduce_scatter_impl == "auto":  # see [Note: bytes on the wire]
            reduce_scatter_impl = "pairwise" if self.backend == "gloo" else "backend"
        if reduce_scatter_impl not in ("pairwise", "backend"):
            raise ValueError(
                f"reduce_scatter_impl must be 'auto', 'pairwise' or 'backend', got {reduce_scatter_impl!r}"
            )
        self.reduce_scatter_impl = reduce_scatter_impl
        self._ranks = dist.get_process_group_ranks(group) if not self.alone else [self.global_rank]
        self._tag = 0  # send/recv tag of the next pairwise reduce-scatter: calls in flight never match each other
        # the first failure of a collective on this group; none is issued after it (see [Note: no collective after
        # a failure])
        self.failure: CollectiveError | None = None
        self._counts: dict[str, CollectiveCount] = defaultdict(CollectiveCount)
        # so that a failing peer can tell whether this process is gone, and this one whether a peer is
        self._peers_unread = 3 if self.size > 1 else 0  # reads of the peers' entries left to try
        if self.size > 1:
            failure.register(self.global_rank, timeout_s)
        # a backend whose wait() does not block the host: a thread names its failures (see [Note: failures under
        # NCCL] in shardtrain.distributed.watchdog)
        self._watchdog = watchdog.watchdog() if not self.alone and not watchdog.blocks_host(self.backend) else None
        # when the watchdog calls a collective timed out: the configured timeout, or earlier when the group's own
        # (NCCL's watchdog, a group the user created) would fire first
        self.watch_timeout_s = timeout_s
        if self._watchdog is not None:
            backend_s = _backend_timeout_s(group)
            if backend_s is not None:
                early = max(backend_s - watchdog.backend_margin_s(backend_s) / 2, 0.5 * backend_s)
                self.watch_timeout_s = min(timeout_s, early)

    # -- accounting -------------------------------------------------------------------------------
    def stats(self) -> dict[str, dict[str, int]]:
        """Per collective kind: ``calls``, ``bytes`` (the bus-bandwidth convention) and ``sent`` (bytes this rank
        put on the wire, see [Note: bytes on the wire])."""
        return {
            k: {"calls": v.calls, "bytes": v.bytes, "sent": v.sent} for k, v in sorted(self._counts.items()) if v.calls
        }

    def wait_seconds(self) -> dict[str, float]:
        """Per collective kind, seconds this process spent blocked waiting for it since the last reset: all of a
        synchronous collective, the part of an asynchronous one that computation did not hide."""
        return {k: v.wait_s for k, v in sorted(self._counts.items()) if v.wait_s}

    def reset_stats(self) -> None:
        for c in self._counts.values():
            c.calls, c.bytes, c.sent = 0, 0, 0

    def reset_wait_seconds(self) -> None:
        for c in self._counts.values():
            c.wait_s = 0.0

    @property
    def group(self) -> dist.ProcessGroup:
        """The process group; gone after :meth:`release`."""
        if self._group is None:
            raise ShardtrainError(
                "this communicator's process group was released by engine.close(): a closed engine issues no "
                "collective (build a new engine with shardtrain.initialize)"
            )
        return self._group

    def release(self) -> None:
        """Drop the reference to the process group, so that a destroyed group is freed (and its gloo worker
        threads joined) now rather than at interpreter teardown; any later collective raises. Local, not
        collective; see [Note: what the engine starts and who joins it] in :mod:`shardtrain.engine.shutdown`."""
        self._group = None

    def break_group(self, err: ShardtrainError) -> None:
        """A collective of this group stays in flight that no peer will pair: a wait that a probe ended ([Note:
        probes while waiting]), or the gather that the peers of a ZeRO-3 rank departing from a trusted unit order
        issued ([Note: departures from a trusted order] in :mod:`shardtrain.zero.departure`). This Communicator and
        every other one of the same process group (under gloo the phase check's is often the data-parallel one's)
        refuse any further collective ([Note: no collective after a failure]): gloo pairs collectives by their
        order on the group, so the next one would meet that unpaired one, and abort the process when the sizes
        differ."""
        if self.failure is None:
            self.failure = err
        if self._group is not None and self.broken_by() is None:
            _broken_groups[id(self._group)] = (weakref.ref(self._group), err)

    def broken_by(self) -> ShardtrainError | None:
        """Why this process group has a collective in flight that no peer will pair (see :meth:`break_group`),
        None if it has none."""
        ref, err = _broken_groups.get(id(self._group), (None, None))
        return err if ref is not None and ref() is self._group else None

    def _gather_traffic(self, out_bytes: int) -> tuple[int, int]:
        """(bytes, sent) of an all-gather whose result has ``out_bytes``: the ring's, on every backend."""
        n = self.size
        nbytes = out_bytes * (n - 1) // n
        return nbytes, nbytes

    def _reduce_scatter_traffic(self, in_bytes: int, pairwise: bool) -> tuple[int, int]:
        """(bytes, sent) of a reduce-scatter of ``in_bytes``: gloo's own moves an all-reduce's bytes (see [Note:
        bytes on the wire]), the pairwise exchange and NCCL the convention's."""
        n = self.size
        nbytes = in_bytes * (n - 1) // n
        return nbytes, nbytes if pairwise or self.backend != "gloo" else 2 * nbytes

    def _count(self, kind: str, nbytes: int, sent: int | None = None) -> None:
        c = self._counts[kind]
        c.calls += 1
        c.bytes += nbytes
        c.sent += nbytes if sent is None else sent

    def describe_failure(
        self, kind: str, what: str, err: BaseException, *, started: float | None = None, frame: Any = None
    ) -> CollectiveError:
        """The error for a failed collective (``started``: when it was launched, ``time.monotonic()``).

        Asks which of the other ranks are gone (see [Note: naming the rank that vanished]): a
        :class:`PeerLostError` names them; a :class:`CollectiveTimeoutError` is returned only when the collective
        waited for the configured timeout; any other failure is a :class:`CollectiveError`. ``frame``: where to read
        the call that was waiting from (the watchdog passes the main thread's; default this thread's)."""
        elapsed = time.monotonic() - started if started is not None else None
        timed_out = elapsed is not None and elapsed >= failure.TIMEOUT_FRACTION * self.timeout_s
        ranks = dist.get_process_group_ranks(self.group) if self.size > 1 else [self.global_rank]
        peers = [r for r in ranks if r != self.global_rank]
        survey = failure.survey(self.global_rank, peers)
        lost, others = failure.explain(survey)
        lost = lost or (not timed_out and failure.peer_lost_text(err) and not survey.alive)
        took = f" after {elapsed:.2f} s" if elapsed is not None else ""
        head = f"failed{took}"
        cls: type[CollectiveError] = PeerLostError if lost else CollectiveError
        if timed_out:
            head = f"timed out{took} (collective timeout {self.timeout_s:g}s)"
            cls = CollectiveTimeoutError
        if not others:
            others = (
                f"a peer of rank {self.global_rank} in this group is gone or took a different code path; check the "
                "other ranks' output"
            )
        call = failure.api_call(frame)
        where = f", in {call}" if call else ""
        error = cls(
            f"rank {self.global_rank}: {kind} of {what} {head}{where}: {others}. Group of {self.size} "
            f"(global ranks {ranks}). {dist.get_backend(self.group)}: {failure.backend_text(err)}"
        )
        if self.failure is None:
            self.failure = error
        return error

    # [Note: no collective after a failure]
    # Once a collective on this group failed here, this rank's sequence of collectives on it no longer matches the
    # survivors' (they may have failed one earlier or later). Gloo pairs operations by tag alone, so a new collective
    # can meet a different one of a peer; with other sizes gloo's transport thread aborts the process (SIGABRT,
    # "collective mismatch") instead of raising the error that names the lost rank (seen at ZeRO-2, world 3:
    # docs/reliability.md, "A rank dies"). Nothing can complete on such a group anyway, so every later collective
    # raises at once, of the first failure's class and with its text; in-flight ones still fail through their wait.
    def _refuse_after_failure(self, kind: str, what: str) -> None:
        failed = self.failure
        if failed is None and self._group is not None:  # another Communicator of this process group broke it
            failed = self.broken_by()
        if failed is None:
            return
        me = f"rank {self.global_rank}: "
        first = str(failed).removeprefix(me)
        raise type(failed)(
            f"{me}{kind} of {what} not issued, since an earlier collective of this group failed (see [Note: no "
            f"collective after a failure] in shardtrain.distributed.communicator): {first}"
        )

    def _completed(self) -> None:
        """After a synchronous collective: every peer has registered; read their entries (a few tries at most)."""
        if self._peers_unread:
            peers = [r for r in dist.get_process_group_ranks(self.group) if r != self.global_rank]
            self._peers_unread = 0 if failure.remember(peers) else self._peers_unread - 1

    @property
    def ranks(self) -> list[int]:
        """The global ranks of this group, in the order of their ranks in it."""
        return list(self._ranks)

    def peers(self) -> list[int]:
        """The other ranks of this group (global ranks)."""
        return [r for r in self._ranks if r != self.global_rank]

    def _run(self, kind: str, what: str, fn, async_op: bool) -> Handle | None:
        self._refuse_after_failure(kind, what)
        started = time.monotonic()
        watched = None  # the watchdog's entry of an asynchronous collective, for its Handle's wait
        try:
            work = fn(async_op)
        except RuntimeError as err:
            raise self.describe_failure(kind, what, err, started=started) from err
        if self._watchdog is not None:
            # an asynchronous collective's Work, or for a synchronous one (issued as the backend issues it, on the
            # current stream) an event recorded after it on that stream
            target = work if work is not None else watchdog.stream_marker()
            if target is not None:
                entry = self._watchdog.track(target, self, kind, what, started)
                if work is not None:
                    watched = entry
        handle = Handle(self, work, kind, what, started, watched)
        if async_op:
            return handle
        handle.wait()
        self._completed()
        return None

    # -- collectives ------------------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, op: Reduce = Reduce.SUM, *, what: str, async_op: bool = False):
        n = self.size
        self._count("all_reduce", 2 * t.numel() * t.element_size() * (n - 1) // n)  # ring: sent as counted
        if self.alone:
            return Handle(self, None, "all_reduce", what) if async_op else None
        return self._run(
            "all_reduce",
            what,
            lambda a: dist.all_reduce(t, op=_OPS[_reduction(op)], group=self.group, async_op=a),
            async_op,
        )

    def reduce_scatter(
        self, out: torch.Tensor, inp: torch.Tensor, op: Reduce = Reduce.SUM, *, what: str, async_op: bool = False
    ):
        """``inp`` holds ``size`` equal chunks; chunk ``rank`` of the reduction lands in ``out``.

        ``inp`` must not change until the collective completes (it is sent from in place)."""
        pairwise = self.size > 1 and self.reduce_scatter_impl == "pairwise"  # one rank: the backend's own
        self._count("reduce_scatter", *self._reduce_scatter_traffic(inp.numel() * inp.element_size(), pairwise))
        if self.alone:
            out.copy_(inp)
            return Handle(self, None, "reduce_scatter", what) if async_op else None
        if pairwise:
            return self._reduce_scatter_pairwise(out, inp, _reduction(op), what, async_op)
        return self._run(
            "reduce_scatter",
            what,
            lambda a: _reduce_scatter_flat(out, inp, op=_OPS[_reduction(op)], group=self.group, async_op=a),
            async_op,
        )

    def _reduce_scatter_pairwise(self, out: torch.Tensor, inp: torch.Tensor, op: Reduce, what: str, async_op: bool):
        """See [Note: bytes on the wire]."""
        if op not in (Reduce.SUM, Reduce.AVG):
            raise ValueError(f"pairwise reduce-scatter supports op 'sum' or 'avg', got {op.value!r}")
        self._refuse_after_failure("reduce_scatter", what)
        n, me = self.size, self.rank
        chunks = inp.view(n, -1)  # [N, S/N]: chunk j goes to rank j
        received = inp.new_empty((n - 1, chunks.shape[1]))
        tag, self._tag = self._tag, (self._tag + 1) % (1 << 30)
        parts: list[torch.Tensor] = [chunks[me]] * n  # by source rank; own chunk in place
        started = time.monotonic()
        works = []
        try:
            for k in range(1, n):
                to, frm = (me + k) % n, (me - k) % n
                parts[frm] = received[k - 1]
                works.append(dist.irecv(received[k - 1], src=self._ranks[frm], group=self.group, tag=tag))
                works.append(dist.isend(chunks[to], dst=self._ranks[to], group=self.group, tag=tag))
        except RuntimeError as err:
            raise self.describe_failure("reduce_scatter", what, err, started=started) from err
        handle = _PairwiseHandle(self, works, parts, out, op, what, started)
        if async_op:
            return handle
        handle.wait()
        self._completed()
        return None

    def all_gather(
        self, out: torch.Tensor, inp: torch.Tensor, *, what: str, async_op: bool = False, kind: str = "all_gather"
    ):
        """Concatenate every rank's ``inp`` into ``out``; ``inp`` may be this rank's chunk of ``out``.

        ``kind`` is the name the bytes are counted under (e.g. ``gather_check`` for ZeRO-3's unit-id check,
        so that parameter traffic stays comparable with the formulas)."""
        self._count(kind, *self._gather_traffic(out.numel() * out.element_size()))
        if self.alone:
            if out.data_ptr() != inp.data_ptr():
                out.copy_(inp)
            return Handle(self, None, kind, what) if async_op else None
        return self._run(
            kind,
            what,
            lambda a: _all_gather_flat(out, inp, group=self.group, async_op=a),
            async_op,
        )

    def all_gather_dim(self, inp: torch.Tensor, dim: int, *, what: str) -> torch.Tensor:
        """Every rank's ``inp`` concatenated along ``dim``, in rank order (a new tensor).

        ``inp`` must have the same shape on every rank. Counted as one ``all_gather`` of the result (the
        tensor-parallel "gather from the region" is this call with ``dim=-1``)."""
        dim = dim % inp.dim()
        stacked = torch.empty((self.size, *inp.shape), dtype=inp.dtype, device=inp.device)  # [N, *inp.shape]
        self.all_gather(stacked.view(-1), inp.contiguous().view(-1), what=what)
        return torch.cat(stacked.unbind(0), dim=dim)  # [..., N * inp.shape[dim], ...]

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, *, what: str) -> None:
        """Chunk ``j`` of ``inp`` (dim 0, ``size`` equal chunks) goes to rank ``j``; chunk ``i`` of ``out`` comes from
        rank ``i``. Counted as ``S * (N-1)/N`` with ``S`` the bytes of ``inp`` (what each rank sends to its peers)."""
        n = self.size
        self._count("all_to_all", inp.numel() * inp.element_size() * (n - 1) // n)
        if self.alone:
            out.copy_(inp)
            return
        self._run("all_to_all", what, lambda a: dist.all_to_all_single(out, inp, group=self.group, async_op=a), False)

    def all_to_all_v(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], *, what: str
    ) -> None:
        """Rows ``in_splits[j]`` of ``inp`` (dim 0, in rank order) go to rank ``j``; ``out`` receives ``out_splits[i]``
        rows from rank ``i``, in rank order. Every rank's ``in_splits[j]`` must be rank ``j``'s ``out_splits`` entry
        for it (exchange the counts first). Counted as the bytes this rank sends to its peers."""
        row = inp[0].numel() * inp.element_size() if inp.shape[0] else 0
        sent = (sum(in_splits) - in_splits[self.rank]) * row
        self._count("all_to_all", sent)
        if self.alone:
            out.copy_(inp)
            return
        self._run(
            "all_to_all",
            what,
            lambda a: dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group, async_op=a),
            False,
        )

    def ring_step(self, out: torch.Tensor, inp: torch.Tensor, *, what: str, async_op: bool = False) -> Handle | None:
        """One step of a ring: ``inp`` goes to the next rank of the group (``rank + 1``), ``out`` is filled from the
        previous one (``rank - 1``). Counted as the bytes of ``inp`` (what this rank sends), so ``size - 1`` steps
        count an all-gather's ``S * (N-1)/N`` of the whole ``S``. Point-to-point, as the pairwise reduce-scatter.
        ``async_op``: return the in-flight step's handle (``out`` is filled, and ``inp`` free to change, once its
        ``wait()`` returns), so that compute overlaps the transfer."""
        nbytes = inp.numel() * inp.element_size()
        self._count("ring", nbytes)
        if self.alone:
            out.copy_(inp)
            return Handle(self, None, "ring", what) if async_op else None
        self._refuse_after_failure("ring", what)
        n, me = self.size, self.rank
        tag, self._tag = self._tag, (self._tag + 1) % (1 << 30)
        started = time.monotonic()
        try:
            works = [
                dist.irecv(out, src=self._ranks[(me - 1) % n], group=self.group, tag=tag),
                dist.isend(inp, dst=self._ranks[(me + 1) % n], group=self.group, tag=tag),
            ]
        except RuntimeError as err:
            raise self.describe_failure("ring", what, err, started=started) from err
        handle = _PointToPointHandle(self, works, "ring", what, started)
        if async_op:
            return handle
        handle.wait()
        self._completed()
        return None

    def broadcast(self, t: torch.Tensor, src: int = 0, *, what: str) -> None:
        """Broadcast from group rank ``src``."""
        n = self.size
        # sent: the group sends S to each of the N-1 others, on average S * (N-1)/N per rank
        self._count(
            "broadcast", t.numel() * t.element_size() if n > 1 else 0, t.numel() * t.element_size() * (n - 1) // n
        )
        if self.alone:
            return
        global_src = dist.get_global_rank(self.group, src)
        self._run("broadcast", what, lambda a: dist.broadcast(t, src=global_src, group=self.group, async_op=a), False)

    def barrier(self, *, what: str) -> None:
        """Wait until every rank of the group has arrived (counted, no bytes)."""
        self._count("barrier", 0)
        if self.alone:
            return
        self._run("barrier", what, lambda a: dist.barrier(group=self.group, async_op=a), False)

    # -- collectives inside captured graphs ---------------------------------------------------------
    # [Note: collectives in graphs]
    # Graph-mode ZeRO-3 (shardtrain.graph.sharded) traces its gathers and reductions as PyTorch's functional
    # collectives (``_c10d_functional`` ops and ``wait_tensor``), graph nodes that a pass can move. The reduce-scatter
    # keeps the algorithm chosen above: on gloo an all-to-all of the ``N`` chunks and the same rank-order sum as
    # ``_PairwiseHandle`` (bitwise the eager result); elsewhere the backend's, averaging on the wire where it can
    # (NCCL's ``avg``, as eager's ``ReduceOp.AVG``: a sum of fp16 gradients can overflow where their average does
    # not, so sum-then-divide would skip steps eager takes), else summing and dividing (:func:`graph_reduce_op`).
    # They fail with the backend's own error after the process group's timeout.
    #
    # [Note: counting a graph's collectives]
    # A captured graph's collectives bypass the methods above, so they are counted per graph run: at compile
    # :meth:`graph_counts` reads this group's collectives from the graph's nodes (static sizes), and
    # :class:`GraphTraffic` adds them to ``stats()`` each time the forward graph returns and its backward has run (a
    # post-hook on the compiled backward node). Bytes follow the eager formulas; a unit's gather counts as
    # ``all_gather`` and its reduction (all-to-all or reduce-scatter) as one ``reduce_scatter``, so ``comm_stats()``
    # compares across modes. Tensor-parallel collectives in a stage-3 graph ([Note: one graph, no splits] in
    # :mod:`shardtrain.between_graphs`) are counted the same way in that communicator. ``wait_s`` is not measured.
    def graph_all_gather(self, shard: torch.Tensor) -> torch.Tensor:
        """Every rank's ``shard`` concatenated (traceable; see [Note: collectives in graphs])."""
        if self.alone:
            return shard
        full = torch.ops._c10d_functional.all_gather_into_tensor(shard, self.size, self.group.group_name)
        return torch.ops._c10d_functional.wait_tensor(full)

    def graph_all_reduce(self, t: torch.Tensor, op: Reduce = Reduce.SUM) -> torch.Tensor:
        """The reduction of every rank's ``t`` (a new tensor; traceable, see [Note: collectives in graphs])."""
        if self.alone:
            return t
        out = torch.ops._c10d_functional.all_reduce(t.contiguous(), op.value, self.group.group_name)
        return torch.ops._c10d_functional.wait_tensor(out)

    def graph_all_gather_dim(self, inp: torch.Tensor, dim: int) -> torch.Tensor:
        """:meth:`all_gather_dim` traceable (see [Note: collectives in graphs]): every rank's ``inp`` concatenated
        along ``dim`` in rank order."""
        if self.alone:
            return inp
        dim = dim % inp.dim()
        stacked = self.graph_all_gather(inp.contiguous())  # [N * inp.shape[0], ...]: rank r's inp at block r
        return torch.cat(stacked.chunk(self.size, 0), dim=dim)

    def graph_reduce_scatter_avg(
        self, full: torch.Tensor, predivide: float | None = None, divide_first: bool = False
    ) -> torch.Tensor:
        """This rank's chunk of the average of every rank's ``full`` (traceable; see [Note: collectives in
        graphs]). ``predivide`` (``prescale_gradients`` / ``gradient_predivide_factor``, as the eager reducer takes
        it): ``full`` is multiplied by ``1/predivide`` before a summing reduction and the result by
        ``predivide/N``, in the same dtype and order as eager, so that the same fp16 sums stay finite.
        ``divide_first``: ``full`` is divided by ``N`` before the sum, as the eager reducer's low-precision
        reductions are ([Note: low-precision reductions divide first] in ``zero/reducer.py``)."""
        n = self.size
        if self.alone:
            return full
        name = self.group.group_name
        if divide_first:
            full, predivide = full / n, float(n)  # then summed; predivide/N = 1 leaves the sum as it is
        elif predivide is not None and predivide != 1:
            full = full * (1.0 / predivide)  # the reciprocal, as the eager reducer (and DeepSpeed): the same rounding
        if self.reduce_scatter_impl != "pairwise":
            op = graph_reduce_op(self.backend) if predivide is None else Reduce.SUM
            out = torch.ops._c10d_functional.reduce_scatter_tensor(full, op.value, n, name)
            out = torch.ops._c10d_functional.wait_tensor(out)
        else:
            chunk = full.numel() // n
            parts = torch.ops._c10d_functional.all_to_all_single(full, [chunk] * n, [chunk] * n, name)
            parts = torch.ops._c10d_functional.wait_tensor(parts).view(n, chunk)
            out = parts[0] + parts[1]
            for k in range(2, n):
                out = out + parts[k]
            op = Reduce.SUM
        if predivide is not None:
            return out * (predivide / n) if predivide != n else out
        return out if op == Reduce.AVG else out / n

    def graph_counts(self, graph: torch.fx.Graph) -> tuple[tuple[str, int, int], ...]:
        """``(kind, bytes, sent)`` of every collective over this group that ``graph`` issues (see [Note: counting
        a graph's collectives])."""
        counts = []
        for node in graph.nodes:
            target = _GRAPH_COLLECTIVES.get(node.target) if node.op == "call_function" else None
            if target is None or node.args[-1] != self.group.group_name:
                continue
            kind, counted = target
            val = (node if counted == "output" else node.args[0]).meta.get("val")
            nbytes = int(val.numel()) * val.element_size()
            if kind == "all_gather":
                counts.append((kind, *self._gather_traffic(nbytes)))
            elif kind == "all_reduce":  # tensor parallelism's, in one graph at ZeRO stage 3: as all_reduce() counts
                ring = 2 * nbytes * (self.size - 1) // self.size
                counts.append((kind, ring, ring))
            else:  # the all-to-all of the pairwise reduce-scatter, or the backend's reduce-scatter
                counts.append((kind, *self._reduce_scatter_traffic(nbytes, counted == "pairwise")))
        return tuple(counts)

    def count_graph(self, counts: tuple[tuple[str, int, int], ...]) -> None:
        """One run of a graph holding the collectives ``counts`` (from :meth:`graph_counts`)."""
        for kind, nbytes, sent in counts:
            self._count(kind, nbytes, sent)

    def all_gather_object(self, obj: Any, *, what: str) -> list[Any]:
        """Small Python objects from every rank (consistency checks, not tensors)."""
        self._count("all_gather_object", len(pickle.dumps(obj)) if self.size > 1 else 0)
        if self.alone:
            return [obj]
        self._refuse_after_failure("all_gather_object", what)
        out: list[Any] = [None] * self.size
        started = time.monotonic()
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except RuntimeError as err:
            raise self.describe_failure("all_gather_object", what, err, started=started) from err
        self._completed()
        return out


# graph op -> (kind counted, what its bytes are read from: "output" (the gathered buffer), "pairwise" or "input")
_GRAPH_COLLECTIVES = {
    torch.ops._c10d_functional.all_gather_into_tensor.default: ("all_gather", "output"),
    torch.ops._c10d_functional.all_to_all_single.default: ("reduce_scatter", "pairwise"),
    torch.ops._c10d_functional.reduce_scatter_tensor.default: ("reduce_scatter", "input"),
    torch.ops._c10d_functional.all_reduce.default: ("all_reduce", "input"),  # tensor parallelism's (one graph)
}


class GraphTraffic:
    """The collectives of one captured forward graph and its backward, counted in the ``stats()`` of the
    communicator of their group (ZeRO's, and tensor parallelism's at stage 3) each time they run (see [Note:
    counting a graph's collectives])."""

    def __init__(self, *comms: Communicator) -> None:
        self.comms = comms
        self.graphs: dict[str, list[tuple[Communicator, tuple[tuple[str, int, int], ...]]]] = {}  # which -> counts

    def compiled(self, which: str, graph: torch.fx.Graph) -> None:
        """The ``which`` graph ("forward" or "backward") was compiled (again: a re-trace holds the same
        collectives, the last one compiled is the one that runs)."""
        self.graphs[which] = [(comm, comm.graph_counts(graph)) for comm in self.comms]

    def _count(self, which: str) -> None:
        for comm, counts in self.graphs.get(which, ()):
            comm.count_graph(counts)

    def forward_ran(self, outputs: Any) -> None:
        """The forward graph returned ``outputs``: count it, and its backward when autograd runs that."""
        self._count("forward")
        if torch.is_grad_enabled():
            for node in _compiled_backward_nodes(outputs):
                # read when it runs: a backward AOT autograd compiles lazily is compiled during that run
                node.register_hook(lambda *_: self._count("backward"))


def _compiled_backward_nodes(outputs: Any) -> list[Any]:
    """The backward nodes of the compiled functions that produced the tensors in ``outputs`` (nested), reached
    through the views autograd may put after them."""
    found, seen = [], set()
    stack = [t.grad_fn for _, t in iter_tensors(outputs) if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node.name() == "CompiledFunctionBackward":
            found.append(node)
        elif "View" in node.name() or "AsStrided" in node.name() or "Alias" in node.name():
            stack.extend(n for n, _ in node.next_functions)
    return found
