"""What an engine saves into a checkpoint and how it takes it back, in any layout.

[Note: engine checkpoint contents]
Logical tensors (see docs/checkpoint-format.md for the storage side):

* ``model/<name>``: every parameter and buffer under its first state-dict name (a tied parameter's other
  names are aliases). Trainable parameters are saved as the optimizer steps them: the fp32 masters under
  mixed precision, else the parameters' own values;
* ``optim/<name>/<key>``: every optimizer state tensor of a trainable parameter (AdamW ``exp_avg``,
  ``exp_avg_sq``, ``step``). Element-wise states are sliced like the parameter; scalars (``step``) are
  stored once.

Each rank passes what it holds: its fragment at stages 1-3 (the ``FlatSlice`` of the flattened tensor it
owns); a tensor every rank holds whole (stage 0, frozen parameters, buffers, scalars) is split into N
contiguous slices, one written by each rank, so the writes run in parallel.

Global objects: ``optimizer/param_groups`` (hyperparameters and parameter names per group), the scheduler
and loss-scaler states, engine counters, the saving topology and ``client_state``; for a transformers model
also ``hf/config`` and ``hf/generation_config`` (JSON text, see :mod:`shardtrain.hf_config`). Per rank: RNG states.

Loading reads, for each tensor, the elements this rank now needs (the whole parameter, a stage-3 fragment,
the master fragment), whatever layout saved them, so a checkpoint taken at N ranks and stage s loads at M
ranks and stage s'. RNG states are restored only at the saving world size (they are per rank).
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from shardtrain.checkpoint import FlatSlice, SavePiece, open_checkpoint, save
from shardtrain.errors import CheckpointError
from shardtrain.hf_config import hf_config_objects
from shardtrain.zero.weights import state_tensors

if TYPE_CHECKING:
    from shardtrain.engine import Engine

PARAM_GROUPS_KEY = "optimizer/param_groups"


def _my_chunk(numel: int, rank: int, world: int) -> tuple[int, int]:
    per = -(-numel // world)
    return min(rank * per, numel), min((rank + 1) * per, numel)


def _replicated(name: str, t: torch.Tensor, rank: int, world: int) -> list[SavePiece]:
    """This rank's share of a tensor every rank holds whole."""
    flat = t.detach().reshape(-1)
    lo, hi = _my_chunk(flat.numel(), rank, world)
    if hi <= lo:
        return []
    return [SavePiece(name, tuple(t.shape), FlatSlice(lo, hi - lo), flat[lo:hi])]


def collect_pieces(engine: Engine) -> tuple[list[SavePiece], dict[str, str], dict[str, Any]]:
    """(this rank's pieces, aliases, the optimizer layout object) for a save."""
    rank, world = engine.topology.dp_rank, engine.topology.dp
    opt = engine._optimizer
    pieces: list[SavePiece] = []
    aliases: dict[str, str] = {}
    stepped_name: dict[int, str] = {}
    with torch._C.DisableTorchFunctionSubclass():  # stage-3 parameters: only metadata and fragments are read
        for names, t in state_tensors(engine.module):
            name = names[0]
            aliases.update({f"model/{alias}": f"model/{name}" for alias in names[1:]})
            frag = opt.fragment_of(t)
            if frag is None:  # frozen parameter or buffer: the same on every rank
                pieces += _replicated(f"model/{name}", t, rank, world)
                continue
            _, bucket, i = frag
            stepped = opt.stepped_of(t)
            stepped_name[id(stepped)] = name
            state = opt.optimizer.state.get(stepped, {})
            if engine.stage == 0:  # whole on every rank
                pieces += _replicated(f"model/{name}", stepped.view(t.shape), rank, world)
                for k, v in state.items():
                    if torch.is_tensor(v):
                        pieces += _replicated(f"optim/{name}/{k}", v, rank, world)
                continue
            f, shape = bucket.fragments[i], tuple(t.shape)
            if f.length:
                pieces.append(SavePiece(f"model/{name}", shape, FlatSlice(f.start, f.length), stepped))
            for k, v in state.items():
                if not torch.is_tensor(v):
                    raise CheckpointError(f"optimizer state {k!r} of {name!r} is not a tensor ({type(v).__name__})")
                if v.dim() == 0:  # a scalar (AdamW 'step'): identical on every rank, stored once
                    pieces.append(SavePiece(f"optim/{name}/{k}", (), FlatSlice(0, 1), v))
                elif v.numel() != f.length:
                    raise CheckpointError(
                        f"optimizer state {k!r} of {name!r} has {v.numel()} elements, neither a scalar nor one "
                        f"per element of the fragment ({f.length}); this optimizer cannot be checkpointed sharded"
                    )
                elif f.length:
                    pieces.append(SavePiece(f"optim/{name}/{k}", shape, FlatSlice(f.start, f.length), v))
    layout = []
    for group in opt.optimizer.param_groups:
        entry = {k: v for k, v in group.items() if k != "params"}
        entry["params"] = [
            stepped_name[id(p)] if id(p) in stepped_name else _frozen_name(engine, p) for p in group["params"]
        ]
        layout.append(entry)
    return pieces, aliases, {PARAM_GROUPS_KEY: layout}


def _frozen_name(engine: Engine, p: torch.Tensor) -> str:
    for n, q in engine.module.named_parameters():
        if q is p:
            return n
    raise CheckpointError("an optimizer param group holds a tensor that is not a parameter of the model")


