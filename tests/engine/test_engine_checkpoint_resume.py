"""Exact resume of real-model features (0-dim parameter, empty and non-contiguous buffers, tied pair, frozen
parameter) at every ZeRO stage and worlds 1-3, with SGD (momentum, nesterov, weight decay) and AdamW in three param
groups: the resumed run is bitwise the uninterrupted one (losses, parameters, optimizer state)."""

import pytest

from shardtrain.testing import run_distributed

from helpers.resume import exact_resume


@pytest.mark.parametrize("world", [1, 2, 3])
def test_exact_resume_every_stage_and_optimizer(tmp_path, world):
    results = run_distributed(exact_resume, world, str(tmp_path), [0, 1, 2, 3], ["sgd", "adamw"], timeout=300)
    problems = [f"rank {r}: {p}" for r, ps in enumerate(results) for p in ps]
    assert not problems, "\n".join(problems)


def test_exact_resume_mixed_precision(tmp_path):
    """bf16 parameters with fp32 masters: the masters and their state are what is saved and restored."""
    results = run_distributed(exact_resume, 2, str(tmp_path), [1, 3], ["adamw"], "bf16", timeout=300)
    problems = [f"rank {r}: {p}" for r, ps in enumerate(results) for p in ps]
    assert not problems, "\n".join(problems)
