"""The one gather service of ZeRO stage 3: every host-side gather and release of a unit goes through
:class:`UnitGathers`.

[Note: one gather service]
Every gather of a unit goes through one :class:`UnitGathers`: the eager runtime's hooks (forward, backward, a
parameter used outside its unit) and ``engine.gathered(...)`` (behind ``full_state_dict``, ``save_16bit_model``,
DeepSpeed's ``GatheredParameters`` and the graph runtime's ``gathered``). It owns a unit's state (``SHARDED`` /
``GATHERING`` / ``GATHERED``), its in-flight collectives, the unit-order check ([Note: unit order check] in
:mod:`shardtrain.runtime.eager`) and the gather's two collaborators (hpZ's secondary shards; the offload's swap
files, read before the all-gather sends from them), and is the only code that issues a unit's all-gather or frees its
full buffer. Interface: ``gather(unit, why)`` (optionally asynchronous, see ``wait``), ``release(unit)``,
``release_all()`` and ``gathered(units)`` (on exit releases only what was sharded before). The eager runtime decides
*when*, this object *how*. Graph mode's gathers are operations in the captured graph over the same units; what a
graph leaves gathered is released here. Not a unit's, so not here: zero.Init's construction-time gathers (no unit
runtime exists yet) and the after-step all-gathers of stages 1-2 (:mod:`shardtrain.zero.step_gather`: buckets).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Protocol

import torch
import torch.distributed as dist

from shardtrain.distributed.communicator import Communicator, Handle
from shardtrain.distributed.mesh import exchanges_on_host
from shardtrain.errors import RankMismatchError
from shardtrain.zero.departure import OrderAgreement
from shardtrain.zero.float8_gather import drop_precast, set_precast, start_float8_gather
from shardtrain.zero.hpz import SecondaryShards
from shardtrain.zero.units import Unit, UnitState


class ShardSource(Protocol):
    """Where a unit's shards live when not in ordinary memory (parameter offload's swap files,
    :class:`~shardtrain.offload.parameters.ParamOffload`; on a GPU, host memory:
    :class:`~shardtrain.offload.param_uploads.ParamUploads`): told before a unit's all-gather is issued (prefetches
    included, so in gather order) and once it has completed, when the shard may leave memory again; ``issuing``
    wraps each of the unit's all-gathers (on a GPU: issued on the stream that copied the shard in)."""

    def will_need(self, unit: Unit) -> None: ...

    def issuing(self, unit: Unit) -> AbstractContextManager[None]: ...

    def done_with(self, units: Iterable[Unit]) -> None: ...


