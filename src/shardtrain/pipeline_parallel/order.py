"""A multi-stage schedule's actions per pipeline rank as torch orders them (its ``pipeline_order``), computed without
a process group, and the idle fraction of a step they leave.

[Note: a schedule's bubble from its own actions]
The bubble of a schedule is not a formula here but the idle time of torch's own action lists: each pipeline rank
runs its list in order (``F`` forward, ``B`` whole backward, ``I`` input pass, ``W`` weight pass, ``OVERLAP_F_B`` a
forward and a backward together), an action starting when its rank is free and what it needs is done: a forward
the previous stage's forward of the micro-batch, a backward (``B`` or ``I``) the stage's forward and the next stage's
backward, a weight pass its input pass. With equal stage costs, a forward costs 1, an input pass 1, a weight pass 1
and a whole backward 2 (the zero-bubble paper's ``T_F = T_B = T_W``); transfers are free. The bubble is the idle
share of ``pp`` ranks over the step's span. For the loop-placed 1F1B family this reproduces ``(p-1)/(v m + p-1)``
(tested in tests/pipeline_parallel/test_pipeline_zero_bubble.py), and it counts the zero-bubble schedules' warm-up
and drain where the weight passes do not fill them. torch builds the lists from the stages' counts alone; stand-in
stages give it those.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

from shardtrain.errors import ConfigError

SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""The zero-bubble schedules: a backward split into input and weight passes ([Note: the weight pass reaches the
reducer])."""
V_SHAPED_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
"""Schedules placing stages ``r`` and ``2 pp - 1 - r`` on pipeline rank ``r`` (two per rank)."""


def stage_ids_of_rank(schedule: str, pp: int, stages_per_rank: int, pp_rank: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` holds under ``schedule``: ``pp_rank``, ``pp_rank + pp``, ... (torch's
    loop placement), or under a V-shaped schedule ``pp_rank`` and ``2 pp - 1 - pp_rank``."""
    if schedule in V_SHAPED_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return list(range(pp_rank, pp * stages_per_rank, pp))


def last_stage_rank(schedule: str, pp: int) -> int:
    """The pipeline rank holding the last stage (the loss): 0 under a V-shaped schedule, else ``pp - 1``."""
    return 0 if schedule in V_SHAPED_SCHEDULES else pp - 1


COSTS = {"F": 1, "I": 1, "W": 1, "B": 2}
"""Each action's cost with equal stage costs ([Note: a schedule's bubble from its own actions])."""


@dataclass
class _StandInStage:
    """What torch's multi-stage schedules read of a stage to order their actions."""

    stage_index: int
    num_stages: int
    group_size: int
    group_rank: int
    submod: nn.Module
    stage_index_to_group_rank: dict[int, int] | None = None

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1


def is_multi_stage(schedule: str) -> bool:
    """Whether ``schedule`` runs several stages per rank (torch's ``PipelineScheduleMulti``)."""
    return issubclass(get_schedule_class(schedule), PipelineScheduleMulti)


def schedule_actions(schedule: str, pp: int, stages_per_rank: int, micro_batches: int) -> dict[int, list[Any]]:
    """torch's ``pipeline_order`` of a multi-stage ``schedule``: each pipeline rank's actions (None: an idle slot
    torch inserted), or a named error where torch refuses the micro-batch count."""
    cls = get_schedule_class(schedule)
    num_stages = pp * stages_per_rank
    stages = [
        _StandInStage(s, num_stages, pp, 0, nn.Identity()) for s in stage_ids_of_rank(schedule, pp, stages_per_rank, 0)
    ]
    try:
        order = cls(stages, n_microbatches=micro_batches, loss_fn=lambda out, target: out).pipeline_order
    except ValueError as err:
        raise ConfigError(
            f"pipeline.schedule {schedule!r} at pipeline_parallel_size {pp} with stages_per_rank {stages_per_rank} "
            f"cannot run gradient_accumulation_steps {micro_batches} micro-batches per step ({err}); change "
            "gradient_accumulation_steps"
        ) from err
    return {rank: list(actions) for rank, actions in order.items()}


def _compute(action: Any) -> list[Any]:
    """The compute actions in ``action`` (an overlapped forward and backward: both); none for idle and transfers."""
    if action is None:
        return []
    if action.sub_actions is not None:
        return [a for sub in action.sub_actions for a in _compute(sub)]
    return [action] if action.computation_type.value in COSTS else []


def simulated_bubble(schedule: str, pp: int, micro_batches: int, stages_per_rank: int) -> float:
    """The idle fraction of a step of ``schedule``'s own actions with equal stage costs ([Note: a schedule's bubble
    from its own actions])."""
    order = schedule_actions(schedule, pp, stages_per_rank, micro_batches)
    lists = {rank: [a for action in actions for a in _compute(action)] for rank, actions in order.items()}
    done: dict[tuple[str, int, int], int] = {}  # (kind, stage, micro-batch): when it ended
    position = dict.fromkeys(lists, 0)
    free = dict.fromkeys(lists, 0)
    last_stage = pp * stages_per_rank - 1

    def needs(kind: str, stage: int, micro: int) -> list[tuple[str, int, int]]:
        if kind == "F":
            return [("F", stage - 1, micro)] if stage > 0 else []
        if kind == "W":
            return [("I", stage, micro)]
        later = [("B", stage + 1, micro)] if stage < last_stage else []  # B or I: both written as "B" when done
        return [("F", stage, micro), *later]

    while any(position[r] < len(lists[r]) for r in lists):
        progressed = False
        for rank, actions in lists.items():
            while position[rank] < len(actions):
                a = actions[position[rank]]
                kind, stage, micro = a.computation_type.value, a.stage_index, a.microbatch_index
                ends = [done.get(n) for n in needs(kind, stage, micro)]
                if any(e is None for e in ends):
                    break
                end = max([free[rank], *ends]) + COSTS[kind]
                free[rank], position[rank] = end, position[rank] + 1
                done[(kind, stage, micro)] = end
                if kind in ("B", "I"):
                    done[("B", stage, micro)] = end
                progressed = True
        if not progressed:
            raise ConfigError(f"pipeline.schedule {schedule!r}: its actions wait on each other (torch's order)")
    span = max(free.values())
    busy = sum(COSTS[a.computation_type.value] for actions in lists.values() for a in actions)
    return 1 - busy / (pp * span)


__all__ = [
    "COSTS",
    "SPLIT_BACKWARD_SCHEDULES",
    "V_SHAPED_SCHEDULES",
    "is_multi_stage",
    "last_stage_rank",
    "schedule_actions",
    "simulated_bubble",
    "stage_ids_of_rank",
]
