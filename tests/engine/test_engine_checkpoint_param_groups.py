"""Param groups are matched by their parameters' names, not positions; loaded optimizer state takes the dtype and
device of the tensor it belongs to (``step`` keeps its own), as ``torch.optim.Optimizer.load_state_dict`` does."""

from __future__ import annotations

import json
import shutil
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from shardtrain import initialize
from shardtrain.errors import CheckpointError
from shardtrain.testing import run_distributed

from helpers.resume import ResumeNet, differences, snapshot, train


def _engine_with_groups(seed: int, groups: str, stage: int, dtype: torch.dtype = torch.float32, bf16: bool = False):
    """AdamW over ResumeNet with the groups named by ``groups``: "three" (matrices, vectors, logit_scale),
    "permuted" (the same three in another order, other hyperparameters), "merged" (matrices and vectors in one
    group), "two" (logit_scale frozen: matrices, vectors)."""
    model = ResumeNet(seed).to(dtype)
    matrices = [model.embed.weight, *(b.fc.weight for b in model.blocks)]
    vectors = [*(b.fc.bias for b in model.blocks), model.norm.weight, model.norm.bias]
    spec = {
        "three": [(matrices, 1e-2, 0.1), (vectors, 5e-3, 0.0), ([model.logit_scale], 2e-2, 0.0)],
        "permuted": [([model.logit_scale], 1.0, 0.5), (matrices, 2.0, 0.5), (vectors[::-1], 3.0, 0.5)],
        "merged": [(matrices + vectors, 1e-2, 0.1), ([model.logit_scale], 2e-2, 0.0)],
        "two": [(matrices, 1e-2, 0.1), (vectors, 5e-3, 0.0)],
    }[groups]
    if groups == "two":
        model.logit_scale.requires_grad_(False)
    opt = torch.optim.AdamW([{"params": p, "lr": lr, "weight_decay": wd} for p, lr, wd in spec])
    config = {
        "train_micro_batch_size_per_gpu": 6 // dist.get_world_size(),
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 50},
    }
    if stage == 3:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 20
    if bf16:
        config["bf16"] = {"enabled": True}
    return initialize(model, config=config, optimizer=opt)


def _refused(engine, path: str) -> str:
    before = snapshot(engine)
    try:
        engine.load_checkpoint(path)
    except CheckpointError as err:
        assert not differences(before, snapshot(engine)), "a refused load changed the engine"
        return str(err)
    return "no error"


def _param_groups_and_dtypes(root: str) -> list[str]:
    problems = []

    def check(cond: bool, what: str) -> None:
        if not cond:
            problems.append(what)

    try:
        saved = _engine_with_groups(0, "three", stage=1)
        train(saved, range(2))
        saved.save_checkpoint(f"{root}/three")
        train(saved, range(2, 4))
        want = snapshot(saved)

        # the same groups in another order with other hyperparameters: each takes the saved group of its names
        permuted = _engine_with_groups(1, "permuted", stage=1)
        permuted.load_checkpoint(f"{root}/three")
        lrs = [(g["lr"], g["weight_decay"]) for g in permuted.optimizer.param_groups]
        check(lrs == [(2e-2, 0.0), (1e-2, 0.1), (5e-3, 0.0)], f"hyperparameters matched by position: {lrs}")
        train(permuted, range(2, 4))
        got = snapshot(permuted)
        got["groups"] = [got["groups"][i] for i in (1, 2, 0)]  # compare group by group in the saved order
        check(not differences(want, got), f"permuted groups do not resume exactly: {differences(want, got)[:3]}")

        # a checkpoint written before optimizer/state_kinds existed: the kinds are read from the shapes
        if dist.get_rank() == 0:
            shutil.copytree(f"{root}/three", f"{root}/old")
            manifest = Path(f"{root}/old/global_step2/manifest.json")
            content = json.loads(manifest.read_text())
            del content["objects"]["optimizer/state_kinds"]
            manifest.write_text(json.dumps(content))
        dist.barrier()
        old = _engine_with_groups(1, "three", stage=1)
        old.load_checkpoint(f"{root}/old")
        train(old, range(2, 4))
        check(not differences(want, snapshot(old)), f"old checkpoint: {differences(want, snapshot(old))[:3]}")

        # another grouping, a parameter the checkpoint's optimizer lacks, one it has and this one lacks
        message = _refused(_engine_with_groups(1, "merged", stage=1), f"{root}/three")
        check(
            "param group 0 holds parameters that the checkpoint has in different groups" in message
            and "saved group 0: 'embed.weight'" in message
            and "saved group 1: 'blocks.0.fc.bias'" in message,
            f"merged groups: {message}",
        )
        two = _engine_with_groups(0, "two", stage=1)
        train(two, range(1))
        two.save_checkpoint(f"{root}/two")
        message = _refused(_engine_with_groups(1, "three", stage=1), f"{root}/two")
        check(
            "param group 2 holds 'logit_scale', which no param group of the checkpoint holds" in message,
            f"missing name: {message}",
        )
        message = _refused(_engine_with_groups(1, "two", stage=1), f"{root}/three")
        check(
            "the checkpoint's param group 2 ('logit_scale') matches no param group here" in message,
            f"extra name: {message}",
        )

        # optimizer state takes the dtype of what it belongs to; ``step`` keeps its own
        wide = _engine_with_groups(0, "three", stage=3, dtype=torch.float64)
        train(wide, range(2))
        wide.save_checkpoint(f"{root}/fp64")
        for bf16 in (False, True):  # fp32 parameters, or bf16 parameters with fp32 masters
            narrow = _engine_with_groups(1, "three", stage=3, bf16=bf16)
            narrow.load_checkpoint(f"{root}/fp64")
            for stepped, state in narrow.optimizer.state.items():
                dtypes = {k: v.dtype for k, v in state.items()}
                want_dtypes = {"step": torch.float32, "exp_avg": torch.float32, "exp_avg_sq": torch.float32}
                check(stepped.dtype == torch.float32 and dtypes == want_dtypes, f"bf16={bf16}: {dtypes}")
            train(narrow, range(2, 3))  # the loaded state steps
    except Exception:
        problems.append(traceback.format_exc())
    return problems


def test_param_groups_matched_by_names_and_state_cast(tmp_path):
    results = run_distributed(_param_groups_and_dtypes, 2, str(tmp_path), timeout=180)
    problems = [f"rank {r}: {p}" for r, ps in enumerate(results) for p in ps]
    assert not problems, "\n".join(problems)
