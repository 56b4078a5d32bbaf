"""Graph-mode ZeRO-3 with tensor parallelism (issue 23, item 3): the forward is one graph ([Note: no split at ZeRO
stage 3]), so the tensor-parallel collectives (Megatron's f and g, the vocab-parallel cross-entropy's all-reduces) are
traced into it as functional collectives ([Note: one graph, no splits]), and each tp rank's unit fragments are
gathered and reduce-scattered over the dp group of its tp block.

Held, on the same ranks, to eager ZeRO-3 with tensor parallelism bitwise (the same shards, the same collectives in the
same reduction order), and to one process training on the whole global batch; at world 2 (dp 1 x tp 2) and world 4
(dp 2 x tp 2, soak: four processes capturing on this CPU). ``engine.tp_comm.stats()`` counts the all-reduces the
graphs run as eager counts its calls."""

from __future__ import annotations

import pytest
import torch

import shardtrain
from shardtrain.errors import GraphCaptureError
from shardtrain.testing import run_distributed

from helpers.tp_cases import (
    Case,
    assert_parity,
    captured_sizes,
    config_for,
    forward_engine,
    global_batches,
    make_model,
    make_optimizer,
    plan_for,
    reference_run,
    sgd_case,
    train,
)

CASE = Case(steps=3, gas=1)  # the graph captured at the second step, reused at the third


def _engine(case: Case, graph: bool, dynamic_shapes: bool = True):
    config = {**config_for(case, 3, 2), "graph": {"enabled": graph, "strict": True, "dynamic_shapes": dynamic_shapes}}
    # graph mode has no per-gather unit-order check (the desync check compares the schemas): off in both modes, so
    # that comm_stats() holds the same kinds
    config["zero_optimization"]["stage3_gather_check"] = False
    model = make_model(case)
    return shardtrain.initialize(
        model, config=config, optimizer=make_optimizer(model, case.lr, case.optimizer), tp_plan=plan_for(case)
    )


def run(case: Case, graph: bool, dynamic_shapes: bool = True) -> dict:
    """This rank's run: losses and grad norms, ZeRO's and tensor parallelism's collectives per step, rank 0's full
    parameters, the graph statistics (graphs generic in the inputs' sizes unless ``dynamic_shapes`` is false)."""
    torch._dynamo.utils.counters.clear()
    engine = _engine(case, graph, dynamic_shapes)
    engine.comm_stats(reset=True)
    engine.tp_comm.reset_stats()
    batches = global_batches(case, engine.topology.dp)
    out = {"losses": [], "norms": [], "comm": [], "tp_comm": []}
    for step in range(case.steps):
        losses, norms = train(engine, case, batches, range(step, step + 1))
        out["losses"] += losses
        out["norms"] += norms
        out["comm"].append(engine.comm_stats(reset=True))
        out["tp_comm"].append(engine.tp_comm.stats())
        engine.tp_comm.reset_stats()
    out["params"] = engine.full_state_dict()
    out["graph"] = engine.graph_stats()
    out["graphs"], out["symbolic sizes"] = captured_sizes(engine)
    out["graph_breaks"] = dict(torch._dynamo.utils.counters["graph_break"])
    out["unit_buckets"] = sum(len(bs) for _, _, bs in engine.layout.unit_buckets)
    # the buckets of the units kept from forward to backward in both modes: the root and the last block
    stack = "blocks" if case.model == "gpt" else "model.layers"
    kept = {"<root>", f"{stack}.{len(engine.module.get_submodule(stack)) - 1}"}
    out["kept_buckets"] = sum(len(bs) for name, _, bs in engine.layout.unit_buckets if name in kept)
    engine.close()
    return out


def both_modes(case: Case, dropout: bool = False) -> dict:
    """Graph mode, then eager ZeRO-3, on the same ranks; with ``dropout``, then the refusal of a GPT with dropout."""
    out = {"graph": run(case, True), "eager": run(case, False)}
    if dropout:
        out["dropout"] = refused_dropout(case)
    return out


def refused_dropout(case: Case) -> str:
    """The error of a training forward with dropout inside the attention, a tensor-parallel region (its heads are
    split), at the graph's capture: graph mode cannot fork the random stream per tp rank there ([Note:
    tensor-parallel RNG])."""
    from shardtrain.models.gpt import GPT, GPTConfig
    from shardtrain.tensor_parallel import GPT_TP_PLAN

    from helpers.tp_cases import SEQ, VOCAB

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_layer=2, n_head=4, dropout=0.1))
    config = {**config_for(case, 3, 2), "graph": {"enabled": True}}
    engine = shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, case.lr), tp_plan=GPT_TP_PLAN)
    x, y = global_batches(case, engine.topology.dp)[0]
    # the first training step runs eagerly, for the check of replicated gradients (the last test): its forward forks
    # the random stream per tp rank as eager mode does; the second forward captures the graph
    engine.backward(forward_engine(engine, x[: case.micro], y[: case.micro]))
    engine.step()
    with pytest.raises(GraphCaptureError) as err:
        engine(x[: case.micro], y[: case.micro])
    engine.close()
    return str(err.value)


