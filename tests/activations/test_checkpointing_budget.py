"""``activation_checkpointing.policy: "budget"``: the planner chooses each block's recompute at ``initialize`` so that
the predicted peak fits ``memory_budget_gib`` ([Note: checkpointing by budget] in estimate/activation_budget.py).
The choice trains bit for bit as no checkpointing (fp32 on the CPU), at world 1, under ZeRO-3 at world 2 and under
tensor parallelism 2; it follows the budget (less memory, more recompute); the peak measured as the estimate tests
measure it stays within the budget; a budget nothing fits is refused by name."""

from __future__ import annotations

import functools
import gc

import pytest
import torch

import shardtrain
from shardtrain.errors import ConfigError
from shardtrain.estimate import PeakMeter
from shardtrain.estimate.activation_budget import _ladder_for, budget_ladder
from shardtrain.models.gpt import GPT, GPTConfig
from shardtrain.tensor_parallel import GPT_TP_PLAN
from shardtrain.testing import run_distributed

from helpers.activation_cases import BUILDERS, assert_bitwise, config_of, policy_runs, reference
from helpers.model_cases import SEQ, assert_parity

GIB = 2**30


def _between(case: str, world: int, stage: int, tp: int = 1) -> dict:
    """A budget halfway between the planner's peaks of no checkpointing and of every block full: some blocks must
    recompute, not necessarily all."""
    plan = GPT_TP_PLAN if tp > 1 and case == "gpt" else None
    ladder, rungs = _ladder_for(BUILDERS[case], config_of(stage, {}, tp), world, SEQ, "cpu", plan, None, None)
    none, full = (ladder.measure(rung, False).peak for rung in (rungs[0], rungs[-1]))
    assert full < none
    return {"policy": "budget", "memory_budget_gib": (none + full) / 2 / GIB, "budget_seq_len": SEQ}


@functools.cache
def _reference(case: str, world: int) -> dict:
    return reference(case, world)


@pytest.mark.parametrize(
    ("case", "world", "stage", "tp"),
    [
        ("gpt", 1, 0, 1),
        ("llama", 1, 0, 1),
        ("gpt", 2, 3, 1),
        ("gpt", 2, 3, 2),
        pytest.param("gpt", 2, 0, 2, marks=pytest.mark.soak),
    ],
)
def test_the_budget_s_choice_trains_bitwise_as_no_checkpointing(case, world, stage, tp):
    """Failed before: ``policy: "budget"`` was refused by the config. The chosen blocks recompute (the budget is
    below the peak without checkpointing) and losses, gradient norms and final parameters equal ``none``'s bit for
    bit; ``none`` is at parity with one process."""
    if case == "llama":
        pytest.importorskip("transformers")
    sections = {"none": {}, "budget": _between(case, world, stage, tp)}
    results = run_distributed(policy_runs, world, case, stage, ["none", "budget"], tp=tp, sections=sections)
    for r in results:
        chosen = r["budget"]["per_block"]
        assert set(chosen) - {"none"}, chosen  # something is recomputed
        assert chosen == results[0]["budget"]["per_block"]  # every rank chose the same
        assert_bitwise(r["budget"], r["none"], f"{case} world {world} stage {stage} tp {tp}: budget vs none")
        assert r["budget"]["kept_bytes"] < r["none"]["kept_bytes"]
    if tp == 1:
        assert_parity([r["none"] for r in results], _reference(case, world))


def _wide_gpt() -> GPT:
    """Activations well above the model state (sequence 128, vocabulary 256): the budget has choices to make."""
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, seq_len=128, d_model=64, n_layer=2, n_head=4))


WIDE = {"train_micro_batch_size_per_gpu": 2}


@functools.cache
def _ladder():
    """The wide GPT's ladder, each rung measured once and kept (the fake models shared)."""
    return _ladder_for(_wide_gpt, WIDE, 1, 128, "cpu", None, None, None)


def _ladder_peaks() -> list[int]:
    ladder, rungs = _ladder()
    return [ladder.measure(rung, False).peak for rung in rungs]


