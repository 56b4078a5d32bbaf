"""``initialize`` and the :class:`Engine` a training loop drives (forward, backward, step).

Protocol of one optimizer step with ``gradient_accumulation_steps = k``::

    for micro in range(k):
        loss = engine(batch)        # the module's forward
        engine.backward(loss)       # loss / k; reductions overlap backward (all stages: the last micro-step;
                                    # stage 2: every micro-step)
        engine.step()               # steps optimizer and scheduler only after the k-th micro-step
"""

from __future__ import annotations

import copy
import logging
import math
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from shardtrain.checkpoint.async_save import AsyncSaver
from shardtrain.checkpoint.owner import SaveDirOwner
from shardtrain.config.auto import resolve_auto
from shardtrain.config.plan import ineffective_offload_keys, parallel_dims, resolve_plan
from shardtrain.config.sections import Config, cast_inputs_half, load_config, resolve_batch_sizes
from shardtrain.distributed import failure
from shardtrain.distributed.communicator import Communicator, Reduce, collecting, merge_stats
from shardtrain.distributed.mesh import Topology, destroy_own_groups, init_topology, join_world, release_groups
from shardtrain.distributed.watchdog import stop_watchdog
from shardtrain.engine import shutdown
from shardtrain.engine.checkpointing import (
    COUNTERS,
    TrainingState,
    full_state_dict,
    load_engine,
    load_full_weights,
    save_engine,
)
from shardtrain.engine.monitor import StepMetrics, check_monitor_packages
from shardtrain.engine.optimizers import (
    OptimizerArg,
    SchedulerArg,
    build_lr_scheduler,
    build_optimizer,
    refuse_deepspeed_muon_clipping,
)
from shardtrain.engine.parallelize import Parts, apply_checkpoint_interval, choose_activation_budget, parallelize
from shardtrain.errors import ConfigError, OptimizerError, ShardtrainError
from shardtrain.host_read import HostRead
from shardtrain.pipeline_parallel import (
    PipelineGrid,
    check_can_cut,
    check_micro_batches,
    last_stage_rank,
    split_micro_batch,
)
from shardtrain.pipeline_parallel.order import V_SHAPED_SCHEDULES
from shardtrain.plan import Plan
from shardtrain.precision.mixed import check_parameter_dtypes
from shardtrain.tensor_parallel import check_same_batch
from shardtrain.weights.loading import KeyMapper
from shardtrain.zero.optimizer import check_optimizer
from shardtrain.zero.units import find_unit_modules

log = logging.getLogger("shardtrain")

__all__ = ["Engine", "OptimizerArg", "SchedulerArg", "initialize"]


@dataclass
class _PendingOverflow:
    """An fp16 step whose overflow was decided on the device (see [Note: an overflow learned a step later])."""

    flags: HostRead  # (overflowed, overflowed at the minimum scale)
    step: int  # its global step, 1-based
    scheduler: tuple[dict, list[dict]] | None  # the scheduler's state and hyperparameters before it stepped


