"""DeepSpeed's ``"optimizer": {"type": "Muon"}`` trained by real DeepSpeed and by ``shardtrain.deepspeed`` with the
same script, in the same processes (tests/compat/test_deepspeed_muon.py).

DeepSpeed runs on its CPU accelerator with ``torch_adam: true`` (its Adam half torch's AdamW: FusedAdam would be
JIT-compiled, minutes on 2 cores) and with ``torch.compiler.set_stance("force_eager")``: DeepSpeed wraps
``muon_update`` and its Newton-Schulz in ``torch.compile``, whose C++ build on a shared 2-core CPU does not fit a
test's time; eager runs the same operations. At ZeRO 3 DeepSpeed refuses Muon with its default ``reduce_scatter``
("Muon and reduce scatter cannot be used together"), so the config says ``reduce_scatter: false`` there.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, WIDE, SEQ, ROWS, STEPS = 13, 8, 20, 5, 6, 4
MUON = {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.1, "muon_lr": 0.03, "adam_lr": 3e-3, "torch_adam": True}


class MuonNet(nn.Module):
    """What the split sees in real models: an embedding (Adam by name), a square, a wide and a tall matrix (Muon: the
    Gram iteration, the square fallback, the aspect ratio), an untied head not called lm_head (Muon, as in
    DeepSpeed), a norm, biases and a 1-D gain (Adam), a frozen matrix (in neither)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.square = nn.Linear(DIM, DIM)
        self.up = nn.Linear(DIM, WIDE, bias=False)  # (20, 8): tall
        self.down = nn.Linear(WIDE, DIM)  # (8, 20): wide
        self.frozen = nn.Parameter(torch.randn(DIM, DIM) * 0.3, requires_grad=False)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + torch.tanh(self.square(h)) @ self.frozen
        h = h + self.down(F.gelu(self.up(h)))
        logits = self.head(self.norm(h)) * self.gain
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        out.append((x, torch.roll(x, -1, 1)))
    return out


def config(stage: int, params: dict, world: int) -> dict:
    zero = {"stage": stage, **({"reduce_scatter": False} if stage == 3 else {})}
    return {
        "train_micro_batch_size_per_gpu": ROWS // world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Muon", "params": params},
    }


def train(module_name: str, stage: int, params: dict) -> dict:
    """On every rank: ``module_name``'s ``initialize`` on the config, STEPS steps of this rank's rows; the global
    loss of each step and the gathered parameters at the end."""
    deepspeed = importlib.import_module(module_name)
    world, rank = dist.get_world_size(), dist.get_rank()
    model = MuonNet()
    trainable = [p for p in model.parameters() if p.requires_grad]
    with contextlib.redirect_stdout(io.StringIO()):
        engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=config(stage, params, world))
    losses = []
    rows = ROWS // world
    for x, y in batches():
        loss = engine(x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows])
        engine.backward(loss)
        engine.step()
        total = torch.tensor([float(loss.detach())], dtype=torch.float64)
        dist.all_reduce(total)
        losses.append(float(total) / world)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        params_out = {n: p.detach().clone().float() for n, p in engine.module.named_parameters()}
    return {"losses": losses, "params": params_out}


def both(stages: list[int], params: dict) -> dict:
    """On every rank: real DeepSpeed, then the shim, at each stage."""
    torch.compiler.set_stance("force_eager")  # DeepSpeed's compiled muon_update runs eagerly (module docstring)
    return {
        (name, stage): train(name, stage, params) for name in ("deepspeed", "shardtrain.deepspeed") for stage in stages
    }


def _steps(engine, rows: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    world, rank = dist.get_world_size(), dist.get_rank()
    n = ROWS // world
    losses = []
    for x, y in rows:
        loss = engine(x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n])
        engine.backward(loss)
        engine.step()
        total = torch.tensor([float(loss.detach())], dtype=torch.float64)
        dist.all_reduce(total)
        losses.append(float(total) / world)
    return losses


def resume_deepspeeds_checkpoint(stage: int, params: dict, save_dir: str, split: int = 2) -> dict:
    """On every rank: real DeepSpeed trains ``split`` steps, saves its checkpoint and continues to STEPS (its own
    continuation); then ``shardtrain.deepspeed`` on a model from another seed loads that checkpoint and continues the
    same steps. Both continuations' losses and final parameters."""
    import deepspeed

    import shardtrain.deepspeed as shim

    torch.compiler.set_stance("force_eager")  # DeepSpeed's compiled muon_update runs eagerly (module docstring)
    world = dist.get_world_size()
    out = {}
    for name, module in (("deepspeed", deepspeed), ("shardtrain.deepspeed", shim)):
        model = MuonNet(seed=0 if name == "deepspeed" else 1)
        trainable = [p for p in model.parameters() if p.requires_grad]
        with contextlib.redirect_stdout(io.StringIO()):
            engine, *_ = module.initialize(model=model, model_parameters=trainable, config=config(stage, params, world))
            if name == "deepspeed":
                _steps(engine, batches()[:split])
                engine.save_checkpoint(save_dir, tag="mid")
            else:
                engine.load_checkpoint(save_dir, tag="mid")
        losses = _steps(engine, batches()[split:])
        with module.zero.GatheredParameters(list(engine.module.parameters())):
            params_out = {n: p.detach().clone().float() for n, p in engine.module.named_parameters()}
        out[name] = {"losses": losses, "params": params_out}
    return out
