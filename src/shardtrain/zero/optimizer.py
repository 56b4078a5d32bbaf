"""The optimizer step on shards: any ``torch.optim`` optimizer, stepping only this rank's fragments.

[Note: optimizer fragments]
The user's optimizer object is kept (an LR scheduler on it keeps working; param groups keep their hyperparameters); only
the tensors in its param groups are replaced: at stage 0 by nothing, at stages 1-2 by each parameter's *fragment*, a 1-D
view of this rank's chunk of the flat buffer ([Note: bucket layout]). With fp32 parameters the fragment *is* the master,
so the step updates the flat buffer in place and the following all-gather writes the other ranks' chunks beside it.
Optimizer state is thus sharded by construction. Every rank holds a fragment of every parameter (maybe empty), so
param-group indexing is identical on all ranks.

[Note: element-wise optimizers]
Stepping 1-D fragments equals stepping whole tensors only if an element's update depends on its own gradient and
state alone (plus per-tensor scalars such as the step count); global-norm clipping is done before, on all fragments
together. Adafactor, Muon, LBFGS and SparseAdam are not element-wise. So at stages 1-3 :func:`check_optimizer`
accepts the torch classes of :data:`ELEMENTWISE_OPTIMIZERS` and their subclasses that do not override ``step``;
anything else needs ``zero_allow_untested_optimizer: true``, and one known or probed not to be element-wise is refused
whatever that key says ([Note: optimizers that need the whole tensor] in zero/elementwise.py). Stage 0 steps whole
parameters: any optimizer goes, unless tensor parallelism splits them (then the same check).
Rprop is element-wise but not listed: its sign-based step turns rounding noise in gradients that are zero up to
rounding (attention key biases) into full steps, so its parity with one process cannot be tested.

[Note: parameters frozen after initialize]
A parameter frozen after ``initialize`` keeps its bucket slot and optimizer state. As in one process (torch.optim steps
what has a ``.grad``, set by every backward it required grad in, until ``zero_grad``), the step updates it iff it
required grad at some ``engine.backward`` since the last zeroing (:meth:`GradientReducer.has_gradient`): frozen
mid-window it gets its earlier micro-steps' gradients (as FSDP2, DeepSpeed stages 1-2; stage 3 drops it); frozen a whole
window it is not stepped (DeepSpeed's flat partitions decay and step it). ``requires_grad`` is read at each backward and
must be set alike on every rank; which slots got a gradient on this rank is not used (a parameter one rank's batch
missed would be stepped in some fragments only), so an unused trainable one steps with a zero gradient.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from shardtrain.distributed.communicator import Communicator, Reduce
from shardtrain.distributed.placement import TPPlacement
from shardtrain.errors import OptimizerError
from shardtrain.host_read import HostRead
from shardtrain.offload.optimizer_state import WholeBuckets
from shardtrain.optim.adam import DeepSpeedAdam
from shardtrain.optim.lamb import Lamb
from shardtrain.optim.muon import MuonWithAdamW
from shardtrain.plan.policies import ZeroPolicy
from shardtrain.zero import owner_staging
from shardtrain.zero.elementwise import known_not_elementwise, slice_mismatch
from shardtrain.zero.layout import Bucket, fragment_places, fragment_tensor
from shardtrain.zero.muon_owners import MuonOwners, TensorParallelBlocks
from shardtrain.zero.owner_staging import OwnerStaging
from shardtrain.zero.reducer import GradientReducer
from shardtrain.zero.shard_sums import ShardSums
from shardtrain.zero.step_gather import ParameterGathers

if TYPE_CHECKING:
    from shardtrain.offload.optimizer_state import OptimizerOffload
    from shardtrain.offload.zenflow import ZenFlowStep


class MakeZenFlow(Protocol):
    """How :class:`ShardedOptimizer` gets the stall-free step ([Note: the ZenFlow rule] in
    :mod:`shardtrain.offload.zenflow`): called once, after the offload, with what it steps, the global shape of each
    one's parameter and where its fragment starts in that parameter flattened."""

    def __call__(self, stepped: list[torch.Tensor], shapes: list[torch.Size], starts: list[int]) -> ZenFlowStep: ...


class MakeOffload(Protocol):
    """How :class:`ShardedOptimizer` gets its optimizer offload: called once, at the end of its construction, with
    what it steps (:meth:`~ShardedOptimizer.stepped_tensors`, after the optimizer's initial state moved to them) and,
    with separate fp32 masters, the compute-dtype fragment of each (else None). The offload takes over that state
    (into its swap files), so it cannot exist before the wrapper; a factory handed in at construction keeps it from
    being attached afterwards (``engine/parallelize.py`` binds the offload policy and the gradient sinks it built
    before the reducer)."""

    def __call__(
        self,
        stepped: list[torch.Tensor],
        fragments: list[torch.Tensor] | None,
        whole_buckets: WholeBuckets | None = None,
    ) -> OptimizerOffload:
        """``whole_buckets``: the optimizer's step is collective over the shard group, its sub-groups must be whole
        buckets ([Note: sub-groups of whole buckets] in offload/optimizer_state.py)."""


IO_FAILED = float(1 << 20)
"""Added to the order flag of the norm's all-reduce by a rank whose gradient I/O failed: every rank raises."""


