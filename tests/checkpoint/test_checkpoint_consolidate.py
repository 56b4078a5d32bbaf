"""Consolidation into Hugging Face-style safetensors and a single-process optimizer state dict; the CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from shardtrain.checkpoint import FlatSlice, SavePiece, open_checkpoint, save
from shardtrain.checkpoint.consolidate import consolidate, parse_size
from shardtrain.cli import main
from shardtrain.errors import CheckpointError
from shardtrain.testing import run_distributed

from helpers.checkpoint import TinyLM, save_engine_like, trained_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("saved")
    run_distributed(save_engine_like, 3, str(d), "global_step2", 3, 0)
    return d


def _load_into_plain_model(state: dict[str, torch.Tensor]) -> TinyLM:
    model = TinyLM()
    result = model.load_state_dict(state, strict=False)
    assert result.missing_keys == ["head.weight"] and result.unexpected_keys == []  # tied: stored once
    return model


def test_single_file_loads_into_the_plain_model(saved, tmp_path):
    files = consolidate(open_checkpoint(saved), tmp_path, progress=False)
    assert [f.name for f in files] == ["model.safetensors"]
    state = load_file(tmp_path / "model.safetensors")
    model = _load_into_plain_model(state)
    want, _ = trained_model(0)
    for (n, p), (_, q) in zip(model.state_dict().items(), want.state_dict().items()):
        assert torch.equal(p, q), n
    assert model.head.weight is model.embed.weight
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert json.loads(f.metadata()["tied"]) == {"head.weight": "embed.weight"}


def test_sharded_output_with_index_and_dtype(saved, tmp_path):
    want, _ = trained_model(0)
    files = consolidate(open_checkpoint(saved), tmp_path, dtype=torch.bfloat16, max_shard_size=1500, progress=False)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted({f.name for f in files} - {"model.safetensors.index.json"})
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"].values()) == set(shards)
    state = {}
    for s in shards:
        part = load_file(tmp_path / s)
        assert sum(t.numel() * t.element_size() for t in part.values()) <= 1500 or len(part) == 1
        state |= part
    assert set(index["weight_map"]) == set(state)
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in state.values())
    for name, p in want.named_parameters():
        assert state[name].dtype == torch.bfloat16
        assert torch.equal(state[name], p.detach().to(torch.bfloat16))
    _load_into_plain_model(state)


def test_optimizer_state_resumes_single_process_training(saved, tmp_path):
    consolidate(open_checkpoint(saved), tmp_path, optimizer=True, progress=False)
    ref_model, ref_opt = trained_model(0)
    model = _load_into_plain_model(load_file(tmp_path / "model.safetensors"))
    opt = torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.0)  # hyperparameters come from the file
    opt.load_state_dict(torch.load(tmp_path / "optimizer.pt"))
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["weight_decay"] == 0.1
    for m, o in [(ref_model, ref_opt), (model, opt)]:
        torch.manual_seed(7)
        for _ in range(2):
            m(torch.randint(0, 37, (4, 5))).logsumexp(-1).mean().backward()
            o.step()
            o.zero_grad()
    for (n, p), (_, q) in zip(ref_model.named_parameters(), model.named_parameters()):
        assert torch.equal(p, q), n


def test_missing_optimizer_layout_and_bad_sizes(tmp_path):
    save(tmp_path / "s", "t", None, [SavePiece("model/w", (4,), FlatSlice(0, 4), torch.ones(4))])
    with pytest.raises(CheckpointError, match="optimizer/param_groups"):
        consolidate(open_checkpoint(tmp_path / "s"), tmp_path / "o", optimizer=True, progress=False)
    assert parse_size("2GB") == 2 * 10**9 and parse_size("1.5GiB") == 3 * 2**29 and parse_size("4096") == 4096
    for bad in ["two GB", "0", "5XB"]:
        with pytest.raises(CheckpointError, match="size"):
            parse_size(bad)


def test_cli_inspect_verify_and_consolidate(saved, tmp_path, capsys):
    assert main(["checkpoint", "inspect", str(saved), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "saved by 3 rank(s)" in out and "step: 2" in out and "verify: all files and checksums OK" in out
    assert "model/embed.weight" in out and "37x12" in out and "(also model/head.weight)" in out
    assert main(["checkpoint", "consolidate", str(saved), str(tmp_path / "hf"), "--no-progress"]) == 0
    assert (tmp_path / "hf" / "model.safetensors").exists()

    damaged = tmp_path / "damaged"
    shutil.copytree(saved, damaged)
    victim = sorted((damaged / "global_step2").glob("rank*.safetensors"))[1]
    with open(victim, "r+b") as f:
        f.seek(-8, os.SEEK_END)
        f.write(b"\xff" * 8)
    capsys.readouterr()
    assert main(["checkpoint", "inspect", str(damaged), "--verify"]) == 1
    out = capsys.readouterr().out
    assert "checksum mismatch" in out and victim.name in out
    assert main(["checkpoint", "inspect", str(tmp_path / "nothing")]) == 2


def test_python_dash_m_runs_the_same_command(saved):
    proc = subprocess.run(
        [sys.executable, "-m", "shardtrain", "checkpoint", "inspect", str(saved)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert "tag: global_step2" in proc.stdout


_RSS_SCRIPT = textwrap.dedent(
    """
    import sys
    from shardtrain.checkpoint import open_checkpoint
    from shardtrain.checkpoint.consolidate import consolidate

    def status(key):
        return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))

    reader = open_checkpoint(sys.argv[1])
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident set size (VmHWM) to the current one
    before = status("VmRSS:")
    consolidate(reader, sys.argv[2], progress=False)
    print(status("VmHWM:") - before)
    """
)


def test_consolidation_memory_is_bounded_by_the_largest_tensor(tmp_path):
    """A 192 MB checkpoint of 4 MB tensors consolidates within a few times 4 MB of memory, not 192 MB."""
    n, numel = 48, 1 << 20
    pieces = []
    for i in range(n):
        t = torch.full((numel,), float(i))
        half = numel // 2
        pieces += [
            SavePiece(f"model/w{i}", (1024, 1024), FlatSlice(0, half), t[:half]),
            SavePiece(f"model/w{i}", (1024, 1024), FlatSlice(half, half), t[half:]),
        ]
    save(tmp_path / "s", "t", None, pieces)
    del pieces, t
    growth = int(
        subprocess.run(
            [sys.executable, "-c", _RSS_SCRIPT, str(tmp_path / "s"), str(tmp_path / "o")],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    largest = numel * 4
    assert growth < 2 * largest + 16 * 2**20, f"peak RSS grew by {growth / 2**20:.0f} MiB"
    state = load_file(tmp_path / "o" / "model.safetensors")
    assert len(state) == n and all(torch.all(state[f"w{i}"] == i) for i in (0, 17, n - 1))
