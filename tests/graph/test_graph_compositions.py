"""Graph-mode ZeRO-3 composed with what it was not tested with (issue 23, item 3): fp16 with dynamic loss scaling,
frozen parameters (frozen before ``initialize``, one of them inside a unit with trainable ones, and one frozen and
unfrozen mid-run), a model built under ``shardtrain.zero.Init``, and the graphs' collectives counted in
``engine.comm_stats()``.

Each composition is held to one process training the same recipe on the whole global batch, and to eager ZeRO-3
on the same ranks, bitwise: the graph gathers the same shards and reduces the same gradients with the same algorithm
and summation order (docs/graph-mode.md), so any difference is a bug, not rounding."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
import torch.distributed as dist

import shardtrain
from shardtrain.config.plan import precision_policy
from shardtrain.config.sections import load_config
from shardtrain.precision.loss_scaler import LossScaler
from shardtrain.testing import run_distributed

from helpers.tp_cases import (
    Case,
    assert_params_parity,
    config_for,
    forward,
    forward_engine,
    global_batches,
    make_model,
    make_optimizer,
)

CASE = Case(steps=5, gas=2)
FP16 = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1}
# (step, micro-step) whose loss is multiplied by OVERFLOW_FACTOR before backward: its fp16 gradients overflow on every
# rank and in the reference alike (by orders of magnitude, never a borderline case), so the step is skipped and the
# dynamic scale halves (256 -> 128); the clean step after a window of 2 clean steps doubles it again (step 4)
OVERFLOWS = frozenset({(1, 1)})
OVERFLOW_FACTOR = 2.0**20
# frozen before initialize: a whole bucket of the root unit, and a bias inside blocks.0's unit whose other
# parameters train
FROZEN = ("pos.weight", "blocks.0.attn.qkv.bias")
MID_RUN = "blocks.1.mlp.0.weight"  # trains at step 0, frozen at steps 1-2, trains again from step 3 on


def trains_mid_run(step: int) -> bool:
    return step == 0 or step >= 3


def _config(options: dict, graph: bool) -> dict:
    config = {**config_for(CASE, 3, 1), "graph": {"enabled": graph, "strict": True}}
    # graph mode has no per-gather unit-order check (the desync check compares the schemas): off in both modes, so
    # that comm_stats() holds the same kinds
    config["zero_optimization"]["stage3_gather_check"] = False
    if options.get("fp16"):
        config["fp16"] = FP16
    if options.get("prescale"):  # DeepSpeed's fp16 habit: divide by the data-parallel size before summing
        config["prescale_gradients"] = True
    return config


def _build(options: dict) -> torch.nn.Module:
    if options.get("init"):
        with shardtrain.zero.Init():
            model = make_model(CASE)
    else:
        model = make_model(CASE)
    if options.get("frozen"):
        params = dict(model.named_parameters())
        for name in FROZEN:
            params[name].requires_grad_(False)
    return model


def _factor(options: dict, step: int, micro: int) -> float:
    return OVERFLOW_FACTOR if options.get("fp16") and (step, micro) in OVERFLOWS else 1.0


def engine_run(options: dict, graph: bool) -> dict:
    """This rank's run: per step the mean loss over every rank, the grad norm, the loss scale, the skipped steps
    and ``comm_stats()``; then rank 0's full parameters and an eval forward's ``comm_stats()``."""
    model = _build(options)
    engine = shardtrain.initialize(model, config=_config(options, graph), optimizer=make_optimizer(model, CASE.lr))
    engine.comm_stats(reset=True)
    batches = global_batches(CASE, engine.topology.dp)
    lo, hi = engine.topology.dp_rank * CASE.micro, (engine.topology.dp_rank + 1) * CASE.micro
    mid_run = dict(engine.module.named_parameters())[MID_RUN]
    out = {"losses": [], "norms": [], "scales": [], "skipped": [], "comm": []}
    for step in range(CASE.steps):
        if options.get("frozen"):
            mid_run.requires_grad_(trains_mid_run(step))
        total = torch.zeros(())
        for m in range(CASE.gas):
            x, y = batches[step * CASE.gas + m]
            loss = forward_engine(engine, x[lo:hi], y[lo:hi])
            engine.backward(loss.float() * _factor(options, step, m))
            engine.step()
            total += loss.detach().float() / CASE.gas
        dist.all_reduce(total)
        out["losses"].append(float(total) / dist.get_world_size())
        out["norms"].append(engine.get_global_grad_norm())
        out["scales"].append(engine.loss_scale)
        out["skipped"].append(engine.skipped_steps)
        out["comm"].append(engine.comm_stats(reset=True))
        if options.get("frozen"):
            full = engine.full_state_dict()
            out.setdefault("mid_run", []).append(full[MID_RUN].clone() if full is not None else None)
            engine.comm_stats(reset=True)  # full_state_dict's gathers are not the step's
    engine.eval()
    with torch.no_grad():
        x, y = batches[0]
        forward_engine(engine, x[lo:hi], y[lo:hi])
    out["eval_comm"] = engine.comm_stats(reset=True)
    out["params"] = engine.full_state_dict()
    out["graph"] = engine.graph_stats()
    out["graph_breaks"] = dict(torch._dynamo.utils.counters["graph_break"])
    out["units"] = [
        (name, module is engine.module, [(b.padded_numel, b.requires_grad, b.flat_param.element_size()) for b in bs])
        for name, module, bs in engine.layout.unit_buckets
    ]
    engine.close()
    return out


def both_modes(options: dict) -> dict:
    """Graph mode, then eager ZeRO-3, on the same ranks."""
    return {"graph": engine_run(options, True), "eager": engine_run(options, False)}


def reference_run(options: dict, dp: int) -> dict:
    """One process, the whole global batch, the same recipe: fp16 compute with fp32 masters made from the fp32 init
    (gradients summed in fp32 over micro-steps, unscaled, an overflow skipping the step and driving the scale as
    DeepSpeed's dynamic loss scaler does), or fp32; the same parameters frozen at the same steps (AdamW skips a
    parameter without a gradient: no decay, no moment update)."""
    model = _build({**options, "init": False})
    init = {k: v.clone() for k, v in model.state_dict().items()}
    opt = make_optimizer(model, CASE.lr)
    params = [p for g in opt.param_groups for p in g["params"]]
    fp16 = bool(options.get("fp16"))
    masters = {p: p.detach().clone() for p in params} if fp16 else {p: p for p in params}
    if fp16:
        for g in opt.param_groups:
            g["params"] = [masters[p] for p in g["params"]]
        model.half()
    scaler = LossScaler.from_policy(precision_policy(load_config(_config(options, False))).loss_scale) if fp16 else None
    mid_run = dict(model.named_parameters())[MID_RUN]
    batches = global_batches(CASE, dp)
    out = {"losses": [], "norms": [], "scales": [], "skipped": [], "init": init}
    skipped = 0
    for step in range(CASE.steps):
        if options.get("frozen"):
            mid_run.requires_grad_(trains_mid_run(step))
        total = 0.0
        for m in range(CASE.gas):
            x, y = batches[step * CASE.gas + m]
            loss = forward(model, x, y)
            scaled = loss.float() * _factor(options, step, m) * (scaler.scale if scaler else 1.0)
            (scaled / CASE.gas).backward()
            if fp16:
                for p in params:
                    if p.grad is not None:
                        g = p.grad.float()
                        masters[p].grad = g if masters[p].grad is None else masters[p].grad + g
                        p.grad = None
            total += loss.item() / CASE.gas
        stepped = [masters[p] for p in params if masters[p].grad is not None]
        if scaler is not None:
            torch._foreach_mul_([m.grad for m in stepped], 1.0 / scaler.scale)
        norm = float(torch.nn.utils.clip_grad_norm_(stepped, CASE.clip))
        overflow = scaler is not None and not math.isfinite(norm)
        if not overflow:
            opt.step()
            if fp16:
                with torch.no_grad():
                    for p in params:
                        p.copy_(masters[p])
        skipped += overflow
        opt.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.update(overflow=overflow)
        out["losses"].append(total)
        out["norms"].append(norm)
        out["scales"].append(scaler.scale if scaler else 1.0)
        out["skipped"].append(skipped)
    out["params"] = {k: v.float() for k, v in model.state_dict().items()}
    return out


def assert_bitwise(graph: dict, eager: dict, what: str) -> None:
    for key in ("losses", "norms", "scales", "skipped"):  # a skipped step's norm is nan in both: compared as text
        assert str(graph[key]) == str(eager[key]), f"{what}: {key}: graph {graph[key]} vs eager {eager[key]}"
    for k, want in eager["params"].items():
        assert torch.equal(graph["params"][k], want), f"{what}: {k} differs from eager ZeRO-3"


def assert_reference_parity(got: dict, ref: dict, options: dict, what: str) -> None:
    """The same skipped steps and loss scales as one process; then

    * fp32: losses within 2e-5 relative, norms 1e-4, every parameter tensor within 5e-3 of the distance it moved
      (L2), as ``helpers.tp_cases.assert_parity``;
    * fp16: losses within 2e-4, norms 5e-3 (measured: 1.5e-5 and 4.2e-4 at world 3), the total parameter error under
      2e-2 of the total distance moved (L1; measured 3.2e-3 at world 3), as the bf16 tests bound it: the ranks'
      fp16 gradients are computed on their rows and averaged in fp16, and Adam turns their rounding where the exact
      gradient is zero (the attention key biases) into whole steps element by element;

    and with frozen parameters, those frozen before ``initialize`` bitwise at their initial values, and the one
    frozen mid-run within 2e-2 of the distance it moved (AdamW decaying it while frozen put it 0.27 away)."""
    fp16 = bool(options.get("fp16"))
    assert got["skipped"] == ref["skipped"] and got["scales"] == ref["scales"], (what, got["scales"], ref["scales"])
    loss_rtol, norm_rtol = (2e-4, 5e-3) if fp16 else (2e-5, 1e-4)
    for s, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        assert abs(a - b) <= loss_rtol * abs(b), f"{what}: step {s}: loss {a} vs reference {b}"
    for s, (a, b) in enumerate(zip(got["norms"], ref["norms"], strict=True)):
        assert math.isfinite(a) == math.isfinite(b), f"{what}: step {s}: grad norm {a} vs reference {b}"
        if math.isfinite(b):
            assert abs(a - b) <= norm_rtol * abs(b), f"{what}: step {s}: grad norm {a} vs reference {b}"
    params, init = got["params"], {k: v.half().float() if fp16 else v for k, v in ref["init"].items()}
    assert params.keys() == ref["params"].keys(), what
    if fp16:
        err = sum((params[k].float() - w).abs().sum().item() for k, w in ref["params"].items())
        moved = sum((w - init[k]).abs().sum().item() for k, w in ref["params"].items())
        assert err <= 2e-2 * moved, f"{what}: total parameter error {err:.3g} vs total distance moved {moved:.3g}"
    else:
        assert_params_parity(got, ref, what, 5e-3)
    if options.get("frozen"):
        for name in FROZEN:
            assert torch.equal(params[name].float(), init[name]), f"{what}: {name} is frozen but moved"
        moved = (ref["params"][MID_RUN] - init[MID_RUN]).norm().item()
        err = (params[MID_RUN].float() - ref["params"][MID_RUN]).norm().item()
        assert err <= 2e-2 * moved, f"{what}: {MID_RUN}: error {err:.3g} vs distance moved {moved:.3g} (L2)"


def assert_frozen_mid_run_stays(r: dict, what: str) -> None:
    """While frozen (steps 1 and 2), ``MID_RUN`` keeps its value bitwise; it moved at step 0 and moves again from
    step 3 on."""
    values = r["mid_run"]
    for step in range(1, CASE.steps):
        moved = (values[step] - values[step - 1]).abs().max().item()
        if trains_mid_run(step):
            assert moved > 0, f"{what}: step {step}: {MID_RUN} trains but did not move"
        else:
            assert moved == 0, f"{what}: step {step}: {MID_RUN} is frozen but moved by {moved:.3g}"


ALL = {"fp16": True, "init": True, "frozen": True}


@pytest.mark.parametrize(
    ("options", "world"),
    [
        ({**ALL, "prescale": True}, 3),
        pytest.param(ALL, 2, marks=pytest.mark.soak),
        pytest.param({"fp16": True}, 3, marks=pytest.mark.soak),
        pytest.param({"frozen": True}, 2, marks=pytest.mark.soak),
        pytest.param({"frozen": True}, 3, marks=pytest.mark.soak),
        pytest.param({"init": True}, 3, marks=pytest.mark.soak),
    ],
    ids=lambda v: "-".join(sorted(v)) if isinstance(v, dict) else f"world{v}",
)
def test_graph_zero3_composes_with_fp16_frozen_parameters_and_zero_init(options, world):
    """fp16 with dynamic loss scaling (an overflow on every rank skips a step and halves the scale, a clean window
    doubles it), parameters frozen before ``initialize`` (one beside trainable ones in a unit) and one frozen and
    unfrozen mid-run, on a model built under ``zero.Init``: graph-mode ZeRO-3 is eager ZeRO-3 bitwise and one
    process within fp16 rounding. ``prescale_gradients`` at world 3 (a division by 3 rounds in fp16): the graph's
    reduction divides where eager's does (it averaged after summing before, 1e-6 apart)."""
    results = run_distributed(both_modes, world, options, timeout=900)
    ref = reference_run(options, world)
    if options.get("fp16"):  # the check proves something: a step was skipped, the scale went down and up
        lowest = min(ref["scales"])
        assert ref["skipped"][-1] >= 1 and lowest < ref["scales"][0] and lowest < ref["scales"][-1], ref["scales"]
    graph, eager = results[0]["graph"], results[0]["eager"]
    what = f"graph-mode ZeRO-3 {'+'.join(sorted(options))} world {world}"
    assert_bitwise(graph, eager, what)
    assert_reference_parity(graph, ref, options, what)
    assert_one_graph_per_schema(graph, options)
    if options.get("frozen"):
        assert_frozen_mid_run_stays(graph, what)


