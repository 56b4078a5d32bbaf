"""Save at N ranks, read at M: whole tensors, ZeRO ranges of another layout, aliases, objects, replicas, tags."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.distributed as dist

from shardtrain.checkpoint import BlockSlice, FlatSlice, SavePiece, open_checkpoint, save
from shardtrain.distributed.communicator import Communicator
from shardtrain.errors import CheckpointError
from shardtrain.testing import DistributedFailure, run_distributed

from helpers.checkpoint import named_params, save_engine_like, trained_model, zero_ranges


@pytest.fixture(scope="module", params=[2, 3])
def saved(request, tmp_path_factory):
    world = request.param
    d = tmp_path_factory.mktemp(f"ckpt{world}")
    results = run_distributed(save_engine_like, world, str(d), "global_step2", world, 0)
    return d, world, results


def test_whole_tensors_and_moments_round_trip(saved):
    d, world, _ = saved
    model, opt = trained_model(0)
    reader = open_checkpoint(d)
    assert reader.manifest.world_size == world and reader.manifest.tag == "global_step2"
    for name, p in model.named_parameters():
        torch.testing.assert_close(reader.read(f"model/{name}"), p.detach(), rtol=0, atol=0)
        st = opt.state[p]
        for key in ("exp_avg", "exp_avg_sq", "step"):
            got = reader.read(f"optim/{name}/{key}").reshape(st[key].shape)
            torch.testing.assert_close(got, st[key], rtol=0, atol=0)


@pytest.mark.parametrize("load_world", [1, 2, 3, 4])
@pytest.mark.parametrize("verify", [True, False])
def test_ranges_of_another_layout(saved, load_world, verify):
    """Each rank of a new layout reads exactly the elements it now owns; only overlapping pieces are touched."""
    d, _, _ = saved
    model, _ = trained_model(0)
    params = named_params(model)
    reader = open_checkpoint(d, verify=verify)
    for rank in range(load_world):
        for i, start, length in zero_ranges([p.numel() for _, p in params], load_world, rank):
            name, p = params[i]
            got = reader.read(f"model/{name}", (start, start + length))
            assert got.shape == (length,)
            torch.testing.assert_close(got, p.reshape(-1)[start : start + length], rtol=0, atol=0)


def test_only_overlapping_pieces_are_read(saved, monkeypatch):
    d, _, _ = saved
    reader = open_checkpoint(d)
    entry = reader.entry("model/embed.weight")
    touched = []
    original = reader._stream_piece
    monkeypatch.setattr(reader, "_stream_piece", lambda e, p, r, s: touched.append(p) or original(e, p, r, s))
    first = entry.pieces[0].slice
    reader.read("model/embed.weight", (first.start, first.start + 1))
    assert touched == [entry.pieces[0]]


def test_alias_objects_and_replicated_pieces(saved):
    d, world, results = saved
    reader = open_checkpoint(d)
    # the tied head reads back through its alias as the independently recomputed model has it
    model, _ = trained_model(0)
    assert model.head.weight is model.embed.weight
    torch.testing.assert_close(reader.read("model/head.weight"), model.head.weight.detach(), rtol=0, atol=0)
    got = reader.read("model/head.weight", (5, 40))
    torch.testing.assert_close(got, model.head.weight.detach().reshape(-1)[5:40], rtol=0, atol=0)
    # ... and is stored once: one entry, under the primary name, listing the alias; no file holds it twice
    manifest = json.loads((d / "global_step2" / "manifest.json").read_text())
    assert "model/head.weight" not in manifest["tensors"]
    assert manifest["tensors"]["model/embed.weight"]["aliases"] == ["model/head.weight"]
    assert [n for n, t in manifest["tensors"].items() if t.get("aliases")] == ["model/embed.weight"]
    assert reader.entry("model/head.weight").name == "model/embed.weight"
    assert reader.objects["step"] == 2 and reader.objects["topology"] == {"world_size": world, "zero_stage": 2}
    assert reader.objects["scheduler"] == {"last_epoch": 2, "milestones": (1, 2)}
    manifest = json.loads((d / "global_step2" / "manifest.json").read_text())
    assert manifest["objects"]["step"] == {"encoding": "json", "value": 2}
    assert manifest["objects"]["scheduler"]["encoding"] == "tagged"
    for rank in range(world):
        objs = reader.rank_objects(rank)
        assert objs["rank"] == rank
        want = results[rank]["rng"]
        assert torch.equal(objs["rng"]["torch"], want["torch"])
        assert np.array_equal(objs["rng"]["numpy"][1], want["numpy"][1]) and objs["rng"]["python"] == want["python"]
    # a step count held whole by several ranks is stored once, by the lowest of them
    for name, entry in reader.manifest.tensors.items():
        if name.endswith("/step"):
            assert len(entry.pieces) == 1
    # every rank wrote in parallel: each holds some bytes
    assert all(r["bytes"] > 0 for r in results)


def _save_block_pieces(save_dir: str) -> None:
    comm = Communicator(dist.group.WORLD, 60.0)
    torch.manual_seed(5)
    qkv = torch.randn(3 * 8, 4)  # fused Q, K, V stacked along dim 0; each rank gets its rows of each
    row = torch.randn(6, 10)
    rank, n = comm.rank, comm.size
    q_part = torch.cat([c.chunk(n, 0)[rank] for c in qkv.chunk(3, 0)])
    pieces = [
        SavePiece("model/qkv", tuple(qkv.shape), BlockSlice(0, rank, n, stride=3), q_part),
        SavePiece("model/row", tuple(row.shape), BlockSlice(1, rank, n), row.chunk(n, 1)[rank]),
    ]
    save(save_dir, "tp", comm, pieces, global_objects={"qkv": qkv.tolist(), "row": row.tolist()})
    return comm.stats()


def test_tensor_parallel_blocks_with_stride(tmp_path):
    stats = run_distributed(_save_block_pieces, 2, str(tmp_path))
    # the save costs three small object gathers per rank; tensor data never crosses the network
    assert all(set(s) == {"all_gather_object"} and s["all_gather_object"]["calls"] == 3 for s in stats)
    reader = open_checkpoint(tmp_path)
    qkv, row = torch.tensor(reader.objects["qkv"]), torch.tensor(reader.objects["row"])
    torch.testing.assert_close(reader.read("model/qkv"), qkv, rtol=0, atol=0)
    torch.testing.assert_close(reader.read("model/row"), row, rtol=0, atol=0)
    for a, b in [(0, 60), (3, 17), (29, 31)]:  # ranges that cut across blocks of both ranks
        torch.testing.assert_close(reader.read("model/row", (a, b)), row.reshape(-1)[a:b], rtol=0, atol=0)
        torch.testing.assert_close(reader.read("model/qkv", (a, b)), qkv.reshape(-1)[a:b], rtol=0, atol=0)


def _save_diverged(save_dir: str) -> None:
    comm = Communicator(dist.group.WORLD, 60.0)
    value = torch.full((4,), float(comm.rank))  # "replicated" but not equal
    save(save_dir, "t", comm, [SavePiece("model/bias", (4,), FlatSlice(0, 4), value)])


def test_diverged_replicas_are_refused_on_every_rank(tmp_path):
    with pytest.raises(DistributedFailure) as info:
        run_distributed(_save_diverged, 2, str(tmp_path))
    text = str(info.value)
    assert text.count("replicated state has diverged") == 2 and "'model/bias'" in text
    assert not (tmp_path / "latest").exists()


def test_single_process_tags_overwrite_and_leftovers(tmp_path):
    t = torch.arange(6.0)
    piece = [SavePiece("model/w", (2, 3), FlatSlice(0, 6), t)]
    save(tmp_path, "a", None, piece)
    with pytest.raises(CheckpointError, match="already exists"):
        save(tmp_path, "a", None, piece)
    (tmp_path / ".tmp-crashed").mkdir()  # leftover of a crashed save
    save(tmp_path, "a", None, [SavePiece("model/w", (2, 3), FlatSlice(0, 6), t + 1)], overwrite=True)
    assert not (tmp_path / ".tmp-crashed").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "latest"]
    torch.testing.assert_close(open_checkpoint(tmp_path).read("model/w"), (t + 1).reshape(2, 3))
    save(tmp_path, "b", None, piece)
    assert (tmp_path / "latest").read_text().strip() == "b"
    torch.testing.assert_close(open_checkpoint(tmp_path, "a").read("model/w"), (t + 1).reshape(2, 3))
    for bad in ["", "latest", ".hidden", "a/b"]:
        with pytest.raises(CheckpointError, match="tag"):
            save(tmp_path, bad, None, piece)


def test_bad_pieces_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="elements"):
        SavePiece("model/w", (2, 3), FlatSlice(0, 4), torch.zeros(5))
    with pytest.raises(CheckpointError, match="exceeds"):
        SavePiece("model/w", (2, 3), FlatSlice(4, 4), torch.zeros(4))
    with pytest.raises(CheckpointError, match=r"elements \[3, 6\) are in no stored piece"):
        save(tmp_path, "gap", None, [SavePiece("model/w", (2, 3), FlatSlice(0, 3), torch.zeros(3))])
    with pytest.raises(CheckpointError, match="overlap"):
        save(
            tmp_path,
            "overlap",
            None,
            [
                SavePiece("model/w", (2, 3), FlatSlice(0, 4), torch.zeros(4)),
                SavePiece("model/w", (2, 3), FlatSlice(2, 4), torch.zeros(4)),
            ],
        )
    assert not (tmp_path / "latest").exists()


def test_open_without_a_complete_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        open_checkpoint(tmp_path)
    (tmp_path / ".tmp-x").mkdir()
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        open_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=r"has no manifest\.json"):
        open_checkpoint(tmp_path, ".tmp-x")
