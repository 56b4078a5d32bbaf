"""Subscribers on an engine at ZeRO stages 0-3: training is not disturbed, every rank writes its own directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import shardtrain
from shardtrain.cli import main
from shardtrain.debug import StatisticsSubscriber, SubscriberManager
from shardtrain.testing import run_distributed

from helpers.parity import Recipe, global_micro_batches, make_model, make_optimizer

RECIPE = Recipe(steps=3, gas=2, micro=2)


def _train(stage: int, out_dir: str | None, start_step: int | None = None, unsubscribe: bool = True) -> dict:
    """One engine run on this rank; with ``out_dir``, a StatisticsSubscriber records from ``start_step`` on."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(RECIPE)
    config = {
        "train_micro_batch_size_per_gpu": RECIPE.micro,
        "gradient_accumulation_steps": RECIPE.gas,
        "gradient_clipping": RECIPE.clip,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000, "allgather_bucket_size": 2000}
        if stage < 3
        else {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine = shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, RECIPE))
    manager = SubscriberManager()
    if out_dir is not None:
        manager.subscribe(engine, StatisticsSubscriber(out_dir, start_step=start_step))
    batches = global_micro_batches(RECIPE, world)
    lo, hi = rank * RECIPE.micro, (rank + 1) * RECIPE.micro
    losses, norms = [], []
    for step in range(RECIPE.steps):
        for m in range(RECIPE.gas):
            x, y = batches[step * RECIPE.gas + m]
            loss = engine(x[lo:hi], y[lo:hi])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
    if out_dir is not None and unsubscribe:
        manager.unsubscribe(engine)
    return {"losses": losses, "norms": norms, "params": engine.full_state_dict()}


def _with_and_without(stage: int, out_dir: str) -> dict:
    result = {"plain": _train(stage, None), "watched": _train(stage, out_dir, start_step=1)}
    try:  # a second run into the same directory: every rank must refuse, each for its own rank_<r>
        StatisticsSubscriber(out_dir)
        result["reuse"] = "accepted"
    except FileExistsError as err:
        result["reuse"] = str(err)
    return result


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_runs_are_undisturbed_and_recorded_per_rank(stage, world_size, tmp_path):
    out = tmp_path / "stats"
    results = run_distributed(_with_and_without, world_size, stage, str(out))
    for r in results:  # bit-identical training with the subscriber attached
        assert r["watched"]["losses"] == r["plain"]["losses"]
        assert r["watched"]["norms"] == r["plain"]["norms"]
    assert all("already exists" in r["reuse"] for r in results)
    final_plain, final_watched = results[0]["plain"]["params"], results[0]["watched"]["params"]
    assert all(torch.equal(final_plain[k], final_watched[k]) for k in final_plain)

    assert sorted(p.name for p in out.iterdir()) == [f"rank_{r}" for r in range(world_size)]
    firsts = []
    for rank in range(world_size):
        files = sorted(p.name for p in (out / f"rank_{rank}").iterdir())
        assert files == ["step_000001.jsonl", "step_000002.jsonl"]  # engine.global_step, from start_step=1
        records = [json.loads(line) for line in (out / f"rank_{rank}" / files[0]).read_text().splitlines()]
        tok = [r for r in records if r["name"] == "tok"]
        # two micro-steps per optimizer step, each a forward then a backward; full activations of this rank's batch
        assert [(r["dir"], r["call"]) for r in tok] == [
            ("forward", 0),
            ("backward", 0),
            ("forward", 1),
            ("backward", 1),
        ]
        assert tok[0]["shape"] == [RECIPE.micro, 16, 32]
        firsts.append(tok[0]["mean"])
    assert len(set(firsts)) == world_size  # each rank recorded its own data, not a neighbour's file


def _two_stages(out_root: str) -> None:
    for stage in (0, 3):
        _train(stage, f"{out_root}/stage{stage}")


def test_stage0_and_stage3_runs_agree_under_compare(tmp_path, capsys):
    run_distributed(_two_stages, 2, str(tmp_path))
    code = main(["compare", str(tmp_path / "stage0"), str(tmp_path / "stage3"), "--rtol", "1e-4"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "records compared: " in out and "over 3 step(s)" in out
    assert Path(tmp_path / "stage3" / "rank_1" / "step_000000.jsonl").exists()


def _second_run_never_unsubscribed(out_root: str) -> None:
    _train(2, f"{out_root}/unsubscribed")
    # the worker then leaves with os._exit (multiprocessing): no atexit handler, no garbage collection runs
    _train(2, f"{out_root}/never_unsubscribed", unsubscribe=False)


def test_engine_records_are_on_disk_without_unsubscribe(tmp_path, capsys):
    run_distributed(_second_run_never_unsubscribed, 2, str(tmp_path))
    code = main(["compare", str(tmp_path / "unsubscribed"), str(tmp_path / "never_unsubscribed"), "--rtol", "0"])
    out = capsys.readouterr().out
    assert code == 0 and "only in" not in out and "over 3 step(s)" in out, out
    for rank in range(2):  # the last step's last gradients (the embeddings', both micro-steps) on every rank
        last = tmp_path / "never_unsubscribed" / f"rank_{rank}" / f"step_{RECIPE.steps - 1:06d}.jsonl"
        records = [json.loads(line) for line in last.read_text().splitlines()]
        assert [(r["dir"], r["call"]) for r in records if r["name"] == "tok"][-2:] == [("forward", 1), ("backward", 1)]
