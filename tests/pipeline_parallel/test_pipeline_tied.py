"""Input and output embeddings tied across the first and last pipeline stage ([Note: weights tied across stages] in
pipeline_parallel/cut.py): parity with one process training the tied model (losses and norms every step, final
parameters), the weight equal on both stages after each step, counted once in the norm, and saved once."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

import shardtrain
from shardtrain.distributed.mesh import make_groups
from shardtrain.testing import run_distributed
from shardtrain.testing.parity import assert_parity, train_one_process

from helpers.pipeline import CLIP, GAS, MICRO, STEPS, global_batches, make_model, make_optimizer

TIED = {"gpt": ("tok.weight", "head.weight"), "llama": ("model.embed_tokens.weight", "lm_head.weight")}


def _loss(kind: str, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(x, y) if kind == "gpt" else model(input_ids=x, labels=y).loss


def _reference(kind: str, dp: int, steps: int = STEPS) -> dict:
    batches = global_batches(kind, dp)

    def run(dtype: torch.dtype) -> dict:
        model = make_model(kind, tied=True).to(dtype)
        return train_one_process(
            model, make_optimizer(model), lambda m, i: _loss(kind, m, *batches[i]), steps, GAS, CLIP
        )

    ref = run(torch.float32)
    ref["exact"] = run(torch.float64)["params"]
    return ref


def _config(pp: int, stage: int, schedule: str = "1F1B", stages_per_rank: int = 1) -> dict:
    return {
        "pipeline_parallel_size": pp,
        "pipeline": {"schedule": schedule, "stages_per_rank": stages_per_rank},
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def _train(engine: shardtrain.Engine, kind: str, steps: range) -> tuple[list[float], list[float], list]:
    t = engine.topology
    rows = slice(t.dp_rank * MICRO, (t.dp_rank + 1) * MICRO)
    batches = [(x[rows], y[rows]) for x, y in global_batches(kind, t.dp)]
    if kind == "llama":
        batches = [{"input_ids": x, "labels": y} for x, y in batches]
    losses, norms, tied = [], [], []
    embedding = TIED[kind][0]
    for step in steps:
        losses.append(float(engine.train_batch(iter(batches[step * GAS : (step + 1) * GAS]))))
        norms.append(engine.get_global_grad_norm())
        # this rank's copy of the tied weight after the step (the first and last stage both hold it)
        held = dict(engine.module.named_parameters()).get(embedding)
        if held is not None:
            with engine._runtime.gathered([held]):
                tied.append(held.detach().clone())
    return losses, norms, tied


def test_the_tied_weights_group_holds_the_first_and_last_stage_ranks_at_one_place():
    """pp 3 x dp 2 (world 6): ranks r and 4 + r sum the tied gradients; the middle stage's ranks are in no such
    group; at pp 2 the pipeline group is that group (``Topology.pp_ends_group``)."""
    ends = {}
    for rank in range(6):
        main, _ = make_groups(rank, 6, 1, "gloo", "world", lambda ranks, backend: ranks, pp=3)
        ends[rank] = main.pp_ends
    assert ends == {0: [0, 4], 1: [1, 5], 2: None, 3: None, 4: [0, 4], 5: [1, 5]}


def _tied_run(kind: str, pp: int, stage: int, schedule: str, stages_per_rank: int) -> dict:
    model = make_model(kind, tied=True)
    engine = shardtrain.initialize(
        model, _config(pp, stage, schedule, stages_per_rank), optimizer=make_optimizer(model)
    )
    losses, norms, tied = _train(engine, kind, range(STEPS))
    # the first and last stage's copies, gathered to every rank: equal after every step
    copies = [c for c in engine._pp_comm.all_gather_object(tied, what="test: tied copies") if c]
    out = {"losses": losses, "norms": norms, "params": engine.full_state_dict(), "copies": copies}
    engine.close()
    return out


def _check(kind: str, pp: int, world: int, stage: int = 0, schedule: str = "1F1B", stages_per_rank: int = 1) -> None:
    results = run_distributed(_tied_run, world, kind, pp, stage, schedule, stages_per_rank)
    assert_parity(results, _reference(kind, world // pp))
    for r in results:
        first, last = r["copies"]  # the two ends of the pipeline, and only they, hold the weight
        assert all(torch.equal(a, b) for a, b in zip(first, last)) and len(first) == STEPS
    embedding, head = TIED[kind]
    assert torch.equal(results[0]["params"][embedding], results[0]["params"][head])


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_tied_embeddings_pp2_match_one_process(kind):
    _check(kind, pp=2, world=2)


def test_tied_gpt_pp3_zero3_matches_one_process():
    _check("gpt", pp=3, world=3, stage=3)


def test_tied_gpt_pp2_dp2_zero1_matches_one_process():
    _check("gpt", pp=2, world=4, stage=1)


@pytest.mark.soak
def test_tied_llama_pp3_matches_one_process():
    _check("llama", pp=3, world=3)


@pytest.mark.soak
def test_tied_gpt_interleaved_zero2_matches_one_process():
    _check("gpt", pp=2, world=2, stage=2, schedule="Interleaved1F1B", stages_per_rank=2)


def _save_then_load_unpipelined(tmp: str, stage: int) -> dict:
    world = dist.get_world_size()
    model = make_model("gpt", tied=True)
    engine = shardtrain.initialize(model, _config(2, stage), optimizer=make_optimizer(model))
    _train(engine, "gpt", range(2))
    engine.save_checkpoint(tmp, tag="t")
    engine.close()
    dist.barrier()
    # the same world without pipelining (ZeRO over every rank) resumes and trains the last step on the same rows
    model = make_model("gpt", tied=True)
    cfg = {k: v for k, v in _config(2, stage).items() if not k.startswith("pipeline")}
    cfg["train_micro_batch_size_per_gpu"] = MICRO // 2
    engine = shardtrain.initialize(model, cfg, optimizer=make_optimizer(model))
    engine.load_checkpoint(tmp, tag="t")
    share = MICRO // 2
    rows = slice(engine.topology.dp_rank * share, (engine.topology.dp_rank + 1) * share)
    for x, y in global_batches("gpt", world // 2)[2 * GAS : 3 * GAS]:
        engine.backward(engine(x[rows], y[rows]))
        engine.step()
    out = {"params": engine.full_state_dict()}
    engine.close()
    return out


@pytest.mark.parametrize(("world", "stage"), [(2, 1), (4, 3)])
def test_tied_weight_saved_once_and_resumed_without_pipelining(tmp_path, world, stage):
    """At pp 2 x dp 2, ZeRO 3, the two stages' fragments of the tied weight differ (other buckets): only the first
    stage's are written."""
    results = run_distributed(_save_then_load_unpipelined, world, str(tmp_path), stage)
    tensors = json.loads((tmp_path / "t" / "manifest.json").read_text())["tensors"]
    # one logical tensor, written by the first stage, the head's name an alias of it; its optimizer state once
    first_stage = {f"rank{r:05d}.safetensors" for r in range(world // 2)}
    assert tensors["model/tok.weight"]["aliases"] == ["model/head.weight"] and "model/head.weight" not in tensors
    assert {p["file"] for p in tensors["model/tok.weight"]["pieces"]} <= first_stage
    assert {p["file"] for p in tensors["optim/tok.weight/exp_avg"]["pieces"]} <= first_stage
    ref = _reference("gpt", world // 2)
    final = results[0]["params"]
    for name, want in ref["params"].items():
        torch.testing.assert_close(final[name], want, rtol=2e-4, atol=2e-5, msg=name)
