"""Checkpoints across expert layouts (docs/expert-parallel.md, "Checkpoints"): a tiny random Qwen3-MoE with 6
experts trained at world 3 with ``expert_parallel_size`` 3 (stage 2) resumes bitwise at that layout and loads on
the same ranks at ep 1 x dp 3 (stage 0), weights and AdamW state (moments, step) carried: the training after the
load is one process's, and a save right after the load holds the same tensors, bit for bit, as the checkpoint it
loaded. ``full_state_dict()`` gathers every expert, ``load_full_state_dict`` and ``from_pretrained`` (the
per-expert files ``save_pretrained`` writes) give each rank its own; the consolidated model opens with
``from_pretrained`` with identical weights; ``inspect --verify`` refuses a missing or doubled expert block. Soak:
a bf16 run at ep 2 resumes bitwise; the same checkpoint loaded at world 2 with ep 2 and at one process; a Mixtral
with 8 experts at world 4, ep 2 x dp 2 (the experts' ZeRO fragments, or the shares of a block held whole, over an
expert-data-parallel group of 2), loaded at ep 4 and at ep 2 x stage 2.

The global batch is the same at every layout (``ROWS`` rows split over the ranks) and the load-balancing loss is off
(it is computed over each rank's own tokens, so it changes with the split), so the loss of a step does not depend on
the layout and every layout is compared with one process."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardtrain
from shardtrain.checkpoint import open_checkpoint
from shardtrain.checkpoint.format import BlockFlatSlice, BlockSlice
from shardtrain.cli import main
from shardtrain.errors import ConfigError
from shardtrain.expert_parallel import refuse_split_experts_checkpoint
from shardtrain.testing import run_distributed

from helpers.moe_cases import VOCAB, tiny_moe

SEQ, ROWS, LR = 6, 12, 1e-2
BEFORE, AFTER = 2, 2  # steps before the save, steps after it


def make_model(kind: str, experts: int, seed: int = 0):
    return tiny_moe(kind, experts, seed, router_logits=False)


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (ROWS, SEQ), generator=g) for _ in range(BEFORE + AFTER)]


def reference(kind: str, experts: int) -> dict:
    """One process on the whole batch: the state after ``BEFORE`` steps (weights and AdamW state by parameter name),
    the losses of the ``AFTER`` steps that follow, and the final weights."""
    model = make_model(kind, experts)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    names = {id(p): n for n, p in model.named_parameters()}
    losses, saved = [], {}
    for step, ids in enumerate(batches()):
        if step == BEFORE:
            saved = {
                "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "optim": {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()},
            }
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {**saved, "losses": losses[BEFORE:], "final": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _engine(kind: str, experts: int, ep: int, stage: int, seed: int = 0, bf16: bool = False):
    model = make_model(kind, experts, seed)
    config = {
        "train_micro_batch_size_per_gpu": ROWS // dist.get_world_size(),
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000},  # several buckets
        "expert_parallel_size": ep,
        "bf16": {"enabled": bf16},
        "collective_timeout_s": 120.0,
    }
    return shardtrain.initialize(model, config=config, optimizer=torch.optim.AdamW(model.parameters(), lr=LR))


def _train(engine, steps: range) -> list[float]:
    rank, rows = dist.get_rank(), ROWS // dist.get_world_size()
    losses = []
    for s in steps:
        ids = batches()[s][rank * rows : (rank + 1) * rows]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _mean_over_ranks(losses: list[float]) -> list[float]:
    t = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def _state(engine) -> dict:
    full = engine.full_state_dict()
    return {k: v.clone() for k, v in full.items()} if full is not None else None


def save_and_resume(kind: str, experts: int, ep: int, stage: int, save_dir: str, others: tuple = ()) -> dict:
    """Train ``BEFORE`` steps and save, then ``AFTER`` more (the unbroken run); a fresh engine from another seed loads
    the checkpoint and trains the same ``AFTER`` steps (the resumed run). Then, on the same ranks, each layout
    ``(ep', stage')`` of ``others`` loads it as :func:`load_elsewhere` does."""
    engine = _engine(kind, experts, ep, stage)
    _train(engine, range(BEFORE))
    engine.save_checkpoint(save_dir, tag="a")
    saved_state = _state(engine)
    unbroken = _train(engine, range(BEFORE, BEFORE + AFTER))
    unbroken_state = _state(engine)
    held = {n: m.expert_range for n, m in engine.module.named_modules() if hasattr(m, "expert_range")}
    engine.close()
    engine = _engine(kind, experts, ep, stage, seed=5)
    engine.load_checkpoint(save_dir, tag="a")
    resumed = _train(engine, range(BEFORE, BEFORE + AFTER))
    out = {
        "unbroken": unbroken,
        "resumed": resumed,
        "mean": _mean_over_ranks(unbroken),
        "saved_state": saved_state,
        "unbroken_state": unbroken_state,
        "resumed_state": _state(engine),
        "held": held,
    }
    out["full_loads"] = _full_loads(engine, saved_state, save_dir)
    engine.close()
    out["from_pretrained"] = _from_pretrained(kind, experts, ep, stage, save_dir)
    for other_ep, other_stage in others:
        tag = f"b_ep{other_ep}_stage{other_stage}"
        out[tag] = load_elsewhere(kind, experts, other_ep, other_stage, save_dir, save_dir, tag)
    return out


def bf16_resume(save_dir: str) -> bool:
    """bf16 (fp32 masters) at ep 2, stage 2: whether the resumed run's losses and full state equal the unbroken run's
    bit for bit."""
    engine = _engine("mixtral", 8, 2, 2, bf16=True)
    _train(engine, range(BEFORE))
    engine.save_checkpoint(save_dir, tag="a")
    unbroken, unbroken_state = _train(engine, range(BEFORE, BEFORE + AFTER)), _state(engine)
    engine.close()
    engine = _engine("mixtral", 8, 2, 2, seed=5, bf16=True)
    engine.load_checkpoint(save_dir, tag="a")
    resumed, resumed_state = _train(engine, range(BEFORE, BEFORE + AFTER)), _state(engine)
    engine.close()
    same_state = unbroken_state is None or all(torch.equal(v, resumed_state[k]) for k, v in unbroken_state.items())
    return resumed == unbroken and same_state


def _full_loads(engine, full: dict | None, save_dir: str) -> list[bool]:
    """``load_full_state_dict`` of the full model, from rank 0's dict and from a safetensors file: each rank keeps
    its experts. Whether ``full_state_dict()`` then gives it back unchanged (rank 0), for each source."""
    from safetensors.torch import save_file

    path = Path(save_dir) / "full.safetensors"
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, str(path))
    dist.barrier()
    same = []
    for source in (full if dist.get_rank() == 0 else None, str(path)):
        engine.load_full_state_dict(source)
        back = _state(engine)
        same.append(back is None or all(torch.equal(back[k], v) for k, v in full.items()))
    return same


def _from_pretrained(kind: str, experts: int, ep: int, stage: int, save_dir: str) -> dict:
    """``shardtrain.from_pretrained`` of what transformers' ``save_pretrained`` writes (one tensor per expert, as on
    the Hub) under expert parallelism: whether ``full_state_dict()`` is transformers' own ``from_pretrained`` of it
    (rank 0; None elsewhere), and the experts whose tensors this rank read."""
    import transformers

    from shardtrain.zero import weights

    path = Path(save_dir) / "pretrained"
    if dist.get_rank() == 0:
        make_model(kind, experts, seed=3).save_pretrained(path)
    dist.barrier()
    read, loader = [], weights._loader

    def counting_loader(file, key):  # how converted tensors (experts.N.*, stacked) are read
        load = loader(file, key)
        return lambda: (read.append(key), load())[1]

    config = {"train_micro_batch_size_per_gpu": 1, "expert_parallel_size": ep, "zero_optimization": {"stage": stage}}
    weights._loader = counting_loader
    try:
        engine = shardtrain.from_pretrained(
            transformers.AutoModelForCausalLM, path, config=config, optimizer=lambda p: torch.optim.AdamW(p, lr=LR)
        )
    finally:
        weights._loader = loader
    full = _state(engine)
    engine.close()
    out = {"experts_read": sorted({int(m[1]) for k in read if (m := re.search(r"experts\.(\d+)\.", k))}), "same": None}
    if full is not None:
        want = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()
        out["same"] = full.keys() == want.keys() and all(torch.equal(full[k], v) for k, v in want.items())
    return out


def load_elsewhere(kind: str, experts: int, ep: int, stage: int, load_dir: str, save_dir: str, tag: str = "b") -> dict:
    """Load the checkpoint at this layout, save it again at once (``tag``), then train ``AFTER`` steps."""
    engine = _engine(kind, experts, ep, stage, seed=5)
    engine.load_checkpoint(load_dir, tag="a")
    engine.save_checkpoint(save_dir, tag=tag)
    losses = _mean_over_ranks(_train(engine, range(BEFORE, BEFORE + AFTER)))
    out = {"losses": losses, "final": _state(engine), "step": engine.global_step}
    engine.close()
    return out


def _same_tensors(a: Path, b: Path, tag_a: str = "a", tag_b: str = "b") -> None:
    """Every model and optimizer tensor of two checkpoints, assembled whole, is bitwise equal."""
    ra, rb = open_checkpoint(a, tag_a), open_checkpoint(b, tag_b)
    names = [n for n in ra.manifest.tensors if n.startswith(("model/", "optim/"))]
    assert names and sorted(names) == sorted(n for n in rb.manifest.tensors if n.startswith(("model/", "optim/")))
    for n in names:
        x, y = ra.read(n), rb.read(n)
        assert x.dtype == y.dtype and torch.equal(x, y), n


def _close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = 1e-4) -> None:
    err = (a.float() - b.float()).abs().max().item()
    assert err <= tol * max(1.0, b.abs().max().item()), f"{what}: max error {err}"


def _check_against_reference(path: Path, tag: str, ref: dict) -> None:
    """The checkpoint's weights and AdamW state (moments, step) are one process's after ``BEFORE`` steps."""
    reader = open_checkpoint(path, tag)
    for k, v in ref["model"].items():
        _close(reader.read(f"model/{k}"), v, k)
    for name, state in ref["optim"].items():
        for key, v in state.items():
            _close(reader.read(f"optim/{name}/{key}").reshape(v.shape), v, f"{name}/{key}")


@pytest.fixture(scope="module")
def ep3(tmp_path_factory) -> dict:
    """Saved at world 3, ep 3 (6 experts, stage 2); loaded on the same ranks at ep 1 x dp 3 (stage 0)."""
    root = tmp_path_factory.mktemp("ep3")
    runs = run_distributed(save_and_resume, 3, "qwen3_moe", 6, 3, 2, str(root / "a"), ((1, 0),), timeout=300)
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
    _check_against_reference(ep3["root"] / "a", "a", ep3["ref"])
    # full_state_dict gathers every expert on rank 0; the other ranks get None
    full = ep3["runs"][0]["saved_state"]
    assert all(r["saved_state"] is None for r in ep3["runs"][1:])
    reader = open_checkpoint(ep3["root"] / "a", "a")
    assert full["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 6
    for k, v in full.items():
        assert torch.equal(v, reader.read(f"model/{k}")), k


def _check_loaded_elsewhere(saved: Path, again: Path, tag: str, run: dict, ref: dict) -> None:
    """A load at another layout: saved again right after it, the same tensors bit for bit; the training that follows
    is one process's (the AdamW moments and step carried: a fresh AdamW would take other steps)."""
    _same_tensors(saved, again, "a", tag)
    assert run["step"] == BEFORE + AFTER
    for a, b in zip(run["losses"], ref["losses"], strict=True):
        assert abs(a - b) <= 2e-5 * abs(b), (run["losses"], ref["losses"])
    for k, v in ref["final"].items():
        moved = (v - ref["model"][k]).norm().item()
        assert moved > 0, k
        assert (run["final"][k] - v).norm().item() <= 5e-3 * moved, k


