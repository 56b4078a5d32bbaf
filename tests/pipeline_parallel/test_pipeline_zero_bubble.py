"""The zero-bubble schedules (``InterleavedZeroBubble``, ``ZBVZeroBubble``, ``DualPipeV``) against one process on the
same global batch: each step's loss and gradient norm and the final parameters ([Note: parity bounds]). Their weight
passes set ``.grad`` without ``AccumulateGrad``; the reducer is handed each of those gradients once per micro-batch
([Note: the weight pass reaches the reducer] in pipeline_parallel/schedule.py), and the V-shaped ones hold stages r
and 2 pp - 1 - r on pipeline rank r."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardtrain
from shardtrain.config import sections
from shardtrain.config.plan import resolve_plan
from shardtrain.config.sections import load_config
from shardtrain.errors import ConfigError
from shardtrain.pipeline_parallel import check_micro_batches, order
from shardtrain.testing import run_distributed
from shardtrain.testing.parity import assert_parity, train_one_process
from shardtrain.zero.reducer import GradientReducer

from helpers.pipeline import CLIP, GAS, MICRO, STEPS, global_batches, make_model, make_optimizer


def _loss(kind: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(x, y) if kind == "gpt" else model(input_ids=x, labels=y).loss


def _reference(kind: str, tied: bool) -> dict:
    batches = global_batches(kind, 1)

    def run(dtype: torch.dtype) -> dict:
        model = make_model(kind, tied=tied).to(dtype)
        return train_one_process(
            model, make_optimizer(model), lambda m, i: _loss(kind, m, *batches[i]), STEPS, GAS, CLIP
        )

    ref = run(torch.float32)
    ref["exact"] = run(torch.float64)["params"]
    return ref


def _config(schedule: str, stage: int) -> dict:
    return {
        "pipeline_parallel_size": 2,
        "pipeline": {"schedule": schedule, "stages_per_rank": 2},
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def _run(kind: str, schedule: str, stage: int, tied: bool) -> dict:
    handed: list[int] = []  # how many weights each weight pass handed the reducer
    direct = GradientReducer.grads_set_directly

    def counted(self: GradientReducer, params: list[torch.Tensor]) -> None:
        handed.append(len(params))
        direct(self, params)

    GradientReducer.grads_set_directly = counted  # this worker process's class only
    try:
        return _train(kind, schedule, stage, tied, handed)
    finally:
        GradientReducer.grads_set_directly = direct


def _train(kind: str, schedule: str, stage: int, tied: bool, handed: list[int]) -> dict:
    model = make_model(kind, tied=tied)
    engine = shardtrain.initialize(model, _config(schedule, stage), optimizer=make_optimizer(model))
    batches = global_batches(kind, 1)
    if kind == "llama":
        batches = [{"input_ids": x, "labels": y} for x, y in batches]
    losses, norms = [], []
    for step in range(STEPS):
        losses.append(float(engine.train_batch(iter(batches[step * GAS : (step + 1) * GAS]))))
        norms.append(engine.get_global_grad_norm())
    if schedule in order.V_SHAPED_SCHEDULES:  # torch's V-shaped schedules run no forward-only step
        with pytest.raises(ConfigError, match=f"eval_batch under pipeline.schedule '{schedule}' is not built"):
            engine.eval_batch(iter(batches[:GAS]))
    out = {
        "losses": losses,
        "norms": norms,
        "params": engine.full_state_dict(),
        "stages": engine._pipeline.stage_ids,
        "last": engine.is_last_stage(),
        "handed": handed,
    }
    engine.close()
    return out


def _check(kind: str, schedule: str, stage: int = 1, tied: bool = False) -> list[dict]:
    results = run_distributed(_run, 2, kind, schedule, stage, tied)
    assert_parity(results, _reference(kind, tied))
    return results


def test_zbv_gpt_zero1_matches_one_process():
    """V placement (stages 0 and 3 on rank 0, whose last stage makes it the loss's rank); every weight pass of a
    stage other than the first hands the reducer its weights' gradients, once per micro-batch."""
    results = _check("gpt", "ZBVZeroBubble", stage=1)
    assert [r["stages"] for r in results] == [[0, 3], [1, 2]]
    assert [r["last"] for r in results] == [True, False]
    # rank 0: stage 3's weight passes (stage 0's backward runs whole); rank 1: stages 1 and 2's; one a micro-batch
    assert [len(r["handed"]) for r in results] == [STEPS * GAS, 2 * STEPS * GAS]
    assert all(n > 0 for r in results for n in r["handed"])


def test_zbv_llama_zero3_matches_one_process():
    _check("llama", "ZBVZeroBubble", stage=3)


def test_interleaved_zero_bubble_gpt_zero3_matches_one_process():
    _check("gpt", "InterleavedZeroBubble", stage=3)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_zbv_tied_embeddings_match_one_process(kind):
    """Under V the first and last stage are on rank 0: the tied weight is one parameter there, its two stages'
    gradients (the embedding's through AccumulateGrad, the head's from the weight pass) added by the reducer."""
    _check(kind, "ZBVZeroBubble", stage=1, tied=True)


@pytest.mark.soak
@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_dual_pipe_v_matches_one_process(kind):
    _check(kind, "DualPipeV", stage=1)


@pytest.mark.soak
def test_interleaved_zero_bubble_llama_zero1_matches_one_process():
    _check("llama", "InterleavedZeroBubble", stage=1)


@pytest.mark.soak
def test_zbv_gpt_zero0_and_2_match_one_process():
    for stage in (0, 2):
        _check("gpt", "ZBVZeroBubble", stage=stage)


def test_v_shaped_schedule_needs_two_stages_per_rank():
    with pytest.raises(ConfigError, match="V-shaped schedule holds exactly 2 stages per rank"):
        load_config({"pipeline": {"schedule": "ZBVZeroBubble", "stages_per_rank": 3}})


_ZBV = {"pipeline_parallel_size": 2, "pipeline": {"schedule": "ZBVZeroBubble", "stages_per_rank": 2}}


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"activation_checkpointing": {"policy": "full"}}, "'ZBVZeroBubble' and activation checkpointing"),
        (
            {"pipeline": {**_ZBV["pipeline"], "activation_checkpoint_interval": 1}},
            "'ZBVZeroBubble' and activation checkpointing",
        ),
    ],
    ids=["policy", "interval"],
)
def test_what_a_zero_bubble_schedule_does_not_compose_with_is_refused_by_name(extra, named):
    """A checkpointed block would be recomputed in the input pass and again in the weight pass (shardtrain's
    checkpoint context is entered once per recomputation)."""
    with pytest.raises(ConfigError, match=named):
        resolve_plan(load_config({**_ZBV, **extra}), 4)


