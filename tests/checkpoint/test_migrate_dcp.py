"""Torch DCP checkpoints (FSDP2, torchtitan) load into any shardtrain layout (issue 21, item 3).

A real FSDP2 run (``fully_shard`` at world 2, gloo) saves with ``dcp.save`` after 3 AdamW steps and goes on; the
engine loads that checkpoint at world 1 (stage 0), world 3 (stage 3) and world 2 with tensor parallelism 2 (stage
1, torchtitan's layout) and must continue with FSDP2's own losses. The same resume with the optimizer state dropped
is far outside the tolerance, so the check sees the moments and step counts carried over.
"""

from __future__ import annotations

import pickle
import re
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

from shardtrain.checkpoint.consolidate import consolidate
from shardtrain.checkpoint.format import BlockFlatSlice, BlockSlice, FlatSlice
from shardtrain.checkpoint.reader import open_checkpoint
from shardtrain.errors import CheckpointError, UnsafePickleError
from shardtrain.testing import run_distributed

from helpers.dcp_runs import (
    BOXES,
    CONTINUE,
    SAVE_AT,
    box_tensors,
    engine_resume_body,
    fsdp2_save_body,
    make_model,
    save_plain,
    world1_body,
)

LOSS_RTOL = 1e-5  # fp32 runs that sum gradients in another order


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fsdp2")
    start = time.monotonic()
    (losses, _) = run_distributed(fsdp2_save_body, 2, str(out))
    return {"dir": out, "losses": losses, "seconds": time.monotonic() - start}


@pytest.fixture(scope="module")
def fsdp2_tied(tmp_path_factory) -> dict:
    """The same run with the LM head tied to the embedding and the position embedding frozen."""
    out = tmp_path_factory.mktemp("fsdp2_tied")
    (losses, _) = run_distributed(fsdp2_save_body, 2, str(out), True)
    return {"dir": out, "losses": losses}


def _mean_losses(results: list[dict]) -> list[float]:
    """Global mean loss per step: the mean over data-parallel ranks (tensor-parallel ranks of a group agree)."""
    mine = [r["losses"] for r in results if r["tp_rank"] == 0]
    return [sum(steps) / len(mine) for steps in zip(*mine)]


def _assert_losses(got: list[float], want: list[float], rtol: float = LOSS_RTOL) -> None:
    assert len(got) == len(want) == CONTINUE
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= rtol * abs(b), f"step {SAVE_AT + step}: loss {a} after loading, FSDP2 continued with {b}"


def test_reader_matches_the_saved_tensors(fsdp2, tmp_path):
    """Any slice kind, from chunks split along rows (unevenly) or columns, against the tensors FSDP2 held."""
    reader = open_checkpoint(fsdp2["dir"] / "boxes")
    full = box_tensors()
    for name, (shape, dim) in BOXES.items():
        entry = reader.manifest.resolve(f"model/{name}")
        assert entry.global_shape == shape and len(entry.chunks) == 2
        assert entry.chunks[0][1][dim] != shape[dim], "the tensor was saved in two chunks"
        t = full[name]
        assert torch.equal(reader.read(f"model/{name}"), t)
        assert torch.equal(reader.read(f"model/{name}", (3, 17)), t.reshape(-1)[3:17])
        block = reader.read_slice(f"model/{name}", BlockSlice(1, 1, 2))
        assert torch.equal(block, t.chunk(2, dim=1)[1])
        frag = reader.read_slice(f"model/{name}", BlockFlatSlice(BlockSlice(1, 0, 2), 2, 7))
        assert torch.equal(frag, t.chunk(2, dim=1)[0].reshape(-1)[2:9])
        assert torch.equal(reader.read_slice(f"model/{name}", FlatSlice(0, 0)), t.reshape(-1)[:0])
    # a read asks DCP for the chunks holding what it needs, and of each only those rows: row 5 of "rows" (saved as
    # rows 0-3 and 4-6) is row 1 of the second chunk
    asked = []
    read_data = reader._storage.read_data
    reader._storage.read_data = lambda plan, planner: asked.extend(plan.items) or read_data(plan, planner)
    assert torch.equal(reader.read("model/rows", (20, 24)), full["rows"][5])
    assert [(tuple(i.storage_index.offset), tuple(i.storage_offsets), tuple(i.lengths)) for i in asked] == [
        ((4, 0), (1, 0), (1, 4))
    ]
    assert open_checkpoint(fsdp2["dir"] / "titan", f"step-{SAVE_AT}").path.name == f"step-{SAVE_AT}"
    # the model and optimizer entries of a real FSDP2 checkpoint equal what torch's own DCP loader reads
    import torch.distributed.checkpoint as dcp

    reader = open_checkpoint(fsdp2["dir"] / "plain")
    want = {k: torch.zeros_like(v) for k, v in make_model(5).state_dict().items()}
    name = "blocks.1.mlp.0.weight"
    state = {"model": want, "optimizer": {"state": {name: {"exp_avg": torch.zeros(128, 32)}}}}
    dcp.load(state, checkpoint_id=str(fsdp2["dir"] / "plain"), no_dist=True)
    for k, v in want.items():
        assert torch.equal(reader.read(f"model/{k}"), v), k
    assert torch.equal(reader.read(f"optim/{name}/exp_avg"), state["optimizer"]["state"][name]["exp_avg"])
    assert reader.read(f"optim/{name}/step").item() == SAVE_AT
    # consolidation streams a DCP checkpoint to Hugging Face-style safetensors as it does ours
    files = consolidate(reader, tmp_path / "hf", progress=False)
    assert [f.name for f in files] == ["model.safetensors"]
    written = safetensors.torch.load_file(files[0])
    assert written.keys() == want.keys() and all(torch.equal(written[k], v) for k, v in want.items())


