"""Shared pieces of the parity tests: the GPT recipes they train, their data, and their one-process and engine runs.

The harness itself (the one-process recipe, the engine's side of it, ``assert_parity`` and [Note: parity bounds]) is
:mod:`shardtrain.testing.parity`, which users prove their own models with; this module adds the suite's GPT variants.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import shardtrain
from shardtrain.models.gpt import GPT, GPTConfig
from shardtrain.testing.parity import (  # noqa: F401  (the tests import the harness from here too)
    EXACT_FACTOR,
    PARAM_TOL,
    MicroLoss,
    assert_params_near,
    assert_parity,
    train_engine,
    train_one_process,
)

VOCAB, SEQ = 64, 16


class TwistedGPT(GPT):
    """GPT variants that stress ZeRO-3: a block called twice, a parameter used outside its module, or the
    blocks run in reverse order from the given step on."""

    def __init__(self, cfg: GPTConfig, twist: str) -> None:
        super().__init__(cfg)
        self.twist = twist
        self.calls = 0

    def forward(self, idx: torch.Tensor, targets: torch.Tensor):
        self.calls += 1
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        blocks = list(self.blocks)
        if self.twist == "twice":
            blocks = [blocks[0], blocks[1], blocks[0]]  # block 0 runs twice
        if self.twist == "reverse" and self.calls > 4:
            blocks = blocks[::-1]
        for block in blocks:
            x = block(x)
        if self.twist == "outside":  # a block's parameter used by the root module
            x = x + 0.1 * x @ self.blocks[1].attn.proj.weight
        logits = self.head(self.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@dataclass(frozen=True)
class Recipe:
    model: str = "gpt"  # "gpt", "tied" (tied embeddings + a frozen parameter), "twice", "outside", "reverse"
    steps: int = 10
    gas: int = 2
    micro: int = 2  # per rank
    clip: float = 0.5
    lr: float = 3e-3
    seed: int = 0
    optimizer: str = "adamw"  # a key of OPTIMIZERS


# element-wise optimizers with non-default options where they have them (lr scaled by the recipe's lr / 3e-3)
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict]] = {
    "adamw": (torch.optim.AdamW, {}),
    "adam": (torch.optim.Adam, {"amsgrad": True}),
    "sgd": (torch.optim.SGD, {"lr": 0.3, "momentum": 0.9, "nesterov": True}),
    "adamax": (torch.optim.Adamax, {}),
    "nadam": (torch.optim.NAdam, {"decoupled_weight_decay": True}),
    "radam": (torch.optim.RAdam, {}),
    "adagrad": (torch.optim.Adagrad, {"lr": 3e-2, "lr_decay": 0.01, "initial_accumulator_value": 0.1}),
    "adadelta": (torch.optim.Adadelta, {"lr": 1.0}),
    "rmsprop": (torch.optim.RMSprop, {"momentum": 0.5, "centered": True, "eps": 1e-6}),
    "asgd": (torch.optim.ASGD, {"lr": 3e-2, "t0": 1}),
}


def make_model(recipe: Recipe) -> nn.Module:
    torch.manual_seed(recipe.seed)
    tied = recipe.model == "tied"
    cfg = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_layer=2, n_head=4, tie_embeddings=tied)
    model = TwistedGPT(cfg, recipe.model) if recipe.model in ("twice", "outside", "reverse") else GPT(cfg)
    if tied:
        model.pos.weight.requires_grad_(False)  # a frozen parameter
    return model


def make_optimizer(model: nn.Module, recipe: Recipe) -> torch.optim.Optimizer:
    """``recipe.optimizer`` (AdamW by default) with two param groups: weight decay on matrices only."""
    cls, kwargs = OPTIMIZERS[recipe.optimizer]
    kwargs = {"lr": recipe.lr, **kwargs}
    kwargs["lr"] *= recipe.lr / 3e-3 if "lr" in OPTIMIZERS[recipe.optimizer][1] else 1.0
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return cls([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], **kwargs)


def global_micro_batches(recipe: Recipe, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234 + recipe.seed)
    rows = recipe.micro * world
    out = []
    for _ in range(recipe.steps * recipe.gas):
        x = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


BeforeMicro = Callable[[nn.Module, int, int], None]
"""Called as ``before_micro(model, step, micro)`` before each micro-step's forward, on the reference model and on the
engine's module alike (to freeze or unfreeze a parameter there, say)."""


def reference_run(recipe: Recipe, world: int, before_micro: BeforeMicro | None = None) -> dict:
    """One process, the global batch: fp32 losses, grad norms and parameters, and the float64 run's parameters
    (``exact``, see [Note: parity bounds])."""
    ref = _reference(recipe, world, torch.float32, before_micro)
    ref["exact"] = _reference(recipe, world, torch.float64, before_micro)["params"]
    return ref


def _reference(recipe: Recipe, world: int, dtype: torch.dtype, before_micro: BeforeMicro | None = None) -> dict:
    model = make_model(recipe).to(dtype)
    batches = global_micro_batches(recipe, world)

    def loss(model: nn.Module, i: int) -> torch.Tensor:
        if before_micro is not None:
            before_micro(model, i // recipe.gas, i % recipe.gas)
        return model(*batches[i])

    return train_one_process(model, make_optimizer(model, recipe), loss, recipe.steps, recipe.gas, recipe.clip)


def train_step(
    engine, recipe: Recipe, batches: list, step: int, rank: int, before_micro: BeforeMicro | None = None
) -> float:
    """Optimizer step ``step``: its ``recipe.gas`` micro-steps on this rank's rows of the global batches; returns
    this rank's mean loss over them."""
    lo, hi = rank * recipe.micro, (rank + 1) * recipe.micro
    total = 0.0
    for m in range(recipe.gas):
        x, y = batches[step * recipe.gas + m]
        if before_micro is not None:
            before_micro(engine.module, step, m)
        loss = engine(x[lo:hi], y[lo:hi])
        engine.backward(loss)
        engine.step()
        total += loss.item() / recipe.gas
    return total


def engine_run(
    recipe: Recipe,
    stage: int,
    world: int,
    bucket: int = 2000,
    zero_extra: dict | None = None,
    extra: dict | None = None,
    before_micro: BeforeMicro | None = None,
) -> dict:
    """Runs on every rank; returns this rank's local losses, the grad norms and rank 0's final state."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model = make_model(recipe)
    config = {
        "train_micro_batch_size_per_gpu": recipe.micro,
        "gradient_accumulation_steps": recipe.gas,
        "gradient_clipping": recipe.clip,
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
            **(zero_extra or {}),
        },
        **(extra or {}),
    }
    engine = shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, recipe))
    batches = global_micro_batches(recipe, world)
    losses, norms, comm = [], [], []
    for step in range(recipe.steps):
        losses.append(train_step(engine, recipe, batches, step, rank, before_micro))
        norms.append(engine.get_global_grad_norm())
        comm.append(engine.comm_stats(reset=True))
    return {
        "losses": losses,
        "norms": norms,
        "params": engine.full_state_dict(),
        "comm": comm,
        "state_bytes": engine.state_bytes(),
        "global_step": engine.global_step,
    }
