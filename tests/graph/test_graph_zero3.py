"""Graph-mode ZeRO-3 against eager ZeRO-3 and one process where AdamW would hide a mistake: plain SGD (a gradient
scaled wrongly, or a gradient where there should be none, moves the parameters by exactly that much), parameters
frozen and unfrozen after ``initialize``, and the schedule measured at run time rather than by the pass itself."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist

import shardtrain
from shardtrain.graph import sharded
from shardtrain.models.gpt import GPT, GPTConfig
from shardtrain.testing import run_distributed

from helpers.tp_cases import SEQ, VOCAB, Case, config_for, forward, forward_engine, global_batches, make_model

FROZEN = "blocks.0.attn.qkv.weight"
LR = 0.2
# no gradient clipping: clipping rescales the update to a fixed norm, which would hide a wrongly scaled gradient
SGD_CASE = Case(steps=3, gas=2, clip=0.0)


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)


def _freezing_plan(steps: int) -> list[bool]:
    """Whether ``FROZEN`` trains at each step: one step, frozen for two, trained again for the rest."""
    return [s == 0 or s >= 3 for s in range(steps)]


def sgd_run(case: Case, stage: int, graph: bool, plan: list[bool] | None = None) -> dict:
    """World N: plain SGD at ``stage``; ``FROZEN`` trains at the steps ``plan`` says (frozen and unfrozen after
    ``initialize``). Returns the full parameters after every step and the losses (rank-local mean)."""
    model = make_model(case)
    config = {**config_for(case, stage, 1), "graph": {"enabled": graph, "strict": True}}
    engine = shardtrain.initialize(model, config=config, optimizer=_sgd(model))
    batches = global_batches(case, engine.topology.dp)
    lo, hi = engine.topology.dp_rank * case.micro, (engine.topology.dp_rank + 1) * case.micro
    weight = dict(engine.module.named_parameters())[FROZEN]
    after = []
    for step, trains in enumerate(plan or [True] * case.steps):
        weight.requires_grad_(trains)
        for m in range(case.gas):
            x, y = batches[step * case.gas + m]
            engine.backward(forward_engine(engine, x[lo:hi], y[lo:hi]))
            engine.step()
        after.append(engine.full_state_dict())
    dist.barrier()
    return {"after": after, "graph": engine.graph_stats()}


def sgd_reference(case: Case, dp: int, plan: list[bool] | None = None) -> list[dict]:
    """One process, the whole global batch, the same plan; the parameters after every step (and before: ``-1``)."""
    model = make_model(case)
    opt = _sgd(model)
    batches = global_batches(case, dp)
    weight = dict(model.named_parameters())[FROZEN]
    after = []
    for step, trains in enumerate(plan or [True] * case.steps):
        weight.requires_grad_(trains)
        for m in range(case.gas):
            x, y = batches[step * case.gas + m]
            (forward(model, x, y) / case.gas).backward()
        if case.clip:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], case.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        after.append({k: v.clone() for k, v in model.state_dict().items()})
    return after


def assert_sgd_parity(got: list[dict], ref: list[dict], init: dict, what: str) -> None:
    """After every step, every parameter tensor within 1e-4 of the distance it moved from ``init`` (L2): SGD moves a
    parameter by lr x its gradient, so a gradient scaled by (N-1)/N, or summed instead of averaged, is off by a
    whole fraction of that distance."""
    for step, (g, r) in enumerate(zip(got, ref, strict=True)):
        for k, want in r.items():
            moved = (want - init[k]).norm().item()
            err = (g[k] - want).norm().item()
            assert err <= 1e-4 * moved + 1e-7, f"{what}: step {step}: {k}: error {err:.3g} vs moved {moved:.3g}"


@pytest.mark.parametrize(("stage", "world"), [pytest.param(1, 3, marks=pytest.mark.soak), (3, 3)])  # suite time
def test_graph_mode_with_sgd_trains_like_one_process(stage, world):
    """Plain SGD without clipping, gradient accumulation over 2 micro-steps, world 3: the parameters after every step
    are one process's on the whole batch (AdamW, which normalizes gradients, would hide a wrong scale)."""
    got = run_distributed(sgd_run, world, SGD_CASE, stage, True, timeout=600)[0]
    init = make_model(SGD_CASE).state_dict()
    assert_sgd_parity(got["after"], sgd_reference(SGD_CASE, world), init, f"graph SGD stage {stage} world {world}")
    assert got["graph"]["captures"] == 1 and got["graph"]["fallbacks"] == [], got["graph"]