def test_it_loads_at_another_expert_layout(ep3):
    assert ep3["runs"][0]["mean"] == pytest.approx(ep3["ref"]["losses"], rel=2e-5)
    tag = "b_ep1_stage0"
    _check_loaded_elsewhere(ep3["root"] / "a", ep3["root"] / "a", tag, ep3["runs"][0][tag], ep3["ref"])


@pytest.mark.soak
@pytest.mark.parametrize("world, ep, stage", [(2, 2, 1), (1, 1, 0)])
def test_it_loads_at_world_2_ep_2_and_at_one_process(ep3, tmp_path, world, ep, stage):
    again = tmp_path / "again"
    run = run_distributed(load_elsewhere, world, "qwen3_moe", 6, ep, stage, str(ep3["root"] / "a"), str(again))
    _check_loaded_elsewhere(ep3["root"] / "a", again, "b", run[0], ep3["ref"])


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
    _check_against_reference(tmp_path, "a", ref)
    entry = open_checkpoint(tmp_path, "a").manifest.tensors["model/model.layers.0.mlp.experts.gate_up_proj"]
    pieces = sorted(entry.pieces, key=lambda p: (p.slice.block.index, p.slice.start))
    assert [p.slice.block for p in pieces] == [BlockSlice(0, i, 2) for i in (0, 0, 1, 1)]
    assert [p.slice.length for p in pieces] == [entry.numel // 4] * 4  # halves of each block: one writer each
    assert [p.file for p in pieces] == [f"rank{r:05d}.safetensors" for r in (0, 2, 1, 3)]  # dp_rank = edp * 2 + ep
    for tag in ("b_ep4_stage1", "b_ep2_stage2"):
        _check_loaded_elsewhere(tmp_path, tmp_path, tag, runs[0][tag], ref)


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


def test_checkpoints_of_split_experts_at_stage_3_are_refused_by_name():
    for what in ("save_checkpoint", "load_checkpoint", "full_state_dict()"):
        with pytest.raises(
            ConfigError, match=rf"{re.escape(what)} with expert_parallel_size \(ep_size\) 2 at ZeRO stage 3"
        ):
            refuse_split_experts_checkpoint(2, 3, what)
        for ep, stage in ((2, 2), (1, 3)):
            refuse_split_experts_checkpoint(ep, stage, what)  # built
