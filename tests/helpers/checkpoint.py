"""Synthetic engine-like checkpoint states for the checkpoint tests: a small model with tied weights whose
parameters and AdamW moments are split into ZeRO fragments (the flattened parameters concatenated, padded, and cut
into equal per-rank ranges, so that some parameters span ranks and some ranks hold none of a parameter)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import shardtrain
from shardtrain.checkpoint import FlatSlice, SavePiece, save
from shardtrain.checkpoint.consolidate import OPTIMIZER_LAYOUT_KEY
from shardtrain.distributed.communicator import Communicator


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 37, dim: int = 12) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.block = nn.Linear(dim, 3 * dim)
        self.norm = nn.LayerNorm(3 * dim)
        self.proj = nn.Linear(3 * dim, dim, bias=False)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(self.norm(self.block(self.embed(idx)))))


def trained_model(seed: int = 0, steps: int = 2) -> tuple[TinyLM, torch.optim.AdamW]:
    """A model and an AdamW that has taken ``steps`` steps (so that moments and step counts are non-trivial)."""
    torch.manual_seed(seed)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(steps):
        idx = torch.randint(0, 37, (4, 5))
        model(idx).logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def named_params(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach()) for n, p in model.named_parameters()]  # tied weight once, as the engine sees it


def zero_ranges(sizes: list[int], world: int, rank: int) -> list[tuple[int, int, int]]:
    """(param index, start, length) of what ``rank`` owns when the concatenated, padded buffer is cut in ``world``."""
    total = sum(sizes)
    per_rank = -(-total // world)
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    out, off = [], 0
    for i, n in enumerate(sizes):
        s, e = max(lo, off), min(hi, off + n)
        if s < e:
            out.append((i, s - off, e - s))
        off += n
    return out


def engine_pieces(model: nn.Module, opt: torch.optim.Optimizer, world: int, rank: int) -> list[SavePiece]:
    """This rank's ZeRO fragments of every parameter and of its exp_avg / exp_avg_sq; ``step`` replicated."""
    params = named_params(model)
    by_id = {id(p): i for i, (_, p) in enumerate(model.named_parameters())}
    states = {by_id[id(p)]: s for p, s in opt.state.items()}
    pieces = []
    for i, start, length in zero_ranges([p.numel() for _, p in params], world, rank):
        name, p = params[i]
        fs = FlatSlice(start, length)
        pieces.append(SavePiece(f"model/{name}", tuple(p.shape), fs, p.reshape(-1)[start : start + length]))
        for key in ("exp_avg", "exp_avg_sq"):
            t = states[i][key]
            pieces.append(SavePiece(f"optim/{name}/{key}", tuple(p.shape), fs, t.reshape(-1)[start : start + length]))
        # step is replicated: every rank that owns part of the parameter passes it whole
        pieces.append(SavePiece(f"optim/{name}/step", (), FlatSlice(0, 1), states[i]["step"].reshape(1)))
    return pieces


def optimizer_layout(model: nn.Module, opt: torch.optim.Optimizer) -> list[dict]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
        for g in opt.param_groups
    ]


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def save_engine_like(save_dir: str, tag: str, world: int, seed: int, **kwargs) -> dict:
    """Run on each rank (via run_distributed): save the synthetic state; returns what this rank passed."""
    comm = Communicator(dist.group.WORLD, 60.0) if dist.is_initialized() else None
    rank = comm.rank if comm else 0
    model, opt = trained_model(seed)
    torch.manual_seed(1000 + rank)
    np.random.seed(1000 + rank)
    random.seed(1000 + rank)
    rng = rng_state()
    if comm is not None:
        pieces = engine_pieces(model, opt, world, rank)
    else:  # one process holding every rank's fragments (replicated pieces once)
        unique = {(p.name, p.slice): p for r in range(world) for p in engine_pieces(model, opt, world, r)}
        pieces = list(unique.values())
    result = save(
        save_dir,
        tag,
        comm,
        pieces,
        rank_objects={"rng": rng, "rank": rank},
        global_objects={
            "step": 2,
            "topology": {"world_size": world, "zero_stage": 2},
            OPTIMIZER_LAYOUT_KEY: optimizer_layout(model, opt),
            "scheduler": {"last_epoch": 2, "milestones": (1, 2)},  # tuple: not JSON-exact, so it is a tagged tree
            "client_state": {"losses": torch.tensor([2.5, 2.25])},  # a tensor: the tree's tensors go to a file
        },
        aliases={"model/head.weight": "model/embed.weight"},
        **kwargs,
    )
    return {"rng": rng, "bytes": result.bytes_written, "tensors": sorted(result.manifest.tensors)}


# A checkpoint in format version 1 (objects that are not plain JSON pickled), written by ``save_v1_fixture`` with the
# code of commit 51377e9 (the last to write that version), at world 2: the compatibility tests load it as it is.
V1_FIXTURE = Path(__file__).parents[1] / "data" / "checkpoint_v1"


def v1_engine(seed: int):
    """The engine of the version-1 fixture (ZeRO-2, AdamW, WarmupLR): world 2, two rows per rank."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 2},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 3}},
    }
    return shardtrain.initialize(model, config=config, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))


def v1_client_state() -> dict:
    """What the fixture's run passed as ``client_state``: values version 1 had to pickle."""
    return {"epoch": 3, "best": (0.5, float("inf")), "ema": torch.arange(4.0), "seen": np.arange(3, dtype=np.int32)}


def save_v1_fixture(save_dir: str) -> None:
    """Run on each of 2 ranks (via run_distributed): two steps, then ``save_checkpoint(save_dir, tag="v1")``."""
    engine = v1_engine(0)
    for step in range(2):
        x = torch.randn(2, 3, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        engine.backward(engine(x).square().mean())
        engine.step()
    engine.save_checkpoint(save_dir, tag="v1", client_state=v1_client_state())