class Engine:
    """Trains ``module`` data-parallel with ZeRO; build it with :func:`initialize`.

    Its parts come from :func:`shardtrain.engine.parallelize.parallelize`; around each step it asks its runtime (eager
    or graph, [Note: one runtime, two implementations]) to run the forward and to prepare and finish the backward."""

    def __init__(
        self,
        module: nn.Module,
        config: Config,
        plan: Plan,
        topology: Topology,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: LRScheduler | None,
        parts: Parts,
        communicators: list[Communicator] | None = None,
    ) -> None:
        """``communicators``: every communicator built for this engine, released at :meth:`close` (the list
        :func:`~shardtrain.distributed.communicator.collecting` fills while ``initialize`` builds it)."""
        self.module, self.config, self.plan, self.topology = module, config, plan, topology
        self.train_batch_size, self.micro_batch_size, self.gradient_accumulation_steps = resolve_batch_sizes(
            config, topology.dp
        )
        comms = parts.comms
        self.comm, self.replica_comm, self._dp_comm = comms.shard, comms.replica, comms.dp
        self._hpz_comm = comms.hpz
        self._expert_comms = {"ep": comms.ep, "edp": comms.edp} if comms.ep is not None else {}
        self.world_comm, self.tp_comm = comms.world, comms.tp
        self._sp, self._phase_check, self._scratch = parts.sp, parts.phase_check, parts.scratch
        self.layout, self.policy = parts.layout, parts.layout.policy
        self.precision, self.scaler = parts.precision, parts.scaler
        self._param_offload, self._reducer, self._optimizer = parts.param_offload, parts.reducer, parts.optimizer
        self._runtime, self.monitor = parts.runtime, parts.monitor
        self._pipeline = parts.pipeline
        self.fp8 = parts.fp8  # fp8.enabled: the layers converted to float8 and those kept, by name (else None)
        if self._pipeline is not None:
            scaler = self.scaler
            self._pipeline.build(
                plan.pipeline.schedule,
                self.gradient_accumulation_steps,
                topology.pp_group,
                topology.device,
                (lambda: scaler.scale_tensor) if scaler is not None else None,
                activation_dtype=plan.precision.compute_dtype,
                grads_set_directly=self._reducer.grads_set_directly,
            )
            self._pp_comm = Communicator(topology.pp_group, topology.timeout_s)
            # checkpoints run their protocol over every rank: each stage writes its own tensors into one manifest
            self._checkpoint_comm = Communicator(topology.world_group, topology.timeout_s)
            # the first and last stage sum a tied weight's gradients ([Note: weights tied across stages])
            tied = self._pipeline.tied
            self._tied_comm = Communicator(topology.pp_ends_group, topology.timeout_s) if tied else None
        self.optimizer, self._lr_scheduler = optimizer, lr_scheduler
        self.global_step = 0
        self.micro_steps = 0
        self._skipped_steps = 0
        self._skipped_at: set[int] = set()  # the global steps (1-based) that were skipped
        self.global_samples = 0  # DeepSpeed's x-axis for monitors: train_batch_size per optimizer step
        self._grad_norm: torch.Tensor | None = None  # on the device: read when asked for
        self._pending: _PendingOverflow | None = None  # the last fp16 step's overflow, on its way to the host
        self._batch_checked = self.tp_comm is None
        self._async_saver: AsyncSaver | None = None  # made by the first asynchronous save_checkpoint
        self._save_dirs = SaveDirOwner()  # rank 0's claims: [Note: one job per save directory]
        self._closed = False
        self._comms = communicators if communicators is not None else []
        # parameters frozen when the buckets and the optimizer state were built: unfreezing one later is refused
        # at the next step (it would never be reduced nor stepped: a silent wrong result)
        self._frozen_at_initialize = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
        shutdown.track(self)  # closed at interpreter exit unless close() ran

    @property
    def stage(self) -> int:
        """The ZeRO stage (what it shards is ``engine.policy``)."""
        return self.policy.stage

    @property
    def mode(self) -> str:
        """``"eager"`` or ``"graph"`` (``graph.enabled``), chosen once by :func:`initialize`."""
        return self._runtime.mode

    # -- DeepSpeed's pipeline queries (deepspeed/runtime/pipe/engine.py, topology.py) ---------------------------
    @property
    def grid(self) -> PipelineGrid:
        """DeepSpeed's ``PipelineParallelGrid`` queries (``get_data_parallel_rank()``, ``get_pipe_parallel_rank()``,
        ``get_slice_parallel_world_size()``, ...) on this engine's mesh; at pipeline size 1 one stage."""
        t = self.topology
        return PipelineGrid(
            global_rank=t.rank,
            world_size=t.world_size,
            pipe_parallel_size=t.pp,
            data_parallel_size=t.dp,
            slice_parallel_size=t.tp,
            stage_id=t.pp_rank,
            data_parallel_id=t.dp_rank,
            slice_rank=t.tp_rank,
            pipe_group=t.pp_group,
            data_group=t.groups.dp,
            slice_group=t.tp_group,
            sp=t.sp * t.cp,  # the ranks sharing a sequence sit between the data and the model axes
        )

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step, ``gradient_accumulation_steps`` (DeepSpeed's ``PipelineEngine.micro_batches``)."""
        return self.gradient_accumulation_steps

    @property
    def stage_id(self) -> int:
        """This rank's pipeline rank (DeepSpeed's stage id; with several stages per rank, the first is ``stage_id``,
        the others ``stage_id + num_stages``, ...)."""
        return self.topology.pp_rank

    @property
    def num_stages(self) -> int:
        """The pipeline-parallel size, as DeepSpeed's ``num_stages`` (its grid's ``pipe_parallel_size``)."""
        return self.topology.pp

    def is_first_stage(self) -> bool:
        """Whether this rank holds the first stage (the one that reads the inputs)."""
        return self._pipeline.first if self._pipeline is not None else self.stage_id == 0

    def is_last_stage(self) -> bool:
        """Whether this rank holds the last stage (the one that computes the loss; pipeline rank 0's under a
        V-shaped schedule)."""
        return self._pipeline.last if self._pipeline is not None else self.stage_id == self.num_stages - 1

    # -- the training loop -------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse_on_pipeline("engine(...)")
        if self.plan.precision.cast_inputs:  # fp16's auto_cast; DeepSpeed: positional inputs only
            args = cast_inputs_half(args)
        call = self._runtime.prepare(args, kwargs)
        communicates = self.tp_comm is not None or self._sp is not None or bool(self._expert_comms)
        if self._runtime.forward_communicates or communicates:
            self._agree("forward", detail=call.detail, explain=call.explain)
        if not self._batch_checked:  # every rank of a tensor-parallel group must get the same batch
            check_same_batch(args, kwargs, self.tp_comm, self.topology.host_tp_group)
            self._batch_checked = True
        if self._sp is not None:  # this rank's slice of the sequence; the loss returned is the whole sequence's
            call = self._runtime.prepare(*self._sp.split(args, kwargs))  # (graph mode refuses sequence parallelism)
        self.monitor.count_tokens(call.args, call.kwargs)  # tokens/s (see [Note: monitor metrics])
        with (
            self.monitor.timed("forward"),  # rank 0's breakdown
            self.monitor.counting_flops(self.global_step),  # the flops profiler's step (rank 0)
            self._runtime.collectives("forward"),
        ):
            out = self._runtime.forward(call)
        return self._sp.combine(out) if self._sp is not None else out

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor, *, scale_wrt_gas: bool = True) -> None:
        """Backpropagate ``loss / gradient_accumulation_steps`` and reduce gradients across ranks.

        ``scale_wrt_gas=False`` (DeepSpeed's argument): the loss is already divided for accumulation (as the Hugging
        Face Trainer's is), so it is backpropagated as given."""
        self._refuse_on_pipeline("engine.backward")
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise ValueError(f"engine.backward expects a scalar loss tensor, got {_describe(loss)}")
        self._agree("backward")  # every micro-step: see [Note: phase agreement] for why
        self.monitor.record_loss(loss)  # the train_loss metric (rank 0)
        with self.monitor.timed("backward"):
            self._backward(loss, self.gradient_accumulation_steps if scale_wrt_gas else 1)

    def _backward(self, loss: torch.Tensor, divisor: int) -> None:
        self._reducer.begin_backward(self.is_gradient_accumulation_boundary())
        self._runtime.begin_backward()
        unwinding = True
        try:
            if self.scaler is not None:  # fp16: scale in fp32 (the scaled loss may not fit fp16), on the device
                loss = loss.float() * self.scaler.scale_tensor.to(torch.float32)
            with self._runtime.collectives("backward"):
                (loss / divisor if divisor != 1 else loss).backward()
            # before the reducer launches the buckets left over: a ZeRO-3 rank whose trusted backward ended short
            # must settle it before issuing collectives its peers, waiting in the order's next gather, never pair
            self._runtime.backward_returned()
            unwinding = False
        finally:
            self._reducer.end_backward(unwinding)
            self._runtime.end_backward()

    def step(self, tokens: int | None = None) -> None:
        """At an accumulation boundary: clip, step optimizer and scheduler, clear gradients.

        ``tokens``: this rank's tokens in the micro-batch just processed, for the ``tokens_per_second`` metric;
        by default rank 0 counts the elements of the first integer tensor passed to ``engine(...)``."""
        self._refuse_on_pipeline("engine.step")
        self.monitor.end_micro_step(tokens)
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        self._refuse_unfrozen()
        if self.policy.stage > 0 or self.tp_comm is not None:  # stage 0 steps without a collective
            self._agree("step", micro_steps=self.micro_steps - 1)  # where backward() was, not one ahead
        with self.monitor.timed("step"):
            self._optimizer_step()
        self.global_samples += self.train_batch_size
        # at every steps_per_print-th step: log and write metrics (the monitor reads the tensors only then)
        scale = self.scaler.scale_tensor if self.scaler is not None else 1.0
        lr = self.optimizer.param_groups[0]["lr"]
        self.monitor.end_optimizer_step(StepMetrics(self.global_step, self.global_samples, lr, self._grad_norm, scale))

    def _refuse_on_pipeline(self, call: str) -> None:
        if self._pipeline is not None:
            raise ConfigError(
                f"{call} on a pipeline-parallel engine (pipeline_parallel_size {self.topology.pp}): each rank holds "
                "only its stages, so a step is one schedule over the step's micro-batches; use "
                "loss = engine.train_batch(data_iter)"
            )

    def train_batch(self, data_iter: Iterator[Any]) -> torch.Tensor:
        """One optimizer step of a pipeline-parallel engine: pull ``gradient_accumulation_steps`` micro-batches from
        ``data_iter`` (each an ``(inputs, labels)`` pair or a dict with ``labels``/``targets``), run the schedule,
        reduce gradients over the data-parallel ranks, clip by the norm over every stage, step; returns the step's
        mean loss over its micro-batches and data-parallel ranks, the same on every rank (as DeepSpeed's
        ``PipelineEngine.train_batch``). Collective: every rank calls it with an iterator of its data-parallel rank's
        rows ([Note: one pipeline step] in ``pipeline_parallel/schedule.py``)."""
        if self._pipeline is None:
            raise ConfigError(
                "engine.train_batch runs a pipeline schedule: set pipeline_parallel_size > 1, or train with "
                "loss = engine(batch); engine.backward(loss); engine.step()"
            )
        self._refuse_unfrozen()
        micro = self._pull_micro_batches(data_iter, "train_batch")
        # stage 3: the stage's units whole from the first forward to the last backward, released before the
        # deferred reductions ([Note: a stage gathered for its schedule] in pipeline_parallel/schedule.py)
        with self.monitor.timed("backward"):
            self._reducer.begin_backward(True)
            unwinding = True
            try:
                with self._runtime.gathered(list(self.module.parameters())):
                    loss = self._run_schedule(micro, train=True)
                self._sum_tied_gradients()
                unwinding = False
            finally:
                self._reducer.end_backward(unwinding)
        self.micro_steps += self.gradient_accumulation_steps
        with self.monitor.timed("step"):
            self._optimizer_step()
        self.global_samples += self.train_batch_size
        loss = self._mean_loss(loss)
        self.monitor.record_loss(loss)
        lr = self.optimizer.param_groups[0]["lr"]
        self.monitor.end_optimizer_step(StepMetrics(self.global_step, self.global_samples, lr, self._grad_norm, 1.0))
        return loss

    def _run_schedule(self, micro: list[Any], train: bool) -> torch.Tensor | None:
        """[Note: guarded stage exchanges] The schedule's sends and receives are torch's, on the pipeline group,
        whose waits end at the engine's collective timeout (its groups are made with it). A failure there (a stage
        rank that died closes its connections at once; one that hangs, at the timeout) is described as a failed
        collective is: which peer is gone, or that it timed out. Before the first step of each kind the pipeline's
        ranks agree on the micro-batches' shapes, which the stages learn then: ranks given different shapes are
        refused by name on every rank, where the schedule would exchange mismatched activations."""
        shapes = [tuple(t.shape) for t in split_micro_batch(micro[0])]
        if not self._pipeline.knows_shapes(train):
            every = self._pp_comm.all_gather_object(shapes, what="pipeline micro-batch shapes")
            if any(other != shapes for other in every):
                t = self.topology
                ranks = [s * t.stage_world + t.rank % t.stage_world for s in range(t.pp)]
                seen = "; ".join(f"rank {r}: inputs {x}, labels {y}" for r, (x, y) in zip(ranks, every))
                raise ConfigError(
                    f"the pipeline's ranks were given micro-batches of different shapes ({seen}): the stages exchange "
                    "activations of one shape; give every rank of a pipeline the same rows and sequence length"
                )
        started = time.monotonic()
        try:
            return self._pipeline.run(micro, train=train)
        except RuntimeError as err:
            if not failure.backend_error(err):
                raise
            what = "pipeline activations and gradients between stages"
            raise self._pp_comm.describe_failure("send/recv", what, err, started=started) from err

    def _sum_tied_gradients(self) -> None:
        """[Note: weights tied across stages] in ``pipeline_parallel/cut.py``: the first and last stage's ranks at
        one place add their gradients of the weights they share, before the data-parallel reduction reads them."""
        if self._tied_comm is None:
            return
        tied = self._pipeline.tied
        grads = [self._reducer.unreduced_grad(p) for p in tied]
        flat = torch.cat(
            [(g if g is not None else torch.zeros_like(p)).reshape(-1).to(torch.float32) for p, g in zip(tied, grads)]
        )
        self._tied_comm.all_reduce(flat, Reduce.SUM, what="tied weights' gradients (first and last pipeline stage)")
        missing = [n for p, g in zip(tied, grads) if g is None for n in self.layout.record_of(p).names[:1]]
        if missing:  # after the all-reduce, so that the other end is not left waiting in it
            raise ShardtrainError(
                f"{', '.join(missing)}: tied across the first and last pipeline stage but given no gradient by this "
                "stage's forwards; a weight tied across stages must be used by both"
            )
        for g, summed in zip(grads, flat.split([p.numel() for p in tied])):
            g.copy_(summed.view_as(g))

    def eval_batch(
        self,
        data_iter: Iterator[Any],
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ) -> torch.Tensor | None:
        """The mean loss of ``gradient_accumulation_steps`` micro-batches pulled from ``data_iter``, as
        :meth:`train_batch` pulls them, over the forward schedule only: no gradients, no step, the module in eval
        mode (dropout off) and back in its mode after. Returned on every rank (``bcast_loss=False``: on the last
        stage's ranks, None elsewhere), as DeepSpeed's ``PipelineEngine.eval_batch``, whose arguments it takes; the
        logits, other reductions and another micro-batch count are refused by name. Collective."""
        if self._pipeline is None:
            raise ConfigError(
                "engine.eval_batch runs a pipeline schedule: set pipeline_parallel_size > 1, or evaluate with "
                "torch.no_grad() and engine(batch)"
            )
        unbuilt = [
            (return_logits, "return_logits=True (the last stage's logits)"),
            (not compute_loss, "compute_loss=False (outputs without a loss)"),
            (reduce_output != "avg", f"reduce_output={reduce_output!r} (only 'avg', the mean loss, is built)"),
            (
                num_micro_batches not in (None, self.gradient_accumulation_steps),
                f"num_micro_batches={num_micro_batches} (the schedule runs gradient_accumulation_steps "
                f"{self.gradient_accumulation_steps})",
            ),
        ]
        for hit, what in unbuilt:
            if hit:
                raise ConfigError(
                    f"engine.eval_batch with {what} is not built; call eval_batch(data_iter) for the mean loss"
                )
        if self.plan.pipeline.schedule in V_SHAPED_SCHEDULES:
            # torch's runtime hands a rank's stage its neighbour's input gradient locally in eval too, and fails
            raise ConfigError(
                f"engine.eval_batch under pipeline.schedule {self.plan.pipeline.schedule!r} is not built: torch's "
                "V-shaped schedules run no forward-only step; evaluate with a checkpoint loaded under a loop-placed "
                "schedule (1F1B, Interleaved1F1B, InterleavedZeroBubble) or without pipelining"
            )
        micro = self._pull_micro_batches(data_iter, "eval_batch")
        training = self.module.training
        self.module.eval()
        try:
            # stage 3: gathered for the forwards, as for a train step ([Note: a stage gathered for its schedule])
            with torch.no_grad(), self._runtime.gathered(list(self.module.parameters())):
                loss = self._run_schedule(micro, train=False)
        finally:
            self.module.train(training)
        return self._mean_loss(loss, broadcast=bcast_loss)

    def _pull_micro_batches(self, data_iter: Iterator[Any], call: str) -> list[Any]:
        """A pipeline step's ``gradient_accumulation_steps`` micro-batches, pulled by every rank, or a named error on
        every rank."""
        micro = []
        for _ in range(self.gradient_accumulation_steps):
            try:
                micro.append(next(data_iter))
            except StopIteration:
                break
        # the ranks agree on how many micro-batches they pulled: one that ran out alone fails on every rank, named
        self._agree(call, detail=len(micro))
        if len(micro) < self.gradient_accumulation_steps:
            raise ConfigError(
                f"data_iter ran out after {len(micro)} of the {self.gradient_accumulation_steps} micro-batches of a "
                f"pipeline step (gradient_accumulation_steps): give {call} an iterator with whole steps left"
            )
        return micro

    def _mean_loss(self, loss: torch.Tensor | None, broadcast: bool = True) -> torch.Tensor | None:
        """The last stage's loss, averaged over its data-parallel ranks and sent to every stage."""
        t = self.topology
        if loss is None:
            loss = torch.zeros((), dtype=torch.float32, device=t.device)
        loss = loss.detach().to(torch.float32).clone()
        if self._pipeline.last:
            self._dp_comm.all_reduce(loss, Reduce.AVG, what="pipeline loss (data parallel)")
        if not broadcast:
            return loss if self._pipeline.last else None
        source = last_stage_rank(self.plan.pipeline.schedule, t.pp)
        self._pp_comm.broadcast(loss, source, what="pipeline loss (from the last stage)")
        return loss

    def _refuse_unfrozen(self) -> None:
        unfrozen = [n for n, p in self._frozen_at_initialize if p.requires_grad]
        if unfrozen:
            names = ", ".join(unfrozen[:5]) + (f" and {len(unfrozen) - 5} more" if len(unfrozen) > 5 else "")
            raise OptimizerError(
                f"{names}: frozen (requires_grad=False) when initialize built the gradient buckets and the optimizer "
                "state, and unfrozen since; such a parameter would never be reduced nor stepped. Make it trainable "
                "before initialize (and freeze it after, if it should start frozen: freezing later is supported)"
            )

    def _optimizer_step(self) -> None:
        self._settle_overflow()  # the last step's: before this step reads the learning rate
        scale = self.scaler.scale_tensor if self.scaler is not None else None
        self._grad_norm, skipped = self._optimizer.step(
            self.config.gradient_clipping, scale, self.precision.skip_nonfinite
        )
        if self.scaler is not None or self.precision.skip_nonfinite:  # a skipped step's norm is inf, as DeepSpeed's
            self._grad_norm = torch.nan_to_num(self._grad_norm, nan=math.inf)
        if self._param_offload is not None:  # updated shards leave memory (the kernel writes them back)
            self._param_offload.done_with(self._runtime.units)
        if torch.is_tensor(skipped):  # decided on the device: see [Note: an overflow learned a step later]
            at_minimum = self.scaler.update(skipped) if self.scaler is not None else None
            flags = skipped.reshape(1) if at_minimum is None else torch.stack([skipped, at_minimum])
            self._pending = _PendingOverflow(HostRead(flags), self.global_step + 1, self._scheduler_snapshot())
            if self._lr_scheduler is not None:
                self._lr_scheduler.step()
        else:
            if self.scaler is not None:
                self.scaler.update(overflow=skipped)
            if skipped:  # parameters, masters, optimizer state and the scheduler stay as they were
                self._count_skip(self.global_step + 1)
            elif self._lr_scheduler is not None:
                self._lr_scheduler.step()
        self._reducer.zero_grads()
        self.global_step += 1

    def _scheduler_snapshot(self) -> tuple[dict, list[dict]] | None:
        """The scheduler's state and its optimizer's hyperparameters, to be put back if the step overflowed."""
        if self._lr_scheduler is None:
            return None
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self._lr_scheduler.optimizer.param_groups]
        return copy.deepcopy(self._lr_scheduler.state_dict()), copy.deepcopy(groups)

    def _settle_overflow(self) -> None:
        """[Note: an overflow learned a step later]
        With fp16 (or bf16 with ``check_grad_overflow``) and an optimizer that skips in its own kernel (torch's fused
        Adam, AdamW, SGD), a step that overflows is skipped on the device: parameters, masters and optimizer state stay
        as they were, and the loss scaler (fp16) backs off, without the host waiting to learn it. The host learns it at
        the next step, or when it asks (``skipped_steps``, the scheduler through ``engine.lr_scheduler``, ``get_lr``, a
        checkpoint), from a copy made at the step (see [Note: reading device values a step later] in
        :mod:`shardtrain.host_read`). Meanwhile the scheduler has stepped as if the step were applied; an overflow puts
        its state and the learning rates back, before the next step reads them, so every step uses the learning rate
        DeepSpeed's would (its scheduler does not step on an overflow). An overflow at the minimum scale raises then, a
        step late. Other optimizers read the overflow on the host before their update (one synchronization per step)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        overflow, *at_minimum = pending.flags.values()
        if not overflow:
            return
        if pending.scheduler is not None:
            state, groups = pending.scheduler
            self._lr_scheduler.load_state_dict(state)
            for group, saved in zip(self._lr_scheduler.optimizer.param_groups, groups):
                group.update(saved)
        self._count_skip(pending.step)
        if at_minimum and at_minimum[0]:
            raise self.scaler.min_scale_error()

    def _count_skip(self, step: int) -> None:
        self._skipped_steps += 1
        self._skipped_at.add(step)
        if self.scaler is not None:
            log.info("step %d skipped: gradient overflow, loss scale now %g", step, self.loss_scale)
        else:  # bf16.check_grad_overflow
            log.warning("step %d skipped: the gradients hold inf or NaN (bf16.check_grad_overflow)", step)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for an fp16 overflow or a bf16 inf/NaN gradient (see [Note: an overflow learned a
        step later])."""
        self._settle_overflow()
        return self._skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._settle_overflow()
        self._skipped_steps = value

    def step_was_skipped(self, step: int) -> bool:
        """Whether optimizer step ``step`` (``global_step`` after it) was skipped (fp16 overflow, bf16 inf/NaN)."""
        self._settle_overflow()
        return step in self._skipped_at

    @property
    def lr_scheduler(self) -> LRScheduler | None:
        self._settle_overflow()  # a pending overflow puts the scheduler back first
        return self._lr_scheduler

    def close(self) -> None:
        """Remove every hook the engine installed (gradient hooks, ZeRO-3 module hooks, a vision model's patch
        split), stop the NCCL watchdog's thread, flush and close the monitors' files (TensorBoard, wandb run), stop
        the offload I/O threads, and destroy the process groups the engine created, once the collectives still in
        flight are complete ([Note: what the engine starts and who joins it] in ``engine/shutdown.py``). Not
        collective; a second call does nothing, and an engine nobody closed is closed at interpreter exit. ZeRO-3
        parameters stay sharded: take ``full_state_dict()`` first if the module is used afterwards. Waits for an
        asynchronous checkpoint save in flight and raises its failure, after the rest of the clean-up."""
        if self._closed:
            return
        self._closed = True
        shutdown.closed(self)
        saver = self._async_saver
        try:
            if saver is not None:
                saver.wait()
        finally:
            if saver is not None:
                saver.close()
            self._save_dirs.release()  # after the save in flight: another job may save there now
            if not failure.any_failed():  # a broken group's work is not waited for (see destroy_own_groups)
                self._optimizer.wait_gathers()  # the last step's parameter all-gathers
            self._reducer.remove_hooks()
            self._optimizer.gathers.remove_hooks()
            if self._sp is not None and hasattr(self._sp, "remove_hooks"):  # a vision model's patch split
                self._sp.remove_hooks()
            stop_watchdog()  # the NCCL watchdog's thread; the next engine's first collective starts it again
            self._runtime.release()  # units a forward without backward kept gathered: their memory back
            self._runtime.close()  # waits for a ZeRO-3 unit-order exchange issued ahead
            self.monitor.close()
            if self._optimizer.zenflow is not None:  # its host update in flight, and its thread
                self._optimizer.zenflow.close()
            if self._optimizer.offload is not None:  # swap files are scratch: removed with their directory
                self._optimizer.offload.close()
            for scratch in self._scratch.values():
                scratch.remove()
            destroy_own_groups(self.topology)
            # the last references to the groups: a destroyed group is freed, its gloo worker threads joined, now
            # and not at interpreter teardown (see [Note: what the engine starts and who joins it])
            if not failure.any_failed():
                for comm in self._comms:
                    comm.release()
                release_groups(self.topology)

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        self.module.eval()
        return self

    def _agree(
        self,
        call: str,
        micro_steps: int | None = None,
        detail: int = 0,
        explain: Callable[..., str] | None = None,
    ) -> None:
        """[Note: phase agreement]: fail on every rank, naming each, unless all ranks are entering ``call`` at the
        same step (and agree on ``detail``; ``explain(comm, global_step, micro_step)`` says how they do not)."""
        if call not in ("forward", "backward"):  # it reads or writes shards: see [Note: gathers after the step]
            self._optimizer.wait_gathers()
        micro = self.micro_steps if micro_steps is None else micro_steps
        why = None if explain is None else lambda: explain(self._phase_check.comm, self.global_step, micro)
        self._phase_check(call, self.global_step, micro, detail, why)

    # -- inspection --------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """Current fp16 loss scale (1.0 without fp16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    @property
    def device(self) -> torch.device:
        """Where the model lives (CUDA device of this local rank, or the CPU); move batches here."""
        return self.topology.device

    def get_global_grad_norm(self, *, as_tensor: bool = False) -> float | torch.Tensor | None:
        """Global gradient norm of the last optimizer step, before clipping; the same on every rank. The step keeps
        it on the device: reading it here waits for the step (see [Note: reading device values a step later]).
        ``as_tensor``: the scalar tensor on the device instead, read by nobody yet."""
        if self._grad_norm is None:
            return None
        return self._grad_norm if as_tensor else float(self._grad_norm)

    def get_lr(self) -> list[float]:
        self._settle_overflow()
        return [g["lr"] for g in self.optimizer.param_groups]

    def graph_stats(self) -> dict[str, Any] | None:
        """Graph mode's captures, reuses, evictions and the reasons of every capture (None when graph mode is off);
        see :class:`shardtrain.graph.GraphStats`. With fp8, ``"fp8"``: the recipe, the layers converted and kept,
        and those whose ZeRO-3 gathers move float8 (none in graph mode: its graphs gather in the compute dtype)."""
        stats = self._runtime.graph_stats()
        if stats is not None and self.fp8 is not None:
            stats = {**stats, "fp8": self.fp8.as_dict()}
        return stats

    def comm_stats(self, reset: bool = False, by_group: bool = False) -> dict[str, dict]:
        """Calls and bytes per collective kind since the last reset (see :mod:`shardtrain.distributed.communicator`),
        of ZeRO's groups added up. ``by_group``: per group instead, ``{"shard": ...}``, and with hybrid sharding
        ``"replicate"`` (the gradient all-reduce across replicas) and ``"dp"`` (every data-parallel rank: the gradient
        norm, the order exchange); the bytes of the last two are the ones that leave a shard group; with ZeRO++ hpZ
        ``"hpz"`` (backward gathers from secondary shards, inside an hpZ group); with expert parallelism ``"ep"`` (the
        token exchange of the expert group) and ``"edp"`` (the expert buckets' reductions and gathers)."""
        comms = self._zero_comms()
        per_group = {name: comm.stats() for name, comm in comms.items()}
        if reset:
            for comm in comms.values():
                comm.reset_stats()
        return per_group if by_group else merge_stats(*per_group.values())

    def _zero_comms(self) -> dict[str, Communicator]:
        """ZeRO's communicators by group name (see :meth:`comm_stats`)."""
        hpz = {} if self._hpz_comm is None else {"hpz": self._hpz_comm}  # ZeRO++ hpZ's backward gathers
        if self.replica_comm is None:
            return {"shard": self.comm, **hpz, **self._expert_comms}
        return {"shard": self.comm, "replicate": self.replica_comm, "dp": self._dp_comm}

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer state (incl. ZeRO padding).

        Parameters: the permanent copies (full flat buffers at stages 0-2; shards of units plus persistent
        and frozen parameters at stage 3, less shards offloaded to files). Transient buffers (gathered units,
        stage-2/3 gradient staging) are not state and not counted."""
        buckets = self.layout.buckets
        params = sum(
            (b.flat_param if b.gather_after_step else b.shard).numel() * b.shard.element_size() for b in buckets
        )
        params += sum(r.param.numel() * r.param.element_size() for r in self.layout.records if r.bucket is None)
        if self._param_offload is not None:  # shards in their swap files are not held (see docs/offload.md)
            params -= self._param_offload.mapped_bytes()
        return {"params": params, "grads": self._reducer.grad_bytes(), "optimizer": self._optimizer.state_bytes()}

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The full model state dict on rank 0 (CPU copies; tied parameters under every name), None elsewhere.

        Collective: every rank must call it (at stages 0-2 without tensor parallelism only the desync check of
        [Note: phase agreement] communicates, so that a script right at stage 0 is right at stage 3). Units are
        gathered one at a time, so no rank holds more than one unit's full parameters besides the CPU copies on
        rank 0."""
        self._agree("full_state_dict")
        t = self.topology
        ep_comm = self._expert_comms.get("ep")
        if self._pipeline is not None:  # each stage's first rank holds its stage's tensors under the model's names
            mine = full_state_dict(  # a stage's tensor-parallel blocks joined over its tp group, its experts over ep
                self._training_state(),
                self._runtime,
                self.tp_comm,
                t.rank % t.stage_world,
                t.dp_rank,
                t.device,
                ep_comm,
            )
            # every pipeline group exchanges (object collectives are collective); only stage rank 0's hold tensors:
            # in this slice the whole model passes through the host of global rank 0's pipeline group
            stages = self._pp_comm.all_gather_object(mine, what="full state dict (pipeline stages)")
            return {k: v for part in stages for k, v in part.items()} if t.rank == 0 else None
        return full_state_dict(
            self._training_state(), self._runtime, self.tp_comm, t.rank, t.dp_rank, t.device, ep_comm
        )

    def save_checkpoint(
        self,
        save_dir: str | Path,
        tag: str | None = None,
        client_state: dict | None = None,
        *,
        async_save: bool | None = None,
    ) -> Path:
        """Save a sharded checkpoint ``save_dir/tag`` (default tag ``global_step{N}``); collective.

        Every rank writes its own part in parallel; the save is crash-safe and ``save_dir/latest`` names the
        newest complete checkpoint (see docs/checkpoint-format.md and [Note: engine checkpoint contents]).

        ``async_save=True``: return once every rank holds a host copy of what it saves; the files are written and
        ``latest`` moved in the background, and training may go on meanwhile ([Note: asynchronous checkpoints] in
        ``checkpoint/async_save.py``). The next ``save_checkpoint`` and ``close()`` wait for it and raise its
        failure. The default is the config's ``checkpoint.writer.decoupled`` (DeepSpeed's key, ``false``). Returns
        the checkpoint's path either way."""
        self._agree("save_checkpoint")
        if self._async_saver is not None:  # one save in flight at most; a failure of the previous one is raised here
            self._async_saver.wait()
        if async_save is None:
            async_save = self.config.checkpoint.writer.decoupled
        if async_save and self._async_saver is None:
            self._async_saver = AsyncSaver()
        saver = self._async_saver if async_save else None
        tag = tag or f"global_step{self.global_step}"
        return save_engine(self._training_state(), save_dir, tag, client_state, saver)

    def load_checkpoint(self, load_dir: str | Path, tag: str | None = None, load_optimizer_states: bool = True) -> dict:
        """Restore a checkpoint saved in any layout (ranks, stage); returns its ``client_state``. Collective.

        Without ``tag`` the one ``load_dir/latest`` names is loaded. ``load_optimizer_states=False`` loads the
        model weights (masters included) and the loss scale only."""
        self._agree("load_checkpoint")
        if self._async_saver is not None:  # a save in flight is what `latest` will name: load it, not the one before
            self._async_saver.wait()
        state = self._training_state()
        client_state = load_engine(state, load_dir, tag, load_optimizer_states)
        self.global_step = state.counters.get("global_step", 0)
        self.micro_steps = state.counters.get("micro_steps", 0)
        self.skipped_steps = state.counters.get("skipped_steps", 0)
        # checkpoints older than the monitors: DeepSpeed's own fallback
        self.global_samples = state.counters.get("global_samples", self.global_step * self.train_batch_size)
        return client_state

    def _training_state(self) -> TrainingState:
        """What the checkpoint code reads and restores (see :mod:`shardtrain.engine.checkpointing`)."""
        pipelined = self._pipeline is not None
        return TrainingState(
            module=self.module,
            layout=self.layout,
            optimizer=self._optimizer,
            comm=self._checkpoint_comm if pipelined else self.world_comm,
            lr_scheduler=self.lr_scheduler,
            scaler=self.scaler,
            counters={k: getattr(self, k) for k in COUNTERS},
            run={
                "compute_dtype": str(self.precision.compute_dtype).removeprefix("torch."),
                "gradient_accumulation_steps": self.gradient_accumulation_steps,
                **({"pp": self.topology.pp} if pipelined else {}),
            },
            owner=self._save_dirs,
            stage_comm=self._pp_comm if pipelined else None,
            # a weight tied across stages is written by the first ([Note: weights tied across stages])
            written_elsewhere=frozenset(id(p) for p in self._pipeline.tied)
            if pipelined and not self._pipeline.first
            else frozenset(),
        )

    def load_full_state_dict(
        self,
        source: Mapping[str, torch.Tensor] | str | Path | list[str | Path] | None,
        strict: bool = True,
        *,
        key_map: KeyMapper | None = None,
    ) -> None:
        """Load full (unsharded) weights; each rank keeps only what it holds. Collective.

        ``source`` is either a state dict on rank 0 (other ranks pass ``None``), or, on every rank, the same
        safetensors file(s) or a directory with ``model.safetensors`` / ``model.safetensors.index.json``.
        Tied parameters may appear under any of their names. With ``strict``, missing or unexpected names
        are an error; without, a warning names them. Peak memory: a rank's fragments plus one tensor (see
        :mod:`shardtrain.weights.loading`). ``key_map`` (files only): how the files' keys become the model's names
        (default: they are); :func:`shardtrain.from_pretrained` passes transformers' own key conversion.
        """
        self._agree("load_full_state_dict")
        load_full_weights(self._training_state(), source, strict, key_map)

    @contextmanager
    def gathered(self, target: nn.Module | nn.Parameter | Iterable[nn.Parameter], modifier_rank: int | None = None):
        """Full parameters of ``target`` inside the block (collective: every rank must enter).

        With ``modifier_rank=r``, the values rank ``r`` holds at the end of the block are copied to every
        rank and into the sharded state (the masters the optimizer steps), so changes made there persist.
        """
        if isinstance(target, nn.Module):
            params = list(target.parameters())
        elif isinstance(target, torch.Tensor):
            params = [target]
        else:
            params = list(target)
        if modifier_rank is not None:
            self._refuse_expert_modifier(params)
        if self._runtime.units or modifier_rank is not None:  # it gathers or broadcasts
            self._agree("gathered")
        with self._runtime.gathered(params) as units:
            yield
            if modifier_rank is not None:
                if not 0 <= modifier_rank < self.topology.dp:
                    raise ValueError(
                        f"modifier_rank {modifier_rank} is not a rank of this job (0..{self.topology.dp - 1})"
                    )
                with torch.no_grad():
                    for p in params:
                        self._dp_comm.broadcast(p.data, modifier_rank, what="parameters changed in engine.gathered()")
                    for unit in units:
                        for b in unit.buckets:
                            lo, hi = b.shard_range
                            b.shard.copy_(b.flat_param[lo:hi])
                    self._optimizer.refresh_masters(params)

    def _refuse_expert_modifier(self, params: list[nn.Parameter]) -> None:
        """One rank's values copied to every rank would overwrite the other ranks' experts (their expert parameters
        have the same shapes and hold other experts): refused by name, the same verdict on every rank."""
        if self.topology.ep == 1:
            return
        split = {id(p) for m in self.module.modules() if hasattr(m, "expert_range") for p in m.parameters()}
        experts = [r.name for p in params if id(p) in split and (r := self.layout.record_of(p)) is not None]
        if experts:
            raise ConfigError(
                f"engine.gathered(..., modifier_rank=...) with expert_parallel_size (ep_size) {self.topology.ep} "
                f"includes expert parameters ({', '.join(experts[:3])}{', ...' if len(experts) > 3 else ''}): each "
                "rank of an expert group holds other experts, so one rank's values cannot be copied to every rank; "
                "pass only dense parameters, or change the experts on every rank without modifier_rank"
            )