def test_the_choice_follows_the_budget():
    """A loose budget: nothing recomputed; tighter ones: more blocks recomputed, more of them fully; the tightest
    that fits: every block full. Each choice is the first rung of the ladder that fits, found by bisection."""
    (ladder, rungs), peaks = _ladder(), _ladder_peaks()
    assert peaks == sorted(peaks, reverse=True), peaks  # the ladder the bisection relies on
    budgets = [peaks[0] + 1, peaks[1], (peaks[1] + peaks[2]) // 2, peaks[3], peaks[4]]
    chosen = [ladder.lowest_fitting(rungs, b, False) for b in budgets]
    assert [rungs.index(c.per_block) for c in chosen] == [0, 1, 2, 3, 4]
    assert [c.setting for c in chosen] == ["none", "budget", "selective", "budget", "full"]
    assert chosen[1].per_block == ("selective", "none") and chosen[3].per_block == ("full", "selective")
    assert all(c.peak <= b for c, b in zip(chosen, budgets))
    assert ladder.lowest_fitting(rungs, peaks[-1] - 1, False) is None


def _budget_measured(budgets_gib: list[float], steps: int = 2) -> list[dict]:
    """Train the wide GPT with each budget; the peak of the last step measured as tests/estimate/test_estimate.py
    measures it (tensors alive at its start, less those before the model, plus what the step adds)."""
    meter = PeakMeter()
    out = []
    try:
        for i, gib in enumerate(budgets_gib):
            gc.collect()
            with meter.window(f"before:{i}", scan=True):
                pass
            model = _wide_gpt()
            section = {"policy": "budget", "memory_budget_gib": gib, "budget_seq_len": 128}
            engine = shardtrain.initialize(
                model,
                {**WIDE, "activation_checkpointing": section},
                torch.optim.AdamW(model.parameters(), lr=1e-3),
            )
            rows = torch.Generator().manual_seed(0)
            for step in range(steps):
                x = torch.randint(0, 256, (2, 128), generator=rows)
                with meter.window(str(i), scan=True) if step == steps - 1 else _nothing():
                    loss = engine(x, torch.roll(x, -1, dims=1))
                    engine.backward(loss)
                    engine.step()
                    del loss
            out.append({"per_block": engine.plan.activations.per_block})
            engine.close()
            del engine, model
    finally:
        meter.stop()
    for i, row in enumerate(out):
        row["peak"] = meter.rise(str(i)) + meter.live[str(i)] - meter.live[f"before:{i}"]
    return out


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize("rung", [0, 3])
def test_the_measured_peak_stays_within_the_budget(rung):
    """Two budgets, each halfway between two rungs of the ladder (so that the choice's prediction is below its budget
    by half a rung): the engine chooses the rung below, and its measured peak is within the budget."""
    peaks = _ladder_peaks()
    budget = (peaks[rung] + peaks[rung + 1]) / 2
    (run,) = run_distributed(_budget_measured, 1, [budget / GIB])[0]
    assert run["per_block"] == budget_ladder(2)[rung + 1], run
    assert run["peak"] <= budget, (run, budget)


def _refused(gib: float) -> str:
    model = _wide_gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    section = {"policy": "budget", "memory_budget_gib": gib, "budget_seq_len": 128}
    try:
        shardtrain.initialize(
            model, {**WIDE, "activation_checkpointing": section}, torch.optim.AdamW(model.parameters(), lr=1e-3)
        )
    except ConfigError as e:
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        assert not any(m._forward_pre_hooks for m in model.modules())  # refused before the model was touched
        return str(e)
    return "initialize accepted it"


def test_a_budget_nothing_fits_is_refused_by_name():
    """The error gives the smallest peak reachable (every block full) and what cpu_checkpointing would reach."""
    (message,) = run_distributed(_refused, 1, 0.001)
    assert "memory_budget_gib 0.001" in message and "no choice of checkpointing fits" in message, message
    assert f"the smallest predicted peak is {_fmt(_ladder_peaks()[-1])}" in message, message
    assert "every block full (policy 'full')" in message and "with cpu_checkpointing: true it is" in message, message


def _fmt(n: int) -> str:
    from shardtrain.estimate import fmt_bytes

    return fmt_bytes(n)