def assert_bitwise(graph: dict, eager: dict, what: str) -> None:
    """Losses, grad norms and rank 0's full parameters (every tp block, joined) equal."""
    assert graph["losses"] == eager["losses"], f"{what}: losses graph {graph['losses']} vs eager {eager['losses']}"
    assert graph["norms"] == eager["norms"], f"{what}: grad norms graph {graph['norms']} vs eager {eager['norms']}"
    assert graph["params"].keys() == eager["params"].keys(), what
    for k, want in eager["params"].items():
        assert torch.equal(graph["params"][k], want), f"{what}: {k} differs from eager ZeRO-3"


def assert_one_graph(r: dict, case: Case) -> None:
    """No split, no fallback, no re-trace: one capture for the whole run, at the second micro-step (the first runs
    eagerly, for the one-time check of replicated gradients: see the last test)."""
    assert r["graph_breaks"] == {}, r["graph_breaks"]
    stats = r["graph"]
    assert stats["captures"] == 1 and stats["reuses"] == case.steps * case.gas - 2, stats
    assert stats["fallbacks"] == [] and stats["guard_recaptures"] == 0, stats


def assert_tp_counts(graph: dict, eager: dict) -> None:
    """Every step the same tensor-parallel all-reduces, calls, bytes and bytes sent, in both modes. Beside them only
    the first step's object exchanges, in both modes: the same-batch check of the first forward and the one-time
    comparison of the replicated parameters' gradients (graph mode runs that step eagerly: docs/graph-mode.md)."""
    for step, (g, e) in enumerate(zip(graph["tp_comm"], eager["tp_comm"], strict=True)):
        assert g["all_reduce"]["calls"] > 0 and g == e, (step, g, e)
        assert g.keys() == ({"all_reduce", "all_gather_object"} if step == 0 else {"all_reduce"}), (step, g)
    assert graph["tp_comm"][0]["all_gather_object"]["calls"] == 2, graph["tp_comm"][0]


def check(world: int, case: Case = CASE, dropout: bool = False) -> list[dict]:
    """Both modes on ``world`` ranks, held to each other and to one process (within run_distributed's 240 s, inside
    the suite's 300 s per test: world 6 too)."""
    results = run_distributed(both_modes, world, case, dropout)
    dp = world // 2
    what = f"graph-mode ZeRO-3 tp 2 dp {dp} {case.model} {case.optimizer}"
    graph, eager = results[0]["graph"], results[0]["eager"]
    assert_bitwise(graph, eager, what)
    assert_parity(graph, reference_run(case, dp), what)
    for r in results:
        assert_one_graph(r["graph"], case)
        assert r["graph"]["graphs"] == 2 and r["graph"]["symbolic sizes"] > 0, r["graph"]  # generic in the sizes
        if dp > 1:  # the passes found ZeRO's gathers and reductions, and only those (not tensor parallelism's)
            buckets, kept = r["graph"]["unit_buckets"], r["graph"]["kept_buckets"]
            assert 2 <= kept < buckets, (kept, buckets)
            assert r["graph"]["graph"]["collectives"] == {
                "forward all-gathers": buckets,
                "forward reduce-scatters": 0,
                "backward all-gathers": buckets - kept,  # the root and the last block kept, as in eager mode
                "backward reduce-scatters": buckets,
            }, r["graph"]["graph"]
    return results


def test_graph_zero3_with_tensor_parallelism_dp1():
    """World 2 = dp 1 x tp 2: the units are whole on each tp rank (a dp group of one: no gather in the graph), every
    collective in the graph is tensor parallelism's. Also: ``tp_comm.stats()`` counts the graphs' all-reduces as eager
    counts its calls, bytes and bytes sent, every step; so does ``comm_stats()`` (ZeRO's groups). And a GPT with
    dropout in its attention is refused at the capture of its graph (the second training forward), naming the random
    operation and what to do."""
    results = check(2, dropout=True)
    for r in results:
        graph, eager = r["graph"], r["eager"]
        assert_tp_counts(graph, eager)
        # ZeRO's group is one rank: no bytes in either mode (eager counts its calls of no-op collectives, the graph
        # has none to count)
        for stats in (*graph["comm"], *eager["comm"]):
            assert all(v["bytes"] == v["sent"] == 0 for v in stats.values()), (graph["comm"], eager["comm"])
        message = r["dropout"]
        head = "graph-mode ZeRO-3 with tensor parallelism: the forward draws random numbers"
        assert message.startswith(head) and "models/gpt.py" in message and "turn graph mode off" in message, message