def _error_dirs(root: Path) -> dict[str, str]:
    sd = make_model(0).state_dict()
    missing = {k: v for k, v in sd.items() if k != "blocks.0.attn.proj.weight"}
    save_plain(missing, root / "missing")
    save_plain({**sd, "tok.weight": torch.zeros(65, 32)}, root / "shape")
    save_plain(sd, root / "model_only")
    return {
        "missing_weights_only": str(root / "missing"),
        "shape_weights_only": str(root / "shape"),
        "no_optimizer": str(root / "model_only"),
        "model_only_weights_only": str(root / "model_only"),
    }


def test_world1_resume_fresh_optimizer_and_errors(fsdp2, tmp_path):
    out = run_distributed(world1_body, 1, str(fsdp2["dir"] / "plain"), _error_dirs(tmp_path))[0]
    resume, fresh = out["resume"], out["fresh"]
    _assert_losses(_mean_losses([resume]), fsdp2["losses"])
    assert resume["global_step"] == SAVE_AT  # the optimizer's step count, FSDP2 scripts save no counter
    assert resume["client_state"] == {"epoch": 7}
    assert resume["lrs"] == pytest.approx([3e-3 / (1 + 0.3 * SAVE_AT)] * 2)  # the scheduler's lr at the save
    assert any("RNG states" in w for w in resume["warnings"])
    # a fresh Adam's first update is lr * sign(gradient): the loss after it is ~2e-3 off (the loaded state: ~1e-7)
    off = max(abs(a - b) / abs(b) for a, b in zip(fresh["losses"], fsdp2["losses"]))
    assert off > 100 * LOSS_RTOL, f"a fresh optimizer is only {off:.2g} off: the test could not tell it apart"
    errors = out["errors"]
    assert "blocks.0.attn.proj.weight" in errors["missing_weights_only"]
    assert "the model has parameters the checkpoint lacks" in errors["missing_weights_only"]
    assert "shape (65, 32) in the checkpoint, (64, 32) in the model" in errors["shape_weights_only"]
    assert "holds no optimizer state" in errors["no_optimizer"]
    assert "load_optimizer_states=False" in errors["no_optimizer"]
    assert errors["model_only_weights_only"] == ""


@pytest.mark.parametrize(
    ("layout", "world", "stage", "tp"),
    [("plain", 3, 3, 1), ("titan", 2, 1, 2)],
    ids=["fsdp2-world3-stage3", "torchtitan-world2-tp2-stage1"],
)
def test_resume_in_another_layout(fsdp2, layout, world, stage, tp):
    path = fsdp2["dir"] / layout  # torchtitan's folder: its highest step-<N> is loaded
    results = run_distributed(engine_resume_body, world, str(path), stage, tp)
    _assert_losses(_mean_losses(results), fsdp2["losses"])
    for r in results:
        assert r["global_step"] == SAVE_AT
        assert r["lrs"] == pytest.approx([3e-3 / (1 + 0.3 * SAVE_AT)] * 2)
        if layout == "titan":
            assert r["client_state"] == {}
            assert any("'dataloader'" in w and "'ntokens_seen'" in w for w in r["warnings"]), r["warnings"]


