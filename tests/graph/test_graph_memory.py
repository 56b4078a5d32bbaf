"""Graph-mode ZeRO-3's memory with the default compiler (docs/graph-memory.md): the capture imports no more of the
compile stack than ``aot_eager`` needs (every module imported stays in the process for its whole life), and the
graphs take AOT autograd's argument list and empty it, so that the backward frees each saved tensor after its
last use instead of holding them all to its end."""

from __future__ import annotations

import sys

import pytest

import shardtrain
from shardtrain.testing import run_distributed

from helpers.tp_cases import Case, config_for, forward_engine, global_batches, make_model, make_optimizer

# what the min-cut partitioner's common-subexpression pass imports (Inductor's pattern matcher, lowerings, kernels)
INDUCTOR_ONLY = ("torch._inductor.pattern_matcher", "torch._inductor.lowering", "torch._inductor.compile_fx")


def _captured_modules() -> dict:
    """World 2 (fresh processes from the forkserver, which preloads TorchDynamo but none of these): two steps of
    graph-mode ZeRO-3 with the default compiler; which of INDUCTOR_ONLY were imported, and what was captured."""
    case = Case()
    before = [m for m in INDUCTOR_ONLY if m in sys.modules]
    model = make_model(case)
    config = {**config_for(case, 3, 1), "graph": {"enabled": True, "strict": True}}
    engine = shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, case.lr))
    batches = global_batches(case, engine.topology.dp)
    lo, hi = engine.topology.dp_rank * case.micro, (engine.topology.dp_rank + 1) * case.micro
    for x, y in batches[:2]:
        engine.backward(forward_engine(engine, x[lo:hi], y[lo:hi]))
        engine.step()
    return {
        "before": before,
        "after": [m for m in INDUCTOR_ONLY if m in sys.modules],
        "partitioner": "torch._functorch.partitioners" in sys.modules,
        "graph": engine.graph_stats(),
        # the first line of each graph's generated code and whether it empties its argument list
        "code": [
            (which, gm.code.strip().splitlines()[0], "args_list.clear()" in gm.code)
            for which, gm in engine._runtime.captured.graphs()
        ],
    }


@pytest.fixture(scope="module")
def captured() -> list[dict]:
    return run_distributed(_captured_modules, 2)


def test_aot_eager_zero3_capture_does_not_import_inductor_lowerings(captured):
    for rank, got in enumerate(captured):
        # the capture really ran the min-cut partitioner on a ZeRO-3 graph (else the check below proves nothing)
        assert got["partitioner"], rank
        assert got["graph"]["captures"] == 1 and got["graph"]["reuses"] == 1, (rank, got["graph"])
        assert got["graph"]["collectives"]["backward all-gathers"] > 0, (rank, got["graph"])
        assert got["before"] == [], (rank, got["before"])
        assert got["after"] == [], f"rank {rank}: the aot_eager capture imported {got['after']}"


def test_aot_eager_graphs_free_their_inputs_as_they_run(captured):
    for rank, got in enumerate(captured):
        assert [which for which, _, _ in got["code"]] == ["forward", "backward"], (rank, got["code"])
        for which, first_line, clears in got["code"]:
            assert first_line.startswith("def forward(self, args_list)") and clears, (rank, which, first_line)
