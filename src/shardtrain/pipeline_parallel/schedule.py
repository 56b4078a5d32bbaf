"""This rank's pipeline stages on ``torch.distributed.pipelining``'s ``PipelineStage`` and schedules.

[Note: one pipeline step]
``engine.train_batch`` pulls ``gradient_accumulation_steps`` micro-batches and hands them to :meth:`Pipeline.run`,
which joins them along the rows and lets torch's schedule cut them again (``tensor_split`` along dim 0: the same
micro-batches). The first stage is given the inputs, the last the labels; the loss function divides each
micro-batch's loss by their count (``scale_grads=False``), so the gradients summed over micro-batches are those of
the mean loss, as ``engine.backward`` divides by the accumulation steps. A whole backward is plain autograd
(``torch.autograd.backward`` per stage output), so the gradient reducer's hooks see every parameter's gradient
accumulate (a split one: [Note: the weight pass reaches the reducer]); the engine opens one reducer backward around
the whole schedule, without overlap, so each bucket is reduced once per step, after the last micro-batch.

[Note: the weight pass reaches the reducer]
The zero-bubble schedules (``SPLIT_BACKWARD_SCHEDULES``) split a micro-batch's backward into an input pass (I: the
gradient sent to the previous stage, ``torch.autograd.grad`` of the stage's inputs, no weight touched) and a later
weight pass (W), torch's ``stage_backward_weight``: ``torch.autograd.grad`` of the weights, written into ``.grad`` by
assignment or ``+=``, not through ``AccumulateGrad``, so the reducer's post-accumulate hooks never run. Each stage
here (:class:`_SplitBackwardStage`) runs torch's weight pass itself, with every weight's ``.grad`` set aside and
None, over the rank's own parameters (a stage module reads the model's pieces and holds none itself: [Note: stages
keep the model's names]); each weight that pass gave a gradient is then handed to the reducer
(``grads_set_directly``), which folds it as its hook would (into the gradient buffer or the staging), exactly once
per micro-batch; the others get their ``.grad`` back. Hooks on the weights themselves (tensor parallelism's sum of a
replicated weight's partial gradients over tp) run in that ``torch.autograd.grad`` as in a whole backward. The first
stage sends no input gradient: torch runs its whole backward in the W slot, through ``AccumulateGrad``, as under
1F1B. The V-shaped schedules (``ZBVZeroBubble``, ``DualPipeV``) hold stages ``r`` and ``2 pp - 1 - r`` on pipeline
rank ``r`` (:func:`stage_ids_of_rank`): the first and the last stage on rank 0, whose loss that rank reports and
whose tied weight is one parameter there (nothing to sum across ranks).

[Note: a stage gathered for its schedule]
At ZeRO stage 3 ``train_batch`` gathers all of this rank's units (its stages' parameters, over the stage's
data-parallel ranks) before the schedule's first forward and releases them after its last backward, before the
deferred reduce-scatters: FSDP2's ``reshard_after_forward=False`` with PP (torchtitan's choice when pp > 1). A
schedule interleaves the micro-batches' forwards and backwards, so gathering per unit and pass would all-gather each
unit twice per micro-batch: ``2 m`` times the bytes, for a stage that holds ``1 / pp`` of the model. Gathered once,
a step moves ``P (N - 1) / N`` parameter bytes and reduces each bucket once. The cost is memory during the step: the
stage's whole parameters and its whole gradients (the reducer's staging, in the accumulation dtype, [Note: gradient
storage per stage]); between steps only the shards, the gradient shards and the optimizer state stay. So the runtime
installs no unit hooks under pipeline parallelism (the stage modules, not the model, run the forwards), and ZeRO-3's
prefetch and ``stage3_max_live_parameters`` do not apply.

[Note: stage shapes given, not inferred]
torch's ``PipelineStage`` infers the activations' shapes by running each stage's forward on meta tensors, which
tensor-parallel layers cannot do (a vocab-parallel embedding masks its ids by value). With tensor parallelism every
stage is therefore given its example input and output (torch's static mode, which all stages must vote for): the
first stage's input is its first micro-batch's ids, another's the ``[rows, seq, width]`` hidden states in the
compute dtype, and each output comes from one real forward of the stage on that input, without gradients and with
the random state restored; the float ones are marked as requiring a gradient, which torch's static mode reads as
"a gradient is sent back for it". The stages and the schedule are built at the first step of each kind (training,
evaluation), whose micro-batches' shapes every later step of that kind must have; with tensor parallelism an
evaluation builds a schedule of its own rather than letting torch infer the shapes again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

from shardtrain.errors import ConfigError
from shardtrain.pipeline_parallel.cut import LossFn
from shardtrain.pipeline_parallel.order import (
    SPLIT_BACKWARD_SCHEDULES,
    V_SHAPED_SCHEDULES,
    is_multi_stage,
    last_stage_rank,
    schedule_actions,
    stage_ids_of_rank,
)

LABEL_KEYS = ("labels", "targets")
POSITION_KEY = "position_ids"  # beside the one input: given to every stage (packed documents, global positions)
GradsSetDirectly = Callable[[list[nn.Parameter]], None]
"""Hands the reducer weights whose ``.grad`` a pass assigned rather than accumulated ([Note: the weight pass reaches
the reducer])."""


class _SplitBackwardStage(PipelineStage):
    """A ``PipelineStage`` whose input and weight passes run over ``weights`` and hand the weight gradients to the
    reducer ([Note: the weight pass reaches the reducer])."""

    def __init__(self, *args: Any, weights: list[nn.Parameter], deliver: GradsSetDirectly, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._weights, self._deliver = weights, deliver

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
    ) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, Any]] | None]:
        if backward_type == "input":
            return stage_backward_input(
                bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"], iter(self._weights)
            )
        if backward_type != "weight":  # a whole backward: AccumulateGrad runs the reducer's hooks
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        held = [p.grad for p in self._weights]  # the reducer's buffer views (ZeRO 0-1) or None
        for p in self._weights:
            p.grad = None
        stage_backward_weight(iter(self._weights), bwd_kwargs["param_groups"])
        got = [p for p in self._weights if p.grad is not None]
        for p, grad in zip(self._weights, held):
            if p.grad is None:
                p.grad = grad
        self._deliver(got)
        return (), None


def split_micro_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, labels)`` of one micro-batch: a 2-tuple as DeepSpeed's ``PipelineModule`` takes, or a dict with
    the labels under ``labels`` (transformers) or ``targets`` (shardtrain's GPT), one input tensor and, for a Hugging
    Face Llama-family model, ``position_ids`` (:func:`micro_batch_positions`)."""
    if isinstance(batch, Mapping):
        labels = [k for k in LABEL_KEYS if k in batch]
        inputs = [k for k in batch if k not in (*LABEL_KEYS, POSITION_KEY)]
        if len(labels) != 1 or len(inputs) != 1:
            raise ConfigError(
                f"a pipeline micro-batch dict needs one label key ({' or '.join(LABEL_KEYS)}) and one input tensor "
                f"(and may have {POSITION_KEY}), got keys {sorted(batch)}; other inputs (attention_mask) are not built "
                "under pipeline parallelism yet"
            )
        return batch[inputs[0]], batch[labels[0]]
    if isinstance(batch, Sequence) and len(batch) == 2 and all(torch.is_tensor(t) for t in batch):
        return batch[0], batch[1]
    raise ConfigError(
        f"a pipeline micro-batch is an (inputs, labels) pair of tensors or a dict of them, got {type(batch).__name__}"
    )


