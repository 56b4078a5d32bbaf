"""The planner reads ``activation_checkpointing.policy``: the activations it reports for ``full`` and ``selective``
are what the engine's policies keep (fewer bytes saved for backward than without checkpointing)."""

import json
import math

from shardtrain.estimate.planner import estimate_memory
from shardtrain.models.gpt import GPT, GPTConfig


def _gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=256, seq_len=128, d_model=64, n_layer=4, n_head=4))


def _saved(policy: str) -> tuple[int, str]:
    config = {"train_micro_batch_size_per_gpu": 2, "activation_checkpointing": {"policy": policy}}
    est = estimate_memory(_gpt, config, world_size=1, seq_len=128, device_type="cpu")
    (row,) = [r for r in est.rows if r.component.startswith("activations saved for backward")]
    return row.nbytes, est.layout.describe()


def test_estimate_reports_the_activations_of_each_policy():
    """Failed before: the planner did not read the section (and the config refused `policy` as unknown)."""
    none, full, selective = _saved("none"), _saved("full"), _saved("selective")
    assert full[0] < selective[0] < none[0], (none, full, selective)
    assert "selective checkpointing" in selective[1] and "checkpointing" in full[1] and "checkpointing" not in none[1]


def deep_gpt() -> GPT:
    """Four blocks whose inputs outweigh the output head's temporaries (vocabulary 64, sequence 256): keeping them
    in host memory lowers the peak below every block full."""
    return GPT(GPTConfig(vocab_size=64, seq_len=256, d_model=64, n_layer=4, n_head=4))


def _cli_fit(capsys, limit: int) -> dict:
    from shardtrain.cli import main

    argv = ["estimate", "test_estimate_activation_policy:deep_gpt", "--micro-batch", "2", "--seq-len", "256"]
    assert main([*argv, "--memory-limit", str(limit), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["fit"]


def test_estimate_says_which_activation_setting_makes_the_model_fit(capsys):
    """Failed before: estimate had no --memory-limit and said nothing of what would fit. A limit only checkpointing
    every block fully meets gives that (the last block selective: backward starts with it, so recomputing it whole
    lowers no peak, and the least recompute is chosen); a limit below that, which only host-kept block inputs meet,
    ``cpu_checkpointing`` with its host bytes; nothing below; a limit above the layout's peak: it fits."""
    from shardtrain.cli import main
    from shardtrain.cli.estimate import _fit_text
    from shardtrain.estimate.activation_budget import _ladder_for

    config = {"train_micro_batch_size_per_gpu": 2}
    ladder, rungs = _ladder_for(deep_gpt, config, 1, 256, "cuda", None, None, None)
    none, two_selective = ladder.measure(rungs[0], False).peak, ladder.measure(rungs[-3], False).peak
    full, full_on_host = ladder.measure(rungs[-1], False).peak, ladder.measure(rungs[-1], True).peak
    assert ladder.measure(rungs[-2], False).peak == full  # every block but the last full: the same peak
    assert full_on_host < full < two_selective < none

    fit = _cli_fit(capsys, full)
    assert not fit["fits"] and fit["peak"] == none
    setting = fit["setting"]
    assert setting["per_block"] == ["full", "full", "full", "selective"] and setting["setting"] == "budget", setting
    assert setting["peak"] == full and setting["host_bytes"] == 0 and not setting["cpu_checkpointing"]
    gib = math.ceil(full / 2**30 * 1e6) / 1e6  # rounded up: the budget fits the rung chosen
    assert setting["config"] == {"policy": "budget", "memory_budget_gib": gib, "budget_seq_len": 256}
    text = _fit_text(fit, 256)  # what the table prints
    assert "the cheapest activation setting that fits: budget (0-2 full, 3 selective)" in text, text

    limit = (full + full_on_host) // 2
    setting = _cli_fit(capsys, limit)["setting"]
    assert setting["cpu_checkpointing"] and setting["setting"].endswith(", cpu_checkpointing"), setting
    assert setting["peak"] <= limit and setting["host_bytes"] > 0 and setting["config"]["cpu_checkpointing"] is True

    assert _cli_fit(capsys, none)["fits"]
    argv = ["estimate", "test_estimate_activation_policy:deep_gpt", "--micro-batch", "2", "--seq-len", "256"]
    assert main([*argv, "--memory-limit", str(full_on_host - 1)]) == 0  # nothing fits: said in words
    assert "no activation checkpointing setting makes it fit" in capsys.readouterr().out


def test_a_layout_names_its_checkpointing():
    """A per-block choice in runs of blocks, and host-kept inputs only where some block is checkpointed (failed
    before the fix: a whole-model policy with cpu_checkpointing raised in ``describe``)."""
    from shardtrain.estimate.planner import Candidate

    def said(ac) -> str:
        return Candidate(1, checkpointing=ac, offload_activations=True).describe()

    assert said(True).endswith("micro-batch 1 x seq 2048, checkpointing, checkpoints in host memory")
    assert said("selective").endswith("selective checkpointing, checkpoints in host memory")
    assert said(("full", "full", "selective", "none")).endswith(
        "checkpointing by block (0-1 full, 2 selective, 3 none), checkpoints in host memory"
    )
    assert "host memory" not in said(False) and "host memory" not in said(("none", "none"))