def assert_one_graph_per_schema(r: dict, options: dict) -> None:
    """No split and no re-trace: one capture per trainable set (unfrozen again, the first graph is reused) and one
    for the eval forward without gradients."""
    assert r["graph_breaks"] == {}, r["graph_breaks"]
    stats = r["graph"]
    assert stats["captures"] == (3 if options.get("frozen") else 2), stats
    assert stats["fallbacks"] == [] and stats["guard_recaptures"] == 0, stats


def test_graph_zero3_collectives_are_counted_in_comm_stats():
    """World 2, fp16 on a model built under ``zero.Init``: the gathers and reduce-scatters the captured graphs run
    are in ``engine.comm_stats()``, counted as eager ZeRO-3 counts its own calls.

    * A forward without gradients moves the same bytes in both modes, kind by kind: one all-gather per bucket.
    * A training step: the same reduce-scatters (one per trainable bucket and micro-step, in the fp16 wire dtype)
      and the same all-reduce (the gradient norm), calls, bytes and bytes sent.
    * Its all-gathers: both modes keep the root unit and the last unit of the forward gathered for the backward
      that follows ([Note: kept after forward] in ``runtime/eager.py``, [Note: kept in the graph] in
      ``graph/sharded.py``), so per micro-step every bucket is gathered twice less the root unit and the last block,
      in the graph from the first step on and the same in eager from its second step on (its first forward, not
      knowing the order yet, releases the last block and gathers it again in backward)."""
    options = {"fp16": True, "init": True}
    results = run_distributed(both_modes, 2, options, timeout=900)
    graph, eager = results[0]["graph"], results[0]["eager"]
    assert_bitwise(graph, eager, "graph-mode ZeRO-3 fp16+init world 2")
    assert_reference_parity(graph, reference_run(options, 2), options, "graph-mode ZeRO-3 fp16+init world 2")
    for r in results:
        graph, eager = r["graph"], r["eager"]
        assert_one_graph_per_schema(graph, options)
        # per bucket: its unit's name, whether that is the root unit, an all-gather's bytes at world 2 (half the buffer)
        buckets = [(name, root, numel * size // 2) for name, root, bs in graph["units"] for numel, _, size in bs]
        every = {"calls": len(buckets), "bytes": sum(b for _, _, b in buckets)}
        every["sent"] = every["bytes"]  # an all-gather sends the convention's bytes on every backend
        assert graph["eval_comm"] == eager["eval_comm"] == {"all_gather": every}, (graph["eval_comm"], every)
        kept = [b for name, root, b in buckets if root or name == "blocks.1"]
        last = [b for name, _, b in buckets if name == "blocks.1"]
        assert 0 < len(last) < len(kept) < len(buckets), buckets
        for step, (g, e) in enumerate(zip(graph["comm"], eager["comm"], strict=True)):
            assert g.keys() == e.keys() == {"all_gather", "all_reduce", "reduce_scatter"}, (step, g, e)
            assert g["reduce_scatter"] == e["reduce_scatter"] and g["all_reduce"] == e["all_reduce"], (step, g, e)
            assert g["reduce_scatter"]["calls"] == CASE.gas * len(buckets), (step, g)
            gathers = {k: 2 * CASE.gas * v for k, v in every.items()}  # forward and backward, every micro-step
            less = {"calls": CASE.gas * len(kept), "bytes": CASE.gas * sum(kept)}
            less["sent"] = less["bytes"]
            want = {k: gathers[k] - less[k] for k in gathers}
            assert g["all_gather"] == want, (step, g["all_gather"], want)
            if step >= 1:
                assert e["all_gather"] == want, (step, e, want)
            else:  # eager's first forward: the last block gathered again in backward
                again = {"calls": len(last), "bytes": sum(last), "sent": sum(last)}
                assert e["all_gather"] == {k: want[k] + again[k] for k in want}, (step, e, want, again)


def _counted_by(compiler: str) -> list[dict]:
    import os

    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # no pool of compile workers for a few kernels
    # compile for real: a graph loaded from Inductor's caches is not scheduled nor counted again (docs/graph-mode.md)
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    case = Case(gas=1, steps=2)
    model = make_model(case)
    config = {**config_for(case, 3, 1), "graph": {"enabled": True, "strict": True, "compiler": compiler}}
    engine = shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, case.lr))
    lo, hi = engine.topology.dp_rank * case.micro, (engine.topology.dp_rank + 1) * case.micro
    stats = []
    for x, y in global_batches(case, engine.topology.dp):
        engine.backward(forward_engine(engine, x[lo:hi], y[lo:hi]))
        engine.step()
        stats.append(engine.comm_stats(reset=True))
    return stats


@pytest.mark.soak
@pytest.mark.skipif(shutil.which("g++") is None, reason="Inductor on the CPU needs a C++ compiler")
def test_inductor_graphs_count_the_same_collectives():
    """Inductor's graphs are counted from its post-grad graphs (the passes of [Note: ZeRO-3 as graph operations]):
    every step's ``comm_stats()`` is the ``aot_eager`` graphs'."""
    want = run_distributed(_counted_by, 2, "aot_eager", timeout=900)[0]
    got = run_distributed(_counted_by, 2, "inductor", timeout=900)[0]
    assert got == want and want[0]["all_gather"]["calls"] > 0, (got, want)