class UnitGathers:
    """See [Note: one gather service]."""

    def __init__(
        self,
        units: list[Unit],
        comm: Communicator,
        gather_check: bool = False,
        check_group: dist.ProcessGroup | None = None,
        secondary: SecondaryShards | None = None,
        source: ShardSource | None = None,
        expert_comm: Communicator | None = None,
        agreement: OrderAgreement | None = None,
    ) -> None:
        """``comm``: the group the units are sharded over; ``check_group``: the host-side group of ``comm``'s ranks,
        for [Note: unit order check] (None: ``comm``'s own group); ``secondary``: ZeRO++ hpZ's secondary shards,
        which backward gathers read ([Note: secondary shards]); ``source``: the shards' swap files;
        ``expert_comm``: under expert parallelism, the expert-data-parallel group the units' expert buckets are
        sharded over and gathered within ([Note: expert buckets] in :mod:`shardtrain.zero.layout`); ``agreement``:
        how a departure from a trusted order is settled ([Note: departures from a trusted order]), None to check
        every gather of every pass."""
        self.units, self.comm, self.gather_check = units, comm, gather_check
        self.expert_comm = expert_comm
        self.secondary, self.source = secondary, source
        # the unit-order check's exchange: over the host-side group; when that is comm's own group (gloo), with
        # comm, so that its calls stay in engine.comm_stats() (under NCCL they are counted apart)
        same = check_group is None or check_group is comm.group
        self.check_comm = comm if same or not gather_check else Communicator(check_group, comm.timeout_s)
        self.announced: Unit | None = None  # its unit-id exchange was issued ahead (see [Note: unit order check])
        # a pass's gathers without exchanges once the order is trusted (see [Note: unit order check]): None where
        # the check is off, or no peer could depart (a group of one)
        self.agreement = agreement if gather_check else None
        self.pass_kind: str | None = None  # the forward or backward pass running, if any
        self.trusted = False  # this pass issues its gathers without exchanges while it follows the order
        self.sequence: list[int] = []  # the units this pass has gathered, in order
        self.recorded: dict[str, list[int]] = {}  # by pass kind: the last pass's sequence
        self.stable: dict[str, bool] = {}  # by pass kind: the last two passes gathered the same sequence
        self._handled: BaseException | None = None  # the exception being handled when the pass began, if any
        self.backward = False  # the runtime is in backward: gathers read hpZ's secondary shards where fresh
        self.max_gathered = 0  # most units gathered at once (tests read it)

    # -- the unit-order check ---------------------------------------------------------------------------
    def _start_check(self, unit: Unit) -> tuple[torch.Tensor, Handle] | None:
        """Issue the unit-id exchange of [Note: unit order check]: on the host over a host-side group."""
        if not self.gather_check:
            return None
        comm = self.check_comm
        device = "cpu" if comm.size == 1 or exchanges_on_host(comm.backend) else unit.buckets[0].flat_param.device
        mine = torch.tensor([unit.index], dtype=torch.int64, device=device)
        everyone = mine.new_empty(comm.size)
        what = f"unit-order check before gathering {unit.name!r}"
        return everyone, comm.all_gather(everyone, mine, what=what, kind="gather_check", async_op=True)

    def _verify(self, unit: Unit) -> None:
        everyone, handle = unit.check
        unit.check = None
        handle.wait()
        ids = everyone.tolist()  # a CPU tensor over a host-side group: no device sync
        if len(set(ids)) > 1:
            per_rank = ", ".join(f"rank {r}: {self._unit_name(i)}" for r, i in enumerate(ids))
            raise RankMismatchError(
                f"ranks are gathering different ZeRO-3 units at the same point ({unit.why}): {per_rank}. "
                "Every rank must run the same sequence of forward and backward passes (same modules, same "
                "number of calls)."
            )

    def _unit_name(self, index: int) -> str:
        if 0 <= index < len(self.units):
            return repr(self.units[index].name)
        # the exchange met another rank's collective of the same size (desync_check off): its data is not an id
        return f"no unit (received {index}: that rank was in another collective)"

    @property
    def can_announce(self) -> bool:
        """Whether an exchange may be issued ahead now (checks on, in a pass not trusted, none issued ahead and not
        yet honoured)."""
        return self.gather_check and not self.trusted and self.announced is None

    # -- passes and the trusted order -------------------------------------------------------------------
    def begin_pass(self, kind: str, pinned: bool) -> None:
        """A forward or backward pass of ``kind`` starts. ``pinned``: every rank entered it through the engine's
        phase check ([Note: phase agreement] in :mod:`shardtrain.distributed.desync`), so every rank is in this
        pass; then, if the last two passes of ``kind`` gathered the same units in the same order (each gather
        checked, or trusted), this one is trusted to do the same (see [Note: unit order check])."""
        self.pass_kind, self.sequence = kind, []
        self._handled = sys.exc_info()[1]  # what the caller is handling (an except clause): not this pass's error
        self.trusted = pinned and self.agreement is not None and self.stable.get(kind, False)
        if self.agreement is not None:
            self.agreement.begin(kind, self.recorded[kind] if self.trusted else [])

    def end_pass(self) -> None:
        """The pass ends. A trusted pass that gathered fewer units than the order is a departure too (the other
        ranks may be waiting in the order's next gather), unless an exception is unwinding it."""
        kind = self.pass_kind
        if kind is None:
            return
        error = sys.exc_info()[1]
        unwinding = error is not None and error is not self._handled
        if self.trusted and not unwinding and len(self.sequence) < len(self.agreement.expected):
            self.agreement.declare(len(self.sequence), None)
        self.stable[kind] = not unwinding and self.recorded.get(kind) == self.sequence
        self.recorded[kind] = self.sequence
        self.pass_kind, self.trusted, self._handled = None, False, None
        if self.agreement is not None:
            self.agreement.at = None

    def _follow(self, unit: Unit) -> None:
        """In a trusted pass, before ``unit``'s gather: if it is not the order's next, settle the departure with
        the other ranks ([Note: departures from a trusted order]); the pass is then checked gather by gather."""
        k = len(self.sequence)
        expected = self.agreement.expected
        if k < len(expected) and expected[k] == unit.index:
            return
        self.agreement.declare(k, unit.index)  # raises unless every rank departed alike
        self.trusted = False

    def announce(self, unit: Unit, why: str) -> None:
        """Issue ``unit``'s unit-id exchange now, ahead of its gather (see [Note: unit order check])."""
        unit.why = why
        unit.check = self._start_check(unit)
        self.announced = unit

    def _honour_announcement(self, unit: Unit) -> None:
        """Before ``unit``'s gather: an exchange issued ahead for another unit is verified and its gather issued
        first (see [Note: unit order check])."""
        announced, self.announced = self.announced, None
        if announced is None or announced is unit:
            return
        self._verify(announced)
        if announced.state is UnitState.SHARDED:  # released at once: never more units whole than a prefetch holds
            self._issue(announced)
            self.release(announced)

    # -- gather / release --------------------------------------------------------------------------------
    def gather(self, unit: Unit, why: str, async_op: bool = False, high_precision: bool = False) -> None:
        """Make ``unit`` whole (collective over ``comm``); ``async_op``: issue only (:meth:`wait` completes it).
        ``high_precision``: float8 buckets too in their own dtype (a read of the weights, not a matmul's gather:
        [Note: gathering in float8] in ``zero/float8_gather.py``)."""
        if unit.state is UnitState.GATHERING:
            if async_op:
                return
            self.wait(unit)
        if unit.state is UnitState.GATHERED:
            if high_precision and unit.float8_only:
                self._fill_high_precision(unit)
            return
        if self.trusted:
            self._follow(unit)
        if not self.trusted:
            self._honour_announcement(unit)
            if unit.check is None:
                unit.why = why
                unit.check = self._start_check(unit)
            if unit.check is not None:
                # verified before the data is issued: all-gathers of different sizes on different ranks would
                # abort the process inside the backend instead of failing with the units' names
                self._verify(unit)
        self._issue(unit, high_precision)
        if not async_op:
            self.wait(unit)

    def _fill_high_precision(self, unit: Unit) -> None:
        """The float8 buckets of ``unit``, gathered in float8 for its matmuls, gathered again in their own dtype."""
        for b in unit.buckets:
            if b.float8 is not None:
                b.flat_param.untyped_storage().resize_(b.padded_numel * b.flat_param.element_size())
                with torch.autograd._unsafe_preserve_version_counter(b.flat_param):
                    self.comm.all_gather(b.flat_param, b.shard, what=f"parameters of unit {unit.name!r}")
        unit.float8_only = False

    def _issue(self, unit: Unit, high_precision: bool = False) -> None:
        """Issue ``unit``'s all-gather (checked already)."""
        if self.pass_kind is not None:
            self.sequence.append(unit.index)
            if self.agreement is not None:  # how far this rank is, for its wait probe
                self.agreement.at = len(self.sequence)
        if self.source is not None:
            self.source.will_need(unit)
        secondary = self.backward and self.secondary is not None and self.secondary.usable(unit)
        unit.float8_only = False
        for i, b in enumerate(unit.buckets):
            if b.float8 is not None and not high_precision:  # [Note: gathering in float8]
                unit.pending.append(start_float8_gather(b, self.comm, async_op=True))
                unit.float8_only = True
                continue
            b.flat_param.untyped_storage().resize_(b.padded_numel * b.flat_param.element_size())
            comm = self.expert_comm if b.expert and self.expert_comm is not None else self.comm
            issuing = self.source.issuing(unit) if self.source is not None else nullcontext()
            with torch.autograd._unsafe_preserve_version_counter(b.flat_param), issuing:
                unit.pending.append(
                    self.secondary.all_gather(unit, i)
                    if secondary
                    else comm.all_gather(b.flat_param, b.shard, what=f"parameters of unit {unit.name!r}", async_op=True)
                )
        unit.state = UnitState.GATHERING
        unit.gathers += 1
        self.max_gathered = max(self.max_gathered, sum(u.state is not UnitState.SHARDED for u in self.units))

    def wait(self, unit: Unit) -> None:
        """Complete ``unit``'s gather in flight."""
        for h in unit.pending:
            h.wait()
        unit.pending.clear()
        unit.state = UnitState.GATHERED
        if unit.float8_only:
            for b in unit.buckets:
                if b.float8 is not None:
                    set_precast(b)
        if self.source is not None:
            self.source.done_with([unit])

    def release(self, unit: Unit, keep_secondary: bool = False) -> None:
        """Free ``unit``'s full buffer; ``keep_secondary``: a forward that records gradients releases it (hpZ keeps
        a secondary shard for its backward)."""
        if unit.state is UnitState.GATHERING:
            self.wait(unit)
        if self.secondary is not None and keep_secondary and unit.state is UnitState.GATHERED:
            self.secondary.keep(unit)
        elif self.secondary is not None:
            self.secondary.drop(unit)
        for b in unit.buckets:
            b.flat_param.untyped_storage().resize_(0)
            if b.float8_data is not None:
                b.float8_data.untyped_storage().resize_(0)
                drop_precast(b)
        unit.state = UnitState.SHARDED
        unit.float8_only = False

    def release_all(self, keep: Iterable[Unit] = (), keep_secondary: bool = False) -> None:
        """Release every unit not sharded, but those in ``keep``."""
        kept = {id(u) for u in keep}
        for u in self.units:
            if u.state is not UnitState.SHARDED and id(u) not in kept:
                self.release(u, keep_secondary)

    def drop_secondaries(self) -> None:
        """Forget every hpZ secondary shard (a new forward cuts them again; the end of backward)."""
        if self.secondary is not None:
            self.secondary.drop_all()

    @contextmanager
    def gathered(self, units: list[Unit], why: str = "engine.gathered()") -> Iterator[None]:
        """Gather ``units`` (collective: every rank must enter) and release on exit those that were sharded."""
        was = {u.index: u.state for u in units}
        for u in units:
            self.gather(u, why, high_precision=True)
        try:
            yield
        finally:
            for u in units:
                if was[u.index] is UnitState.SHARDED:
                    self.release(u)
