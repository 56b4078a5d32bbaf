"""Activation checkpointing under pipeline parallelism: each stage's blocks recomputed in backward
(``activation_checkpointing.policy`` full or selective), bitwise the same training as without it (recomputation is
deterministic on the CPU) and within the parity bounds of one process."""

from __future__ import annotations

import pytest
import torch

import shardtrain
from shardtrain.config.plan import resolve_plan
from shardtrain.config.sections import load_config
from shardtrain.engine.parallelize import apply_checkpoint_interval
from shardtrain.errors import ConfigError
from shardtrain.plan import Plan
from shardtrain.testing import run_distributed
from shardtrain.testing.parity import assert_parity, train_one_process

from helpers.pipeline import CLIP, GAS, MICRO, STEPS, global_batches, make_model, make_optimizer


def _run(kind: str, pp: int, stage: int, policy: str | None) -> dict:
    model = make_model(kind)
    config = {
        "pipeline_parallel_size": pp,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if policy is not None:
        config["activation_checkpointing"] = {"policy": policy}
    engine = shardtrain.initialize(model, config, optimizer=make_optimizer(model))
    # each held block's first norm runs once per micro-batch, twice where the block is recomputed in backward
    blocks = engine.module.blocks if kind == "gpt" else engine.module.model.layers
    calls = {"n": 0}
    for block in blocks.values():
        norm = block.ln1 if kind == "gpt" else block.input_layernorm
        norm.register_forward_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
    batches = global_batches(kind, 1)
    if kind == "llama":
        batches = [{"input_ids": x, "labels": y} for x, y in batches]
    losses, norms = [], []
    for step in range(STEPS):
        losses.append(float(engine.train_batch(iter(batches[step * GAS : (step + 1) * GAS]))))
        norms.append(engine.get_global_grad_norm())
    out = {"losses": losses, "norms": norms, "params": engine.full_state_dict()}
    out["runs"], out["micro-batches"] = calls["n"], len(blocks) * STEPS * GAS  # per held block, summed
    engine.close()
    return out


def _reference(kind: str) -> dict:
    batches = global_batches(kind, 1)

    def loss(m: torch.nn.Module, i: int) -> torch.Tensor:
        x, y = batches[i]
        return m(x, y) if kind == "gpt" else m(input_ids=x, labels=y).loss

    def run(dtype: torch.dtype) -> dict:
        model = make_model(kind).to(dtype)
        return train_one_process(model, make_optimizer(model), loss, STEPS, GAS, CLIP)

    ref = run(torch.float32)
    ref["exact"] = run(torch.float64)["params"]
    return ref


def _check(kind: str, pp: int, stage: int, policy: str) -> None:
    plain = run_distributed(_run, pp, kind, pp, stage, None)
    checkpointed = run_distributed(_run, pp, kind, pp, stage, policy)
    for a, b in zip(plain, checkpointed):
        # (torch's schedule runs each stage once more at its first step, to learn the activations' shapes)
        assert b["runs"] - a["runs"] >= a["micro-batches"], (a["runs"], b["runs"], a["micro-batches"])
        assert a["losses"] == b["losses"] and a["norms"] == b["norms"]
    assert all(torch.equal(v, checkpointed[0]["params"][n]) for n, v in plain[0]["params"].items())
    assert_parity(checkpointed, _reference(kind))


def test_full_checkpointing_gpt_pp2():
    _check("gpt", pp=2, stage=0, policy="full")


def test_selective_checkpointing_llama_pp2_zero3():
    _check("llama", pp=2, stage=3, policy="selective")


@pytest.mark.soak
def test_full_checkpointing_gpt_pp3_zero1():
    _check("gpt", pp=3, stage=1, policy="full")


def _interval_plan(interval: int, pp: int = 2, **extra: object) -> Plan:
    return resolve_plan(
        load_config({"pipeline_parallel_size": pp, "pipeline": {"activation_checkpoint_interval": interval}, **extra}),
        pp,
    )


def test_deepspeeds_checkpoint_interval_of_one_is_each_block_recomputed_whole():
    """[Note: DeepSpeed's checkpoint interval]: 1 is policy "full" for a model cut here; 0 changes nothing."""
    assert apply_checkpoint_interval(make_model("gpt"), _interval_plan(1)).activations.recompute == "full"
    assert apply_checkpoint_interval(make_model("gpt"), _interval_plan(0)).activations.recompute == "none"


@pytest.mark.parametrize(
    ("interval", "extra", "named"),
    [
        (2, {}, "activation_checkpoint_interval 2 on GPT: shardtrain checkpoints each block"),
        (1, {"activation_checkpointing": {"policy": "selective"}}, "ask for two checkpointings"),
    ],
)
def test_a_checkpoint_interval_not_built_for_a_cut_model_is_refused_by_name(interval, extra, named):
    with pytest.raises(ConfigError, match=named):
        apply_checkpoint_interval(make_model("gpt"), _interval_plan(interval, **extra))


def test_a_checkpoint_interval_without_a_pipeline_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"activation_checkpoint_interval 1 is DeepSpeed's PipelineEngine key"):
        _interval_plan(1, pp=1)