@pytest.mark.soak
@pytest.mark.parametrize("layout", ["plain", "titan"])
@pytest.mark.parametrize(("world", "stage"), [(1, 1), (1, 3), (2, 0), (2, 2), (2, 3), (3, 0), (3, 1), (3, 2)])
def test_resume_matrix(fsdp2, layout, world, stage):
    results = run_distributed(engine_resume_body, world, str(fsdp2["dir"] / layout), stage)
    _assert_losses(_mean_losses(results), fsdp2["losses"])


@pytest.mark.soak
@pytest.mark.parametrize("layout", ["plain", "titan"])
@pytest.mark.parametrize(("world", "stage", "tp"), [(1, 2, 1), (3, 3, 1), (2, 1, 2)])
def test_resume_tied_and_frozen(fsdp2_tied, layout, world, stage, tp):
    path = str(fsdp2_tied["dir"] / layout)
    results = run_distributed(engine_resume_body, world, path, stage, tp, False, True)
    _assert_losses(_mean_losses(results), fsdp2_tied["losses"])


def test_unsafe_metadata_is_refused_before_anything_runs(tmp_path):
    """A .metadata naming anything but DCP's metadata classes is refused by name; torch's own reader would run it."""
    marker = tmp_path / "ran"

    class Exploit:
        def __reduce__(self):
            return (Path.touch, (marker,))

    save_plain(make_model(0).state_dict(), tmp_path / "ckpt")
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(UnsafePickleError, match=r"refused to unpickle 'pathlib\..*touch'"):
        open_checkpoint(tmp_path / "ckpt")
    assert not marker.exists()


def test_damaged_chunk_names_the_tensor(tmp_path):
    sd = make_model(0).state_dict()
    save_plain(sd, tmp_path / "ckpt")
    data = next((tmp_path / "ckpt").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:1000])  # truncated
    reader = open_checkpoint(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=re.escape("cannot read tensor 'model.blocks.1.mlp.2.weight'")):
        reader.read("model/blocks.1.mlp.2.weight")
    problems = reader.verify()
    assert problems and all("model.blocks.1.mlp.2.weight" not in p or "damaged" in p for p in problems)
    assert any("model.blocks.1.mlp.2.weight" in p for p in problems)


def test_the_dcp_tutorials_app_state_layout(tmp_path):
    """``{"app": AppState}`` holding ``{"model": ..., "optim": ...}`` (the DCP tutorial's recipe) reads as the
    plain layout: the same names, param groups and optimizer step."""
    import torch.distributed.checkpoint as dcp

    sd = make_model(0).state_dict()
    optim = {
        "state": {k: {"exp_avg": torch.full_like(v, 0.5), "step": torch.tensor(4.0)} for k, v in sd.items()},
        "param_groups": [{"lr": 0.01, "betas": (0.9, 0.95), "params": list(sd)}],
    }
    dcp.save({"app": {"model": sd, "optim": optim}}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    reader = open_checkpoint(tmp_path / "ckpt")
    want = {f"model/{k}" for k in sd} | {f"optim/{k}/{s}" for k in sd for s in ("exp_avg", "step")}
    assert set(reader.manifest.tensors) == want
    with pytest.warns(UserWarning, match="RNG states"):
        objects = reader.objects
    assert objects["optimizer/param_groups"] == [{"lr": 0.01, "betas": (0.9, 0.95), "params": list(sd)}]
    assert objects["optimizer/state_kinds"] == {"exp_avg": "elementwise", "step": "scalar"}
    assert objects["engine/counters"] == {"global_step": 4}
    assert torch.equal(reader.read("model/tok.weight"), sd["tok.weight"])
    assert torch.equal(reader.read("optim/head.weight/exp_avg", (5, 9)), torch.full((4,), 0.5))


def test_inspect_lists_a_dcp_directory(tmp_path, capsys):
    """``shardtrain checkpoint inspect`` names a DCP directory, lists its tensors with their chunks, and
    ``--verify`` reads them; a truncated data file is reported, not a traceback."""
    from shardtrain.cli import main

    sd = make_model(0).state_dict()
    save_plain(sd, tmp_path / "ckpt")
    with pytest.warns(UserWarning, match="RNG states"):
        assert main(["checkpoint", "inspect", str(tmp_path / "ckpt"), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "torch DCP" in out and f"tensors: {len(sd)}," in out
    assert "model/head.weight" in out and "1 chunk(s)" in out and "verify: every tensor read whole" in out
    data = next((tmp_path / "ckpt").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:1000])
    with pytest.warns(UserWarning, match="RNG states"):
        assert main(["checkpoint", "inspect", str(tmp_path / "ckpt"), "--verify"]) == 1
    out = capsys.readouterr().out
    assert "problem(s)" in out and "Traceback" not in out