@pytest.mark.soak
def test_graph_zero3_with_tensor_parallelism_dp2():
    """World 4 = dp 2 x tp 2: each tp rank's unit fragments are gathered and reduce-scattered over the dp group of its
    tp block (ranks {0, 2} and {1, 3}), the tensor-parallel all-reduces over {0, 1} and {2, 3}, in one graph."""
    results = check(4)
    for r in results:
        graph, eager = r["graph"], r["eager"]
        assert_tp_counts(graph, eager)
        for step, (g, e) in enumerate(zip(graph["comm"], eager["comm"], strict=True)):
            # the same all-gathers too: both modes keep the root and the last block from forward to backward (the
            # first step, the one graph mode runs eagerly, included)
            assert g.keys() == e.keys() == {"all_gather", "reduce_scatter"}, (step, g, e)
            assert g == e, (step, g, e)


@pytest.mark.soak
def test_graph_zero3_with_tensor_parallelism_partial_gradients():
    """A Hugging Face Qwen3 at world 2 (dp 1 x tp 2): its per-head q/k norms are replicated parameters applied to split
    heads, whose gradients are partial sums over the tp ranks (``partial_grad``). In eager mode a hook on each sums
    them; in the graph they are summed inside the units' backward, before the reduction: the same numbers."""
    check(2, Case(model="qwen3", steps=2, gas=1))


@pytest.mark.soak
def test_graph_zero3_with_tensor_parallelism_sgd_world4():
    """SGD without clipping (its update is the gradient itself: a gradient summed twice over the tp ranks, or over
    the wrong group, would show) at dp 2 x tp 2 on a Hugging Face Llama (vocab-parallel embedding, an LM head that
    gathers its output: the tensor-parallel all-gather in the graph, which the passes leave alone)."""
    check(4, sgd_case(model="llama", steps=2, gas=1))


@pytest.mark.soak
def test_graph_zero3_with_tensor_parallelism_odd_dp():
    """World 6 = dp 3 x tp 2: an odd data-parallel group (units padded to a multiple of 3, the pairwise reduce-scatter
    over three ranks summed in rank order) under tensor parallelism."""
    results = check(6)
    for r in results:
        assert_tp_counts(r["graph"], r["eager"])


def _unmarked_norms(graph: bool) -> tuple[str | None, list[str]]:
    """Qwen3 with its own plan minus ``replicated_with_grad_allreduce`` on the per-head q/k norms (their gradients are
    partial sums over the tp ranks), plus a replicated parameter no forward uses, at ZeRO stage 3: the first
    backward's error (None: trained on) and the warnings ``initialize`` and that step gave."""
    import warnings

    from shardtrain.errors import LayoutError
    from shardtrain.tensor_parallel import hf_tp_plan

    case = Case(model="qwen3", steps=1, gas=1)
    model = make_model(case)
    model.model.layers[1].mlp.unused = torch.nn.Parameter(torch.ones(4))
    plan = {k: v for k, v in hf_tp_plan(model).items() if not k.endswith("_norm")}
    config = {**config_for(case, 3, 2), "graph": {"enabled": graph, "strict": True}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, case.lr), tp_plan=plan)
        x, y = global_batches(case, 1)[0]
        try:
            engine.backward(forward_engine(engine, x[: case.micro], y[: case.micro]))
            error = None
        except LayoutError as err:
            error = str(err)
    engine.close()
    return error, [str(w.message) for w in caught]


def _unmarked_norms_both() -> tuple:
    return _unmarked_norms(True), _unmarked_norms(False)


def test_graph_mode_refuses_a_missing_partial_grad_mark_as_eager_does():
    """The one-time check of replicated gradients hooks the parameters, which the graph's backward does not reach at
    ZeRO stage 3: graph mode runs the first training step eagerly while the check waits on unit parameters, so a plan
    missing a ``replicated_with_grad_allreduce`` mark raises there the error eager mode raises (the same message: the
    same gradients) instead of training on, silently wrong. A parameter that got no gradient in that step is named in
    a warning: graph mode will not check it."""
    for (graph, graph_warnings), (eager, _) in run_distributed(_unmarked_norms_both, 2):
        assert eager is not None and "model.layers.1.self_attn.k_norm.weight" in eager, eager
        assert graph == eager, f"graph mode: {graph!r}\neager: {eager!r}"
        unchecked = [w for w in graph_warnings if "model.layers.1.mlp.unused" in w]
        assert len(unchecked) == 1 and "not checked" in unchecked[0], graph_warnings