# -- initialize -------------------------------------------------------------------------------------


def initialize(
    model: nn.Module,
    config: Config | Mapping[str, Any] | str | Path | None = None,
    optimizer: OptimizerArg = None,
    lr_scheduler: SchedulerArg = None,
    *,
    auto_values: Mapping[str, Any] | None = None,
    tp_plan: Mapping[str, str] | None = None,
) -> Engine:
    """Wrap ``model`` for sharded data-parallel training and return the :class:`Engine`.

    ``optimizer``: a ``torch.optim.Optimizer`` built over ``model.parameters()`` (its param groups and
    hyperparameters are kept), a callable ``params -> Optimizer`` (called with the model's parameters), or
    None when the config has an ``optimizer`` section. ``lr_scheduler``: a scheduler built on that optimizer,
    a callable ``optimizer -> scheduler``, or None (the config's ``scheduler`` section, if any, is used).
    ``auto_values``: what config values written ``"auto"`` are resolved from, as Hugging Face's Trainer
    does (``lr``, ``betas``, ``eps``, ``weight_decay``, ``gradient_clipping``, ``train_micro_batch_size_per_gpu``,
    ``gradient_accumulation_steps``, ``train_batch_size``, ``warmup_min_lr``, ``warmup_num_steps``,
    ``total_num_steps``, ``precision``, ``hidden_size``; see :mod:`shardtrain.config.auto`). The resolved
    config is logged once (rank 0) and kept as ``engine.config``.
    ``tp_plan``: with ``tensor_parallel.size`` > 1, module-name patterns -> Hugging Face tensor-parallel styles
    (``colwise``, ``rowwise``, ...; see docs/tensor-parallel.md). Without it a transformers model uses its own
    plan (``config.base_model_tp_plan`` and the head's ``_tp_plan``).
    """
    cfg = load_config(config)
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize() expects an nn.Module, got {type(model).__name__}")
    with collecting() as comms:  # released by close(): see [Note: what the engine starts and who joins it]
        return _initialize(model, cfg, optimizer, lr_scheduler, auto_values, tp_plan, comms)


