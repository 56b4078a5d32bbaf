"""``graph.dynamic_shapes: false``: graphs specialized on the inputs' sizes, one per set of sizes. A new size is a
new schema, captured with a reason naming the input and both shapes; each graph computes what eager does; at ZeRO
stage 3 and world 3 training matches one process step by step, with a batch size that changes mid-run."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

import shardtrain
from shardtrain import graph
from shardtrain.testing import run_distributed
from test_graph_capture import Toy, _same, _x
from test_graph_zero3 import SGD_CASE, _sgd, assert_sgd_parity, sgd_reference
from tp_cases import config_for, forward_engine, global_batches, make_model


def test_a_new_size_is_a_new_static_graph_with_its_reason(caplog):
    caplog.set_level(logging.INFO, logger="shardtrain.graph")
    model = Toy().eval()
    static, dynamic = graph.capture(model, dynamic_shapes=False), graph.capture(model)
    sizes = [(2, 5), (3, 7), (2, 5), (3, 7)]
    for batch, seq in sizes:
        x = _x(batch, seq)
        mask = torch.ones(batch, seq, dtype=torch.int64)
        want = model(x, mask)
        _same(static(x, mask), want)
        _same(dynamic(x, mask), want)
    assert static.graph_stats()["captures"] == 2 and static.graph_stats()["reuses"] == 2, static.graph_stats()
    assert dynamic.graph_stats()["captures"] == 1 and dynamic.graph_stats()["reuses"] == 3, dynamic.graph_stats()
    lines = [r.getMessage() for r in caplog.records if r.name == "shardtrain.graph"]
    assert "input 'x': shape [2, 5, 8] -> [3, 7, 8] (static shapes)" in lines[-1], lines
    assert "input 'mask': shape [2, 5] -> [3, 7] (static shapes)" in lines[-1], lines
    # the static graph has no symbolic size anywhere: specialized, not generic
    for which, gm in static.graphs():
        for node in gm.graph.nodes:
            val = node.meta.get("val")
            assert not isinstance(val, torch.SymInt), (which, node)
            if isinstance(val, torch.Tensor):
                assert all(isinstance(d, int) for d in val.shape), (which, node, val.shape)


def _static_run(case, halves: list[bool]) -> dict:
    """World N, ZeRO-3 in graph mode with static shapes, plain SGD; at the steps where ``halves`` says so, each
    micro-batch is run as two calls of half the rows (another size: another graph), the two losses weighted so the
    gradient is the full micro-batch's."""
    model = make_model(case)
    config = {**config_for(case, 3, 1), "graph": {"enabled": True, "strict": True, "dynamic_shapes": False}}
    engine = shardtrain.initialize(model, config=config, optimizer=_sgd(model))
    batches = global_batches(case, engine.topology.dp)
    lo, hi = engine.topology.dp_rank * case.micro, (engine.topology.dp_rank + 1) * case.micro
    after = []
    for step, split in enumerate(halves):
        for m in range(case.gas):
            x, y = batches[step * case.gas + m]
            x, y = x[lo:hi], y[lo:hi]
            if split:
                h = case.micro // 2
                loss = (forward_engine(engine, x[:h], y[:h]) + forward_engine(engine, x[h:], y[h:])) / 2
            else:
                loss = forward_engine(engine, x, y)
            engine.backward(loss)
            engine.step()
        after.append(engine.full_state_dict())
    dist.barrier()
    return {"after": after, "graph": engine.graph_stats()}


@pytest.mark.parametrize("world", [2, 3])
def test_static_shapes_zero3_trains_like_one_process_across_sizes(world):
    halves = [False, True, False]
    got = run_distributed(_static_run, world, SGD_CASE, halves, timeout=600)[0]
    init = make_model(SGD_CASE).state_dict()
    assert_sgd_parity(got["after"], sgd_reference(SGD_CASE, world), init, f"static graph world {world}")
    stats = got["graph"]
    assert stats["captures"] == 2 and stats["fallbacks"] == [], stats  # the full micro-batch and the half
    assert any("(static shapes)" in reason for reason in stats["reasons"]), stats
