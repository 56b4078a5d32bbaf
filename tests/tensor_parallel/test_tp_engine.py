"""Tensor parallelism composed with ZeRO stages 0-3 through the engine: parity with one process, and checkpoints
saved in one (dp, tp, stage) layout loaded into another."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from shardtrain.testing import DistributedFailure, run_distributed

from helpers.tp_cases import (
    SGD_MOVED_FRAC,
    Case,
    assert_params_parity,
    assert_parity,
    build_engine,
    forward_engine,
    global_batches,
    reference_run,
    run_cases,
    sgd_case,
    train,
)


@functools.cache
def reference(case: Case, dp: int, steps: int | None = None) -> dict:
    return reference_run(case, dp, steps)


def _check(cases: list[tuple[Case, int, int]], results: list[dict], world: int) -> None:
    failures = []
    for (case, stage, tp), r in zip(cases, results):
        what = f"{case.model} {case.dtype} {case.optimizer} (dp {world // tp}, tp {tp}) stage {stage}"
        try:
            assert_parity(r, reference(case, world // tp), what)
        except AssertionError as err:
            failures.append(str(err))
    assert not failures, "\n".join(failures)


def test_parity_tp2():
    """(dp 1, tp 2): the project's GPT at every stage, HF Llama and Qwen3 with their own plans, HF GPT-2 with the
    strided plan, and bf16; with SGD (a wrongly scaled gradient fails those: tp_cases) the GPT at every stage,
    Qwen3 (partial gradients summed) and GPT-2."""
    cases = [(Case(), s, 2) for s in range(4)]
    cases += [(sgd_case(), s, 2) for s in range(4)] + [(sgd_case(model="qwen3"), 2, 2), (sgd_case(model="gpt2"), 3, 2)]
    cases += [(Case(model="llama"), 0, 2), (Case(model="llama"), 3, 2), (Case(model="gpt2"), 2, 2)]
    cases += [(Case(model="qwen3"), 2, 2)]  # q/k norms: replicated, gradients summed over the tp group
    cases += [(Case(dtype="bf16", steps=3), 1, 2), (Case(model="llama", dtype="bf16", steps=3), 3, 2)]
    _check(cases, run_distributed(run_cases, 2, cases)[0], 2)


def test_parity_world4():
    """(dp 2, tp 2) and (dp 1, tp 4) at every stage; HF Llama and GPT-2 at (dp 2, tp 2); SGD at (dp 2, tp 2)
    stages 1 and 3, and (dp 1, tp 4) stage 2."""
    cases = [(Case(), s, tp) for tp in (2, 4) for s in range(4)]
    cases += [(sgd_case(), 1, 2), (sgd_case(), 3, 2), (sgd_case(), 2, 4)]
    cases += [(Case(model="llama"), 1, 2), (Case(model="gpt2"), 3, 2), (Case(dtype="bf16", steps=3), 2, 2)]
    _check(cases, run_distributed(run_cases, 4, cases)[0], 4)


def _doubled_gradient(cases: list[Case]) -> list[dict]:
    """(dp 1, tp 2) stage 1, with one tensor's gradient doubled on every rank (as a gradient summed twice would be)."""
    out = []
    for case in cases:
        engine = build_engine(case, 1, 2)
        engine.module.get_submodule("blocks.0.mlp.0").weight.register_hook(lambda g: 2 * g)
        losses, norms = train(engine, case, global_batches(case, 1), range(case.steps))
        out.append({"losses": losses, "norms": norms, "params": engine.full_state_dict()})
        engine.close()
    return out


def test_sgd_parity_catches_a_gradient_scale_adamw_does_not():
    """Why the SGD cases: a doubled gradient leaves AdamW's parameters within their bound (its update ignores the
    scale; only the gradient-norm check could notice), while SGD's bound names the tensor."""
    adamw, sgd = Case(clip=0.0), sgd_case()
    results = run_distributed(_doubled_gradient, 2, [adamw, sgd])[0]
    assert_params_parity(results[0], reference(adamw, 1), "adamw, one gradient doubled", 5e-3)  # blind to it
    with pytest.raises(AssertionError, match=r"sgd, one gradient doubled: blocks\.0\.mlp\.0\.weight: error"):
        assert_params_parity(results[1], reference(sgd, 1), "sgd, one gradient doubled", SGD_MOVED_FRAC)


# -- checkpoints across layouts ------------------------------------------------------------------------------------


