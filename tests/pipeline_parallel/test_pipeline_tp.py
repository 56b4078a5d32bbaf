"""Tensor parallelism inside each pipeline stage (pp 2 x tp 2, world 4) against one process on the same global
batch: each step's loss and gradient norm, and the final parameters (tolerances of [Note: parity bounds]), for
shardtrain's GPT (its tensor-parallel plan) and a tiny Hugging Face Llama (the plan its config carries), at ZeRO 1
and 3; a checkpoint saved at pp 2 x tp 2 loads without pipelining or tensor parallelism and trains on equal."""

from __future__ import annotations

import pytest
import torch

import shardtrain
from shardtrain.testing import run_distributed
from shardtrain.testing.parity import assert_parity
from test_pipeline_parity import reference

from helpers.pipeline import CLIP, GAS, MICRO, SEQ, STEPS, VOCAB, global_batches, make_model, make_optimizer


def tp_plan(kind: str):
    from shardtrain.tensor_parallel import GPT_TP_PLAN

    return GPT_TP_PLAN if kind == "gpt" else None  # Llama: the plan its config carries


def config(pp: int, tp: int, stage: int) -> dict:
    return {
        "pipeline_parallel_size": pp,
        "tensor_parallel": {"size": tp},
        "pipeline": {"schedule": "1F1B"},
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


def pp_tp_run(kind: str, pp: int, tp: int, stage: int) -> dict:
    model = make_model(kind)
    engine = shardtrain.initialize(model, config(pp, tp, stage), optimizer=make_optimizer(model), tp_plan=tp_plan(kind))
    t = engine.topology
    assert (t.pp, t.tp, t.dp) == (pp, tp, torch.distributed.get_world_size() // (pp * tp))
    batches = batches_of(kind, engine)
    losses, norms = [], []
    for step in range(STEPS):
        losses.append(float(engine.train_batch(iter(batches[step * GAS : (step + 1) * GAS]))))
        norms.append(engine.get_global_grad_norm())
    # the shapes this rank holds (a split weight's tp block), to compare with the whole model's
    held = {n: tuple(p.shape) for n, p in engine.module.named_parameters()}
    out = {"losses": losses, "norms": norms, "params": engine.full_state_dict(), "held": held}
    engine.close()
    return out


def check(kind: str, stage: int, world: int = 4) -> None:
    results = run_distributed(pp_tp_run, world, kind, 2, 2, stage)
    ref = reference(kind, world // 4)
    assert_parity(results, ref)
    # ranks 0, 1 hold stage 0 and ranks 2, 3 stage 1, each a tp rank's blocks: a weight split in two, the rest whole
    for stage_ranks in (results[0:2], results[2:4]):
        a, b = (r["held"] for r in stage_ranks)
        assert a.keys() == b.keys() and a.keys() < ref["params"].keys()
        halves = [n for n in a if a[n] != tuple(ref["params"][n].shape)]
        assert halves, "no parameter of the stage is split over tp"
        for n in halves:
            assert 2 * torch.Size(a[n]).numel() == ref["params"][n].numel(), n
    assert results[0]["held"].keys().isdisjoint(results[2]["held"].keys())


@pytest.mark.parametrize("stage", [1, 3])
def test_gpt_pp2_tp2(stage):
    check("gpt", stage)


@pytest.mark.parametrize("stage", [1, 3])
def test_llama_pp2_tp2(stage):
    check("llama", stage)


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
