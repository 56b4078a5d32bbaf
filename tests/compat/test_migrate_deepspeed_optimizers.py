"""DeepSpeed checkpoints written with each optimizer DeepSpeed builds resume in shardtrain with their step counts.

DeepSpeed's default for a config's ``optimizer: {type: AdamW}`` is its ``FusedAdam`` (with ``DS_ACCELERATOR=cpu``
a CPU build of the same class, JIT-compiled on first use: about 100 s once on a 2-core machine, then cached in
the venv by ``tests/conftest.py``), whose ``step`` is a Python int in the state dict; with ``offload_optimizer`` it is
``DeepSpeedCPUAdam`` (an int too); ``torch_adam: true`` and a client torch optimizer save a 0-dim tensor
([Note: DeepSpeed's step counts] in ``deepspeed_format.py``). Before the reader took the int, such a checkpoint
loaded its moments without ``step`` and the first ``engine.step()`` failed with ``KeyError: 'step'``.

Real DeepSpeed (world 2) writes FusedAdam checkpoints at ZeRO stages 0-3; each resumes in shardtrain at world 3
(stages 1 and 3 also at world 1) at another stage, and the losses equal DeepSpeed's continuation within 1e-5
relative (a fresh optimizer misses by about 1e-2: ``test_migrate_deepspeed_checkpoint.py``). A checkpoint without
its step counts fails ``inspect --verify`` and is refused at load by name. Under ``-m soak``: DeepSpeedCPUAdam
with offload at stages 1-3, a client torch AdamW at stages 0, 1 and 3, FusedAdam in bf16.

Stage 0 is in the default run because FusedAdam's stage-0 state is peculiar: it steps a whole param group with the
count of the last parameter it visits and increments only that one's ``step`` (the others stay 0), which a reader
taking each parameter's own count gets wrong by 3e-2 on the second step after the resume.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from shardtrain.checkpoint.reader import open_checkpoint
from shardtrain.cli import main
from shardtrain.testing import DistributedFailure, run_distributed

from helpers.ds import (
    SAVE_AT,
    STEPS,
    case_name,
    clear_stale_extension_builds,
    resume,
    resume_each,
    write_deepspeed_checkpoints,
)

RTOL = 1e-5
FUSED_STAGES = (0, 1, 2, 3)


def _write(root, cases, optimizer):
    clear_stale_extension_builds()  # a build killed by an earlier run would make this one wait forever
    return run_distributed(write_deepspeed_checkpoints, 2, str(root), cases, optimizer, timeout=600)[0]


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds_fused")
    return root, _write(root, [(s, "fp32") for s in FUSED_STAGES], "fused")


def _optimizer_files(path):
    return sorted(path.glob("global_step*/*optim_states.pt")) or sorted(path.glob("global_step*/*model_states.pt"))


def _saved_state_dicts(data):
    """The optimizer state dicts of one DeepSpeed file (one per param group's partition at stages 1-3)."""
    if "optimizer_state_dict" not in data:  # stage 0: the model-states file's optimizer
        return [data["optimizer"]]
    osd = data["optimizer_state_dict"]
    return [osd["base_optimizer_state"] if "base_optimizer_state" in osd else osd["optimizer_state_dict"]]


def _rewrite(src, dst, edit) -> None:
    """A copy of checkpoint ``src`` at ``dst`` with ``edit(optimizer state dict)`` applied in every file."""
    shutil.copytree(src, dst)
    for f in _optimizer_files(dst):
        data = torch.load(f, weights_only=False)
        for sd in _saved_state_dicts(data):
            edit(sd)
        torch.save(data, f)


@pytest.mark.parametrize("stage", FUSED_STAGES)
def test_fused_adam_step_is_read(fused, stage):
    root, _ = fused
    path = root / case_name(stage, "fp32", "fused")
    sd = _saved_state_dicts(torch.load(_optimizer_files(path)[0], weights_only=False))[0]
    assert type(sd["state"][0]["step"]) is int  # what makes FusedAdam's layout different: not a tensor
    assert sd["param_groups"][0]["step"] == 0  # its per-group count, unused since DeepSpeed 0.9
    reader = open_checkpoint(path)
    step = reader.read("optim/fc.weight/step")
    assert step.dtype == torch.float32 and step.shape == () and step.item() == SAVE_AT
    assert reader.objects["optimizer/state_kinds"] == {
        "exp_avg": "elementwise",
        "exp_avg_sq": "elementwise",
        "step": "scalar",
    }
    assert all("step" not in g for g in reader.objects["optimizer/param_groups"])  # not a hyperparameter
    assert main(["checkpoint", "inspect", str(path), "--verify"]) == 0


@pytest.mark.parametrize("world", [3, 1])
def test_fused_adam_resumes_at_other_layouts(fused, world):
    """Every writing stage into another stage, at world 3 and at world 1: losses equal DeepSpeed's continuation."""
    root, runs = fused
    loads = {3: [(0, 3), (1, 2), (2, 3), (3, 1)], 1: [(3, 0), (1, 3)]}[world]
    cases = [(case_name(s, "fp32", "fused"), load) for s, load in loads]
    results = run_distributed(resume_each, world, str(root), cases, timeout=300)[0]
    for (name, _), got in zip(cases, results):
        assert got["losses"] == pytest.approx(runs[name]["after"], rel=RTOL), (name, got["losses"])
        assert got["global_step"] == STEPS


def test_fused_adam_group_step_of_older_releases(fused, tmp_path):
    """FusedAdam before DeepSpeed 0.9 counted in ``param_groups[g]['step']`` and kept no per-parameter step: the
    group's count is the step, and the resume is the same."""
    root, runs = fused
    name = case_name(2, "fp32", "fused")

    def to_group_count(sd):
        for group in sd["param_groups"]:
            group["step"] = sd["state"][group["params"][0]].pop("step")

    _rewrite(root / name, tmp_path / name, to_group_count)
    assert open_checkpoint(tmp_path / name).read("optim/fc.weight/step").item() == SAVE_AT
    got = run_distributed(resume, 1, str(tmp_path), name, 1, "fp32", timeout=300)[0]["losses"]
    assert got == pytest.approx(runs[name]["after"], rel=RTOL)


def test_missing_step_fails_verify_and_is_refused_by_name(fused, tmp_path, capsys):
    root, _ = fused
    name = case_name(1, "fp32", "fused")

    def drop_step(sd):
        for group in sd["param_groups"]:
            group.pop("step", None)
            sd["state"][group["params"][0]].pop("step")

    _rewrite(root / name, tmp_path / name, drop_step)
    capsys.readouterr()
    assert main(["checkpoint", "inspect", str(tmp_path / name), "--verify"]) == 1
    out = capsys.readouterr().out
    assert "optimizer state 'step' is missing" in out and "'fc.weight'" in out
    with pytest.raises(DistributedFailure) as info:
        run_distributed(resume, 1, str(tmp_path), name, 2, "fp32", timeout=300)
    message = str(info.value)
    assert "but not ['step'], which AdamW needs" in message and "load_optimizer_states=False" in message
    assert "KeyError" not in message
    # the weights alone still load
    run_distributed(resume, 1, str(tmp_path), name, 2, "fp32", False, timeout=300)


# -- soak: the other optimizers DeepSpeed builds, and more layouts ----------------------------------------------------
SOAK = [
    ("cpu_offload", [(1, "fp32"), (2, "fp32"), (3, "fp32")], {3: [(1, 3), (2, 1), (3, 2)], 1: [(3, 0), (1, 2)]}),
    ("client", [(0, "fp32"), (1, "fp32"), (3, "fp32")], {3: [(0, 2), (1, 3), (3, 1)], 1: [(3, 0), (0, 3)]}),
]


@pytest.mark.soak
@pytest.mark.parametrize("optimizer,cases,loads", SOAK, ids=[s[0] for s in SOAK])
def test_every_deepspeed_optimizer_resumes(tmp_path, optimizer, cases, loads):
    runs = _write(tmp_path, cases, optimizer)
    for world, pairs in loads.items():
        named = [(case_name(s, "fp32", optimizer), load) for s, load in pairs]
        results = run_distributed(resume_each, world, str(tmp_path), named, timeout=300)[0]
        for (name, _), got in zip(named, results):
            assert got["losses"] == pytest.approx(runs[name]["after"], rel=RTOL), (name, got["losses"])
    for stage, dtype in cases:
        assert main(["checkpoint", "inspect", str(tmp_path / case_name(stage, dtype, optimizer)), "--verify"]) == 0


@pytest.mark.soak
def test_fused_adam_bf16_resumes(tmp_path):
    """bf16: within 2e-3, as for torch's AdamW (the two systems' bf16 forward passes differ by about 1e-3)."""
    runs = _write(tmp_path, [(2, "bf16"), (3, "bf16")], "fused")
    for stage, load, world in [(2, 1, 3), (3, 2, 1)]:
        name = case_name(stage, "bf16", "fused")
        got = run_distributed(resume, world, str(tmp_path), name, load, "bf16", timeout=300)[0]["losses"]
        assert got == pytest.approx(runs[name]["after"], rel=2e-3), (name, got)
