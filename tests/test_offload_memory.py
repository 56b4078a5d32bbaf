"""Parameter offload's memory during the optimizer step: the pages of the mapped unit shards are dropped sub-group
by sub-group, so a step holds one sub-group of them, not the whole shard (found by bench/bench_large_model.py: in
fp32 training the step touches every page of the rank's shard, which then stayed in the process until the step
ended, as much memory as the parameters the offload was meant to keep out)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardtrain
from shardtrain.testing import run_distributed

WIDTH, LAYERS = 256, 4  # each layer's weight is 256 KiB of fp32: 64 pages


def mapped_param_rss() -> int:
    """Bytes of this process's memory that are pages of parameter swap files (``/proc/self/smaps``)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):  # a mapping's header
                inside = len(head) >= 6 and "/param-" in head[-1] and head[-1].endswith(".bin")
            elif inside and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


def run(nvme: str) -> dict:
    import torch.distributed as dist

    world = dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    zero = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "sub_group_size": (WIDTH * WIDTH + WIDTH) // world,  # one layer's shard (weight + bias) per sub-group
        "offload_param": {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0},
        "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = shardtrain.initialize(model, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero}, optimizer)
    seen: list[int] = []
    optimizer.register_step_post_hook(lambda *_: seen.append(mapped_param_rss()))  # once per sub-group
    x = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(2):
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    shard = engine._param_offload.mapped_bytes()
    engine.close()
    return {"seen": seen, "shard": shard, "losses": losses}


@pytest.mark.parametrize("world", [1, 2])
def test_optimizer_step_holds_one_sub_group_of_mapped_parameter_pages(world, tmp_path):
    out = run_distributed(run, world, str(tmp_path))
    layer = (WIDTH * WIDTH + WIDTH) * 4 // world  # one sub-group's bytes of this rank's shard
    for r in out:
        assert len(r["seen"]) == 2 * LAYERS  # the hook saw every sub-group of both steps
        assert r["shard"] >= LAYERS * layer  # the measurement can see the whole shard
        # while a sub-group is stepped, at most its own pages (plus the two it shares with its neighbours) are in
        # the process; the old code held every page stepped so far: at the last sub-group, the whole shard
        assert max(r["seen"]) <= layer + 2 * 4096, r["seen"]
        assert max(r["seen"]) > 0  # the current sub-group's pages were measured
        assert r["losses"][1] < r["losses"][0]


def layout_under_init(nvme: str) -> list[tuple[int, int]]:
    """(construction chunk bytes alive, bytes of those not laid out yet) at each unit ``initialize`` lays out."""
    import torch.distributed as dist

    import shardtrain.zero.build as build
    from shardtrain.models.gpt import GPT, GPTConfig
    from shardtrain.zero.guarded import guard_of

    torch.manual_seed(0)
    with shardtrain.zero.Init():
        model = GPT(GPTConfig(vocab_size=256, seq_len=16, d_model=128, n_layer=3, n_head=4))
    # parameter -> (its construction unit's bucket, which holds the chunk, and the chunk's bytes)
    chunks = {}
    for p in model.parameters():
        (b,) = guard_of(p).unit.buckets
        chunks[id(p)] = (b, b.shard.untyped_storage().nbytes())
    laid_out: set[int] = set()
    seen = []
    real = build.build_buckets

    def spy(groups, *args, **kwargs):
        alive = sum(b.shard.untyped_storage().nbytes() for b, _ in chunks.values())
        seen.append((alive, sum(n for k, (_, n) in chunks.items() if k not in laid_out)))
        laid_out.update(id(p) for group in groups for _, p in group)
        return real(groups, *args, **kwargs)

    build.build_buckets = spy
    try:
        zero = {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_param": {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0},
        }
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}
        engine = shardtrain.initialize(model, config, torch.optim.AdamW(model.parameters()))
    finally:
        build.build_buckets = real
    engine.close()
    assert dist.get_world_size() == 2
    return seen


def test_initialize_frees_each_construction_chunk_once_its_unit_is_laid_out(tmp_path):
    """A model built under ``zero.Init`` is laid out into units one unit at a time; each parameter's construction
    chunk is freed as soon as its unit's shard holds its values (the big run found them all kept until the end of
    ``initialize``: each rank held its part of the model twice, 2 x 5 GB per rank for a 2.5B model)."""
    for seen in run_distributed(layout_under_init, 2, str(tmp_path)):
        assert len(seen) >= 4 and seen[0][0] > 0  # blocks and the root, measured
        assert [alive for alive, _ in seen] == [left for _, left in seen], seen
