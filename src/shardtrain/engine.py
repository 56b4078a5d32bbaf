"""``initialize`` and the :class:`Engine` a training loop drives (forward, backward, step).

Protocol of one optimizer step with ``gradient_accumulation_steps = k``::

    for micro in range(k):
        loss = engine(batch)        # the module's forward
        engine.backward(loss)       # loss / k; reductions overlap backward (all stages: the last micro-step;
                                    # stage 2: every micro-step)
        engine.step()               # steps optimizer and scheduler only after the k-th micro-step
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from shardtrain import comm_failure
from shardtrain.checkpoint.async_save import AsyncSaver
from shardtrain.comm import Communicator, merge_stats
from shardtrain.config import (
    Config,
    cast_inputs_half,
    gradient_predivide,
    load_config,
    optimizer_class_and_kwargs,
    resolve_batch_sizes,
)
from shardtrain.config_auto import resolve_auto
from shardtrain.desync import PhaseCheck
from shardtrain.engine_checkpoint import COUNTERS, TrainingState, load_engine, save_engine
from shardtrain.errors import ConfigError, LayoutError, OptimizerError, RankMismatchError
from shardtrain.mesh import Topology, init_topology
from shardtrain.monitor import StepMetrics, TrainingMonitor, check_monitor_packages
from shardtrain.precision import LossScaler, check_parameter_dtypes, policy_from_config
from shardtrain.schedulers import build_scheduler
from shardtrain.sequence_parallel import SequenceSplitter, install_ulysses, refuse_unbuilt_sequence_parallel
from shardtrain.sequence_parallel.tiling import install as install_tiling
from shardtrain.tensor_parallel import assemble_blocks, check_same_batch, parallelize
from shardtrain.tensor_parallel.parallelize import check_replicated_gradients
from shardtrain.zero.build import build_layout
from shardtrain.zero.init import (
    is_deferred,
    is_under_construction,
    materialize_deferred,
    record_initialization,
)
from shardtrain.zero.layout import ParamRecord, cast_bucket
from shardtrain.zero.offload import (
    ParamOffload,
    ScratchDir,
    build_optimizer_offload,
    host_masters,
    ineffective_offload_keys,
    on_every_rank,
    prepare_scratch,
)
from shardtrain.zero.optimizer import ShardedOptimizer, TensorParallelNorm, check_optimizer, make_masters
from shardtrain.zero.reducer import GradientReducer
from shardtrain.zero.unit_runtime import ParameterUnits
from shardtrain.zero.units import find_unit_modules
from shardtrain.zero.weights import (
    Destination,
    load_safetensors,
    load_state_dict_from_rank0,
    safetensors_files,
    weight_destinations,
)

log = logging.getLogger("shardtrain")

OptimizerArg = torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer] | None
if TYPE_CHECKING:
    from shardtrain.graph import CapturedModule
    from shardtrain.graph.sharded import ShardedUnits

SchedulerArg = LRScheduler | Callable[[torch.optim.Optimizer], LRScheduler] | None


class Engine:
    """Trains ``module`` data-parallel with ZeRO; build it with :func:`initialize`."""

    def __init__(
        self,
        module: nn.Module,
        config: Config,
        topology: Topology,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: LRScheduler | None,
        tp_placements: Mapping[str, Any] | None = None,
        tp_comm: Communicator | None = None,
    ) -> None:
        self.module, self.config, self.topology = module, config, topology
        # ZeRO's collectives: the dp axis, or its shard groups with hybrid sharding, where the gradient shards are
        # all-reduced across the replicas and what must reach every data-parallel rank goes over the dp axis (see
        # [Note: the hybrid mesh] in shardtrain/mesh.py)
        self.comm = Communicator(topology.shard_group, topology.timeout_s)
        self.replica_comm = Communicator(topology.replicate_group, topology.timeout_s) if topology.hybrid else None
        self._dp_comm = Communicator(topology.dp_group, topology.timeout_s) if topology.hybrid else self.comm
        # every rank: checkpoint protocols, agreement checks, and the gradient norm on a (dp, tp) mesh
        self.world_comm = self._dp_comm if topology.tp == 1 else Communicator(topology.world_group, topology.timeout_s)
        self.tp_comm = tp_comm  # tensor-parallel layers' collectives (None without tensor parallelism)
        # sequence parallelism: the sp group's all-to-alls, and the split of every forward's inputs
        self._sp = (
            SequenceSplitter(module, Communicator(topology.sp_group, topology.timeout_s)) if topology.sp > 1 else None
        )
        if self._sp is not None:
            install_ulysses(module, self._sp.comm, tp=topology.tp)
        install_tiling(module, config)  # ALST's tiled loss and MLP, when configured
        # every rank says where it is before each call that communicates ([Note: phase agreement]); its own
        # Communicator over the world group, so that comm_stats() keeps only the traffic of the ZeRO formulas
        self._phase_check = PhaseCheck(
            Communicator(topology.host_world_group, topology.timeout_s) if config.desync_check else None,
            topology.tp,
            topology.device,
            sp=topology.sp,
        )
        zcfg = config.zero_optimization
        self.train_batch_size, self.micro_batch_size, self.gradient_accumulation_steps = resolve_batch_sizes(
            config, topology.dp
        )
        _check_ranks_agree(self.world_comm, module, config)
        # swap directories are checked on every rank before the model is touched (see docs/offload.md); a failure
        # of the rest of the construction (a full disk, a peer lost) leaves none behind
        self._scratch = _prepare_offload(zcfg, topology, self.world_comm)
        self._async_saver: AsyncSaver | None = None  # made by the first asynchronous save_checkpoint
        try:
            self._build(optimizer, lr_scheduler, tp_placements)
        except BaseException:
            for scratch in self._scratch.values():
                scratch.remove()
            raise

    def _build(
        self,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: LRScheduler | None,
        tp_placements: Mapping[str, Any] | None,
    ) -> None:
        """The parts, in order: layout, ZeRO-3 units, precision, parameter offload, reducer, optimizer, graph."""
        module, config, topology, tp_comm = self.module, self.config, self.topology, self.tp_comm
        zcfg = config.zero_optimization
        # where every parameter lives (see [Note: the layout]); built before anything else touches the model
        self.layout = build_layout(
            module, zcfg, self.comm, tp_placements, tp=topology.tp, tp_rank=topology.tp_rank, dp_comm=self._dp_comm
        )
        self.policy = self.layout.policy
        self._units: ParameterUnits | None = None
        if self.layout.units:
            self._units = ParameterUnits(
                module,
                self.layout.units,
                self.comm,
                zcfg.stage3_prefetch_bucket_size,
                zcfg.stage3_gather_check,
                check_group=topology.host_shard_group,
            )
        self.precision = policy_from_config(config)
        self.scaler = LossScaler.from_config(config)
        self.skipped_steps = 0
        masters = None
        trainable = self.layout.trainable_buckets  # frozen buckets (stage-3 units) are never reduced nor stepped
        if self.precision.mixed:  # masters from the fp32 values, then compute-dtype parameters
            masters = make_masters(trainable, self.policy)
            self._cast_to_compute_dtype()
            if self._units is not None:  # the cast made new full buffers
                self._units.index_storages()
        self._param_offload: ParamOffload | None = None
        if zcfg.offload_param.device == "nvme" and self._units is not None:  # shards into mapped files
            self._param_offload = on_every_rank(
                self.world_comm,
                "parameter swap files",
                lambda: ParamOffload(
                    self._units.units,
                    self._scratch["offload_param"],
                    topology.rank,
                    zcfg.offload_param.max_in_cpu,
                    zcfg.offload_param.buffer_count,
                ),
            )
            self._units.before_gather = self._param_offload.will_need
            self._units.after_gather = lambda unit: self._param_offload.done_with([unit])
        offload = zcfg.offload_optimizer
        if offload.device != "none" and topology.device.type == "cuda":  # the step runs on the host
            fragments = {id(s.param): s.param.detach() for b in trainable for s in b.slots}
            if self.policy.shard_optimizer_state:
                fragments = {
                    id(s.param): b.shard[f.shard_offset : f.shard_offset + f.length]
                    for b in trainable
                    for s, f in zip(b.slots, b.fragments)
                }
            ratio = offload.ratio if offload.device == "cpu" else 1.0  # nvme: resident sub-groups stay on the host
            masters = host_masters(masters, fragments, offload.pin_memory, zcfg.sub_group_size, ratio)
        partial_grads = frozenset(id(r.param) for r in self.layout.records if r.tp is not None and r.tp.partial_grad)
        self._reducer = GradientReducer(
            trainable,
            self.policy,
            self.comm,
            zcfg.overlap_comm,
            on_grad_ready=self._units.on_grad_ready if self._units else None,
            reduce_dtype=self.precision.reduce_dtype if self.precision.mixed else None,
            tp_partial=(tp_comm, partial_grads) if partial_grads and tp_comm is not None else None,
            predivide=gradient_predivide(config, topology.shard_size),
            replicate=self.replica_comm,
            order_comm=self._dp_comm,
        )
        tp_norm = None
        if topology.tp > 1:
            split = frozenset(id(r.param) for r in self.layout.records if r.tp_split)
            tp_norm = TensorParallelNorm(
                self.world_comm, split, topology.zero_rank, topology.tp_rank, replica_rank=topology.replica_rank
            )
        self._optimizer = ShardedOptimizer(
            optimizer,
            module,
            trainable,
            self._reducer,
            self.policy,
            self.comm,
            zcfg.allgather_bucket_size,
            masters=masters,
            tp_norm=tp_norm,
            dp_comm=self._dp_comm,
            replica_rank=topology.replica_rank,
            overlap_gathers=not config.graph.enabled,  # a captured graph must see plain parameters
        )
        if offload.device != "none":
            self._optimizer.attach_offload(
                build_optimizer_offload(
                    optimizer,
                    self._optimizer.stepped_tensors(),
                    offload.device,
                    zcfg.sub_group_size,
                    offload.buffer_count,
                    offload.ratio,
                    offload.pin_memory,
                    self._scratch.get("offload_optimizer"),
                    topology.rank,
                    self.world_comm,
                    fragments=self._optimizer.stepped_fragments() if masters is not None else None,
                )
            )
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.global_step = 0
        self.micro_steps = 0
        self.global_samples = 0  # DeepSpeed's x-axis for monitors: train_batch_size per optimizer step
        self._grad_norm: float | None = None
        # metrics, monitors (TensorBoard/CSV/wandb) and wall-clock breakdown: rank 0 only, never communicates
        self.monitor = TrainingMonitor(config, topology.rank, topology.device, topology.dp)
        self._batch_checked = tp_comm is None
        self._graph = _graph_mode(module, config, topology, self._graph_units())
        for comm in self._zero_comms().values():
            comm.reset_stats()

    @property
    def stage(self) -> int:
        """The ZeRO stage (what it shards is ``engine.policy``)."""
        return self.policy.stage

    # -- setup ----------------------------------------------------------------------------------
    def _cast_to_compute_dtype(self) -> None:
        """See [Note: mixed precision]: buckets, other fp32 parameters and floating buffers."""
        policy = self.precision
        for b in self.layout.buckets:
            if b.dtype == torch.float32:
                cast_bucket(b, policy.compute_dtype)
        with torch.no_grad():
            for p in self.module.parameters():
                record = self.layout.record_of(p)
                if (record is None or record.bucket is None) and policy.casts(p):
                    p.data = p.data.to(policy.compute_dtype)
            for m in self.module.modules():
                for name, buf in m._buffers.items():
                    if buf is not None and policy.casts(buf):
                        m._buffers[name] = buf.to(policy.compute_dtype)

    # -- the training loop -------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.config.fp16.enabled is True and self.config.fp16.auto_cast:  # DeepSpeed: positional inputs only
            args = cast_inputs_half(args)
        if self._graph is not None and self._graph.sharded is not None:
            return self._graph_forward(args, kwargs)
        if self._units is not None or self.tp_comm is not None or self._sp is not None:  # forward communicates
            self._agree("forward")
        if not self._batch_checked:  # every rank of a tensor-parallel group must get the same batch
            check_same_batch(args, kwargs, self.tp_comm, self.topology.host_tp_group)
            self._batch_checked = True
        if self._sp is not None:  # this rank's slice of the sequence; the loss returned is the whole sequence's
            args, kwargs = self._sp.split(args, kwargs)
        self.monitor.count_tokens(args, kwargs)  # tokens/s (see [Note: monitor metrics])
        with self.monitor.timed("forward"), self._graph_collectives("forward"):  # timed: rank 0's breakdown
            out = (self._graph or self.module)(*args, **kwargs)
        return self._sp.combine(out) if self._sp is not None else out

    def _graph_forward(self, args: tuple, kwargs: dict) -> Any:
        """Graph mode at ZeRO-3: the gathers are collectives inside the graph, so every rank must run the same
        graph. The desync check of this forward also compares the input schemas (hooks included: a subscriber on one
        rank only splits that rank's graph) and, when they differ, says how."""
        schema = self._graph.schema(args, kwargs)

        def explain() -> str:
            from shardtrain.graph.schema import differences

            everyone = self._phase_check.comm.all_gather_object(schema.portable(), what="graph-mode input schemas")
            ranks = "; ".join(
                f"rank {r} differs from rank 0: {', '.join(differences(everyone[0], s))}"
                for r, s in enumerate(everyone)
                if s != everyone[0]
            )
            return (
                f"ranks entered forward() at global step {self.global_step}, micro step {self.micro_steps} with "
                f"different inputs for graph mode: {ranks}. At ZeRO stage 3 the captured graph's gathers and "
                "reduce-scatters are collectives, so every rank must run the same graph: call the engine with inputs "
                "of the same structure, and attach hooks (subscribers) on every rank or on none."
            )

        self._phase_check("forward", self.global_step, self.micro_steps, schema.fingerprint(), explain)
        self.monitor.count_tokens(args, kwargs)
        with self.monitor.timed("forward"), self._graph_collectives("forward"):
            return self._graph.run(schema, args, kwargs)

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor, *, scale_wrt_gas: bool = True) -> None:
        """Backpropagate ``loss / gradient_accumulation_steps`` and reduce gradients across ranks.

        ``scale_wrt_gas=False`` (DeepSpeed's argument): the loss is already divided for accumulation (as the Hugging
        Face Trainer's is), so it is backpropagated as given."""
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise ValueError(f"engine.backward expects a scalar loss tensor, got {_describe(loss)}")
        self._agree("backward")  # every micro-step: see [Note: phase agreement] for why
        self.monitor.record_loss(loss)  # the train_loss metric (rank 0)
        with self.monitor.timed("backward"):
            self._backward(loss, self.gradient_accumulation_steps if scale_wrt_gas else 1)

    def _graph_units(self) -> ShardedUnits | None:
        """ZeRO-3 in graph mode: the units as graph inputs; the eager gather hooks are removed (see [Note: ZeRO-3
        as graph operations]). What graph mode does not run at stage 3 was refused by :func:`_refuse_unbuilt`."""
        if not self.config.graph.enabled or self._units is None:
            return None
        from shardtrain.graph.sharded import ShardedUnits  # imports TorchDynamo: only when graph mode is on

        self._units.remove_hooks()
        self._reducer.hand_over([b for u in self._units.units for b in u.buckets if b.requires_grad])
        wire = self.precision.reduce_dtype if self.precision.mixed else None
        return ShardedUnits(
            self._units.units,
            self.comm,
            lambda b: wire or b.dtype,
            self._reducer.shard_grad,
            self._reducer.overlap,
            predivide=self._reducer.predivide,
        )

    @contextmanager
    def _graph_collectives(self, call: str) -> Iterator[None]:
        """Graph-mode ZeRO-3: a collective of the captured graph that fails (a peer gone, the process group's
        timeout) raises the error eager collectives raise, naming the ranks, instead of the backend's."""
        if self._graph is None or self._graph.sharded is None:
            yield
            return
        started = time.monotonic()
        try:
            yield
        except RuntimeError as err:
            if not comm_failure.backend_error(err):
                raise
            what = f"ZeRO-3 units in the captured {call} graph"
            raise self.comm.describe_failure("a gather or reduce-scatter", what, err, started=started) from err

    def _backward(self, loss: torch.Tensor, divisor: int) -> None:
        # graph-mode ZeRO-3: the graph reduces the units (the reducer was told), the eager unit runtime is idle
        units = self._units if self._graph is None or self._graph.sharded is None else None
        self._reducer.begin_backward(self.is_gradient_accumulation_boundary())
        if units is not None:
            units.begin_backward()
        try:
            if self.scaler is not None:  # fp16: scale in fp32 (the scaled loss may not fit fp16)
                loss = loss.float() * self.scaler.scale
            with self._graph_collectives("backward"):
                (loss / divisor if divisor != 1 else loss).backward()
        finally:
            self._reducer.end_backward()
            if units is not None:
                units.end_backward()

    def step(self, tokens: int | None = None) -> None:
        """At an accumulation boundary: clip, step optimizer and scheduler, clear gradients.

        ``tokens``: this rank's tokens in the micro-batch just processed, for the ``tokens_per_second`` metric;
        by default rank 0 counts the elements of the first integer tensor passed to ``engine(...)``."""
        self.monitor.end_micro_step(tokens)
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        if self.policy.stage > 0 or self.tp_comm is not None:  # stage 0 steps without a collective
            self._agree("step", micro_steps=self.micro_steps - 1)  # where backward() was, not one ahead
        with self.monitor.timed("step"):
            self._optimizer_step()
        self.global_samples += self.train_batch_size
        # at every steps_per_print-th step: log and write metrics
        self.monitor.end_optimizer_step(
            StepMetrics(self.global_step, self.global_samples, self.get_lr()[0], self._grad_norm, self.loss_scale)
        )

    def _optimizer_step(self) -> None:
        scale = self.scaler.scale if self.scaler is not None else None
        self._grad_norm, skipped = self._optimizer.step(self.config.gradient_clipping, scale)
        if self._param_offload is not None:  # updated shards leave memory (the kernel writes them back)
            self._param_offload.done_with(self._units.units)
        if self.scaler is not None:
            self.scaler.update(overflow=skipped)
        if skipped:  # parameters, masters, optimizer state and the scheduler stay as they were
            self.skipped_steps += 1
            log.info("step %d skipped: gradient overflow, loss scale now %g", self.global_step + 1, self.loss_scale)
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self._reducer.zero_grads()
        self.global_step += 1

    def close(self) -> None:
        """Remove every hook the engine installed (gradient hooks, ZeRO-3 module hooks) and flush and close the
        monitors' files (TensorBoard, wandb run). Not collective; safe to call more than once. ZeRO-3 parameters
        stay sharded: take ``full_state_dict()`` first if the module is used afterwards. Waits for an asynchronous
        checkpoint save in flight and raises its failure, after the rest of the clean-up."""
        saver = self._async_saver
        try:
            if saver is not None:
                saver.wait()
        finally:
            if saver is not None:
                saver.close()
            self._reducer.remove_hooks()
            self._optimizer.gathers.remove_hooks()
            if self._units is not None:
                self._units.remove_hooks()
            self.monitor.close()
            if self._optimizer.offload is not None:  # swap files are scratch: removed with their directory
                self._optimizer.offload.close()
            for scratch in self._scratch.values():
                scratch.remove()

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        self.module.eval()
        return self

    def _agree(self, call: str, micro_steps: int | None = None) -> None:
        """[Note: phase agreement]: fail on every rank, naming each, unless all ranks are entering ``call`` at the
        same step."""
        if call not in ("forward", "backward"):  # it reads or writes shards: see [Note: gathers after the step]
            self._optimizer.wait_gathers()
        self._phase_check(call, self.global_step, self.micro_steps if micro_steps is None else micro_steps)

    # -- inspection --------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """Current fp16 loss scale (1.0 without fp16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    @property
    def device(self) -> torch.device:
        """Where the model lives (CUDA device of this local rank, or the CPU); move batches here."""
        return self.topology.device

    def get_global_grad_norm(self) -> float | None:
        """Global gradient norm of the last optimizer step, before clipping; the same on every rank."""
        return self._grad_norm

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def graph_stats(self) -> dict[str, Any] | None:
        """Graph mode's captures, reuses, evictions and the reasons of every capture (None when graph mode is off);
        see :class:`shardtrain.graph.GraphStats`."""
        return self._graph.graph_stats() if self._graph is not None else None

    def comm_stats(self, reset: bool = False, by_group: bool = False) -> dict[str, dict]:
        """Calls and bytes per collective kind since the last reset (see :mod:`shardtrain.comm`), of ZeRO's groups
        added up. ``by_group``: per group instead, ``{"shard": ...}``, and with hybrid sharding ``"replicate"``
        (the gradient all-reduce across replicas) and ``"dp"`` (every data-parallel rank: the gradient norm, the
        order exchange); the bytes of the last two are the ones that leave a shard group."""
        comms = self._zero_comms()
        per_group = {name: comm.stats() for name, comm in comms.items()}
        if reset:
            for comm in comms.values():
                comm.reset_stats()
        return per_group if by_group else merge_stats(*per_group.values())

    def _zero_comms(self) -> dict[str, Communicator]:
        """ZeRO's communicators by group name (see :meth:`comm_stats`)."""
        if self.replica_comm is None:
            return {"shard": self.comm}
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
        rank0 = self.topology.dp_rank == 0
        copies: dict[int, torch.Tensor] = {}
        if self._units is not None:
            for unit in self._units.units:
                with self._units.gathered([unit]):
                    for b in unit.buckets:
                        for s in b.slots:
                            if rank0:
                                copies[id(s.param)] = s.param.detach().to("cpu", copy=True)
        if rank0 and self.tp_comm is not None:  # tensor-parallel blocks of dp rank 0's group, joined
            for r in self.layout.records:
                if r.tp_split:
                    local = copies[id(r.param)] if id(r.param) in copies else r.param.detach()
                    copies[id(r.param)] = self._join_blocks(local.to(self.device), r).cpu()
        if self.topology.rank != 0:
            return None
        state = self.module.state_dict(keep_vars=True)
        return {k: copies[id(v)] if id(v) in copies else v.detach().to("cpu", copy=True) for k, v in state.items()}

    def _join_blocks(self, local: torch.Tensor, record: ParamRecord) -> torch.Tensor:
        """The full tensor from every tp rank's block (collective over the tensor-parallel group)."""
        t = self.topology.tp
        everyone = local.new_empty(t * local.numel())
        self.tp_comm.all_gather(everyone, local.reshape(-1).contiguous(), what=f"blocks of {record.name!r}")
        return assemble_blocks(everyone.view(t, *local.shape).unbind(0), record.tp)

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
        """What the checkpoint code reads and restores (see :mod:`shardtrain.engine_checkpoint`)."""
        return TrainingState(
            module=self.module,
            layout=self.layout,
            optimizer=self._optimizer,
            comm=self.world_comm,
            lr_scheduler=self.lr_scheduler,
            scaler=self.scaler,
            counters={k: getattr(self, k) for k in COUNTERS},
            run={
                "compute_dtype": str(self.precision.compute_dtype).removeprefix("torch."),
                "gradient_accumulation_steps": self.gradient_accumulation_steps,
            },
        )

    def load_full_state_dict(
        self,
        source: Mapping[str, torch.Tensor] | str | Path | list[str | Path] | None,
        strict: bool = True,
    ) -> None:
        """Load full (unsharded) weights; each rank keeps only what it holds. Collective.

        ``source`` is either a state dict on rank 0 (other ranks pass ``None``), or, on every rank, the same
        safetensors file(s) or a directory with ``model.safetensors`` / ``model.safetensors.index.json``.
        Tied parameters may appear under any of their names. With ``strict``, missing or unexpected names
        are an error. Peak memory: a rank's fragments plus one tensor (see :mod:`shardtrain.zero.weights`).
        """
        self._agree("load_full_state_dict")
        dests = self._weight_destinations()
        if isinstance(source, (str, Path, list, tuple)):
            load_safetensors(dests, safetensors_files(source), strict)
        else:
            load_state_dict_from_rank0(dests, source, self.world_comm, strict)  # global rank 0's dict

    def _weight_destinations(self) -> list[Destination]:
        return weight_destinations(self.module, self.layout, self._optimizer)

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
        if self._units is not None or modifier_rank is not None:  # it gathers or broadcasts
            self._agree("gathered")
        units = self._units.units_of(params) if self._units is not None else []
        context = self._units.gathered(units) if self._units is not None else nullcontext()
        with context:
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
    ``total_num_steps``, ``precision``, ``hidden_size``; see :mod:`shardtrain.config_auto`). The resolved
    config is logged once (rank 0) and kept as ``engine.config``.
    ``tp_plan``: with ``tensor_parallel.size`` > 1, module-name patterns -> Hugging Face tensor-parallel styles
    (``colwise``, ``rowwise``, ...; see docs/tensor-parallel.md). Without it a transformers model uses its own
    plan (``config.base_model_tp_plan`` and the head's ``_tp_plan``).
    """
    cfg = load_config(config)
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize() expects an nn.Module, got {type(model).__name__}")
    topology = init_topology(
        tp=cfg.tensor_parallel.degree,
        timeout_s=cfg.collective_timeout_s,
        shard_size=cfg.zero_optimization.mics_shard_size,
        sp=cfg.sequence_parallel_size,
    )
    # "auto" values are resolved before the model is touched
    cfg = resolve_auto(cfg, dp=topology.dp, model=model, auto_values=auto_values)
    if topology.rank == 0:
        log.info("shardtrain config: %s", cfg.model_dump_json(exclude_unset=True))
    resolve_batch_sizes(cfg, topology.dp)  # fail on batch-size mistakes before touching the model
    _refuse_unbuilt(cfg, topology, model)
    check_monitor_packages(cfg)  # an enabled tensorboard/wandb monitor without its package
    check_parameter_dtypes(model, policy_from_config(cfg))  # a bf16 model without a bf16 section, ...
    if cfg.seed is not None:
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
    # built under zero.Init(config) with tensor parallelism, or on meta: its parameters are made below as chunks
    deferred = is_deferred(model)
    if deferred:
        record_initialization(model)  # reset_parameters() of a model built on meta without Init, before the split
    if not deferred and any(t.device != topology.device for t in (*model.parameters(), *model.buffers())):
        model.to(topology.device)
    tp_comm, placements = None, None
    if topology.tp > 1:  # split the layers before anything is laid out or built over the parameters
        tp_comm = Communicator(topology.tp_group, topology.timeout_s)
        if not deferred:  # deferred values are the same on every rank by construction: nothing to broadcast
            _refuse_sharded_construction(model)
            _broadcast_model(model, Communicator(topology.world_group, topology.timeout_s))
        # a plan given at size 1 splits nothing: same script. A deferred model's gradient check needs real parameters
        placements = parallelize(model, tp_plan, tp_comm, check_replicated_grads=not deferred)
        if not any(p.is_split for p in placements.values()):
            raise LayoutError(
                f"tensor_parallel.size is {topology.tp} but the tensor-parallel plan splits no parameter of "
                f"{type(model).__name__}: its patterns match none of the model's module names (a model wrapped in "
                "another module has longer names; pass initialize(tp_plan=...) with the full names)"
            )
    if deferred:  # each rank's data-parallel chunk of its tensor-parallel block, and nothing more
        dp_comm = Communicator(topology.dp_group, topology.timeout_s)
        materialize_deferred(model, placements, dp_comm, topology.tp_rank, topology.tp, topology.device)
        if tp_comm is not None:
            check_replicated_gradients(model, placements, tp_comm)
    # everything that can be refused is checked before the model is touched (hooks, flat storage)
    if not any(p.requires_grad for p in model.parameters()):
        raise OptimizerError(
            f"{type(model).__name__} has no trainable parameters (none with requires_grad=True): nothing to train"
        )
    opt = _build_optimizer(model, cfg, optimizer)
    check_optimizer(opt, model, cfg.zero_optimization.stage, cfg.zero_allow_untested_optimizer)
    scheduler = _build_scheduler(cfg, opt, lr_scheduler)
    return Engine(model, cfg, topology, opt, scheduler, placements, tp_comm)


def _refuse_unbuilt(cfg: Config, topology: Topology, model: nn.Module) -> None:
    """Combinations that are not built, refused before the model, its parameters or the disk are touched."""
    zcfg = cfg.zero_optimization
    param = zcfg.offload_param
    if param.device != "none" and topology.device.type == "cuda":
        raise ConfigError(
            f"zero_optimization.offload_param.device {param.device!r} is not built on CUDA yet; use "
            "offload_optimizer (optimizer state, and fp32 masters, in host memory or on disk) and set "
            "offload_param.device to 'none' (docs/offload.md)"
        )
    if cfg.graph.enabled and zcfg.stage == 3 and (param.device == "nvme" or topology.tp > 1):
        raise ConfigError(
            "graph.enabled with ZeRO stage 3: "
            + ("offload_param to nvme" if param.device == "nvme" else "tensor parallelism")
            + " does not run in graph mode yet; turn graph mode off, or use stage 0-2 with it"
        )
    if zcfg.stage == 3 and zcfg.stage3_unit_classes:
        find_unit_modules(model, zcfg.stage3_unit_classes)  # names the classes the model does not have
    refuse_unbuilt_sequence_parallel(cfg)


def _prepare_offload(zcfg: Any, topology: Topology, world: Communicator) -> dict[str, ScratchDir]:
    """Each rank's swap directories (device ``nvme``), checked on every rank; offload keys that cannot act here are
    logged."""
    for note in ineffective_offload_keys(zcfg, topology.device.type):
        log.warning(note)
    param = zcfg.offload_param
    scratch = {}
    if param.device == "nvme":
        scratch["offload_param"] = prepare_scratch(
            param.nvme_path, topology.rank, "zero_optimization.offload_param", world
        )
    off = zcfg.offload_optimizer
    if off.device == "nvme":
        scratch["offload_optimizer"] = prepare_scratch(
            off.nvme_path, topology.rank, "zero_optimization.offload_optimizer", world
        )
    return scratch


def _refuse_sharded_construction(model: nn.Module) -> None:
    if any(is_under_construction(p) for p in model.parameters()):
        raise ConfigError(
            "a model built under shardtrain.zero.Init() (sharded over the world as it was built) cannot be split "
            "by tensor parallelism: build it under shardtrain.zero.Init(config) with the same config, whose "
            "tensor_parallel section makes each rank build only its blocks (docs/sharded-construction.md)"
        )


def _broadcast_model(model: nn.Module, world: Communicator) -> None:
    """Every rank starts from rank 0's full model before tensor parallelism cuts each rank's blocks (the
    data-parallel broadcast after the split only reaches ranks holding the same block)."""
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            world.broadcast(t.data, 0, what=f"initial value of {name!r} before the tensor-parallel split")


def _build_optimizer(model: nn.Module, cfg: Config, optimizer: OptimizerArg) -> torch.optim.Optimizer:
    if optimizer is not None and cfg.optimizer is not None:
        raise ConfigError(
            "an optimizer was passed to initialize() and the config has an 'optimizer' section; keep one of them"
        )
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if callable(optimizer):
        built = optimizer(model.parameters())
        if not isinstance(built, torch.optim.Optimizer):
            raise OptimizerError(f"the optimizer callable returned {type(built).__name__}, not a torch optimizer")
        return built
    if optimizer is not None:
        raise OptimizerError(f"optimizer must be a torch.optim.Optimizer or a callable, got {type(optimizer).__name__}")
    if cfg.optimizer is None:
        raise ConfigError("no optimizer: pass initialize(optimizer=...) or add an 'optimizer' section to the config")
    cls, kwargs = optimizer_class_and_kwargs(cfg.optimizer)
    return cls([p for p in model.parameters() if p.requires_grad], **kwargs)


def _build_scheduler(cfg: Config, opt: torch.optim.Optimizer, lr_scheduler: SchedulerArg) -> LRScheduler | None:
    if lr_scheduler is not None and cfg.scheduler is not None:
        raise ConfigError(
            "an lr_scheduler was passed to initialize() and the config has a 'scheduler' section; keep one of them"
        )
    if isinstance(lr_scheduler, LRScheduler):
        if lr_scheduler.optimizer is not opt:
            raise OptimizerError(
                "lr_scheduler was built on a different optimizer than the one passed to initialize(); "
                "build it on that optimizer, or pass a callable optimizer -> scheduler"
            )
        return lr_scheduler
    if callable(lr_scheduler):
        built = lr_scheduler(opt)
        if not isinstance(built, LRScheduler):
            raise OptimizerError(f"the lr_scheduler callable returned {type(built).__name__}, not a torch LRScheduler")
        return built
    if lr_scheduler is not None:
        raise OptimizerError(f"lr_scheduler must be an LRScheduler or a callable, got {type(lr_scheduler).__name__}")
    if cfg.scheduler is not None:
        return build_scheduler(cfg.scheduler, opt)
    return None


def _check_ranks_agree(comm: Communicator, module: nn.Module, cfg: Config) -> None:
    """Fail at once, naming ranks, if ranks got different configs or models (instead of hanging later)."""
    structure = [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters()]
    mine = {
        "config": hashlib.sha256(cfg.model_dump_json().encode()).hexdigest()[:16],
        "model": hashlib.sha256(json.dumps(structure).encode()).hexdigest()[:16],
    }
    everyone = comm.all_gather_object(mine, what="config and model fingerprints")
    for key in ("config", "model"):
        values = [e[key] for e in everyone]
        if len(set(values)) > 1:
            groups: dict[str, list[int]] = {}
            for r, v in enumerate(values):
                groups.setdefault(v, []).append(r)
            detail = "; ".join(f"ranks {rs} have {v}" for v, rs in groups.items())
            raise RankMismatchError(f"ranks disagree on the {key} passed to initialize(): {detail}")


def _graph_mode(
    module: nn.Module, config: Config, topology: Topology, sharded: ShardedUnits | None
) -> CapturedModule | None:
    """The graph-mode wrapper of ``module`` when ``graph.enabled`` (``sharded``: the ZeRO-3 units)."""
    gcfg = config.graph
    if not gcfg.enabled:
        return None
    from shardtrain.graph import CapturedModule  # imports TorchDynamo: only when graph mode is on

    return CapturedModule(
        module, strict=gcfg.strict, cache_size=gcfg.cache_size, compiler=gcfg.compiler, sharded=sharded
    )


def _describe(x: Any) -> str:
    if torch.is_tensor(x):
        return f"a tensor of shape {tuple(x.shape)}"
    return type(x).__name__