def test_too_few_micro_batches_for_dual_pipe_v_are_refused_by_name():
    """torch's own check of its action lists (DualPipeV: a micro-batch per stage), as a named error before the model
    is touched; enough of them pass."""
    with pytest.raises(ConfigError, match=r"'DualPipeV' .* cannot run gradient_accumulation_steps 2 micro-batches"):
        check_micro_batches("DualPipeV", 2, 2, 2)
    check_micro_batches("DualPipeV", 4, 2, 2)


def test_the_config_and_the_schedules_name_the_same_zero_bubble_schedules():
    assert sections.SPLIT_BACKWARD_SCHEDULES == order.SPLIT_BACKWARD_SCHEDULES
    assert set(order.SPLIT_BACKWARD_SCHEDULES) <= set(sections.MULTI_STAGE_SCHEDULES)


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (2, 8), (3, 6), (4, 8), (4, 16)])
def test_the_bubble_from_torch_s_action_lists(pp, m):
    """[Note: a schedule's bubble from its own actions]: for the interleaved 1F1B family the idle slots of torch's
    lists are the formula ``(p-1)/(v m + p-1)``; the zero-bubble schedules' weight passes fill all but
    ``(p-1)/(3 v m + p-1)`` (forward, input pass and weight pass of equal cost) once ``m >= 2p``."""
    for schedule in ("Interleaved1F1B", "LoopedBFS"):
        assert order.simulated_bubble(schedule, pp, m, 2) == pytest.approx((pp - 1) / (2 * m + pp - 1))
    assert order.simulated_bubble("Interleaved1F1B", pp, m, 3) == pytest.approx((pp - 1) / (3 * m + pp - 1))
    for schedule in order.SPLIT_BACKWARD_SCHEDULES:
        assert order.simulated_bubble(schedule, pp, m, 2) == pytest.approx((pp - 1) / (6 * m + pp - 1))


def test_the_bubble_counts_what_a_formula_misses():
    """With as few micro-batches as pipeline ranks, ZBVZeroBubble's warm-up is not filled by weight passes: its
    action lists idle more than ``(p-1)/(6m+p-1)`` says, and the estimate reports what they idle."""
    zbv = order.simulated_bubble("ZBVZeroBubble", 4, 4, 2)
    assert zbv == pytest.approx(0.2) and zbv > 3 / (6 * 4 + 3)


@pytest.mark.parametrize(("kind", "stage"), [("gpt", 1), pytest.param("llama", 3, marks=pytest.mark.soak)])
def test_zero_bubble_with_tensor_parallelism_matches_one_process(kind, stage):
    """pp 2 x tp 2 (world 4): the weight pass runs the tensor-parallel layers' gradient hooks (a replicated weight's
    partial gradients summed over tp) as a whole backward does; eval_batch against one process's loss."""
    from test_pipeline_tp import check as check_tp

    check_tp(kind, stage, schedule="InterleavedZeroBubble")