def _initialize(
    model: nn.Module,
    cfg: Config,
    optimizer: OptimizerArg,
    lr_scheduler: SchedulerArg,
    auto_values: Mapping[str, Any] | None,
    tp_plan: Mapping[str, str] | None,
    communicators: list[Communicator],
) -> Engine:
    world = join_world(cfg.collective_timeout_s, cfg.device)
    # the sizes are checked before any group is made; "auto" values need the data-parallel size they give
    topology = init_topology(parallel_dims(cfg, world), cfg.collective_timeout_s, cfg.device)
    # "auto" values are resolved before the model is touched; the plan the engine is built from holds them, and
    # refuses the combinations that are not built
    cfg = resolve_auto(cfg, dp=topology.dp, model=model, auto_values=auto_values)
    plan = resolve_plan(cfg, world, topology.device.type)
    if topology.rank == 0:
        log.info("shardtrain config: %s", cfg.model_dump_json(exclude_unset=True))
    _, _, gas = resolve_batch_sizes(cfg, topology.dp)  # fail on batch-size mistakes before touching the model
    if plan.dims.pp > 1:  # what cannot be cut or scheduled, before the model is touched
        check_can_cut(model, plan.dims.pp * plan.pipeline.stages_per_rank)
        check_micro_batches(plan.pipeline.schedule, gas, plan.dims.pp, plan.pipeline.stages_per_rank)
    if plan.zero.shard_parameters and plan.zero.unit_classes:
        find_unit_modules(model, plan.zero.unit_classes)  # names the classes the model does not have
    for note in ineffective_offload_keys(cfg, topology.device.type):
        log.warning(note)
    check_monitor_packages(cfg)  # an enabled tensorboard/wandb monitor without its package
    check_parameter_dtypes(model, plan.precision)  # a bf16 model without a bf16 section, ...
    if not any(p.requires_grad for p in model.parameters()):
        raise OptimizerError(
            f"{type(model).__name__} has no trainable parameters (none with requires_grad=True): nothing to train"
        )
    # the optimizer and scheduler are refused, or built, before the model is touched: moving it to its device, the
    # tensor-parallel split and deferred construction keep every parameter object the optimizer holds
    opt = build_optimizer(model, cfg, optimizer, topology.device)
    check_optimizer(opt, model, plan.zero.stage, cfg.zero_allow_untested_optimizer, tp=plan.dims.tp)
    refuse_deepspeed_muon_clipping(opt, plan.zero.stage, cfg.gradient_clipping)
    scheduler = build_lr_scheduler(cfg, opt, lr_scheduler)
    if cfg.seed is not None:
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
    if plan.dims.pp > 1:  # the last refusal before the model is touched, which a PipelineModule's interval is
        plan = apply_checkpoint_interval(model, plan)  # [Note: DeepSpeed's checkpoint interval]
    plan = choose_activation_budget(model, plan, cfg, topology, opt, tp_plan)
    parts = parallelize(model, plan, topology, opt, cfg, tp_plan)
    return Engine(model, cfg, plan, topology, opt, scheduler, parts, communicators)


def _describe(x: Any) -> str:
    if torch.is_tensor(x):
        return f"a tensor of shape {tuple(x.shape)}"
    return type(x).__name__
