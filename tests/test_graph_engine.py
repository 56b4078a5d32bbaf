"""Graph mode in the engine: ZeRO stages 0-2 train like one process on the same global batch, one capture for the
whole run, on the project's GPT and on a Hugging Face Llama; bf16, gradient accumulation and tensor parallelism
included; ZeRO-3, which graph mode does not run yet, is refused."""

from __future__ import annotations

import pytest

import shardtrain
from shardtrain.errors import ConfigError
from shardtrain.testing import run_distributed
from tp_cases import (
    Case,
    assert_parity,
    config_for,
    global_batches,
    make_model,
    make_optimizer,
    plan_for,
    reference_run,
    train,
)


def graph_run(case: Case, stage: int, tp: int = 1) -> dict:
    model = make_model(case)
    config = {**config_for(case, stage, tp), "graph": {"enabled": True, "strict": True}}
    engine = shardtrain.initialize(
        model, config=config, optimizer=make_optimizer(model, case.lr), tp_plan=plan_for(case) if tp > 1 else None
    )
    batches = global_batches(case, engine.topology.dp)
    losses, norms = train(engine, case, batches, range(case.steps))
    return {"losses": losses, "norms": norms, "params": engine.full_state_dict(), "graph": engine.graph_stats()}


@pytest.mark.parametrize(
    ("model", "stage", "world"),
    [("gpt", 0, 1), ("gpt", 1, 3), ("gpt", 2, 2), ("llama", 2, 2)],
)
def test_graph_mode_trains_like_one_process(model, stage, world):
    case = Case(model=model)  # 4 steps of 2 micro-steps each (gradient accumulation)
    results = run_distributed(graph_run, world, case, stage, timeout=600)
    assert_parity(results[0], reference_run(case, world), f"graph {model} stage {stage} world {world}")
    for r in results:  # one schema for the whole run: one capture, every other micro-step reuses it
        assert r["graph"]["captures"] == 1 and r["graph"]["reuses"] == case.steps * case.gas - 1, r["graph"]
        assert r["graph"]["fallbacks"] == [] and r["graph"]["guard_recaptures"] == 0


@pytest.mark.parametrize(("model", "stage"), [("gpt", 2), ("llama", 1)])
def test_graph_mode_with_tensor_parallelism(model, stage):
    """tp=2 (world 2): the tensor-parallel collectives and RNG forks run between the graph's pieces, by design (no
    fallback, strict on); the losses and parameters are those of one process."""
    case = Case(model=model)
    results = run_distributed(graph_run, 2, case, stage, 2, timeout=600)
    assert_parity(results[0], reference_run(case, 1), f"graph {model} stage {stage} tp 2")
    for r in results:
        assert r["graph"]["captures"] == 1 and r["graph"]["fallbacks"] == [], r["graph"]


def test_graph_mode_bf16():
    case = Case(dtype="bf16", steps=2)
    results = run_distributed(graph_run, 2, case, 2, timeout=600)
    assert_parity(results[0], reference_run(case, 2), "graph gpt bf16 stage 2 world 2")


def _refused(config: dict) -> str:
    from shardtrain.tensor_parallel import GPT_TP_PLAN

    model = make_model(Case())
    with pytest.raises(ConfigError) as err:
        shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, 1e-3), tp_plan=GPT_TP_PLAN)
    return str(err.value)


def test_zero3_is_refused_in_graph_mode_for_now():
    msg = run_distributed(_refused, 1, {**config_for(Case(), 3, 1), "graph": {"enabled": True}})[0]
    assert "graph.enabled: ZeRO stage 3 does not run in graph mode yet" in msg


def test_graph_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"graph\.compiler"):
        shardtrain.config.load_config({"graph": {"enabled": True, "compiler": "tvm"}})
    with pytest.raises(ConfigError, match=r"graph\.cache_size"):
        shardtrain.config.load_config({"graph": {"cache_size": 0}})
    with pytest.raises(ConfigError, match=r"graph\.capture"):
        shardtrain.config.load_config({"graph": {"capture": True}})