def micro_batch_positions(batch: Any) -> torch.Tensor | None:
    """A micro-batch dict's ``position_ids`` ``[rows or 1, seq]`` (or ``[seq]``) as ``[rows, seq]``; None when it has
    none."""
    positions = batch.get(POSITION_KEY) if isinstance(batch, Mapping) else None
    if positions is None:
        return None
    inputs, _ = split_micro_batch(batch)
    if not torch.is_tensor(positions) or positions.shape[-1] != inputs.shape[-1] or positions.dim() > 2:
        shape = tuple(positions.shape) if torch.is_tensor(positions) else type(positions).__name__
        raise ConfigError(
            f"position_ids {shape} in a pipeline micro-batch of inputs {tuple(inputs.shape)}: give [rows, seq] (or "
            "[1, seq], [seq]) positions of its tokens"
        )
    return positions.reshape(-1, positions.shape[-1]).expand(inputs.shape[0], -1)


@runtime_checkable
class SequenceShare(Protocol):
    """Where the sequence is split over ranks (sequence or context parallelism in each stage, [Note: a sequence
    split in a pipeline] in ``engine/pipeline_sequence.py``): each micro-batch's share of this rank, and the loss over
    the ranks sharing the sequence."""

    def prepare(
        self, inputs: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """This rank's inputs and labels and what every stage is given with them, from the whole micro-batch."""
        ...

    def loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The whole micro-batch's mean loss from this rank's output and labels."""
        ...


def _check_one_shape(tensors: list[torch.Tensor], what: str) -> None:
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) != 1:
        raise ConfigError(
            f"the micro-batches of one pipeline step have {what} of different shapes {sorted(shapes)}: the schedule "
            "sends activations of one shape between stages; pad or bucket them to one shape per step"
        )


def _join(tensors: list[torch.Tensor], what: str) -> torch.Tensor:
    _check_one_shape(tensors, what)
    return torch.cat(tensors)


def check_micro_batches(schedule: str, micro_batches: int, pp: int, stages_per_rank: int = 1) -> None:
    """Refuse a step of fewer micro-batches than the schedule needs (1F1B and the interleaved ones: one per stage
    rank; the multi-stage ones as torch's own check of its action lists), before the model is touched."""
    if micro_batches < pp and schedule.lower() in ("1f1b", "interleaved1f1b"):
        raise ConfigError(
            f"pipeline.schedule {schedule!r} needs at least pipeline_parallel_size ({pp}) micro-batches per step, got "
            f"gradient_accumulation_steps {micro_batches}; raise it (more micro-batches also shrink the bubble) or use "
            "GPipe"
        )
    if is_multi_stage(schedule):
        schedule_actions(schedule, pp, stages_per_rank, micro_batches)


class Pipeline:
    """This rank's stages (``stage_ids`` of ``num_stages``) and the schedule that runs them."""

    def __init__(
        self,
        parts: list[nn.Module],
        stage_ids: list[int],
        num_stages: int,
        loss_fn: LossFn,
        tied: list[nn.Parameter] | None = None,
        activation_width: int | None = None,
        weights: list[nn.Parameter] | None = None,
    ) -> None:
        """``activation_width``: the hidden size the stages send each other, where their shapes are given rather
        than inferred ([Note: stage shapes given, not inferred]); None: torch infers them. ``weights``: this rank's
        parameters, which a zero-bubble schedule's weight passes differentiate ([Note: the weight pass reaches the
        reducer])."""
        self.parts, self.stage_ids, self.num_stages, self.loss_fn = parts, stage_ids, num_stages, loss_fn
        self.weights: list[nn.Parameter] = list(weights or [])
        self.activation_width = activation_width
        self._make_schedule: Callable[[list[Any] | None], Any] | None = None
        self._schedules: dict[bool, Any] = {}  # with given shapes: each kind's, built at its first step
        self._activation_dtype = torch.float32
        self._micro_batches = 1
        # the parameters this rank shares with the other end of the pipeline, in one order on both ([Note: weights
        # tied across stages] in pipeline_parallel/cut.py); empty on the middle stages and for an untied model
        self.tied: list[nn.Parameter] = list(tied or [])
        self._schedule = None
        self._device = torch.device("cpu")
        self._training = True  # whether the running step trains (an fp16 loss is scaled) or evaluates
        self._unscaled: dict[int, torch.Tensor] = {}  # id of a loss given to the schedule: the unscaled loss
        # the first train step's and the first eval step's inputs and labels: torch's schedule infers the stages'
        # activation shapes again when it turns from training to evaluation or back, never within one
        self._shapes: dict[bool, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self.sequence: SequenceShare | None = None  # the sequence split over ranks in each stage (else None)

    def share_sequence(self, sequence: SequenceShare) -> None:
        """Split every micro-batch's sequence over ranks as ``sequence`` says: its inputs and labels, what the
        stages are given, and the loss ([Note: a sequence split in a pipeline] in ``engine/pipeline_sequence.py``);
        before the first step. The stages' shapes are then given, not inferred: the inference would run their
        exchanges on meta tensors."""
        if self.activation_width is None:
            raise ConfigError("a pipeline whose sequence is split over ranks is given its stages' activation width")
        self.sequence, self.loss_fn = sequence, sequence.loss
        for part in self.parts:
            part.sequence = sequence

    @property
    def first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def build(
        self,
        schedule: str,
        micro_batches: int,
        group: dist.ProcessGroup,
        device: torch.device,
        loss_scale: Callable[[], torch.Tensor] | None = None,
        activation_dtype: torch.dtype = torch.float32,
        grads_set_directly: GradsSetDirectly | None = None,
    ) -> None:
        """The ``PipelineStage`` of each part and ``schedule`` over ``micro_batches`` (see [Note: one pipeline
        step]); ``loss_scale``: fp16's current loss scale, which a training step's losses are multiplied by before
        the schedule's backward ([Note: fp16's loss scale in the schedule]); ``grads_set_directly``: under a
        zero-bubble schedule, where its weight passes' gradients go ([Note: the weight pass reaches the reducer])."""
        check_micro_batches(schedule, micro_batches, dist.get_world_size(group), len(self.parts))
        cls = get_schedule_class(schedule)
        k, self._device, self._activation_dtype = micro_batches, device, activation_dtype
        self._micro_batches = k

        def loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            value = self.loss_fn(output, labels)
            if loss_scale is None or not self._training:
                scaled = value / k
            else:
                # [Note: fp16's loss scale in the schedule] as engine.backward scales a loss: in fp32 (the scaled
                # loss may not fit fp16), by the scale on the device, then divided by the micro-batches; the
                # optimizer unscales, and an overflow on any stage skips the step on every stage ([Note: the norm
                # across stages] in zero/optimizer.py)
                scaled = value.float() * loss_scale().to(torch.float32) / k
            # what the step reports, unscaled, by the tensor torch lists among the step's losses (the schedule may
            # call the loss more often than once per micro-batch, on the first step's shape inference)
            self._unscaled[id(scaled)] = (value / k).detach()
            return scaled

        multi = issubclass(cls, PipelineScheduleMulti)
        split = cls.__name__.removeprefix("Schedule") in SPLIT_BACKWARD_SCHEDULES
        if split and grads_set_directly is None:
            raise ConfigError(
                f"pipeline.schedule {schedule!r} splits the backward: its weight gradients need a reducer"
            )
        weights = [p for p in self.weights if p.requires_grad]

        def stage(part: nn.Module, index: int, x: Any, y: Any) -> PipelineStage:
            common = {"input_args": x, "output_args": y, "group": group}
            if split:
                return _SplitBackwardStage(
                    part, index, self.num_stages, device, weights=weights, deliver=grads_set_directly, **common
                )
            return PipelineStage(part, index, self.num_stages, device, **common)

        def make(examples: list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] | None) -> Any:
            given = examples or [(None, None)] * len(self.parts)
            stages = [stage(p, s, x, y) for p, s, (x, y) in zip(self.parts, self.stage_ids, given)]
            return cls(stages if multi else stages[0], n_microbatches=k, loss_fn=loss, scale_grads=False)

        self._make_schedule = make
        if self.activation_width is None:
            self._schedule = make(None)

    def _examples(
        self, inputs: torch.Tensor, given: dict[str, torch.Tensor]
    ) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
        """Each of this rank's stages' example inputs and outputs for one micro-batch of ``inputs`` (the step's
        rows joined), given the first micro-batch's share of ``given``: [Note: stage shapes given, not inferred]. A
        stage that takes more than the hidden states (the routers' sums, [Note: the router's loss across stages])
        says what beside them (``carried_examples``)."""
        rows = inputs.shape[0] // self._micro_batches
        micro = inputs[:rows]
        kwargs = {k: v[:rows] for k, v in given.items()}
        hidden = (micro.shape[0], micro.shape[1], self.activation_width)
        out = []
        on_device = self._device.type != "cpu"  # the CPU generator is forked always
        devices = [self._device] if on_device else []
        with torch.no_grad(), torch.random.fork_rng(devices, device_type=self._device.type if on_device else "cuda"):
            for part, stage in zip(self.parts, self.stage_ids):
                if stage == 0:
                    args: tuple[torch.Tensor, ...] = (micro,)
                else:
                    x = torch.zeros(hidden, dtype=self._activation_dtype, device=self._device)
                    carried = getattr(part, "carried_examples", None)
                    args = (x, *(carried(self._device) if carried is not None else ()))
                    # torch sends a gradient back for what its example says requires one: every float activation
                    args = tuple(a.requires_grad_() for a in args)
                result = part(*args, **kwargs)
                outputs = result if isinstance(result, tuple) else (result,)
                out.append((args, tuple(o.requires_grad_() for o in outputs)))
        return out

    def _schedule_for(self, inputs: torch.Tensor, given: dict[str, torch.Tensor], train: bool) -> Any:
        if self.activation_width is None:
            return self._schedule
        if train not in self._schedules:
            self._schedules[train] = self._make_schedule(self._examples(inputs, given))
        return self._schedules[train]

    def knows_shapes(self, train: bool) -> bool:
        """Whether the stages have learned their activations' shapes for a training (or evaluation) step: after
        the first such step, whose micro-batches' shapes every later one must have."""
        return train in self._shapes

    def run(self, micro_batches: list[Any], train: bool = True) -> torch.Tensor | None:
        """One step's forward and backward over ``micro_batches`` (``train=False``: the forwards only, torch's
        ``schedule.eval``; the caller disables gradients); the sum of their losses divided by their count on the last
        stage's rank (the mean loss), None elsewhere."""
        pairs = [split_micro_batch(b) for b in micro_batches]
        _check_one_shape([x for x, _ in pairs], "inputs")
        _check_one_shape([y for _, y in pairs], "labels")
        shapes = (tuple(pairs[0][0].shape), tuple(pairs[0][1].shape))
        first = self._shapes.setdefault(train, shapes)
        if shapes != first:
            # the stages learned their activations' shapes at the first step: others would hang or fail deep in torch
            what = "step" if train else "eval_batch"
            raise ConfigError(
                f"pipeline micro-batches of inputs {shapes[0]} and labels {shapes[1]}, where the first {what}'s were "
                f"{first[0]} and {first[1]}: the stages exchange activations of the shapes of the first {what}; pad "
                "every micro-batch to one shape (the same rows and sequence length)"
            )
        inputs, labels, given = self._prepare(micro_batches, pairs)
        args = (inputs,) if self.first else ()
        schedule = self._schedule_for(inputs, given, train)
        run = schedule.step if train else schedule.eval
        self._training, self._unscaled = train, {}
        if self.last:
            losses: list[torch.Tensor] = []
            run(*args, target=labels, losses=losses, **given)
            mean = torch.stack([self._unscaled[id(x)] for x in losses]).sum()
            self._unscaled = {}
            return mean
        run(*args, **given)
        return None

    def _prepare(
        self, micro_batches: list[Any], pairs: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """The step's inputs and labels, its micro-batches' rows joined, and what every stage is given beside them
        (joined likewise; torch's schedule cuts them again per micro-batch): each micro-batch's position ids, and
        under a sequence split this rank's share of each."""
        positions = [micro_batch_positions(b) for b in micro_batches]
        if any(p is not None for p in positions) and not all(
            getattr(part, "takes_position_ids", False) for part in self.parts
        ):
            raise ConfigError(
                f"position_ids in the micro-batches of a pipeline of {type(self.parts[0]).__name__}: built for "
                "Hugging Face Llama-family stages; give (inputs, labels) only"
            )
        if any(p is None for p in positions) and any(p is not None for p in positions):
            raise ConfigError(
                "position_ids in some micro-batches of a pipeline step and not in others: give all or none"
            )
        device = self._device
        if self.sequence is not None:
            shares = [
                self.sequence.prepare(x.to(device), y.to(device), None if p is None else p.to(device))
                for (x, y), p in zip(pairs, positions)
            ]
        else:
            shares = [(x, y, {} if p is None else {POSITION_KEY: p}) for (x, y), p in zip(pairs, positions)]
        inputs = _join([x for x, _, _ in shares], "inputs").to(device)
        labels = _join([y for _, y, _ in shares], "labels").to(device)
        given = {k: _join([g[k] for _, _, g in shares], k).to(device) for k in shares[0][2]}
        return inputs, labels, given


__all__ = [
    "SPLIT_BACKWARD_SCHEDULES",
    "V_SHAPED_SCHEDULES",
    "GradsSetDirectly",
    "Pipeline",
    "SequenceShare",
    "check_micro_batches",
    "last_stage_rank",
    "micro_batch_positions",
    "split_micro_batch",
    "stage_ids_of_rank",
]