class SwappedGradients(Protocol):
    """Gradients that live outside memory until the stepper reads them ([Note: gradient offload]): what the one
    step needs of them ([Note: the one step])."""

    failed: bool
    """This rank's I/O failed since the last step."""

    def deferred(self, stepped: list[bool], zeroed: bool) -> frozenset[int]:
        """The members stepped now (``stepped``) whose gradient is not in memory: read by the stepper. ``zeroed``: no
        backward reached the gradients since they were zeroed."""

    def deferred_norms(self, deferred: frozenset[int], inv_scale: float | None) -> dict[int, torch.Tensor]:
        """The norm of each deferred member's (unscaled) gradient."""

    def raise_failure(self, comm: Communicator) -> None:
        """Some rank's I/O failed: raise on every rank, naming what failed."""


@dataclass(frozen=True)
class TensorParallelNorm:
    """The global gradient norm on a (dp, tp) mesh: split parameters add up across the tensor-parallel group,
    parameters every tp rank holds the same are counted once (tp rank 0's), and across the data-parallel group
    fragments add up (stages 1-3) or only dp rank 0's whole gradients count (stage 0). One all-reduce over
    every rank carries both sums and the reducer's order flag (see [Note: collective order]); a non-finite
    value anywhere (fp16 overflow) therefore reaches every rank.

    Under expert parallelism the expert parameters are held the same by every tp rank (tp rank 0's count) and differ
    along the data-parallel axis: their fragments (stages 1-3, never replicated by hybrid sharding) count on every
    data-parallel rank, their whole gradients (stage 0) on the ranks of the first expert group, ``dp_rank < E``."""

    world: Communicator
    split: frozenset[int]  # ids of the parameters split by tensor parallelism
    dp_rank: int
    tp_rank: int
    replica_rank: int = 0  # hybrid sharding: only the first replica's fragments count (the others are copies)
    expert: frozenset[int] = frozenset()  # ids of the expert parameters (expert parallelism)
    ep: int = 1  # the expert-parallel size E

    def global_square(
        self, keys: list[int], grads: list[torch.Tensor], sharded: bool, reducer: GradientReducer
    ) -> torch.Tensor:
        def square(gs: list[torch.Tensor]) -> torch.Tensor:
            if not gs:
                return torch.zeros((), dtype=torch.float32, device=reducer.device)
            return (torch.linalg.vector_norm(torch.stack(torch._foreach_norm(gs))) ** 2).to(torch.float32)

        split = square([g for k, g in zip(keys, grads) if k in self.split and g.numel()])
        dense = [g for k, g in zip(keys, grads) if k not in self.split and k not in self.expert and g.numel()]
        expert = square([g for k, g in zip(keys, grads) if k in self.expert and g.numel()])
        owner = 1.0 if (sharded and self.replica_rank == 0) or self.dp_rank == 0 else 0.0
        expert_owner = float(sharded or self.dp_rank < self.ep) * float(self.tp_rank == 0)
        flag = torch.full_like(split, float(reducer.order_departed))  # a fill: no copy from the host
        replicated = square(dense) * owner * float(self.tp_rank == 0)
        parts = torch.stack([split * owner, replicated + expert * expert_owner, flag])
        self.world.all_reduce(parts, Reduce.SUM, what="squared gradient norm (data x tensor parallel)")
        if reducer.sharded_grads:
            reducer.settle_order_later(parts[2])
        return parts[0] + parts[1]


