"""Tensor parallelism inside each pipeline stage (pp 2 x tp 2, world 4) against one process on the same global
batch: each step's loss and gradient norm, and the final parameters (tolerances of [Note: parity bounds]), for
shardtrain's GPT (its tensor-parallel plan) and a tiny Hugging Face Llama (the plan its config carries), at ZeRO 1
and 3; a checkpoint saved at pp 2 x tp 2 loads without pipelining or tensor parallelism and trains on equal."""

from __future__ import annotations

import pytest
import torch

import shardtrain
from shardtrain.distributed.mesh import make_groups
from shardtrain.testing import run_distributed
from shardtrain.testing.parity import assert_parity
from test_pipeline_parity import model_loss, reference

from helpers.pipeline import CLIP, GAS, MICRO, SEQ, STEPS, VOCAB, global_batches, make_model, make_optimizer


def test_a_stage_group_holds_one_stage_ranks_under_tensor_parallelism():
    """pp 2 x tp 2 x dp 2 (world 8): the ranks that broadcast, agree and sum the tp norm are one stage's four; without
    tensor parallelism no such group is made (the dp group serves)."""
    stage = {}
    for rank in range(8):
        main, _ = make_groups(rank, 8, 2, "gloo", "world", lambda ranks, backend: ranks, pp=2)
        stage[rank] = main.stage
        assert make_groups(rank, 8, 1, "gloo", "world", lambda ranks, backend: ranks, pp=2)[0].stage is None
    assert stage == {r: [0, 1, 2, 3] if r < 4 else [4, 5, 6, 7] for r in range(8)}


def tp_plan(kind: str):
    from shardtrain.tensor_parallel import GPT_TP_PLAN

    return GPT_TP_PLAN if kind == "gpt" else None  # Llama: the plan its config carries