def save_engine(engine: Engine, save_dir: str | Path, tag: str, client_state: dict | None) -> Path:
    pieces, aliases, layout = collect_pieces(engine)
    top = engine.topology
    global_objects = {
        **layout,
        "engine/counters": {
            "global_step": engine.global_step,
            "micro_steps": engine.micro_steps,
            "skipped_steps": engine.skipped_steps,
            "global_samples": engine.global_samples,
        },
        "engine/topology": {
            "world_size": top.dp,
            "zero_stage": engine.stage,
            "compute_dtype": str(engine.precision.compute_dtype).removeprefix("torch."),
            "gradient_accumulation_steps": engine.gradient_accumulation_steps,
        },
        "engine/scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "engine/scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
        "client_state": client_state if client_state is not None else {},
        **hf_config_objects(engine.module),  # a transformers model's config: consolidation writes config.json
    }
    rng = {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    result = save(
        save_dir,
        tag,
        engine.comm,
        pieces,
        rank_objects={"rng": rng},
        global_objects=global_objects,
        aliases=aliases,
    )
    return result.path


def load_engine(engine: Engine, load_dir: str | Path, tag: str | None, load_optimizer_states: bool) -> dict:
    """Restore ``engine`` from a checkpoint; returns the saved ``client_state``. Collective.

    A rank reads only what it needs, so a damaged file may fail on one rank only: the outcome is shared,
    and every rank raises the failing ranks' messages (instead of the others hanging later)."""
    error, client_state = None, {}
    try:
        client_state = _load(engine, load_dir, tag, load_optimizer_states)
    except CheckpointError as err:
        error = str(err)
    outcomes = engine.comm.all_gather_object(error, what="checkpoint load outcome")
    failed = [(r, e) for r, e in enumerate(outcomes) if e is not None]
    if failed:
        raise CheckpointError("; ".join(f"rank {r}: {e}" for r, e in failed))
    return client_state


def _load(engine: Engine, load_dir: str | Path, tag: str | None, load_optimizer_states: bool) -> dict:
    reader = open_checkpoint(load_dir, tag)
    manifest = reader.manifest
    opt = engine._optimizer

    def entry_name(candidates: list[str], prefix: str) -> str:
        for n in candidates:
            try:
                return manifest.resolve(prefix + n).name
            except CheckpointError:
                continue
        raise CheckpointError(
            f"{reader.path}: no tensor {prefix}{candidates[0]!r} (the model has parameters the checkpoint lacks)"
        )

    for dest in engine._weight_destinations():
        lo, hi = dest.needed_range()
        name = entry_name(dest.names, "model/")
        entry = manifest.resolve(name)
        if tuple(entry.global_shape) != tuple(dest.shape):
            raise CheckpointError(
                f"{name!r}: shape {tuple(entry.global_shape)} in the checkpoint, {tuple(dest.shape)} in the model"
            )
        if hi > lo:
            dest.write_slice(reader.read(name, (lo, hi)), lo)

    objects = reader.objects
    if load_optimizer_states:
        for names, t in state_tensors(engine.module):
            frag = opt.fragment_of(t)
            if frag is None:
                continue
            _, bucket, i = frag
            stepped = opt.stepped_of(t)
            base = entry_name(names, "model/").removeprefix("model/")
            prefix = f"optim/{base}/"
            lo, hi = (
                (0, t.numel())
                if engine.stage == 0
                else (
                    bucket.fragments[i].start,
                    bucket.fragments[i].start + bucket.fragments[i].length,
                )
            )
            state = {}
            for tensor_name, entry in manifest.tensors.items():
                if not tensor_name.startswith(prefix):
                    continue
                k = tensor_name[len(prefix) :]
                if entry.global_shape == ():
                    state[k] = reader.read(tensor_name).to(stepped.device)
                else:
                    value = reader.read(tensor_name, (lo, hi)) if hi > lo else torch.empty(0, dtype=entry.torch_dtype)
                    state[k] = value.view(stepped.shape).to(stepped.device)
            if state:
                opt.optimizer.state[stepped] = state
        _restore_param_groups(opt.optimizer, objects.get(PARAM_GROUPS_KEY))
        if engine.lr_scheduler is not None and objects.get("engine/scheduler") is not None:
            engine.lr_scheduler.load_state_dict(objects["engine/scheduler"])
    if engine.scaler is not None and objects.get("engine/scaler") is not None:
        engine.scaler.load_state_dict(objects["engine/scaler"])
    counters = objects.get("engine/counters", {})
    engine.global_step = counters.get("global_step", 0)
    engine.micro_steps = counters.get("micro_steps", 0)
    engine.skipped_steps = counters.get("skipped_steps", 0)
    # checkpoints older than the monitors: DeepSpeed's own fallback
    engine.global_samples = counters.get("global_samples", engine.global_step * engine.train_batch_size)
    if manifest.world_size == engine.topology.dp:
        rng = reader.rank_objects(engine.topology.dp_rank).get("rng")
        if rng is not None:
            torch.set_rng_state(rng["torch"])
            if rng["cuda"] is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
            np.random.set_state(rng["numpy"])
            random.setstate(rng["python"])
    else:
        warnings.warn(
            f"checkpoint saved by {manifest.world_size} ranks loaded by {engine.topology.dp}: per-rank RNG states "
            "are not restored",
            stacklevel=3,
        )
    return objects.get("client_state", {})


def _restore_param_groups(optimizer: torch.optim.Optimizer, saved: list[dict] | None) -> None:
    if saved is None:
        return
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(saved)} param groups, this one {len(optimizer.param_groups)}"
        )
    for group, stored in zip(optimizer.param_groups, saved):
        if len(stored["params"]) != len(group["params"]):
            raise CheckpointError(
                f"a param group holds {len(group['params'])} parameters here, {len(stored['params'])} in the checkpoint"
            )
        group.update({k: v for k, v in stored.items() if k != "params"})
