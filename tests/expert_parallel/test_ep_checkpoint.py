"""Checkpoints across expert layouts (docs/expert-parallel.md, "Checkpoints"): a tiny random Qwen3-MoE with 6 experts
trained at world 3 with ``expert_parallel_size`` 3 (stage 2) resumes bitwise at that layout and loads on the same ranks
at ep 1 x dp 3 (stage 0) and at ep 3, stage 3, weights and AdamW state (moments, step) carried: the training after the
load is one process's, and a save right after the load holds the same tensors, bit for bit, as the checkpoint it loaded.
``full_state_dict()`` gathers every expert, ``load_full_state_dict`` and ``from_pretrained`` (the per-expert files
``save_pretrained`` writes) give each rank its own; the consolidated model opens with ``from_pretrained`` with identical
weights; ``inspect --verify`` refuses a missing or doubled expert block. Soak: a bf16 run at ep 2 resumes bitwise; the
same checkpoint loaded at world 2 with ep 2 and at one process; a Mixtral with 8 experts at world 4, ep 2 x dp 2 (the
experts' ZeRO fragments, or the shares of a block held whole, over an expert-data-parallel group of 2), loaded at ep 4
and at ep 2 x stage 2.

Stage 3, hybrid sharding and optimizer offload: test_ep_checkpoint_layouts.py. The runs and checks both use are in
``helpers.ep_checkpoint_runs``."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from shardtrain.checkpoint import open_checkpoint
from shardtrain.checkpoint.format import BlockFlatSlice, BlockSlice
from shardtrain.cli import main
from shardtrain.testing import run_distributed

from helpers.ep_checkpoint_runs import (
    UNITS,
    bf16_resume,
    check_against_reference,
    check_loaded_elsewhere,
    load_elsewhere,
    other_tag,
    reference,
    save_and_resume,
)


@pytest.fixture(scope="module")
def ep3(tmp_path_factory) -> dict:
    """Saved at world 3, ep 3 (6 experts, stage 2); loaded on the same ranks at ep 1 x dp 3 (stage 0) and at ep 3,
    stage 3 (every expert parameter in a unit, sharded over its expert-data-parallel group of one rank)."""
    root = tmp_path_factory.mktemp("ep3")
    others = ((1, 0), (3, 3, UNITS))
    runs = run_distributed(save_and_resume, 3, "qwen3_moe", 6, 3, 2, str(root / "a"), others, timeout=300)
    return {"root": root, "runs": runs, "ref": reference("qwen3_moe", 6)}


def test_a_run_saved_under_expert_parallelism_resumes_bitwise(ep3):
    for rank, r in enumerate(ep3["runs"]):
        assert r["resumed"] == r["unbroken"], rank
    full_unbroken, full_resumed = ep3["runs"][0]["unbroken_state"], ep3["runs"][0]["resumed_state"]
    assert full_unbroken.keys() == full_resumed.keys()
    for k, v in full_unbroken.items():
        assert torch.equal(v, full_resumed[k]), k


def test_the_checkpoint_records_each_rank_s_experts_as_a_block(ep3):
    assert [r["held"]["model.layers.0.mlp.experts"] for r in ep3["runs"]] == [(0, 2), (2, 4), (4, 6)]
    manifest = open_checkpoint(ep3["root"] / "a", "a").manifest
    for name in ("model/model.layers.1.mlp.experts.gate_up_proj", "optim/model.layers.1.mlp.experts.down_proj/exp_avg"):
        entry = manifest.tensors[name]
        assert entry.global_shape[0] == 6
        # stage 2 at ep 3: one expert-data-parallel rank per expert group, so each fragment is its whole block
        assert all(isinstance(p.slice, BlockFlatSlice) for p in entry.pieces)
        pieces = sorted(entry.pieces, key=lambda p: p.slice.block.index)
        assert [p.slice.block for p in pieces] == [BlockSlice(0, i, 3) for i in range(3)]
        assert all(p.slice.start == 0 and p.slice.length == entry.numel // 3 for p in pieces)
        assert [p.file for p in pieces] == [f"rank{i:05d}.safetensors" for i in range(3)]  # each rank its own experts
    assert manifest.tensors["optim/model.layers.1.mlp.experts.down_proj/step"].global_shape == ()


def test_load_full_state_dict_keeps_each_rank_s_experts(ep3):
    assert [r["full_loads"] for r in ep3["runs"]] == [[True, True]] * 3


def test_from_pretrained_of_per_expert_files_reads_each_rank_s_experts_only(ep3):
    assert [r["from_pretrained"]["same"] for r in ep3["runs"]] == [True, None, None]
    assert [r["from_pretrained"]["experts_read"] for r in ep3["runs"]] == [[0, 1], [2, 3], [4, 5]]


def test_the_saved_state_is_one_process_s(ep3):
    check_against_reference(ep3["root"] / "a", "a", ep3["ref"])
    # full_state_dict gathers every expert on rank 0; the other ranks get None
    full = ep3["runs"][0]["saved_state"]
    assert all(r["saved_state"] is None for r in ep3["runs"][1:])
    reader = open_checkpoint(ep3["root"] / "a", "a")
    assert full["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 6
    for k, v in full.items():
        assert torch.equal(v, reader.read(f"model/{k}")), k


def test_it_loads_at_another_expert_layout(ep3):
    assert ep3["runs"][0]["mean"] == pytest.approx(ep3["ref"]["losses"], rel=2e-5)
    for tag in (other_tag(1, 0), other_tag(3, 3, UNITS)):  # a stage-2 checkpoint at stage 0 and at stage 3
        check_loaded_elsewhere(ep3["root"] / "a", ep3["root"] / "a", tag, ep3["runs"][0][tag], ep3["ref"])


@pytest.mark.soak
@pytest.mark.parametrize("world, ep, stage", [(2, 2, 1), (1, 1, 0)])
def test_it_loads_at_world_2_ep_2_and_at_one_process(ep3, tmp_path, world, ep, stage):
    again = tmp_path / "again"
    run = run_distributed(load_elsewhere, world, "qwen3_moe", 6, ep, stage, str(ep3["root"] / "a"), str(again))
    check_loaded_elsewhere(ep3["root"] / "a", again, "b", run[0], ep3["ref"])


@pytest.mark.soak
def test_a_bf16_run_resumes_bitwise(tmp_path):
    assert run_distributed(bf16_resume, 2, str(tmp_path), timeout=300) == [True, True]


@pytest.mark.soak
@pytest.mark.parametrize("stage", [1, 0])
def test_ep2_x_dp2_and_ep4_at_world_4(tmp_path, stage):
    # world 4, ep 2: the experts' ZeRO fragments (stage 1) or the shares of a block held whole (stage 0) are over an
    # expert-data-parallel group of 2; loaded at ep 4 and at ep 2 x stage 2 on the same ranks
    ref = reference("mixtral", 8)
    runs = run_distributed(save_and_resume, 4, "mixtral", 8, 2, stage, str(tmp_path), ((4, 1), (2, 2)), timeout=600)
    for r in runs:
        assert r["resumed"] == r["unbroken"]
    check_against_reference(tmp_path, "a", ref)
    entry = open_checkpoint(tmp_path, "a").manifest.tensors["model/model.layers.0.mlp.experts.gate_up_proj"]
    pieces = sorted(entry.pieces, key=lambda p: (p.slice.block.index, p.slice.start))
    assert [p.slice.block for p in pieces] == [BlockSlice(0, i, 2) for i in (0, 0, 1, 1)]
    assert [p.slice.length for p in pieces] == [entry.numel // 4] * 4  # halves of each block: one writer each
    assert [p.file for p in pieces] == [f"rank{r:05d}.safetensors" for r in (0, 2, 1, 3)]  # dp_rank = edp * 2 + ep
    for tag in ("b_ep4_stage1", "b_ep2_stage2"):
        check_loaded_elsewhere(tmp_path, tmp_path, tag, runs[0][tag], ref)


def test_consolidate_writes_what_from_pretrained_opens(ep3, tmp_path):
    import transformers

    out = tmp_path / "hf"
    assert main(["checkpoint", "consolidate", str(ep3["root"] / "a"), str(out), "--tag", "a"]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    reader = open_checkpoint(ep3["root"] / "a", "a")
    state = model.state_dict()
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (6, 24, 16)
    for k, v in state.items():
        assert torch.equal(v, reader.read(f"model/{k}")), k


def test_inspect_verify_checks_the_expert_blocks_cover_each_tensor_once(ep3, tmp_path, capsys):
    copy = tmp_path / "ck"
    shutil.copytree(ep3["root"] / "a", copy)
    assert main(["checkpoint", "inspect", str(copy), "--tag", "a", "--verify"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "layers.0.mlp.experts.gate_up_proj " in x)
    assert "tp: dim 0, 3 blocks" in line, line
    name = "model/model.layers.0.mlp.experts.gate_up_proj"
    manifest = copy / "a" / "manifest.json"
    saved = json.loads(manifest.read_text())
    pieces = saved["tensors"][name]["pieces"]
    for damage, words in [
        ([p for p in pieces if p["slice"]["index"] != 1], "are in no stored piece"),  # expert block 1 missing
        ([*pieces, {**pieces[0], "key": pieces[0]["key"] + "@9"}], "stored pieces overlap"),  # block 0 twice
    ]:
        d = json.loads(json.dumps(saved))
        d["tensors"][name]["pieces"] = damage
        manifest.write_text(json.dumps(d))
        assert main(["checkpoint", "inspect", str(copy), "--tag", "a", "--verify"]) == 2
        err = capsys.readouterr().err
        assert name in err and words in err, err
