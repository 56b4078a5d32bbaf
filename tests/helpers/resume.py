"""Exact-resume checks for engine checkpoints: a model with every kind of tensor real models have, and the body
that trains it straight and with a save / fresh engine / load in the middle, comparing everything bitwise.

The model holds a 0-dim trainable parameter (a learned temperature, like CLIP's ``logit_scale``), a zero-element
buffer, a non-contiguous buffer, a tied pair (embedding and LM head) and a frozen parameter inside each block (a
stage-3 unit). The fresh engine's model is built from another seed, so every value it ends with must come from the
checkpoint.
"""

from __future__ import annotations

import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardtrain
from shardtrain.zero.layout import state_tensors

VOCAB, DIM, SEQ, ROWS = 13, 8, 5, 6  # 6 rows split evenly over 1, 2 or 3 ranks
STEPS, SAVE_AT = 6, 3


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.frozen = nn.Parameter(torch.randn(d, d) * 0.3, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x) @ self.frozen)


class ResumeNet(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(DIM), Block(DIM)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied pair
        self.logit_scale = nn.Parameter(torch.tensor(1.0 + seed))  # 0-dim, trainable
        self.register_buffer("empty", torch.empty(0))  # zero elements
        self.register_buffer("mix", torch.randn(DIM, 3).t())  # (3, DIM), not contiguous
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)  # differs between seeds, like every other tensor

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x) + self.mix.mean(0) + self.empty.sum()
        logits = self.head(x) * self.logit_scale
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def make_optimizer(model: ResumeNet, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":  # every parameter, the frozen ones included (as SGD(model.parameters()) would)
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
    matrices = [model.embed.weight, *(b.fc.weight for b in model.blocks)]
    vectors = [*(b.fc.bias for b in model.blocks), model.norm.weight, model.norm.bias]
    return torch.optim.AdamW(
        [
            {"params": matrices, "lr": 1e-2, "weight_decay": 0.1},
            {"params": vectors, "lr": 5e-3, "weight_decay": 0.0},
            {"params": [model.logit_scale], "lr": 2e-2, "weight_decay": 0.0},
        ]
    )


def make_engine(seed: int, stage: int, optimizer: str, dtype: str = "fp32", threshold: int = 20):
    model = ResumeNet(seed)
    world = dist.get_world_size()
    zero: dict = {"stage": stage, "reduce_bucket_size": 50, "allgather_bucket_size": 50}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = threshold
    config = {
        "train_micro_batch_size_per_gpu": ROWS // world,
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
    }
    if dtype != "fp32":
        config[dtype] = {"enabled": True}
    return shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, optimizer))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        out.append((x, torch.roll(x, -1, 1)))
    return out


def train(engine, steps: range) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = ROWS // world
    losses = []
    for s in steps:
        x, y = (t[rank * rows : (rank + 1) * rows].to(engine.device) for t in batches()[s])
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def snapshot(engine) -> dict:
    """Everything training depends on, comparable bitwise between two engines of the same layout: the full model
    state (rank 0), this rank's stepped tensors and optimizer state by parameter name, the param groups."""
    opt = engine._optimizer
    stepped, state = {}, {}
    with torch._C.DisableTorchFunctionSubclass():  # stage-3 parameters: only their fragments are read
        for names, t in state_tensors(engine.module):
            if opt.fragment_of(t) is None:
                continue
            s = opt.stepped_of(t)
            stepped[names[0]] = s.detach().cpu().clone()
            state[names[0]] = {
                k: (v.detach().cpu().clone(), v.device.type) if torch.is_tensor(v) else v
                for k, v in opt.optimizer.state.get(s, {}).items()
            }
    groups = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
    full = engine.full_state_dict()
    return {
        "full": {k: v.cpu() for k, v in full.items()} if full is not None else None,
        "stepped": stepped,
        "state": state,
        "groups": groups,
        "global_step": engine.global_step,
    }


def differences(a: dict, b: dict) -> list[str]:
    """What differs between two snapshots (bitwise for tensors, dtype included)."""
    out = []

    def same(x, y) -> bool:
        if torch.is_tensor(x) or torch.is_tensor(y):
            return torch.is_tensor(x) and torch.is_tensor(y) and x.dtype == y.dtype and torch.equal(x, y)
        if isinstance(x, tuple) and isinstance(y, tuple) and len(x) == len(y):
            return all(same(p, q) for p, q in zip(x, y))
        return x == y

    for part in ("full", "stepped", "state"):
        if a[part] is None:
            continue
        if a[part].keys() != b[part].keys():
            out.append(f"{part}: names {sorted(a[part])} vs {sorted(b[part])}")
            continue
        for name in a[part]:
            x, y = a[part][name], b[part][name]
            if part == "state":
                if x.keys() != y.keys():
                    out.append(f"optimizer state of {name}: keys {sorted(x)} vs {sorted(y)}")
                    continue
                out += [f"optimizer state {name}/{k}: {x[k]} vs {y[k]}" for k in x if not same(x[k], y[k])]
            elif not same(x, y):
                out.append(f"{part} {name}: {x} vs {y}")
    if a["groups"] != b["groups"]:
        out.append(f"param groups: {a['groups']} vs {b['groups']}")
    if a["global_step"] != b["global_step"]:
        out.append(f"global_step {a['global_step']} vs {b['global_step']}")
    return out


def exact_resume(save_root: str, stages: list[int], optimizers: list[str], dtype: str = "fp32") -> list[str]:
    """Runs on every rank: for each stage and optimizer, 6 straight steps vs 3 steps + save + a fresh engine (new
    model from another seed, new optimizer) + load + 3 steps. Returns what differed (empty: bitwise identical)."""
    problems = []
    for stage in stages:
        for kind in optimizers:
            where = f"stage {stage}, {kind}, {dtype}, world {dist.get_world_size()}"
            try:
                straight = make_engine(0, stage, kind, dtype)
                straight_losses = train(straight, range(STEPS))
                want = snapshot(straight)

                first = make_engine(0, stage, kind, dtype)
                first_losses = train(first, range(SAVE_AT))
                path = f"{save_root}/s{stage}-{kind}-{dtype}"
                first.save_checkpoint(path)

                fresh = make_engine(1, stage, kind, dtype)
                fresh.load_checkpoint(path)
                resumed_losses = train(fresh, range(SAVE_AT, STEPS))
                got = snapshot(fresh)
            except Exception:
                problems.append(f"{where}: {traceback.format_exc(limit=-4)}")
                continue
            if first_losses + resumed_losses != straight_losses:
                problems.append(f"{where}: losses {first_losses + resumed_losses} vs {straight_losses}")
            problems += [f"{where}: {d}" for d in differences(want, got)]
    return problems