def _eager_then_graph_sgd(case: Case, stage: int, plan: list[bool]) -> tuple[dict, dict]:
    """Both modes in the same processes (one start of the ranks instead of two)."""
    return sgd_run(case, stage, False, plan), sgd_run(case, stage, True, plan)


# suite time (15 s fresh): by default test_graph_compositions.py freezes and unfreezes a parameter mid-run at world 3
# (bitwise eager ZeRO-3, frozen steps bitwise unchanged, the first graph reused once unfrozen, one process's numbers)
@pytest.mark.soak
def test_a_parameter_frozen_after_initialize_stops_training_and_trains_again_when_unfrozen():
    """World 2, SGD, stage 3: ``FROZEN`` is frozen after the first step and unfrozen after the third. While frozen
    it keeps its value exactly (as in eager ZeRO-3, where it gets no gradient); unfrozen, it trains again; every
    parameter after every step is eager ZeRO-3's and one process's."""
    case = Case(steps=5, gas=1, clip=0.0)
    plan = _freezing_plan(case.steps)
    eager, graph = run_distributed(_eager_then_graph_sgd, 2, case, 3, plan, timeout=600)[0]
    ref = sgd_reference(case, 2, plan)
    for step in range(1, case.steps):
        moved = (graph["after"][step][FROZEN] - graph["after"][step - 1][FROZEN]).abs().max().item()
        if plan[step]:
            assert moved > 1e-3, f"step {step}: {FROZEN} trains but moved {moved:.3g}"
        else:
            assert moved == 0, f"step {step}: {FROZEN} is frozen but moved by {moved:.3g}"
    init = make_model(case).state_dict()
    assert_sgd_parity(graph["after"], ref, init, "graph-mode ZeRO-3, freezing")
    assert_sgd_parity(eager["after"], ref, init, "eager ZeRO-3, freezing")
    for step in range(case.steps):  # the same shards, gradients and reduction: bitwise eager ZeRO-3
        for k, want in eager["after"][step].items():
            assert torch.equal(graph["after"][step][k], want), f"step {step}: {k}"
    # one capture per trainable set: unfrozen again, the parameters reuse the first graph (with its gradient)
    assert graph["graph"]["captures"] == 2 and graph["graph"]["reuses"] == case.steps - 2, graph["graph"]


class _DataDependent(torch.nn.Module):
    """Wraps a module with Python control flow on a tensor's value (TorchDynamo cannot trace ``.item()``) and counts
    the forwards that really ran."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.runs = inner, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs.append(1)
        h = self.inner(x)
        return h * 2 if h.sum().item() > 0 else h


def _split_at_stage3(strict: bool) -> dict:
    case = Case(gas=1)
    model = make_model(case)
    model.blocks[0].mlp = _DataDependent(model.blocks[0].mlp)
    config = {**config_for(case, 3, 1), "graph": {"enabled": True, "strict": strict}}
    engine = shardtrain.initialize(model, config=config, optimizer=_sgd(model))
    (x, y), *_ = global_batches(case, engine.topology.dp, steps=1)
    with pytest.raises(shardtrain.errors.GraphCaptureError) as err:
        forward_engine(engine, x[: case.micro], y[: case.micro])
    return {"message": str(err.value), "runs": len(model.blocks[0].mlp.runs), "graph": engine.graph_stats()}


@pytest.mark.parametrize("strict", [False, True])
def test_a_split_at_stage3_is_an_error_naming_the_construct_before_anything_runs(strict):
    """A construct TorchDynamo cannot trace, inside the model at ZeRO stage 3, would make the forward run eagerly
    inside the parameter swap, every unit gathered at once until backward. Strict or not (the default), it is an
    error naming the construct, raised while tracing: the model's forward never ran, so nothing was gathered whole."""
    for r in run_distributed(_split_at_stage3, 2, strict, timeout=300):
        message = r["message"]
        assert message.startswith("cannot capture GPT as one graph at ZeRO stage 3: "), message
        # the construct (a branch on a tensor's value) and the model's line of code holding it
        assert "data-dependent expression" in message and "turn graph mode off" in message, message
        assert 'test_graph_zero3.py", line ' in message and "in forward" in message, message
        assert r["runs"] == 0 and r["graph"]["fallbacks"] == [], r


