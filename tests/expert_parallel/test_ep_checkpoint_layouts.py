"""Checkpoints of split experts at ZeRO stage 3, with hybrid sharding and with optimizer offload
(docs/expert-parallel.md, "Checkpoints"): a tiny random Mixtral with 8 experts at world 4, ep 2 x dp 2, so that each
expert block is sharded over an expert-data-parallel group of two ranks.

* Stage 3 with every parameter in a unit: the resumed run equals the unbroken one bit for bit; the checkpoint holds
  one process's weights and AdamW state, each expert block as the fragments of the two ranks holding it;
  ``full_state_dict()`` gives every expert and ``consolidate`` writes them for ``from_pretrained``; loaded at ep 2 x
  stage 2, a save right after the load holds the same tensors and training goes on as one process's. A save that
  fails on one rank leaves the previous checkpoint as it was.
* Stage 3 with hybrid sharding (``mics_shard_size`` 2), the optimizer on the host and some expert parameters
  persistent: the dense state, replicated across the two shard groups, is written once (by the first group), the
  expert state by every rank of each expert-data-parallel group; it resumes bit for bit and loads at ep 4 with hybrid
  sharding at stage 2.

A stage-2 checkpoint loading at stage 3 (world 3, ep 3) is in test_ep_checkpoint.py. Soak: optimizer offload to the
host at stages 1 and 2 and to swap files at stage 3 (with the parameters), hybrid sharding at stages 1 and 2, a save
at world 3, ep 3, stage 3 with 6 experts, and one at world 2, ep 2, stage 3 with hybrid sharding (shard groups of
one rank) and the optimizer on the host, each loaded at other layouts (ep 4 at stage 3 among them); a stage-3
checkpoint loaded at one process.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import torch

from shardtrain.checkpoint import open_checkpoint
from shardtrain.checkpoint.format import BlockFlatSlice
from shardtrain.cli import main
from shardtrain.testing import run_distributed

from helpers.ep_checkpoint_runs import (
    UNITS,
    check_against_reference,
    check_loaded_elsewhere,
    failed_save_keeps_the_previous,
    load_elsewhere,
    other_tag,
    reference,
    save_and_resume,
)

HOST = {"offload_optimizer": {"device": "cpu"}}
HYBRID = {"mics_shard_size": 2}
# the down_proj blocks (4 x 16 x 24 elements) stay whole (persistent), the gate_up_proj ones (4 x 48 x 16) in units
HYBRID_HOST = {**HYBRID, **HOST, "stage3_param_persistence_threshold": 2000}
STAGE3_OTHERS = ((2, 2),)  # and at ep 4, stage 3: soak
HYBRID_OTHERS = ((4, 2, HYBRID),)


def stage3_runs(root: str) -> dict:
    """The world-4 runs, on the same ranks (one start of the processes)."""
    return {
        "z3": save_and_resume("mixtral", 8, 2, 3, f"{root}/z3", STAGE3_OTHERS, UNITS),
        "hybrid": save_and_resume("mixtral", 8, 2, 3, f"{root}/hybrid", HYBRID_OTHERS, HYBRID_HOST),
        "failed": failed_save_keeps_the_previous("mixtral", 8, 2, 3, f"{root}/z3", f"{root}/failed", UNITS),
    }


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ep_stage3")
    runs = run_distributed(stage3_runs, 4, str(root), timeout=600)
    return {"root": root, "runs": runs, "ref": reference("mixtral", 8)}


def _check_resumes_bitwise(runs: list[dict]) -> None:
    for rank, r in enumerate(runs):
        assert r["resumed"] == r["unbroken"], rank
    unbroken, resumed = runs[0]["unbroken_state"], runs[0]["resumed_state"]
    assert unbroken.keys() == resumed.keys()
    for k, v in unbroken.items():
        assert torch.equal(v, resumed[k]), k


def _check_blocks_over_expert_groups(path: Path, name: str) -> None:
    """Expert block ``i`` is stored by the ranks holding it (dp ranks ``i`` and ``i + 2``), as fragments that
    cover it once."""
    entry = open_checkpoint(path, "a").manifest.tensors[name]
    assert entry.global_shape[0] == 8
    assert all(isinstance(p.slice, BlockFlatSlice) and p.slice.block.count == 2 for p in entry.pieces), name
    for i in range(2):
        pieces = sorted((p for p in entry.pieces if p.slice.block.index == i), key=lambda p: p.slice.start)
        assert {p.file for p in pieces} <= {f"rank{r:05d}.safetensors" for r in (i, i + 2)}, (name, pieces)
        spans = [(p.slice.start, p.slice.start + p.slice.length) for p in pieces]
        assert spans[0][0] == 0 and spans[-1][1] == entry.numel // 2, (name, spans)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)), (name, spans)


def test_a_stage_3_run_resumes_bitwise(world4):
    runs = [r["z3"] for r in world4["runs"]]
    _check_resumes_bitwise(runs)
    # every expert bucket is in a unit, sharded over the two ranks holding the same experts
    assert all(r["expert_buckets"] == [(2, False)] for r in runs)
    assert [r["held"]["model.layers.0.mlp.experts"] for r in runs] == [(0, 4), (4, 8), (0, 4), (4, 8)]


def test_the_stage_3_checkpoint_is_one_process_s_with_each_block_over_its_expert_group(world4):
    path = world4["root"] / "z3"
    check_against_reference(path, "a", world4["ref"])
    for name in (
        "model/model.layers.0.mlp.experts.gate_up_proj",
        "model/model.layers.1.mlp.experts.down_proj",
        "optim/model.layers.1.mlp.experts.gate_up_proj/exp_avg_sq",
    ):
        _check_blocks_over_expert_groups(path, name)
    # full_state_dict() at stage 3: every expert, gathered on rank 0, what the checkpoint holds
    full, reader = world4["runs"][0]["z3"]["saved_state"], open_checkpoint(path, "a")
    assert all(r["z3"]["saved_state"] is None for r in world4["runs"][1:])
    assert full["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 48, 16)
    for k, v in full.items():
        assert torch.equal(v, reader.read(f"model/{k}")), k
    assert [r["z3"]["full_loads"] for r in world4["runs"]] == [[True, True]] * 4  # load_full_state_dict at stage 3


def test_inspect_verify_lists_the_fragments_of_each_expert_block(world4, capsys):
    assert main(["checkpoint", "inspect", str(world4["root"] / "z3"), "--tag", "a", "--verify"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "layers.0.mlp.experts.gate_up_proj " in x)
    assert "tp: dim 0, 2 blocks | zero: 2 fragments per block" in line, line


def test_a_stage_3_checkpoint_loads_at_stage_2(world4):
    run, root = world4["runs"][0]["z3"], world4["root"] / "z3"
    assert run["mean"] == pytest.approx(world4["ref"]["losses"], rel=2e-5)
    for other in STAGE3_OTHERS:
        tag = other_tag(*other)
        check_loaded_elsewhere(root, root, tag, run[tag], world4["ref"])


def test_a_stage_3_checkpoint_consolidates_to_what_from_pretrained_opens(world4, tmp_path):
    import transformers

    out = tmp_path / "hf"
    assert main(["checkpoint", "consolidate", str(world4["root"] / "z3"), str(out), "--tag", "a"]) == 0
    state = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    full = world4["runs"][0]["z3"]["saved_state"]
    assert state.keys() == full.keys()
    for k, v in state.items():
        assert torch.equal(v, full[k]), k


def test_a_failed_save_leaves_the_previous_checkpoint(world4):
    runs = [r["failed"] for r in world4["runs"]]
    for r in runs:  # every rank is told, naming the rank whose disk was full
        assert r["error"] is not None and re.search(r"\brank 3\b", r["error"]), r["error"]
        assert r["latest"] == "good" and not r["bad_left"]
    assert runs[0]["same"] is True


def test_hybrid_sharding_writes_dense_state_once_and_expert_state_over_expert_groups(world4):
    runs = [r["hybrid"] for r in world4["runs"]]
    _check_resumes_bitwise(runs)
    assert all(r["replicas"] == 2 and r["offloaded"] for r in runs)
    assert all(r["expert_buckets"] == [(2, False), (2, True)] for r in runs)  # in units and persistent
    path = world4["root"] / "hybrid"
    check_against_reference(path, "a", world4["ref"])
    manifest = open_checkpoint(path, "a").manifest
    for name, entry in manifest.tensors.items():
        if not name.startswith(("model/", "optim/")) or entry.global_shape == ():
            continue
        if ".experts." in name:
            _check_blocks_over_expert_groups(path, name)
        else:  # the first shard group's copy: ranks 2 and 3 hold the same and write nothing of it
            assert {p.file for p in entry.pieces} <= {"rank00000.safetensors", "rank00001.safetensors"}, name
    for other in HYBRID_OTHERS:
        tag = other_tag(*other)
        check_loaded_elsewhere(path, path, tag, world4["runs"][0]["hybrid"][tag], world4["ref"])


NVME = {"device": "nvme", "nvme_path": "<swap>"}


def _with_swap(zero: dict, swap: Path) -> dict:
    swap.mkdir(exist_ok=True)
    return {
        k: {**v, "nvme_path": str(swap)} if isinstance(v, dict) and "nvme_path" in v else v for k, v in zero.items()
    }


@pytest.mark.soak
@pytest.mark.parametrize(
    "world, kind, experts, ep, stage, zero, others",
    [
        (4, "mixtral", 8, 2, 1, HOST, ((4, 1, HOST), (2, 3, UNITS))),
        (4, "mixtral", 8, 2, 2, HOST, ((2, 1), (4, 3, HOST))),
        (
            4,
            "mixtral",
            8,
            2,
            3,
            {**UNITS, "offload_optimizer": NVME, "offload_param": NVME},
            ((2, 2, HOST), (4, 3, UNITS)),
        ),
        (4, "mixtral", 8, 2, 1, HYBRID, ((2, 3, UNITS), (4, 1, HYBRID))),
        (4, "mixtral", 8, 2, 2, {**HYBRID, **HOST}, ((2, 2),)),
        (3, "qwen3_moe", 6, 3, 3, {**UNITS, **HOST}, ((1, 0), (3, 2))),
        (2, "mixtral", 8, 2, 3, {**UNITS, **HOST, "mics_shard_size": 1}, ((1, 2), (2, 1, HYBRID))),
    ],
)
def test_offload_and_hybrid_sharding_at_each_stage(tmp_path, world, kind, experts, ep, stage, zero, others):
    zero = _with_swap(zero, tmp_path / "swap")
    runs = run_distributed(save_and_resume, world, kind, experts, ep, stage, str(tmp_path), others, zero, timeout=600)
    _check_resumes_bitwise(runs)
    assert all(r["offloaded"] == ("offload_optimizer" in zero) for r in runs)
    ref = reference(kind, experts)
    check_against_reference(tmp_path, "a", ref)
    for other in others:
        tag = other_tag(*other)
        check_loaded_elsewhere(tmp_path, tmp_path, tag, runs[0][tag], ref)


@pytest.mark.soak
def test_a_stage_3_checkpoint_loads_at_one_process(world4, tmp_path):
    run = run_distributed(load_elsewhere, 1, "mixtral", 8, 1, 3, str(world4["root"] / "z3"), str(tmp_path), "b", UNITS)
    check_loaded_elsewhere(world4["root"] / "z3", tmp_path, "b", run[0], world4["ref"])
