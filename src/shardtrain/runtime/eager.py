"""The eager runtime: the module runs op by op; at ZeRO stage 3 module hooks gather, release and prefetch units
around forward and backward (the graph runtime's counterpart is :mod:`shardtrain.graph.runtime`; the interface both
implement is :mod:`shardtrain.runtime.interface`).

[Note: gathering for backward]
Backward needs a unit's parameters exactly when autograd unpacks a tensor saved in forward that aliases the unit's
storage (a saved weight, a view of it). A ``saved_tensors_hooks`` pair marks such tensors in every forward; unpacking
one gathers its unit (recording the backward order, prefetching the next). Keying on saved tensors, not on module
hooks, also covers outputs hooks cannot see (a dataclass, a loss stored on a module), parameters used outside their
unit and units with no root. Inside ``torch.utils.checkpoint`` the checkpoint's hooks are innermost, so a unit forward
and every operation taking a sharded parameter push ours again over them, chaining to the checkpoint's (its count of
saved tensors is unchanged); a forward the checkpoint re-runs in backward gathers its unit as a backward need. Unseen:
inside a checkpoint region, a view of a parameter (``w.t()``) saved by a later operation; it is released with its
unit once the parameter's gradient is in, which is after every use for a trainable parameter.
Release in backward: once every trainable parameter of the unit has its gradient (``on_grad_ready``) and none of its
saved tensors is left to unpack (marks freed with the graph count as unpacked). A unit whose last saved tensor was
just unpacked is released at the next event in another autograd node, since the unpacking node still uses it. What
is still gathered at the end of backward is released then.

[Note: kept after forward]
A forward that records gradients leaves the root unit (its head is backward's first need, its embeddings the last) and
the last unit of the forward order gathered, as FSDP2 does: re-gathering them would move their bytes again for nothing.
Their backward gathers are no-ops; they are released once their gradients are in. After a forward no backward follows,
they stay gathered until the next forward, which releases them first (a step or ``engine.gathered(modifier_rank=...)``
may have changed the shards). Memory: never more whole than forward holds (root, current and prefetched unit). A step
then moves ``3P - (root + last unit)`` parameter bytes times ``(N-1)/N``.

[Note: unit order check]
Before an all-gather the ranks exchange the id of the unit they will gather (8 bytes; ``stage3_gather_check``, on by
default) and compare them *before* issuing the data collective: ranks on different paths then fail naming each rank's
unit instead of mixing buffers, hanging (NCCL) or aborting (gloo). A check that looked back would come too late. The
ids go over the host-side data-parallel group (``Topology.host_dp_group``, gloo; [Note: the engine's groups] in
:mod:`shardtrain.distributed.mesh`), so the check never waits for queued kernels, as an NCCL read-back would.
Waiting at each gather would make it a rendezvous (cost: docs/benchmarks.md, "Figures from the design notes"), so the
exchange for the next prefetch's unit is issued asynchronously with the gather before it, and waited for when its own
gather is issued. It commits every rank on the path: a rank whose next gather is another unit first verifies, issues,
waits for and releases the committed one, then checks its own, so collectives still pair. Gathers that start a pass
and gathers on demand (departures, parameters used outside their unit, ``engine.gathered``) wait for theirs at once.
Once the order is known the exchanges stop (eager ZeRO-3 is host-bound under NCCL, issue 33): a pass the engine
started after its phase check ([Note: phase agreement] in :mod:`shardtrain.distributed.desync`), whose kind's last
two passes gathered the same units in the same order, is *trusted* and gathers without exchanges while each gather is
the order's at that position (:class:`~shardtrain.zero.gather.UnitGathers` compares on the host); every rank is in
the same pass and holds the same order. A rank that departs settles with the others before issuing anything
([Note: departures from a trusted order] in :mod:`shardtrain.zero.departure`). Passes the engine did not start and
gathers outside a pass (``engine.gathered``, ``full_state_dict``) stay checked.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from shardtrain.distributed import failure
from shardtrain.distributed.communicator import Communicator
from shardtrain.distributed.wait_probes import add_wait_probe, remove_wait_probe
from shardtrain.errors import ShardtrainError
from shardtrain.plan.policies import NO_PREFETCH, PrefetchPolicy
from shardtrain.runtime.interface import Call, Runtime
from shardtrain.zero.departure import OrderAgreement
from shardtrain.zero.gather import ShardSource, UnitGathers
from shardtrain.zero.guarded import ShardedParameter, guard, guard_of
from shardtrain.zero.hpz import SecondaryShards
from shardtrain.zero.layout import Bucket, UnitBuckets
from shardtrain.zero.units import Unit, UnitState


class _Saved:
    """A saved tensor aliasing a unit's storage (see [Note: gathering for backward])."""

    __slots__ = ("live", "payload", "unit")

    def __init__(self, unit: Unit, payload: object) -> None:
        self.unit, self.payload, self.live = unit, payload, True
        unit.saved += 1

    def done(self) -> None:
        if self.live:
            self.live = False
            self.unit.saved -= 1

    def __del__(self) -> None:  # the graph was freed without this tensor being unpacked
        self.done()


