"""Bodies of the DCP migration tests: a real FSDP2 run (``fully_shard``) saving torch DCP checkpoints in the two
layouts shardtrain reads, and the engine resuming them in another layout.

Both sides train the same GPT on the same global batches (``ROWS`` rows split over the data-parallel ranks), with
AdamW in two param groups and a LambdaLR, one micro-step per optimizer step. FSDP2 saves after ``SAVE_AT`` steps and
goes on for ``CONTINUE`` more: those losses are FSDP2's own continuation from the checkpoint, which the engine must
reproduce. The engine's model is built from another seed, so every weight it trains from comes from the checkpoint.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import shardtrain
from shardtrain.errors import CheckpointError
from shardtrain.models.gpt import GPT, GPTConfig
from shardtrain.tensor_parallel import GPT_TP_PLAN

ROWS, VOCAB, SEQ = 6, 64, 16  # 6 rows split evenly over 1, 2 or 3 data-parallel ranks
SAVE_AT, CONTINUE = 3, 3
BOXES = {"cols": ((5, 6), 1), "rows": ((7, 4), 0)}  # name -> (shape, sharded dim) of the DTensors of box_tensors


def make_model(seed: int, tied: bool = False) -> GPT:
    """``tied``: the LM head shares the embedding, and the position embedding is frozen."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_layer=2, n_head=4, tie_embeddings=tied))
    if tied:
        model.pos.weight.requires_grad_(False)
    return model


def make_optimizer(params: list[tuple[str, torch.nn.Parameter]]) -> torch.optim.AdamW:
    decay = [p for _, p in params if p.dim() >= 2 and p.requires_grad]
    no_decay = [p for _, p in params if p.dim() < 2 and p.requires_grad]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=3e-3
    )


def make_scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.3 * s))


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(99)
    out = []
    for _ in range(SAVE_AT + CONTINUE):
        x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def box_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {name: torch.randn(shape, generator=g) for name, (shape, _) in BOXES.items()}


def fsdp2_save_body(out: str, tied: bool = False) -> list[float]:
    """World 2. Saves ``out/plain`` (model and optimizer under their keys, as FSDP2 examples do),
    ``out/titan/step-3`` (torchtitan's layout) and ``out/boxes`` (DTensors split along columns and unevenly along
    rows); returns the global mean losses of the steps after the save."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    model = make_model(0, tied)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = make_optimizer(list(model.named_parameters()))
    sched = make_scheduler(opt)
    per = ROWS // world
    losses = []
    for step, (x, y) in enumerate(global_batches()):
        if step == SAVE_AT:
            model_sd = get_model_state_dict(model)
            optim_sd = get_optimizer_state_dict(model, opt)
            plain = {"model": model_sd, "optimizer": optim_sd, "lr_scheduler": sched.state_dict(), "epoch": 7}
            dcp.save(plain, checkpoint_id=f"{out}/plain")
            flat = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
            titan = {  # torchtitan's CheckpointManager: model names at the top level, the rest under its keys
                **model_sd,
                "optimizer": flat,
                "lr_scheduler": {"last_epoch": sched.last_epoch},
                "train_state": {"step": SAVE_AT, "ntokens_seen": SAVE_AT * ROWS * SEQ},
                "dataloader": {f"dp_rank_{rank}": pickle.dumps({"position": step * per})},
            }
            dcp.save(titan, checkpoint_id=f"{out}/titan/step-{SAVE_AT}")
            full = box_tensors()
            dcp.save(
                {n: distribute_tensor(full[n], mesh, [Shard(dim)]) for n, (_, dim) in BOXES.items()},
                checkpoint_id=f"{out}/boxes",
            )
        loss = model(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses[SAVE_AT:]


def engine_resume_body(path: str, stage: int, tp: int = 1, fresh_optimizer: bool = False, tied: bool = False) -> dict:
    """Builds an engine at (world, ``stage``, ``tp``) from another seed, loads the DCP checkpoint ``path`` and
    trains the remaining steps; returns this rank's losses and what the load restored. ``fresh_optimizer``: drop
    the loaded optimizer state (moments and step counts) before training, keeping the learning rates."""
    model = make_model(1, tied)
    opt = make_optimizer(list(model.named_parameters()))
    config = {
        "train_micro_batch_size_per_gpu": ROWS // (dist.get_world_size() // tp),
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 3000,
            "allgather_bucket_size": 3000,
            "stage3_param_persistence_threshold": 0,
        },
        "tensor_parallel": {"size": tp},
    }
    engine = shardtrain.initialize(
        model, config=config, optimizer=opt, lr_scheduler=make_scheduler, tp_plan=GPT_TP_PLAN if tp > 1 else None
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        client_state = engine.load_checkpoint(path)
    lrs, loaded_step = [g["lr"] for g in opt.param_groups], engine.global_step
    if fresh_optimizer:
        opt.state.clear()
    dp, dp_rank = engine.topology.dp, engine.topology.dp_rank
    per = ROWS // dp
    losses = []
    for x, y in global_batches()[SAVE_AT:]:
        loss = engine(x[dp_rank * per : (dp_rank + 1) * per], y[dp_rank * per : (dp_rank + 1) * per])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {
        "losses": losses,
        "tp_rank": engine.topology.tp_rank,
        "global_step": loaded_step,
        "client_state": client_state,
        "lrs": lrs,
        "warnings": [str(w.message) for w in caught],
    }


def engine_errors_body(paths: dict[str, str]) -> dict[str, str]:
    """World 1: each case's CheckpointError message (``load_optimizer_states`` False for ``*weights_only`` cases)."""
    messages = {}
    for case, path in paths.items():
        model = make_model(1)
        opt = make_optimizer(list(model.named_parameters()))
        engine = shardtrain.initialize(model, config={"train_micro_batch_size_per_gpu": 2}, optimizer=opt)
        try:
            engine.load_checkpoint(path, load_optimizer_states=not case.endswith("weights_only"))
            messages[case] = ""
        except CheckpointError as err:
            messages[case] = str(err)
    return messages


def save_plain(model_sd: dict, path: Path, optimizer: dict | None = None) -> None:
    """A DCP checkpoint written without a process group (one rank), as a single-process script would."""
    import torch.distributed.checkpoint as dcp

    state = {"model": model_sd} if optimizer is None else {"model": model_sd, "optimizer": optimizer}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving as one rank"
        dcp.save(state, checkpoint_id=str(path), no_dist=True)


def world1_body(path: str, error_paths: dict[str, str]) -> dict:
    """World 1 in one process: the resume, the same resume with a fresh optimizer, and the error cases."""
    return {
        "resume": engine_resume_body(path, stage=0),
        "fresh": engine_resume_body(path, stage=0, fresh_optimizer=True),
        "errors": engine_errors_body(error_paths),
    }