def _leg(save_dir: str, rows: int, tp: int, stage: int, steps: range, load: bool, save: bool) -> dict:
    """One leg of a chain on this job's (world / tp, tp) layout: load (optional), train ``steps``, save (optional).
    Every layout sees the same ``rows`` global rows per micro-step (``micro = rows / dp``)."""
    dp = dist.get_world_size() // tp
    case = Case(micro=rows // dp)
    engine = build_engine(case, stage, tp, seed=1 if load else 0)  # a fresh engine must get everything from disk
    loaded = None
    if load:
        engine.load_checkpoint(save_dir)
        loaded = engine.full_state_dict()
    losses, _ = train(engine, case, global_batches(case, dp, steps.stop), steps)
    if save:
        engine.save_checkpoint(save_dir)
    out = {"losses": losses, "loaded": loaded, "final": engine.full_state_dict(), "step": engine.global_step}
    engine.close()
    return out


# (world, tp, stage) per leg; the examples
CHAINS = {
    "(dp2,tp2,Z1)->(dp1,tp2,Z3)->(dp1,tp1,Z0)": [(4, 2, 1), (2, 2, 3), (1, 1, 0)],
    "(dp1,tp2,Z2)->(dp3,tp1,Z2)": [(2, 2, 2), (3, 1, 2)],
    "(dp2,tp1,Z3)->(dp1,tp2,Z1)": [(2, 1, 3), (2, 2, 1)],
}


@pytest.mark.parametrize("chain", list(CHAINS))
def test_checkpoint_round_trip_across_layouts(chain, tmp_path):
    """Save at layout A, load at B (and C), train on: the losses and final parameters equal one process training
    straight through, and what each leg loads equals what the previous leg saved, bitwise. The fused QKV weight is
    saved as strided blocks: dropping the stride anywhere (save, load or the join of full_state_dict) scrambles
    Q, K and V and fails both checks (confirmed by forcing stride 1 in engine_checkpoint._block_of)."""
    legs = CHAINS[chain]
    per_leg = 2
    rows = 6 if any(world // tp == 3 for world, tp, _ in legs) else 4
    ref = reference(Case(micro=rows), 1, per_leg * len(legs))
    previous, losses = None, []
    for i, (world, tp, stage) in enumerate(legs):
        steps = range(i * per_leg, (i + 1) * per_leg)
        last = i == len(legs) - 1
        # up to three legs, each well under 90 s, inside the suite's 300 s per test
        r = run_distributed(_leg, world, str(tmp_path), rows, tp, stage, steps, i > 0, not last, timeout=90)[0]
        if previous is not None:
            for k, v in previous.items():
                assert torch.equal(r["loaded"][k], v), f"{chain}: leg {i} loaded {k} differently from what was saved"
        previous, losses = r["final"], losses + r["losses"]
        assert r["step"] == (i + 1) * per_leg
    for s, (a, b) in enumerate(zip(losses, ref["losses"])):
        assert abs(a - b) <= 2e-5 * abs(b), f"{chain}: step {s}: loss {a} vs uninterrupted {b}"
    for k, want in ref["params"].items():
        moved = (want - ref["init"][k]).norm().item()
        err = (previous[k] - want).norm().item()
        assert err <= 5e-3 * moved + 1e-7, f"{chain}: {k}: error {err:.3g} vs distance moved {moved:.3g} (L2)"


# -- mistakes ----------------------------------------------------------------------------------------------------


def _different_batches() -> None:
    case = Case()
    engine = build_engine(case, 1, 2)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    engine(x, torch.roll(x, -1, dims=1))


def test_different_batches_in_a_tp_group_are_refused():
    with pytest.raises(DistributedFailure) as err:
        run_distributed(_different_batches, 2)
    assert "batch" in str(err.value) and "rank" in str(err.value), err.value


def _bad_size() -> None:
    build_engine(Case(), 1, 2)


def test_tp_size_must_divide_the_world():
    with pytest.raises(DistributedFailure) as err:
        run_distributed(_bad_size, 3)
    assert "tensor_parallel.size 2 does not divide the 3 processes" in str(err.value), err.value


def _load_full(stage: int) -> bool:
    from helpers.tp_cases import make_model

    engine = build_engine(Case(), stage, 2)
    other = make_model(Case(), seed=7).state_dict()  # full tensors, on global rank 0 only
    engine.load_full_state_dict(other if dist.get_rank() == 0 else None)
    full = engine.full_state_dict()
    return full is None or all(torch.equal(full[k], v) for k, v in other.items())


def _unmarked_norms(stages: list[int]) -> list[str | None]:
    """Qwen3 with its own plan minus ``replicated_with_grad_allreduce`` on the per-head q/k norms, through the
    engine: the first backward's error at each stage (None: trained on)."""
    import shardtrain
    from shardtrain.errors import LayoutError
    from shardtrain.tensor_parallel import hf_tp_plan

    from helpers.tp_cases import config_for, make_model, make_optimizer

    case = Case(model="qwen3")
    out = []
    for stage in stages:
        model = make_model(case)
        plan = {k: v for k, v in hf_tp_plan(model).items() if not k.endswith("_norm")}
        engine = shardtrain.initialize(
            model, config=config_for(case, stage, 2), optimizer=make_optimizer(model, case.lr), tp_plan=plan
        )
        x, y = global_batches(case, 1, 1)[0]
        try:
            engine.backward(forward_engine(engine, x, y))
            out.append(None)
        except LayoutError as err:
            out.append(str(err))
        engine.close()
    return out


def test_replicated_norms_without_their_style_are_refused_at_the_first_backward():
    """The engine's reducer sums partial gradients in hooks of its own: the check's hooks see the gradients before
    them, at every stage, and the error names the parameters and the style to add."""
    for stage, message in zip([1, 3], run_distributed(_unmarked_norms, 2, [1, 3])[0]):
        assert message is not None, f"stage {stage}: q/k norms with tp-partial gradients trained on, unnoticed"
        assert "model.layers.1.self_attn.k_norm.weight" in message and "replicated_with_grad_allreduce" in message


@pytest.mark.parametrize("stage", [1, 3])
def test_load_full_state_dict_cuts_each_ranks_blocks(stage):
    """Full weights on global rank 0 go to every rank's tensor-parallel block (fused QKV strided) and fragment."""
    assert all(run_distributed(_load_full, 4, stage))