class _SavedTensorHooks:
    """The pack/unpack pair of [Note: gathering for backward], chained to the hooks active when pushed."""

    def __init__(self, runtime: EagerRuntime) -> None:
        self.runtime = runtime
        self.outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self.context = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor) -> object:
        packed = self.outer[0](t) if self.outer is not None else t
        # a float8 weight gathered in float8 is torchao's wrapper around a view of its unit's 1-byte buffer
        inner = getattr(t, "_data", None)
        try:
            key = (inner if isinstance(inner, torch.Tensor) else t).untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):  # a tensor without a plain storage cannot alias a unit
            return packed
        unit = self.runtime.unit_of_storage.get(key)
        return packed if unit is None else _Saved(unit, packed)

    def unpack(self, packed: object) -> torch.Tensor:
        if isinstance(packed, _Saved):
            self.runtime.on_unpack(packed)
            packed = packed.payload
        return self.outer[1](packed) if self.outer is not None else packed


class EagerRuntime(Runtime):
    """The module run op by op; at stage 3 the [Note: unit lifecycle] of its units, run by module hooks (none are
    installed below stage 3, where ``units`` is empty)."""

    mode = "eager"

    def __init__(
        self,
        root: nn.Module,
        units: list[UnitBuckets],
        comm: Communicator,
        prefetch: PrefetchPolicy = NO_PREFETCH,
        gather_check: bool = False,
        check_group: dist.ProcessGroup | None = None,
        secondary: SecondaryShards | None = None,
        source: ShardSource | None = None,
        expert_comm: Communicator | None = None,
        phase_checked: bool = False,
        module_hooks: bool = True,
    ) -> None:
        """``check_group``: the host-side group of ``comm``'s ranks, for [Note: unit order check] (None: ``comm``'s
        own group); ``phase_checked``: the engine's phase check runs before every forward and backward it makes
        ([Note: phase agreement]), so that passes the engine runs may be trusted to follow the order;
        ``secondary``: ZeRO++ hpZ's secondary shards ([Note: secondary shards]); ``source``: where the shards are
        read from before a gather (parameter offload); ``expert_comm``: the group expert buckets are gathered within
        ([Note: expert buckets] in :mod:`shardtrain.zero.layout`). All but ``phase_checked`` go to the gather
        service. ``module_hooks=False``: no forward hooks; the caller gathers the units around what runs them
        (pipeline parallelism, [Note: a stage gathered for its schedule] in
        :mod:`shardtrain.pipeline_parallel.schedule`)."""
        self.root, self.comm = root, comm
        self.prefetch, self.gather_check = prefetch, gather_check
        self._units: list[Unit] = []
        self._unit_of_bucket: dict[int, Unit] = {}
        self.unit_of_storage: dict[int, Unit] = {}  # the full buffers' storages (stable across resizes)
        for index, (name, module, buckets) in enumerate(units):
            unit = Unit(index, name, module, buckets, runtime=self)
            self._units.append(unit)
            for b in buckets:  # shards were cut by the engine while planning (one unit at a time)
                self._unit_of_bucket[b.index] = unit
                for s in b.slots:
                    guard(s.param, s.name, unit)
            unit.state = UnitState.SHARDED
        self.index_storages()
        # a departure from a trusted order is settled through the store ([Note: departures from a trusted order])
        self._agreement = None
        peers = [c for c in (comm, expert_comm) if c is not None and c.size > 1]
        if gather_check and phase_checked and self._units and peers:
            self._agreement = OrderAgreement(peers, [u.name for u in self._units], comm.timeout_s)
            add_wait_probe(self._agreement.probe)
        self._pinned = False  # the next root forward is the engine's (after its phase check)
        # every gather and release of a unit, its state and the unit-order check ([Note: one gather service])
        self.gathers = UnitGathers(
            self._units, comm, gather_check, check_group, secondary, source, expert_comm, self._agreement
        )
        self._forward_depth = 0  # unit or root forwards running (parameters may be gathered on demand)
        self._pushed: list[_SavedTensorHooks | None] = []  # per running forward hook, what it pushed
        self._fwd_order: list[int] | None = None  # recorded on the first forward (see [Note: unit lifecycle])
        self._bwd_order: list[int] | None = None
        self._fwd_now: list[int] = []
        self._bwd_now: list[int] = []
        self._order_ok = True
        self._warned = False
        self._bwd_gathered: list[Unit] = []  # units gathered for this backward, in the order they were needed
        self.forwards_with_grad = 0  # root forwards that recorded gradients since the last backward (graph runtime)
        by_module: dict[int, list[Unit]] = {}
        for u in self.units:
            by_module.setdefault(id(u.module), []).append(u)
        self._hooks = []
        if not self.units or not module_hooks:  # below stage 3: the module runs as it is
            return
        for u in self.units:
            if u.module is root:
                continue
            self._hooks.append(u.module.register_forward_pre_hook(partial(self._pre_forward, u)))
            self._hooks.append(u.module.register_forward_hook(partial(self._post_forward, u), always_call=True))
        root_units = by_module.get(id(root), [])
        self._hooks.append(root.register_forward_pre_hook(partial(self._root_pre_forward, root_units)))
        self._hooks.append(root.register_forward_hook(partial(self._root_post_forward, root_units), always_call=True))

    @property
    def units(self) -> list[Unit]:
        return self._units

    def forward(self, call: Call) -> Any:
        self._pinned = True  # the engine's forward: its phase check ran on every rank
        try:
            return self.root(*call.args, **call.kwargs)
        finally:
            self._pinned = False

    @property
    def hook_ids(self) -> frozenset[int]:
        """The ids of the module hooks this runtime installed."""
        return frozenset(h.id for h in self._hooks)

    def index_storages(self) -> None:
        """Map each unit's full-buffer storage to the unit; again whenever buffers are re-created (a cast to the
        compute dtype makes new ones)."""
        self.unit_of_storage = {b.flat_param.untyped_storage()._cdata: u for u in self.units for b in u.buckets}
        self.unit_of_storage |= {
            b.float8_data.untyped_storage()._cdata: u
            for u in self.units
            for b in u.buckets
            if b.float8_data is not None
        }

    # -- gather / release: the gather service ([Note: one gather service] in zero/gather.py) ---------------
    @property
    def _in_backward(self) -> bool:
        return self.gathers.backward

    @_in_backward.setter
    def _in_backward(self, value: bool) -> None:
        self.gathers.backward = value

    @property
    def hpz(self) -> SecondaryShards | None:
        """ZeRO++ hpZ's secondary shards, which backward gathers read ([Note: secondary shards]); None without."""
        return self.gathers.secondary

    @property
    def max_gathered(self) -> int:
        """The most units gathered at once (tests read it)."""
        return self.gathers.max_gathered

    def touch(self, p: ShardedParameter) -> None:
        """A sharded parameter's data is being used: gather on demand in forward or backward, else refuse."""
        g = guard_of(p)
        unit = g.unit
        if unit.state is UnitState.GATHERING:
            self.gathers.wait(unit)
            return
        if self._in_backward:  # a forward re-run by an activation checkpoint that bypasses module hooks
            self._need_in_backward(unit, f"parameter {g.name!r} used in backward")
            return
        if self._forward_depth > 0:  # a parameter used outside its unit
            self.gathers.gather(unit, f"parameter {g.name!r} used outside its unit", high_precision=True)
            return
        raise ShardtrainError(
            f"parameter {g.name!r} is partitioned by ZeRO stage 3 and not gathered here. Read it inside "
            "`with engine.gathered(module_or_params):` (pass modifier_rank=r to change it), or use "
            "engine.full_state_dict()."
        )

    # -- prefetch and order ----------------------------------------------------------------------------
    def _record(self, now: list[int], recorded: list[int] | None, index: int) -> bool:
        """Append to the order of this pass; False (and a warning, once) if it departs from the recording."""
        now.append(index)
        if recorded is None or not self._order_ok:
            return recorded is not None and self._order_ok
        k = len(now) - 1
        if k >= len(recorded) or recorded[k] != index:
            self._order_ok = False
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"ZeRO-3 unit order differs from the first step's at position {k} (unit "
                    f"{self.units[index].name!r}); training stays correct, prefetch is skipped for such passes",
                    stacklevel=4,
                )
            return False
        return True

    def _prefetch(self, recorded: list[int], position: int, why: str) -> None:
        """Start gathering the next unit of the recorded order, as :class:`PrefetchPolicy` decides."""
        current = recorded[position] if position >= 0 else None
        for k in range(position + 1, len(recorded)):
            unit = self.units[recorded[k]]
            if unit.state is UnitState.SHARDED and self.prefetch.ahead(unit.numel):
                self.gathers.gather(unit, why, async_op=True)
                unit.prefetches += 1
                self._announce(recorded, k, why)
            if recorded[k] != current:  # the next distinct unit decides; do not look further
                return

    def _announce(self, recorded: list[int], position: int, why: str) -> None:
        """Issue the unit-id exchange of the gather the next prefetch will issue (that after ``recorded[position]``),
        one unit ahead of it (see [Note: unit order check])."""
        if not self.gathers.can_announce:
            return
        for index in recorded[position + 1 :]:
            if index != recorded[position]:
                unit = self.units[index]
                if unit.state is UnitState.SHARDED and self.prefetch.ahead(unit.numel) and unit.check is None:
                    self.gathers.announce(unit, f"{why}, checked one unit ahead")
                return

    # -- forward hooks ---------------------------------------------------------------------------------
    def hooks_for_op(self) -> _SavedTensorHooks | None:
        """Saved-tensor hooks to push around one operation, or None where ours are already innermost, no
        gradient is recorded, or a non-reentrant checkpoint re-runs a forward in backward (its tensors go to the
        checkpoint's holders, which our hooks marked in the first forward; a reentrant checkpoint has no hooks
        active and builds a new graph, which is marked)."""
        if not torch.is_grad_enabled():
            return None
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None:
            return _SavedTensorHooks(self)
        if self._in_backward or isinstance(getattr(top[0], "__self__", None), _SavedTensorHooks):
            return None
        return _SavedTensorHooks(self)

    def _push_saved_hooks(self) -> None:
        """Mark saved tensors of this forward, unless our hooks are already the innermost ones."""
        hooks = self.hooks_for_op()
        if hooks is not None:
            hooks.context.__enter__()
        self._pushed.append(hooks)

    def _pop_saved_hooks(self) -> None:
        hooks = self._pushed.pop()
        if hooks is not None:
            hooks.context.__exit__(None, None, None)

    # Every hook returns at once while TorchDynamo traces the module: the graph runtime gathers inside the graph and
    # keeps these hooks for direct calls of the module (see [Note: one runtime, two implementations]); traced, the
    # test is a constant and the hook leaves nothing in the graph.
    def _root_pre_forward(self, root_units: list[Unit], module, args) -> None:
        if torch.compiler.is_compiling():
            return
        self._forward_depth += 1
        self._push_saved_hooks()
        if self._in_backward:  # re-run by an activation checkpoint of the whole model
            for u in root_units:
                self._need_in_backward(u, "root forward re-run in backward")
            return
        self._fwd_now, self._order_ok = [], True
        pinned, self._pinned = self._pinned, False  # a nested call of the root is not the engine's
        self.gathers.begin_pass("forward" if torch.is_grad_enabled() else "forward without gradients", pinned)
        self.forwards_with_grad += torch.is_grad_enabled()
        # kept by a forward that no backward followed: the shards may have changed since
        self.gathers.release_all()
        self.gathers.drop_secondaries()  # this forward cuts them again
        for u in root_units:
            self.gathers.gather(u, "root forward")
        if self._fwd_order and self.prefetch.enabled:
            self._prefetch(self._fwd_order, -1, "forward prefetch")

    def _root_post_forward(self, root_units: list[Unit], module, args, output):
        if torch.compiler.is_compiling():
            return output
        self._forward_depth -= 1
        self._pop_saved_hooks()
        if self._in_backward:
            return output
        self.gathers.end_pass()
        if self._fwd_order is None:
            self._fwd_order = list(self._fwd_now)
        keep = self._kept_for_backward(root_units)
        # on-demand and any prefetched-but-unused unit; the root unless kept
        self.gathers.release_all(keep, keep_secondary=torch.is_grad_enabled())
        return output

    def _kept_for_backward(self, root_units: list[Unit]) -> list[Unit]:
        """The units a forward leaves gathered for the backward that follows (see [Note: kept after forward])."""
        if not torch.is_grad_enabled() or not self._order_ok or not self._fwd_order:
            return []
        return [*root_units, self.units[self._fwd_order[-1]]]

    def _pre_forward(self, unit: Unit, module, args) -> None:
        if torch.compiler.is_compiling():
            return
        self._forward_depth += 1
        self._push_saved_hooks()
        if self._in_backward:  # re-run by an activation checkpoint: its backward follows at once
            # the gather is ours, not the block's: a selective checkpoint's dispatch mode, which replays the block's
            # own operations only, must not see it (its forward ran before the checkpoint's hooks)
            with _disable_current_modes():
                self._need_in_backward(unit, "forward re-run in backward (activation checkpointing)")
            return
        in_order = self._record(self._fwd_now, self._fwd_order, unit.index)
        self.gathers.gather(unit, "forward")
        if in_order and self.prefetch.enabled:
            self._prefetch(self._fwd_order, len(self._fwd_now) - 1, "forward prefetch")

    def _post_forward(self, unit: Unit, module, args, output):
        if torch.compiler.is_compiling():
            return output
        self._forward_depth -= 1
        self._pop_saved_hooks()
        if self._in_backward:  # in backward the unit stays until its gradients are in
            return output
        last = self._fwd_order is not None and len(self._fwd_now) == len(self._fwd_order)
        if not (last and self._order_ok and torch.is_grad_enabled() and unit.index == self._fwd_order[-1]):
            # else kept (see [Note: kept after forward])
            self.gathers.release(unit, keep_secondary=torch.is_grad_enabled())
        return output

    # -- backward --------------------------------------------------------------------------------------
    def _need_in_backward(self, unit: Unit, why: str) -> None:
        if not unit.needed_in_backward:
            unit.needed_in_backward = True
            self._bwd_gathered.append(unit)
            # recorded whether it is sharded or already being prefetched: the order is what is checked
            in_order = self._record(self._bwd_now, self._bwd_order, unit.index)
            self.gathers.gather(unit, why)
            if in_order and self.prefetch.enabled:
                self._prefetch(self._bwd_order, len(self._bwd_now) - 1, "backward prefetch")
        else:
            self.gathers.gather(unit, why)

    def on_unpack(self, saved: _Saved) -> None:
        """Autograd is about to use a tensor aliasing ``saved.unit``'s storage (see [Note: gathering for
        backward])."""
        unit = saved.unit
        saved.done()
        node = torch._C._current_autograd_node()
        unit.last_unpack = node
        if self._in_backward:
            self._release_finished(node)
            self._need_in_backward(unit, "backward")
        else:  # autograd.grad or backward outside engine.backward(): gather, released by the next forward
            self.gathers.gather(unit, "backward outside engine.backward()")

    def on_grad_ready(self, bucket: Bucket) -> None:
        """A trainable parameter of ``bucket`` has its gradient (called by the gradient reducer)."""
        unit = self._unit_of_bucket.get(bucket.index)
        if unit is not None:
            unit.grads_pending -= 1
        self._release_finished(None)

    def _release_finished(self, node: object) -> None:
        """Release units whose backward is over: gradients in, nothing saved left, not in use by ``node``."""
        for u in self._bwd_gathered:
            if (
                u.state is not UnitState.SHARDED
                and u.grads_pending <= 0
                and u.saved <= 0
                and (u.last_unpack is None or u.last_unpack is not node)
            ):
                self.gathers.release(u)

    def begin_backward(self) -> None:
        if not self.units:
            return
        self._in_backward = True
        self.gathers.begin_pass("backward", pinned=True)  # only the engine's backward calls it, after its check
        self._bwd_now, self._order_ok = [], True
        self._bwd_gathered = []
        for u in self.units:
            u.grads_pending = u.trainable
            u.needed_in_backward = False
            u.last_unpack = None

    def backward_returned(self) -> None:
        if self.units:  # a trusted pass that ended short settles it before the reducer's leftover reductions
            self.gathers.end_pass()

    def end_backward(self) -> None:
        if self.units:  # ends the pass unless backward_returned did (backward raised)
            self.gathers.end_pass()
        self._in_backward = False
        self.forwards_with_grad = 0
        if self._bwd_order is None:
            self._bwd_order = list(self._bwd_now)
        for u in self.units:
            u.last_unpack = None
        self.gathers.release_all()
        self.gathers.drop_secondaries()  # units whose saved tensors this backward never reached

    # -- access outside forward ------------------------------------------------------------------------
    def units_of(self, params: list[nn.Parameter]) -> list[Unit]:
        wanted = {id(guard_of(p).unit) for p in params if isinstance(p, ShardedParameter)}
        return [u for u in self.units if id(u) in wanted]

    @contextmanager
    def gathered(self, params: list[nn.Parameter]) -> Iterator[list[Unit]]:
        """The units of ``params``, gathered through the gather service (collective: every rank must enter)."""
        units = self.units_of(params)
        with self.gathers.gathered(units):
            yield units

    def release(self) -> None:
        self.gathers.release_all()

    def close(self) -> None:
        # an exchange issued ahead (see [Note: unit order check]) may still be in flight: its group's worker thread
        # must not hold it when the groups are destroyed (see [Note: what the engine starts and who joins it])
        for u in self.units:
            if u.check is not None and not failure.any_failed():
                u.check[1].wait()
            u.check = None
        self.gathers.announced = None
        if self._agreement is not None:
            remove_wait_probe(self._agreement.probe)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