def _inductor_lazy_backward() -> dict:
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # no pool of compile workers for a few kernels (saves seconds)
    # compile for real: a graph loaded from Inductor's caches was scheduled when it was stored, and our pass, which
    # reports what it scheduled, does not run again
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    case = Case(gas=1, micro=1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=16, n_layer=1, n_head=2))  # few kernels to compile
    config = {**config_for(case, 3, 1), "graph": {"enabled": True, "strict": True, "compiler": "inductor"}}
    engine = shardtrain.initialize(model, config=config, optimizer=_sgd(model))
    x = torch.randint(0, 64, (1, 1), generator=torch.Generator().manual_seed(engine.topology.dp_rank))
    loss = forward_engine(engine, x, x)
    before = dict(engine.graph_stats()["collectives"])
    engine.backward(loss)
    buckets = [b for _, _, bs in engine.layout.unit_buckets for b in bs]
    return {
        "before": before,
        "after": engine.graph_stats()["collectives"],
        "trainable": sum(b.requires_grad for b in buckets),
    }


@pytest.mark.skipif(shutil.which("g++") is None, reason="Inductor on the CPU needs a C++ compiler")
def test_inductor_schedules_a_backward_compiled_lazily():
    """Inputs of size 1 are static, so the backward saves no symbolic size and AOT autograd compiles it lazily, at
    its first run, after the forward returned: its reduce-scatters must still be scheduled by our pass (the pass
    reports each graph it scheduled: the backward's count is there only after backward)."""
    for r in run_distributed(_inductor_lazy_backward, 2, timeout=600):
        assert "backward reduce-scatters" not in r["before"], r  # not compiled with the forward: lazily
        assert r["after"]["backward reduce-scatters"] == r["trainable"] > 0, r


def most_live_gathers(gm: torch.fx.GraphModule) -> int:
    """The most all-gathered buffers alive at once when ``gm`` runs, read from its generated code's own rule, not
    from the scheduling pass: the code drops each value after its last use (``node.users``), and a buffer lives
    while any value sharing its storage (the wait's result, every view of it: fake tensors share storage as the
    real ones do) is alive."""
    from torch.multiprocessing.reductions import StorageWeakRef

    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    storage_of = {}
    for n in nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            storage_of[n] = StorageWeakRef(val.untyped_storage())
    spans = []
    for n in nodes:
        if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default:
            # wait_tensor returns its input at run time (its fake result is a new tensor): the same buffer
            buffer = {storage_of[m] for m in [n, *n.users] if m in storage_of}
            sharing = [m for m in nodes if m in storage_of and storage_of[m] in buffer]
            end = max(max([index[u] for u in m.users] + [index[m]]) for m in sharing)
            spans.append((index[n], end))
    # a unit kept gathered from forward to backward: the backward graph's inputs saved of its buffer (the views the
    # pass tagged), alive from the start until the last use of any of them
    kept = {storage_of[n] for n in nodes if n.op == "placeholder" and sharded.KEPT in n.meta}
    for buffer in kept:
        sharing = [m for m in nodes if m in storage_of and storage_of[m] == buffer]
        spans.append((0, max(max([index[u] for u in m.users] + [index[m]]) for m in sharing)))
    return max((sum(a <= i <= b for a, b in spans) for i in range(len(nodes))), default=0)