class ShardedOptimizer:
    """Steps ``optimizer`` on this rank's fragments; ``initialize`` has already run :func:`check_optimizer`."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        module: nn.Module,
        buckets: list[Bucket],
        reducer: GradientReducer,
        policy: ZeroPolicy,
        comm: Communicator,
        allgather_bucket_numel: int,
        masters: dict[int, torch.Tensor] | None = None,
        tp_norm: TensorParallelNorm | None = None,
        dp_comm: Communicator | None = None,
        replica_rank: int = 0,
        overlap_gathers: bool = True,
        make_offload: MakeOffload | None = None,
        experts: tuple[Communicator, Communicator] | None = None,
        stage_comm: Communicator | None = None,
        counted_elsewhere: frozenset[int] = frozenset(),
        make_zenflow: MakeZenFlow | None = None,
        tp_blocks: tuple[Communicator, dict[int, TPPlacement]] | None = None,
    ) -> None:
        """``comm``: the group the buckets are sharded over; with hybrid sharding (``dp_comm``: every data-parallel
        rank, ``replica_rank``: this rank's replica) the shard group. ``overlap_gathers``: the all-gathers after a
        step are waited for where the parameters are next needed ([Note: gathers after the step]); False (graph
        mode) waits at the end of the step. ``make_offload``: optimizer state offloaded (see :data:`MakeOffload`; None:
        the optimizer steps every tensor at once, in memory). ``experts``: under expert parallelism, the
        expert-data-parallel group the expert buckets are gathered over and the expert group whose ranks hold
        different experts (the norm at stage 0 sums their expert squares; see [Note: expert buckets] in
        zero/layout.py). ``stage_comm``: under pipeline parallelism, the ranks holding the other stages, over which the
        squared norm is summed as well ([Note: the norm across stages]); ``counted_elsewhere``: the ids of parameters
        whose gradient another stage holds too and counts in that sum (a weight tied across stages), left out here.
        ``make_zenflow``: the stall-free step replaces the offload's (see :data:`MakeZenFlow`). ``tp_blocks``: under
        tensor parallelism, the tensor-parallel group and each split parameter's placement (by id), which Muon's
        owners assemble whole matrices from ([Note: Muon's matrices under tensor parallelism])."""
        self.optimizer, self.buckets, self.reducer = optimizer, buckets, reducer
        self.stage_comm, self.counted_elsewhere = stage_comm, counted_elsewhere
        self.tp_norm = tp_norm  # with tensor parallelism: how the squared norm is summed (see the class)
        self.tp_blocks = tp_blocks
        self.comm, self.allgather_bucket_numel = comm, allgather_bucket_numel
        # the norm's all-reduce when it carries the reducer's order flag: every data-parallel rank must see the flag
        # (see [Note: collective order]); the replicas' copies of the fragments count once
        self.norm_comm = dp_comm if dp_comm is not None else comm
        self.norm_weight = 1.0 if replica_rank == 0 else 0.0
        self.sharded = policy.shard_optimizer_state  # steps fragments (else whole parameters)
        # the all-gathers of the updated chunks after each step (stages 1-3: the buckets gathered after a step)
        self.expert_comm, self.expert_group = experts if experts is not None else (None, None)
        self.gathers = ParameterGathers(
            buckets if self.sharded else [],
            comm,
            allgather_bucket_numel,
            module,
            overlap_gathers,
            expert_comm=self.expert_comm,
        )
        # (fragment tensor, bucket, slot index) for every trainable parameter, keyed by the parameter, in the order
        # the offload indexes them by (fragment_places)
        self._frag: dict[int, tuple[torch.Tensor, Bucket, int]] = {
            id(b.slots[i].param): (fragment_tensor(b, i, self.sharded), b, i) for b, i in fragment_places(buckets)
        }
        # what the optimizer steps: fp32 masters under mixed precision (see [Note: mixed precision]), else
        # the fragments themselves
        self.masters = masters
        self._stepped = {k: (masters[k] if masters is not None else t) for k, (t, _, _) in self._frag.items()}
        if self.sharded or masters is not None:
            self._move_initial_state()
            for group in optimizer.param_groups:
                group["params"] = [self._stepped.get(id(p), p) for p in group["params"]]
        collective_step = isinstance(optimizer, (MuonWithAdamW, Lamb)) and self.sharded
        if collective_step:
            # Muon assembles tensor-parallel blocks ([Note: Muon's matrices under tensor parallelism]); LAMB does not
            lamb = isinstance(optimizer, Lamb)  # Muon serves experts' matrices too ([Note: experts' matrices])
            self._refuse_unserved_whole_tensor(type(optimizer).__name__, tp_norm, experts, stage_comm, lamb)
            # a host step (optimizer offload on a GPU) hands its collectives host tensors: they run on device copies
            # ([Note: the owners' collectives on the device] in zero/owner_staging.py)
            staging = (
                owner_staging.device_staging(buckets[0].shard.device) if make_offload is not None and buckets else None
            )
            if isinstance(optimizer, MuonWithAdamW):
                self._bind_muon_owners(optimizer, staging)
            else:  # [Note: LAMB's norms across shards] in optim/lamb.py
                optimizer.tensor_norms = ShardSums(self.comm, staging)
        # sub-group stepping with offloaded state, made from the tensors stepped (after the state moved to them)
        self.offload: OptimizerOffload | None = None
        if make_offload is not None:
            fragments = self.stepped_fragments() if masters is not None else None
            whole = self._whole_buckets() if collective_step else None
            self.offload = make_offload(self.stepped_tensors(), fragments, whole)
        self.zenflow: ZenFlowStep | None = None
        if make_zenflow is not None:
            places = self.fragment_places()
            shapes = [b.slots[i].shape for b, i in places]
            starts = [b.fragments[i].start if self.sharded else 0 for b, i in places]
            self.zenflow = make_zenflow(self.stepped_tensors(), shapes, starts)

    def _refuse_unserved_whole_tensor(self, name: str, tp_norm, experts, stage_comm, lamb: bool) -> None:
        """What the owners of whole-tensor optimizers do not serve yet, refused by name: LAMB with tensor, expert or
        pipeline parallelism. Muon's optimizer offload with tensor or expert parallelism is served: every tp rank
        cuts the same sub-groups of whole buckets (same local shapes), so the tp gathers pair up; an expert bucket's
        owners are in its expert shard group (tests/zero/test_muon_owners.py)."""
        unserved = [
            what
            for what, present in (
                ("tensor parallelism", tp_norm is not None and lamb),
                ("expert parallelism", experts is not None and lamb),
                ("pipeline parallelism", stage_comm is not None and lamb),
            )
            if present
        ]
        if unserved:
            raise OptimizerError(
                f"{name} at ZeRO stages 1-3 is not served yet with {', '.join(unserved)} (docs/muon.md); "
                "use it without them, or AdamW"
            )

    def _whole_buckets(self) -> WholeBuckets:
        """Each stepped tensor's bucket and each bucket's chunk size ([Note: sub-groups of whole buckets])."""
        position: dict[int, int] = {}
        chunks: list[int] = []
        for _, b, _ in self._frag.values():
            if id(b) not in position:
                position[id(b)] = len(chunks)
                chunks.append(b.shard_numel)
        return WholeBuckets(tuple(position[id(b)] for _, b, _ in self._frag.values()), tuple(chunks))

    def _bind_muon_owners(self, optimizer: MuonWithAdamW, staging: OwnerStaging | None) -> None:
        """Muon's orthogonalization on owner ranks ([Note: one owner per matrix] in zero/muon_owners.py)."""
        places = {id(self._stepped[k]): (b, i) for k, (_, b, i) in self._frag.items()}
        muon = [id(p) for g in optimizer.param_groups if g["use_muon"] for p in g["params"]]
        blocks = None
        if self.tp_blocks is not None:
            tp_comm, placements = self.tp_blocks
            blocks = TensorParallelBlocks(
                tp_comm, {id(self._stepped[k]): placements[k] for k in placements if k in self._stepped}
            )
        optimizer.whole_matrices = MuonOwners(
            self.comm, {k: places[k] for k in muon}, blocks, self.expert_comm, staging
        )

    def _move_initial_state(self) -> None:
        """State an optimizer made at construction (Adagrad's ``sum`` and ``step``) follows the tensors it
        steps: per-element tensors are cut like the fragment, other values copied."""
        for p in [p for p in self.optimizer.state if id(p) in self._frag]:
            old = self.optimizer.state.pop(p)
            stepped = self._stepped[id(p)]
            f = self._frag[id(p)][1].fragments[self._frag[id(p)][2]]
            new = {}
            for k, v in old.items():
                if torch.is_tensor(v) and v.shape == p.shape and v.numel() > 1:
                    piece = v.reshape(-1)[f.start : f.start + f.length] if self.sharded else v
                    v = piece.to(device=stepped.device, dtype=stepped.dtype, copy=True).view_as(stepped)
                new[k] = v
            self.optimizer.state[stepped] = new

    def stepped_tensors(self) -> list[torch.Tensor]:
        """What the optimizer steps, one per trainable parameter, in the order gradients are handed over."""
        return list(self._stepped.values())

    def stepped_now(self) -> list[bool]:
        """Per :meth:`stepped_tensors`, whether the next step updates it: False for a parameter frozen at every
        backward since the last step (see [Note: parameters frozen after initialize])."""
        return [self.reducer.has_gradient(b.slots[i].param) for _, b, i in self._frag.values()]

    def stepped_fragments(self) -> list[torch.Tensor]:
        """The fragment (or whole parameter) of each of :meth:`stepped_tensors`, in the same order."""
        return [t for t, _, _ in self._frag.values()]

    def readable(self, stepped: torch.Tensor) -> torch.Tensor:
        """The values of a stepped tensor: itself, or an offloaded master's file mapped (read and written in place)."""
        return self.offload.master_view(stepped) if self.offload is not None else stepped

    def state_of(self, stepped: torch.Tensor) -> dict:
        """The optimizer state of a stepped tensor, offloaded parts included (mapped, not read into memory)."""
        if self.zenflow is not None:
            return self.zenflow.state_of(stepped)
        if self.offload is not None:
            return self.offload.state_of(stepped)
        return self.optimizer.state.get(stepped, {})

    def set_state(self, stepped: torch.Tensor, state: dict) -> None:
        """Replace the optimizer state of a stepped tensor (an empty dict removes it)."""
        if self.zenflow is not None:
            self.zenflow.set_state(stepped, state)
        elif self.offload is not None:
            self.offload.set_state(stepped, state)
        elif state:
            self.optimizer.state[stepped] = state
        else:
            self.optimizer.state.pop(stepped, None)

    def fragment_places(self) -> list[tuple[Bucket, int]]:
        """(bucket, slot index) of each of :meth:`stepped_tensors`, in the same order."""
        return [(b, i) for _, b, i in self._frag.values()]

    def fragment_of(self, p: torch.Tensor) -> tuple[torch.Tensor, Bucket, int] | None:
        """(fragment tensor, bucket, slot index) of a trainable parameter; None for anything else."""
        return self._frag.get(id(p))

    def stepped_of(self, p: torch.Tensor) -> torch.Tensor:
        """What the optimizer steps for a trainable parameter: its fp32 master or its fragment."""
        return self._stepped[id(p)]

    def master_of(self, p: torch.Tensor) -> torch.Tensor | None:
        """The fp32 master of a trainable parameter's fragment under mixed precision, else None."""
        if self.masters is None or id(p) not in self.masters:
            return None
        return self.readable(self.masters[id(p)])

    def refresh_masters(self, params: list[torch.Tensor]) -> None:
        """Masters take the (changed) compute-dtype values of these parameters' fragments."""
        if self.masters is None:
            return
        with torch.no_grad():
            for p in params:
                if id(p) in self._frag:
                    master = self.master_of(p)
                    master.copy_(self._frag[id(p)][0].reshape(-1).view_as(master))

    def _fragment_grads(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(stepped tensor, fragment, its reduced gradient) for every trainable parameter."""
        triples = []
        for (key, (t, b, i)), stepped in zip(self._frag.items(), self.stepped_now()):
            # frozen at every backward since the last step: not stepped (see [Note: parameters frozen after
            # initialize]); its zero gradient would let AdamW decay it and move it by its moments
            if not stepped:
                triples.append((self._stepped[key], t, None))
                continue
            if not self.sharded:
                g = self.reducer.param_grad(b, i)
            else:
                f = b.fragments[i]
                g = self.reducer.shard_grad(b)[f.shard_offset : f.shard_offset + f.length]
            triples.append((self._stepped[key], t, g))
        return triples

    def step(
        self, max_norm: float, loss_scale: torch.Tensor | float | None = None, skip_nonfinite: bool = False
    ) -> tuple[torch.Tensor, bool | torch.Tensor]:
        """Unscale, clip by the global norm, step, refresh and re-gather parameters (see [Note: the one step]).

        Returns (the norm of the unscaled gradients before clipping, a scalar tensor on the device; whether the step was
        skipped). Without a loss scale and without ``skip_nonfinite`` no step is skipped (``False``). With either, a
        non-finite norm on any rank (it is all-reduced, so every rank sees the same) skips the step and leaves
        parameters, masters and optimizer state untouched. Where the optimizer can skip in its own kernel (torch's fused
        optimizers take ``found_inf`` as they take it from ``torch.amp.GradScaler``) and the gradients are in memory,
        the skip is decided on the device and returned as a boolean tensor, read by nobody during the step (see [Note:
        reading device values a step later]); otherwise the host reads the norm first (one synchronization) and returns
        a bool.

        [Note: the one step]
        Every step takes one path, whatever holds the gradients: (1) the gradients stepped now, in memory or *deferred*
        when in swap files (:class:`SwappedGradients`, [Note: gradient offload]); (2) the in-memory ones unscaled; (3)
        each member's norm (deferred ones from their source), the squared global norm summed once over the ranks, with
        the reducer's order flag and the source's I/O failure on the same all-reduce; (4) the overflow decision; (5) one
        clip coefficient, applied now in memory and to deferred ones as read; (6) the update, whole or one sub-group at
        a time; (7) the compute-dtype fragments refreshed and the all-gathers launched. One arithmetic order: the
        numbers are bitwise the same wherever the gradients were."""
        self.gathers.wait_all("step")  # the chunks stepped below are the input of the last step's gathers
        swapped = self.offload.grads if self.offload is not None else None
        triples = self._fragment_grads()
        # the optimizer sees the stepped tensors' dtype (fp32 masters): upcast
        grads = [None if g is None else g if g.dtype == s.dtype else g.to(s.dtype) for s, _, g in triples]
        deferred: frozenset[int] = frozenset()
        if swapped is not None:  # gradients in swap files are read by the stepper, with their sub-group's state
            deferred = swapped.deferred([g is not None for g in grads], self.reducer.grads_zeroed)
            grads = [None if i in deferred else g for i, g in enumerate(grads)]
        in_memory = [g for g in grads if g is not None and g.numel()]
        on_device = swapped is None and self.offload is None
        inv = self._inverse(loss_scale, on_device)
        if inv is not None and in_memory:
            torch._foreach_mul_(in_memory, inv)
        if self.tp_norm is not None:  # its own sums over the mesh, expert parameters included
            local_sq = self._global_square(torch.zeros(()), grads, swapped)
        elif self.expert_group is not None and not self.sharded:
            local_sq = self._dense_and_expert_square(grads)
        elif self.expert_group is not None and self.norm_comm is not self.comm:
            local_sq = self._hybrid_expert_square(grads, deferred, swapped, inv)
            local_sq = self._global_square(local_sq, grads, swapped, weighted=True)
        elif self.counted_elsewhere:  # under pipeline parallelism (no tp there): a tied weight another stage counts
            keys = list(self._frag)
            counted = [None if k in self.counted_elsewhere else g for k, g in zip(keys, grads)]
            # gradients in swap files are left out by their index (their entries in ``grads`` are None)
            counted_deferred = frozenset(i for i in deferred if keys[i] not in self.counted_elsewhere)
            local_sq = self._local_square(
                counted, [g for g in counted if g is not None and g.numel()], counted_deferred, swapped, inv
            )
            local_sq = self._global_square(local_sq, grads, swapped)
        else:
            local_sq = self._local_square(grads, in_memory, deferred, swapped, inv)
            local_sq = self._global_square(local_sq, grads, swapped)
        if self.stage_comm is not None:
            # [Note: the norm across stages] each pipeline stage holds other parameters: the global norm, which the
            # clip coefficient and the reported norm must share on every rank, sums every stage's square. The
            # overflow decision below reads this sum: an inf or NaN on any stage skips the step on every stage
            # (bf16's check_grad_overflow), with no all-reduce of a found-inf flag of its own
            local_sq = local_sq.clone()  # its own storage: it may be a view of the dp reduction's buffer
            self.stage_comm.all_reduce(local_sq, Reduce.SUM, what="squared gradient norm (pipeline stages)")
        total_norm = local_sq.sqrt()
        found_inf = None
        if loss_scale is not None or skip_nonfinite:
            overflow = ~torch.isfinite(local_sq)
            if on_device and getattr(self.optimizer, "_step_supports_amp_scaling", False):
                found_inf = overflow
            elif self.offload is not None:
                # the host step waits for the norm anyway (its clip coefficient): the flag is read the same way, a
                # copy to pinned memory behind an event ([Note: reading device values a step later])
                if HostRead(overflow).values()[0]:
                    return total_norm, True
            elif bool(overflow):  # decided on the host: one synchronization
                return total_norm, True
        coef = None
        if max_norm > 0 and (in_memory or deferred):
            # identical to torch.nn.utils.clip_grad_norm_: scale by max_norm/(norm+1e-6), never up
            coef = torch.clamp(max_norm / (local_sq.sqrt() + 1e-6), max=1.0)
            if in_memory and not self._offload_clips():
                # else applied in the host step's one pass ([Note: one pass over a sub-group] in offload/one_pass.py)
                torch._foreach_mul_(in_memory, coef)
        self._update(grads, deferred, triples, inv, coef, found_inf)
        # every rank's updated chunks into the full flat buffers, waited for where they are next needed
        self.gathers.launch()
        return total_norm, found_inf if found_inf is not None else False

    def _offload_clips(self) -> bool:
        """Whether the in-memory gradients' clip is left to the offload's step, which applies it in its one pass
        ([Note: one pass over a sub-group] in offload/one_pass.py). Never when another step replaces the offload's
        (``zenflow``, the stall-free step): that one takes its gradients clipped."""
        return self.offload is not None and self.offload.takes_clip and self.zenflow is None

    @staticmethod
    def _inverse(loss_scale: torch.Tensor | float | None, on_device: bool) -> torch.Tensor | float | None:
        """What the gradients are multiplied by to unscale them: ``1 / loss_scale`` rounded to fp32 as a scalar
        argument is (a device tensor when the gradients are in memory, a float when they are read from the host)."""
        if loss_scale is None:
            return None
        if not torch.is_tensor(loss_scale):
            return 1.0 / loss_scale if loss_scale != 1.0 else None
        inv = (1.0 / loss_scale).to(torch.float32)
        return inv if on_device else float(inv)

    def _local_square(
        self,
        grads: list[torch.Tensor | None],
        in_memory: list[torch.Tensor],
        deferred: frozenset[int],
        swapped: SwappedGradients | None,
        inv: float | None,
    ) -> torch.Tensor:
        """This rank's squared gradient norm: each member's norm in member order, deferred ones from ``swapped``."""
        if self.tp_norm is not None:  # its own sums over the mesh (gradients are never swapped with it)
            return torch.zeros(())
        memory_norms = iter(torch._foreach_norm(in_memory) if in_memory else [])
        from_files = swapped.deferred_norms(deferred, inv) if swapped is not None else {}
        norms = []
        for i, g in enumerate(grads):
            if i in deferred:
                norms.append(from_files[i])
            elif g is not None and g.numel():
                norms.append(next(memory_norms))
        if not norms:
            device = self.buckets[0].flat_param.device if self.buckets else "cpu"
            return torch.zeros((), device=device)
        return (torch.linalg.vector_norm(torch.stack(norms)) ** 2).to(torch.float32)

    def _dense_and_expert_square(self, grads: list[torch.Tensor | None]) -> torch.Tensor:
        """Stage 0 under expert parallelism: every rank holds every gradient it reduced, the dense ones the same on
        every rank, the expert ones of other experts on each rank of its expert group; the squared norm is the
        dense square plus the expert squares summed over the expert group (each gradient counted once; a weight tied
        across pipeline stages only on the stage that counts it, ``counted_elsewhere`` elsewhere)."""
        expert = [b.expert for _, b, _ in self._frag.values()]
        dense_grads = [None if e or k in self.counted_elsewhere else g for k, g, e in zip(self._frag, grads, expert)]
        expert_grads = [g if e else None for g, e in zip(grads, expert)]

        def square(gs: list[torch.Tensor | None]) -> torch.Tensor:
            present = [g for g in gs if g is not None and g.numel()]
            return self._local_square(gs, present, frozenset(), None, None)

        moe = square(expert_grads)
        self.expert_group.all_reduce(moe, Reduce.SUM, what="squared expert gradient norm")
        return square(dense_grads) + moe

    def _hybrid_expert_square(
        self,
        grads: list[torch.Tensor | None],
        deferred: frozenset[int],
        swapped: SwappedGradients | None,
        inv: float | None,
    ) -> torch.Tensor:
        """Hybrid sharding under expert parallelism: every replica holds the same dense fragments, while the expert
        fragments, sharded over the expert-data-parallel group, are each on one rank only. The dense square counts on
        the first replica, the expert squares on every rank, before the sum over every data-parallel rank
        (``weighted`` in :meth:`_global_square`)."""
        expert = [b.expert for _, b, _ in self._frag.values()]

        def square(moe: bool) -> torch.Tensor:
            gs = [g if e == moe else None for g, e in zip(grads, expert)]
            present = [g for g in gs if g is not None and g.numel()]
            own = frozenset(i for i in deferred if expert[i] == moe)
            return self._local_square(gs, present, own, swapped, inv)

        return square(False) * self.norm_weight + square(True)

    def _global_square(
        self,
        local_sq: torch.Tensor,
        grads: list[torch.Tensor | None],
        swapped: SwappedGradients | None,
        weighted: bool = False,
    ) -> torch.Tensor:
        """The squared norm over every rank, from one all-reduce that also carries the reducer's order flag (see
        [Note: collective order]) and the swapped gradients' I/O failure. ``weighted``: ``local_sq`` counts the
        replicas' copies once already (:meth:`_hybrid_expert_square`) and is summed over every data-parallel rank."""
        if self.tp_norm is not None:
            keys = [k for k, g in zip(self._frag, grads) if g is not None]
            present = [g for g in grads if g is not None]
            return self.tp_norm.global_square(keys, present, self.sharded, self.reducer)
        if self.sharded and self.reducer.sharded_grads:
            # fragments are disjoint: the squares add up across ranks
            flag = float(self.reducer.order_departed)
            if swapped is not None and swapped.failed:
                flag += IO_FAILED
            weight = 1.0 if weighted else self.norm_weight
            both = torch.stack([local_sq * weight, torch.full_like(local_sq, flag)])  # a fill, no copy
            self.norm_comm.all_reduce(both, Reduce.SUM, what="squared gradient norm")
            if swapped is not None:  # read now: a failed read of the gradient files stops this step
                if float(both[1]) >= IO_FAILED:
                    swapped.raise_failure(self.norm_comm)
                self.reducer.settle_order(bool(both[1] > 0))
            else:  # see [Note: reading device values a step later]
                self.reducer.settle_order_later(both[1])
            return both[0]
        if self.sharded:  # a shard group's fragments cover every parameter once: enough for the norm
            (self.norm_comm if weighted else self.comm).all_reduce(local_sq, Reduce.SUM, what="squared gradient norm")
        return local_sq

    def _update(
        self,
        grads: list[torch.Tensor | None],
        deferred: frozenset[int],
        triples: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
        inv: torch.Tensor | float | None,
        coef: torch.Tensor | None,
        found_inf: torch.Tensor | None = None,
    ) -> None:
        """Step (6) and (7) of [Note: the one step]. ``found_inf``: the optimizer's kernel skips the update when it
        is true (its own state untouched), as under ``torch.amp.GradScaler``."""
        if found_inf is None:
            self._step_optimizer(grads, deferred, triples, inv, coef)
        else:
            self.optimizer.grad_scale, self.optimizer.found_inf = None, found_inf.to(torch.float32)
            try:
                self._step_optimizer(grads, deferred, triples, inv, coef)
            finally:
                del self.optimizer.grad_scale, self.optimizer.found_inf
        self._refresh_fragments()

    def _step_optimizer(
        self,
        grads: list[torch.Tensor | None],
        deferred: frozenset[int],
        triples: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
        inv: torch.Tensor | float | None,
        coef: torch.Tensor | None,
    ) -> None:
        if not self.sharded and self.masters is None:  # fp32 stage 0: the parameters hold their gradients
            # frozen for this whole step: hidden from the optimizer, as torch.optim skips a parameter without a
            # gradient (their .grad is a view of the reducer's zeroed buffer)
            frozen = [(s, s.grad) for s, _, g in triples if g is None and s.grad is not None]
            for s, _ in frozen:
                s.grad = None
            try:
                self.optimizer.step()
            finally:
                for s, grad in frozen:
                    s.grad = grad
            return
        if self.zenflow is not None:  # gradients in memory, unscaled and clipped ([Note: the ZenFlow rule])
            self.zenflow.step(grads)
            return
        if self.offload is not None:  # one sub-group at a time (see [Note: sub-group stepping])
            # host-stepped gradients copied in backward are raw: unscaled and clipped on the host, by the same factors
            # ([Note: overlapped offload] in offload/host_copies.py); the coefficient is read once for them
            host_coef = self.offload.on_host(coef)

            def transform(read: list[torch.Tensor]) -> None:  # the deferred or host-copied gradients, as they are read
                if inv is not None:
                    torch._foreach_mul_(read, inv)
                if coef is not None:
                    torch._foreach_mul_(read, host_coef if read[0].device == host_coef.device else coef)

            copied = self.offload.copies is not None
            if copied:  # what transform does to the raw host copies, for the one pass to do instead
                factors = tuple(f for f in (inv, host_coef) if f is not None)
            else:  # the clip left to the offload's step (takes_clip), or nothing
                factors = (coef,) if coef is not None and self._offload_clips() else ()
            self.offload.step(grads, deferred, transform if deferred or copied else None, factors)
        else:
            stepped = [s for s, _, g in triples if g is not None]
            for s, g in zip(stepped, (g for g in grads if g is not None)):
                s.grad = g
            self.optimizer.step()
            for s in stepped:
                s.grad = None

    def _refresh_fragments(self) -> None:
        if self.masters is not None and not (self.offload is not None and self.offload.holds_masters):
            # refresh the compute-dtype fragments from the fp32 masters (offloaded ones refreshed as stepped, host
            # masters sent back as their sub-groups stepped: [Note: overlapped offload] in offload/host_copies.py)
            sent = self.offload.copies.host if self.offload is not None and self.offload.copies is not None else None
            # written already in the host step's one pass ([Note: one pass over a sub-group] in offload/one_pass.py)
            passed = self.offload.refreshed if self.offload is not None else None
            pairs = [
                (t, m)
                for k, ((t, _, _), m) in enumerate(zip(self._frag.values(), self._stepped.values()))
                if t.numel() and not (sent is not None and sent[k]) and not (passed is not None and passed[k])
            ]
            same = [(t, m) for t, m in pairs if t.device == m.device]
            with torch.no_grad():
                if same:
                    torch._foreach_copy_([t for t, _ in same], [m for _, m in same])
                for t, m in pairs:
                    if t.device != m.device:  # host masters without copy streams
                        t.copy_(m)  # blocking: the host masters change at the next step

    def wait_gathers(self) -> None:
        """Wait for the all-gathers of the last step still in flight (before reading or writing shards)."""
        self.gathers.wait_all("engine")

    def state_bytes(self) -> int:
        """Optimizer state plus fp32 masters (when they are separate from the parameters)."""
        total = sum(m.numel() * m.element_size() for m in self.masters.values()) if self.masters else 0
        for st in self.optimizer.state.values():
            for v in st.values():
                if torch.is_tensor(v):
                    total += v.numel() * v.element_size()
        return total


ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.ASGD,
    DeepSpeedAdam,
)
"""Optimizers whose update is element-wise: they may step 1-D fragments (see [Note: element-wise optimizers])."""


def _elementwise_base(cls: type) -> type | None:
    """The element-wise torch class ``cls`` is or derives from without overriding its ``step``; else None."""
    for base in ELEMENTWISE_OPTIMIZERS:
        # torch wraps ``step`` in profiling hooks (on whichever class is instantiated first): compare unwrapped
        if issubclass(cls, base) and inspect.unwrap(cls.step) is inspect.unwrap(base.step):
            return base
    return None


def check_optimizer(
    optimizer: torch.optim.Optimizer, module: nn.Module, stage: int, allow_untested: bool = False, tp: int = 1
) -> None:
    """Refuse an optimizer that cannot be stepped on this stage's tensors (1-D fragments at stages 1-3, row blocks under
    tensor parallelism ``tp > 1``) or that does not cover the model. See [Note: element-wise optimizers] and [Note:
    optimizers that need the whole tensor] in zero/elementwise.py."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise OptimizerError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if stage > 0 or tp > 1:
        _check_elementwise(optimizer, stage, allow_untested, tp)
    if any(_has_stepped(s) for s in optimizer.state.values()):
        raise OptimizerError("the optimizer already holds state (it has taken a step); pass a freshly built optimizer")
    names = {id(p): n for n, p in module.named_parameters()}
    seen: dict[int, int] = {}
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if id(p) not in names:
                raise OptimizerError(
                    f"param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}) is not a parameter of the "
                    "model passed to initialize(); build the optimizer over model.parameters()"
                )
            if id(p) in seen:
                raise OptimizerError(
                    f"parameter {names[id(p)]!r} is in param groups {seen[id(p)]} and {gi}; list it once"
                )
            seen[id(p)] = gi
    missing = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        raise OptimizerError(
            f"trainable parameters not in any optimizer param group: {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}; add them to the optimizer or set requires_grad=False"
        )


def _check_elementwise(optimizer: torch.optim.Optimizer, stage: int, allow_untested: bool, tp: int) -> None:
    cls = type(optimizer)
    if _elementwise_base(cls) is not None:
        return
    if issubclass(cls, (MuonWithAdamW, Lamb)):  # served at ZeRO 1-3 ([Note: Muon on owners], [Note: LAMB's norms
        # across shards]); Muon under tp at ZeRO 1-3 ([Note: Muon's matrices under tensor parallelism])
        if tp == 1:
            return
        if issubclass(cls, MuonWithAdamW):
            if stage > 0:
                return
            raise OptimizerError(
                f"{cls.__name__} under tensor parallelism (size {tp}) is served at ZeRO stages 1-3 only: at stage 0 "
                "its Newton-Schulz would read each rank's block of a split matrix, not the whole matrix "
                "(docs/muon.md). Use ZeRO stage 1, 2 or 3, or tensor_parallel.size 1"
            )
        raise OptimizerError(
            f"{cls.__name__} is not served under tensor parallelism (size {tp}) yet: its trust ratio would read each "
            "rank's block of a split matrix, not the whole matrix (docs/muon.md). Use tensor_parallel.size 1 "
            "(ZeRO 0-3 are served), or AdamW"
        )
    name = f"{cls.__module__}.{cls.__qualname__}"
    where = f"ZeRO stage {stage}" if stage > 0 else f"tensor parallel size {tp}"
    pieces = (
        "flat 1-D fragments of the parameters" if stage > 0 else "each rank's block of a split matrix"
    ) + ", not whole tensors"
    ways_out = (
        f"Use ZeRO stage 0{' without tensor parallelism' if tp > 1 else ''}, or an element-wise optimizer "
        f"({', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)})"
        + (", or for Muon shardtrain.optim.muon.MuonWithAdamW (served at ZeRO 1-3, with tensor and expert parallelism)")
    )
    known = known_not_elementwise(cls)
    if known is not None:
        base, why = known
        raise OptimizerError(
            f"{name} cannot be used at {where}: {why} ({base}), and the optimizer would step {pieces}, a "
            f"different algorithm. {ways_out}. zero_allow_untested_optimizer does not lift "
            "this: the step is known not to be element-wise"
        )
    mismatch = slice_mismatch(optimizer, tp=tp, flat=stage > 0)
    if mismatch is not None:
        raise OptimizerError(
            f"{name} cannot be used at {where}: its step is not element-wise ({mismatch}), and the optimizer would "
            f"step {pieces}. {ways_out}. zero_allow_untested_optimizer does not lift this: "
            "the probe showed the difference"
        )
    if not allow_untested:
        own_step = any(issubclass(cls, b) for b in ELEMENTWISE_OPTIMIZERS)
        why = "it overrides step()" if own_step else "its update is not known to be element-wise"
        raise OptimizerError(
            f"{name} cannot be used at {where}: {why}, and ZeRO hands the optimizer {pieces} (an update that "
            "factors or orthogonalizes matrices, or needs all parameters at once, would be silently wrong; a probe on "
            "a small tensor found no difference or could not step it: evidence, not proof). "
            f'{ways_out}, or set "zero_allow_untested_optimizer": true if its update is element-wise'
        )


def _has_stepped(state: dict) -> bool:
    """Whether a parameter's optimizer state shows a step (state made at construction, Adagrad's, has step 0)."""
    step = state.get("step")
    return bool(state) and (step is None or float(step) != 0)


def make_masters(buckets: list[Bucket], policy: ZeroPolicy) -> dict[int, torch.Tensor]:
    """fp32 copies of this rank's fragments, taken before the parameters are cast to the compute dtype."""
    masters = {}
    for b in buckets:
        for slot, f in zip(b.slots, b.fragments):
            t = (
                b.shard[f.shard_offset : f.shard_offset + f.length]
                if policy.shard_optimizer_state
                else slot.param.detach()
            )
            masters[id(slot.param)] = t.to(torch.float32, copy=True)
    return masters