def config(pp: int, tp: int, stage: int, schedule: str = "1F1B") -> dict:
    return {
        "pipeline_parallel_size": pp,
        "tensor_parallel": {"size": tp},
        "pipeline": {"schedule": schedule, "stages_per_rank": 1 if schedule in ("1F1B", "GPipe") else 2},
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def batches_of(kind: str, engine) -> list:
    t = engine.topology
    rows = slice(t.dp_rank * MICRO, (t.dp_rank + 1) * MICRO)
    batches = [(x[rows], y[rows]) for x, y in global_batches(kind, t.dp)]
    if kind == "llama":  # the dict form, as transformers' collators make it
        batches = [{"input_ids": x, "labels": y} for x, y in batches]
    return batches


def pp_tp_run(kind: str, pp: int, tp: int, stage: int, schedule: str) -> dict:
    model = make_model(kind)
    engine = shardtrain.initialize(
        model, config(pp, tp, stage, schedule), optimizer=make_optimizer(model), tp_plan=tp_plan(kind)
    )
    t = engine.topology
    assert (t.pp, t.tp, t.dp) == (pp, tp, torch.distributed.get_world_size() // (pp * tp))
    batches = batches_of(kind, engine)
    losses, norms = [], []
    for step in range(STEPS):
        losses.append(float(engine.train_batch(iter(batches[step * GAS : (step + 1) * GAS]))))
        norms.append(engine.get_global_grad_norm())
    # the shapes this rank holds (a split weight's tp block), to compare with the whole model's
    held = {n: tuple(p.shape) for n, p in engine.module.named_parameters()}
    # evaluation builds a schedule of its own, its shapes given as training's are
    evaluated = float(engine.eval_batch(iter(batches[:GAS])))
    out = {"losses": losses, "norms": norms, "params": engine.full_state_dict(), "held": held, "eval": evaluated}
    engine.close()
    return out


def check(kind: str, stage: int, world: int = 4, schedule: str = "1F1B") -> None:
    results = run_distributed(pp_tp_run, world, kind, 2, 2, stage, schedule)
    ref = reference(kind, world // 4)
    assert_parity(results, ref)
    # eval_batch: the mean loss of the first step's micro-batches under the trained parameters, as one process has it
    model = make_model(kind)
    model.load_state_dict(results[0]["params"])
    with torch.no_grad():
        expected = sum(float(model_loss(kind, model, x, y)) for x, y in global_batches(kind, world // 4)[:GAS]) / GAS
    assert all(abs(r["eval"] - expected) <= 1e-5 * abs(expected) for r in results), (
        [r["eval"] for r in results],
        expected,
    )
    # the first world / 2 ranks hold stage 0, the others stage 1; ranks 2 i and 2 i + 1 a tp pair, each holding its
    # block of a split weight (half of it) and the rest whole
    stage_world = world // 2
    for first in (0, stage_world):
        a, b = results[first]["held"], results[first + 1]["held"]
        assert a.keys() == b.keys() and a.keys() < ref["params"].keys()
        halves = [n for n in a if a[n] != tuple(ref["params"][n].shape)]
        assert halves, "no parameter of the stage is split over tp"
        for n in halves:
            assert 2 * torch.Size(a[n]).numel() == ref["params"][n].numel(), n
    assert results[0]["held"].keys().isdisjoint(results[stage_world]["held"].keys())


@pytest.mark.parametrize("stage", [1, 3])
def test_gpt_pp2_tp2(stage):
    check("gpt", stage)


@pytest.mark.parametrize("stage", [1, 3])
def test_llama_pp2_tp2(stage):
    check("llama", stage)


def test_gpt_pp2_tp2_interleaved():
    """Two stages per rank, each given its shapes: the second's input is hidden states received from the other rank."""
    check("gpt", 1, schedule="Interleaved1F1B")


@pytest.mark.soak
@pytest.mark.parametrize("stage", [1, 3])
def test_gpt_pp2_tp2_dp2(stage):
    """World 8: each stage's four ranks two tp pairs of two data-parallel ranks."""
    check("gpt", stage, world=8)


def _ckpt_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps * GAS):
        x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def _ckpt_engine(pp: int, tp: int, seed: int) -> shardtrain.Engine:
    torch.manual_seed(seed)
    model = make_model("gpt")
    if seed:  # other initial weights: everything must come from the checkpoint
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    cfg = config(pp, tp, stage=1) | {"gradient_clipping": 0.0}
    # SGD with momentum: state to resume, and no normalisation that turns a zero gradient's rounding into full steps
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return shardtrain.initialize(model, cfg, optimizer=optimizer, tp_plan=tp_plan("gpt") if tp > 1 else None)


def _ckpt_train(engine: shardtrain.Engine, batches: list, steps: range) -> list[float]:
    losses = []
    for s in steps:
        micro = batches[s * GAS : (s + 1) * GAS]
        if engine.topology.pp > 1:
            losses.append(float(engine.train_batch(iter(micro))))
            continue
        total = 0.0
        for x, y in micro:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += float(loss) / GAS
        losses.append(total)
    return losses


def _save_at_pp2_tp2(path: str) -> dict:
    batches = _ckpt_batches(4)
    engine = _ckpt_engine(2, 2, seed=0)
    _ckpt_train(engine, batches, range(2))
    engine.save_checkpoint(path, tag="step2")
    saved = engine.full_state_dict()
    straight = _ckpt_train(engine, batches, range(2, 4))
    out = {"saved": saved, "straight": straight, "final": engine.full_state_dict()}
    engine.close()
    return out


def _load_at_pp1_tp1(path: str) -> dict:
    engine = _ckpt_engine(1, 1, seed=1)
    engine.load_checkpoint(path, tag="step2")
    loaded = engine.full_state_dict()
    losses = _ckpt_train(engine, _ckpt_batches(4), range(2, 4))
    out = {"loaded": loaded, "losses": losses, "final": engine.full_state_dict(), "step": engine.global_step}
    engine.close()
    return out


def test_pp2_tp2_checkpoint_loads_at_pp1_tp1(tmp_path):
    """Each stage's tp ranks write their blocks of the model's logical tensors: one process reads the whole tensors
    (bit for bit the saved ones) with the optimizer's momentum, and trains on as the pp 2 x tp 2 run did."""
    path = str(tmp_path / "ckpt")
    first = run_distributed(_save_at_pp2_tp2, 4, path)[0]
    (one,) = run_distributed(_load_at_pp1_tp1, 1, path)
    assert one["loaded"].keys() == first["saved"].keys()
    for name, value in first["saved"].items():
        assert torch.equal(one["loaded"][name], value), name
    assert one["step"] == 4
    # the same training from there: the pipeline's and tp's summation order only
    for a, b in zip(one["losses"], first["straight"]):
        assert abs(a - b) <= 1e-5 * abs(b), (one["losses"], first["straight"])
    for name, value in first["final"].items():
        assert torch.allclose(one["final"][name], value, rtol=1e-4, atol=1e-6), name


def test_a_model_without_a_hidden_size_is_refused_by_name_under_pp_and_tp():
    """The stages' shapes are given from the model's hidden size; a model that says none (a PipelineModule, a bare
    module) is refused by name, not failed deep in torch's shape inference."""
    from shardtrain.engine.parallelize import activation_width
    from shardtrain.errors import ConfigError

    assert activation_width(make_model("gpt")) == 32 and activation_width(make_model("llama")) == 32
    with pytest.raises(ConfigError, match=r"Sequential with pipeline and tensor parallelism is not built yet"):
        activation_width(torch.nn.Sequential(torch.nn.Linear(4, 4)))