def _schedule_run(zero: dict) -> dict:
    case = Case(gas=1, steps=2)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_layer=4, n_head=4))  # 5 units with the root
    config = {**config_for(case, 3, 1), "graph": {"enabled": True, "strict": True}}
    config["zero_optimization"].update(zero)
    engine = shardtrain.initialize(model, config=config, optimizer=_sgd(model))
    batches = global_batches(case, engine.topology.dp)
    lo, hi = engine.topology.dp_rank * case.micro, (engine.topology.dp_rank + 1) * case.micro
    for x, y in batches:
        engine.backward(forward_engine(engine, x[lo:hi], y[lo:hi]))
        engine.step()
    live = {which: most_live_gathers(gm) for which, gm in engine._runtime.captured.graphs()}
    return {"graph": engine.graph_stats(), "live": live, "units": len(engine.layout.unit_buckets),
            "params": engine.full_state_dict()}  # fmt: skip


def _schedules() -> list[dict]:
    runs = [
        _schedule_run({}),
        _schedule_run({"stage3_prefetch_bucket_size": 0}),
        _schedule_run({"overlap_comm": False}),
    ]
    model = make_model(Case())
    config = {**config_for(Case(), 3, 1), "graph": {"enabled": True}}
    config["zero_optimization"]["stage3_gather_check"] = False
    with pytest.warns(UserWarning, match=r"stage3_gather_check: false has no effect in graph mode"):
        shardtrain.initialize(model, config=config, optimizer=_sgd(model))
    return runs


def test_the_schedule_follows_prefetch_and_overlap_and_its_peak_is_measured_from_the_graphs():
    """Graph-mode ZeRO-3 on 5 units. The most units gathered at once is read from the graphs that run (each value
    dropped after its last use, a buffer alive while any view of it is), not from the pass: 3 in forward (the root,
    whose embedding comes first and head last, the current and the prefetched unit), at most 3 in backward (where
    the root and the last block, kept from forward, count from the start until their last use).
    ``stage3_prefetch_bucket_size: 0`` issues each gather right before its use (one unit fewer alive);
    ``overlap_comm: false`` waits for each reduce-scatter at once. The numbers stay bitwise the same."""
    default, no_prefetch, no_overlap = run_distributed(_schedules, 2, timeout=600)[0]
    assert default["units"] == 5
    assert default["live"] == {"forward": 3, "backward": default["live"]["backward"]}, default["live"]
    assert 2 <= default["live"]["backward"] <= 3, default["live"]
    assert default["graph"]["most_gathered"] == max(default["live"].values()), default
    overlapped = default["graph"]["overlapped"]
    # every gather issued ahead: 4 in forward (all but the root's), 3 in backward (the root and the last block are
    # kept from forward; the first re-gather is issued at the backward's start)
    assert default["graph"]["collectives"]["backward all-gathers"] == 3, default["graph"]
    assert overlapped["forward prefetched all-gathers"] == 4 and overlapped["backward prefetched all-gathers"] == 3
    assert overlapped["backward overlapped reduce-scatters"] == 4, overlapped  # the last one has nothing to overlap
    assert no_prefetch["live"] == {"forward": 2, "backward": default["live"]["backward"] - 1}, no_prefetch["live"]
    assert no_prefetch["graph"]["overlapped"] == {**overlapped, "forward prefetched all-gathers": 0,
                                                  "backward prefetched all-gathers": 0}  # fmt: skip
    assert no_overlap["live"] == default["live"]
    assert no_overlap["graph"]["overlapped"] == {**overlapped, "backward overlapped reduce-scatters": 0}
    for k, want in default["params"].items():
        assert torch.equal(no_prefetch["params"][k], want) and torch.equal(no_overlap["params"][k], want), k
