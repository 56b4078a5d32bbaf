"""What an engine saves into a checkpoint and how it takes it back, in any layout.

[Note: engine checkpoint contents]
Logical tensors (see docs/checkpoint-format.md for the storage side):

* ``model/<name>``: every parameter and buffer under its first state-dict name (a tied parameter's other
  names are aliases), zero-element and non-contiguous ones included. Parameters the optimizer steps are saved
  as it steps them: the fp32 masters under mixed precision, else the parameters' own values;
* ``optim/<name>/<key>``: every optimizer state tensor of a stepped parameter (SGD ``momentum_buffer``, AdamW
  ``exp_avg``, ``exp_avg_sq``, ``step``). A state is *element-wise* (one value per element of the parameter,
  saved with the parameter's shape and sliced like it) or *scalar* (a 0-dim tensor such as ``step``, stored
  once). The global object ``optimizer/state_kinds`` records which, because the shapes alone cannot tell for
  a 0-dim parameter.

Each rank passes what it holds: its fragment at stages 1-3 (the ``FlatSlice`` of the flattened tensor it
owns); a tensor every rank holds whole (stage 0, frozen parameters outside stage-3 units, buffers) is split
into N contiguous slices, one written by each rank, so the writes run in parallel. A parameter that lives in
a stage-3 unit is saved as the rank's fragment whether it is trainable or frozen; a frozen one simply has
no optimizer state.

Global objects: ``optimizer/param_groups`` (hyperparameters and parameter names per group),
``optimizer/state_kinds``, the scheduler and loss-scaler states, engine counters, the saving topology and
``client_state``; for a transformers model also ``hf/config`` and ``hf/generation_config`` (JSON text, see
:mod:`shardtrain.hf_config`). Per rank: RNG states.

Loading reads, for each tensor, the elements this rank now needs (the whole parameter, a stage-3 fragment,
the master fragment), whatever layout saved them, so a checkpoint taken at N ranks and stage s loads at M
ranks and stage s'. Param groups are matched by their parameters' names, not by position. Optimizer state is
cast as ``torch.optim.Optimizer.load_state_dict`` casts it: to the dtype and device of the tensor it belongs
to, except ``step``, which keeps its own. RNG states are restored only at the saving world size.

[Note: checkpoint failures are collective]
A save or load may fail on one rank only (its file is damaged, its disk is full, a bug). Every exception on
any rank is caught and carried in the next object gather, so every rank raises one ``CheckpointError``
naming the failing ranks and their causes within seconds, instead of the others waiting for the collective
timeout. A failed save publishes nothing: ``latest`` still names the previous checkpoint.
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from shardtrain.checkpoint import FlatSlice, SavePiece, open_checkpoint, save
from shardtrain.checkpoint.reader import CheckpointReader
from shardtrain.errors import CheckpointError
from shardtrain.hf_config import hf_config_objects
from shardtrain.zero.weights import state_tensors

if TYPE_CHECKING:
    from shardtrain.engine import Engine

PARAM_GROUPS_KEY = "optimizer/param_groups"
STATE_KINDS_KEY = "optimizer/state_kinds"
ELEMENTWISE, SCALAR = "elementwise", "scalar"


def _my_chunk(numel: int, rank: int, world: int) -> tuple[int, int]:
    per = -(-numel // world)
    return min(rank * per, numel), min((rank + 1) * per, numel)


def _replicated(name: str, t: torch.Tensor, rank: int, world: int) -> list[SavePiece]:
    """This rank's share of a tensor every rank holds whole (any strides); rank 0 describes an empty one."""
    flat = t.detach().reshape(-1)  # a copy when ``t`` is not contiguous
    lo, hi = _my_chunk(flat.numel(), rank, world)
    if hi <= lo and not (flat.numel() == 0 and rank == 0):
        return []
    return [SavePiece(name, tuple(t.shape), FlatSlice(lo, hi - lo), flat[lo:hi])]


def _stepped(engine: Engine, t: torch.Tensor) -> torch.Tensor | None:
    """What the optimizer steps for ``t`` (its fp32 master or its fragment), None for a tensor it does not step."""
    try:
        return engine._optimizer.stepped_of(t)
    except KeyError:
        return None


def _state_kind(key: str, value: torch.Tensor, stepped: torch.Tensor, name: str) -> str | None:
    """ELEMENTWISE or SCALAR; None when the shapes cannot tell (a 0-dim parameter stepped whole, at stage 0)."""
    if stepped.dim() == 0 and value.dim() == 0:
        return None
    if value.dim() == 0:
        return SCALAR
    if value.shape == stepped.shape:
        return ELEMENTWISE
    raise CheckpointError(
        f"optimizer state {key!r} of {name!r} has shape {tuple(value.shape)}, neither a scalar nor the shape of "
        f"what the optimizer steps ({tuple(stepped.shape)}); this optimizer's state cannot be checkpointed"
    )


def _names_by_tensor(engine: Engine) -> dict[int, list[str]]:
    """Every state-dict name of each parameter, keyed by the parameter and by what the optimizer steps for it."""
    names: dict[int, list[str]] = {}
    with torch._C.DisableTorchFunctionSubclass():
        for ns, t in state_tensors(engine.module):
            names[id(t)] = ns
            stepped = _stepped(engine, t)
            if stepped is not None:
                names[id(stepped)] = ns
    return names


def collect_pieces(engine: Engine) -> tuple[list[SavePiece], dict[str, str], dict[str, Any]]:
    """(this rank's pieces, aliases, the optimizer's global objects) for a save."""
    rank, world = engine.topology.dp_rank, engine.topology.dp
    opt = engine._optimizer
    pieces: list[SavePiece] = []
    aliases: dict[str, str] = {}
    kinds: dict[str, str] = {}
    with torch._C.DisableTorchFunctionSubclass():  # stage-3 parameters: only metadata and fragments are read
        for names, t in state_tensors(engine.module):
            name = names[0]
            aliases.update({f"model/{alias}": f"model/{name}" for alias in names[1:]})
            located = engine._slots.get(id(t))
            if located is None:  # a buffer or a parameter held whole (frozen below stage 3, persistent frozen)
                pieces += _replicated(f"model/{name}", t, rank, world)
                continue
            bucket, i = located
            f = bucket.fragments[i]
            # a bucketed parameter, trainable or (in a stage-3 unit) frozen: whole at stage 0, else this rank's
            # fragment of it
            fragment = t if engine.stage == 0 else bucket.shard[f.shard_offset : f.shard_offset + f.length]
            stepped = _stepped(engine, t)
            value = stepped if stepped is not None else fragment
            shape = tuple(t.shape)
            if engine.stage == 0:  # whole on every rank
                pieces += _replicated(f"model/{name}", value.view(shape), rank, world)
            elif f.length or (t.numel() == 0 and rank == 0):
                pieces.append(SavePiece(f"model/{name}", shape, FlatSlice(f.start, f.length), value))
            state = opt.optimizer.state.get(stepped, {}) if stepped is not None else {}
            for k, v in state.items():
                if not torch.is_tensor(v):
                    raise CheckpointError(f"optimizer state {k!r} of {name!r} is not a tensor ({type(v).__name__})")
                kind = _state_kind(k, v, value, name)
                if kind is not None and kinds.setdefault(k, kind) != kind:
                    raise CheckpointError(
                        f"optimizer state {k!r} is a scalar for some parameters and element-wise for others "
                        f"({name!r}); this optimizer's state cannot be checkpointed"
                    )
                if kind == SCALAR:  # identical on every rank, stored once
                    pieces.append(SavePiece(f"optim/{name}/{k}", (), FlatSlice(0, 1), v))
                elif engine.stage == 0:
                    pieces += _replicated(f"optim/{name}/{k}", v.view(shape), rank, world)
                elif f.length or (t.numel() == 0 and rank == 0):
                    pieces.append(SavePiece(f"optim/{name}/{k}", shape, FlatSlice(f.start, f.length), v))
        # a state seen only on 0-dim parameters stepped whole: torch's optimizers make only "step" a scalar
        for k in {k for st in opt.optimizer.state.values() for k in st if k not in kinds}:
            kinds[k] = SCALAR if k == "step" else ELEMENTWISE
    names = _names_by_tensor(engine)
    layout = []
    for gi, group in enumerate(opt.optimizer.param_groups):
        entry = {k: v for k, v in group.items() if k != "params"}
        try:
            entry["params"] = [names[id(p)][0] for p in group["params"]]
        except KeyError:
            raise CheckpointError(
                f"optimizer param group {gi} holds a tensor that is not a parameter of the model"
            ) from None
        layout.append(entry)
    return pieces, aliases, {PARAM_GROUPS_KEY: layout, STATE_KINDS_KEY: dict(sorted(kinds.items()))}


def _describe_failure(err: BaseException) -> str:
    return str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}"


def save_engine(engine: Engine, save_dir: str | Path, tag: str, client_state: dict | None) -> Path:
    """Collective; see [Note: checkpoint failures are collective]."""
    failure, pieces, aliases, global_objects, rng = None, [], {}, {}, {}
    try:
        pieces, aliases, optimizer_objects = collect_pieces(engine)
        top = engine.topology
        global_objects = {
            **optimizer_objects,
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
    except Exception as err:  # the save is abandoned on every rank (see the Note)
        failure = f"collecting what to save: {_describe_failure(err)}"
    result = save(
        save_dir,
        tag,
        engine.comm,
        pieces,
        rank_objects={"rng": rng},
        global_objects=global_objects,
        aliases=aliases,
        failure=failure,
    )
    return result.path


def load_engine(engine: Engine, load_dir: str | Path, tag: str | None, load_optimizer_states: bool) -> dict:
    """Restore ``engine`` from a checkpoint; returns the saved ``client_state``. Collective.

    A rank reads only what it needs, so a damaged file may fail on one rank only: the outcome is shared,
    and every rank raises the failing ranks' messages (see [Note: checkpoint failures are collective])."""
    error, client_state = None, {}
    try:
        client_state = _load(engine, load_dir, tag, load_optimizer_states)
    except Exception as err:
        error = _describe_failure(err)
        cause = err
    outcomes = engine.comm.all_gather_object(error, what="checkpoint load outcome")
    failed = [(r, e) for r, e in enumerate(outcomes) if e is not None]
    if failed:
        where = f"{load_dir}" + (f" (tag {tag!r})" if tag is not None else "")
        message = "; ".join(f"rank {r} failed to load checkpoint {where}: {e}" for r, e in failed)
        if error is not None:
            raise CheckpointError(message) from cause
        raise CheckpointError(message)
    return client_state


def _load(engine: Engine, load_dir: str | Path, tag: str | None, load_optimizer_states: bool) -> dict:
    reader = open_checkpoint(load_dir, tag)
    manifest = reader.manifest

    def entry_name(candidates: list[str], prefix: str) -> str:
        for n in candidates:
            try:
                return manifest.resolve(prefix + n).name
            except CheckpointError:
                continue
        raise CheckpointError(
            f"{reader.path}: no tensor {prefix}{candidates[0]!r} (the model has parameters the checkpoint lacks)"
        )

    objects = reader.objects
    # everything that can be refused without reading tensors is checked before the engine is touched
    dests = engine._weight_destinations()
    for dest in dests:
        entry = manifest.resolve(entry_name(dest.names, "model/"))
        if tuple(entry.global_shape) != tuple(dest.shape):
            raise CheckpointError(
                f"{entry.name!r}: shape {tuple(entry.global_shape)} in the checkpoint, {tuple(dest.shape)} in the model"
            )
    if load_optimizer_states:
        group_matches = _match_param_groups(engine, objects.get(PARAM_GROUPS_KEY), reader)

    for dest in dests:
        lo, hi = dest.needed_range()
        if hi > lo:
            dest.write_slice(reader.read(entry_name(dest.names, "model/"), (lo, hi)), lo)

    if load_optimizer_states:
        _load_optimizer_state(engine, reader, entry_name)
        for group, saved in group_matches:
            group.update({k: v for k, v in saved.items() if k != "params"})
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
            stacklevel=4,
        )
    return objects.get("client_state", {})


def _load_optimizer_state(engine: Engine, reader: CheckpointReader, entry_name) -> None:
    """Replace the optimizer state of every stepped tensor by the checkpoint's, read for this rank's range."""
    manifest, opt = reader.manifest, engine._optimizer
    saved_kinds = reader.objects.get(STATE_KINDS_KEY)  # absent in checkpoints written before it existed
    by_param: dict[str, dict[str, str]] = {}
    for tensor_name in manifest.tensors:
        if tensor_name.startswith("optim/"):
            param, _, key = tensor_name.removeprefix("optim/").rpartition("/")
            by_param.setdefault(param, {})[key] = tensor_name
    group_of = {id(p): g for g in opt.optimizer.param_groups for p in g["params"]}
    new_state: dict[torch.Tensor, dict[str, Any]] = {}
    with torch._C.DisableTorchFunctionSubclass():
        for names, t in state_tensors(engine.module):
            frag = opt.fragment_of(t)
            stepped = _stepped(engine, t) if frag is not None else None
            if stepped is None:
                continue
            _, bucket, i = frag
            f = bucket.fragments[i]
            lo, hi = (0, t.numel()) if engine.stage == 0 else (f.start, f.start + f.length)
            base = entry_name(names, "model/").removeprefix("model/")
            state: dict[str, Any] = {}
            for key, tensor_name in sorted(by_param.get(base, {}).items()):
                entry = manifest.tensors[tensor_name]
                kind = (saved_kinds or {}).get(key) or _infer_kind(key, entry.global_shape, tuple(t.shape))
                if kind == SCALAR:
                    value = reader.read(tensor_name).reshape(())
                elif tuple(entry.global_shape) != tuple(t.shape):
                    raise CheckpointError(
                        f"{tensor_name!r}: shape {tuple(entry.global_shape)} in the checkpoint, the parameter's is "
                        f"{tuple(t.shape)}"
                    )
                else:
                    value = reader.read(tensor_name, (lo, hi)).view(stepped.shape)
                state[key] = _cast_like_torch(key, value, stepped, group_of.get(id(stepped), {}))
            new_state[stepped] = state
    for stepped, state in new_state.items():  # like Optimizer.load_state_dict: the checkpoint's state replaces all
        if state:
            opt.optimizer.state[stepped] = state
        else:
            opt.optimizer.state.pop(stepped, None)


def _infer_kind(key: str, saved_shape: tuple[int, ...], param_shape: tuple[int, ...]) -> str:
    """For checkpoints without ``optimizer/state_kinds``: the shapes tell, except for a 0-dim parameter."""
    if tuple(saved_shape) == () and param_shape != ():
        return SCALAR
    if param_shape == () and tuple(saved_shape) == ():
        return SCALAR if key == "step" else ELEMENTWISE
    return ELEMENTWISE


def _cast_like_torch(key: str, value: torch.Tensor, stepped: torch.Tensor, group: dict) -> torch.Tensor:
    """The policy of ``torch.optim.Optimizer.load_state_dict``: ``step`` keeps its dtype and stays on the host
    unless the group is fused or capturable; any other state takes the dtype (when floating) and device of the
    tensor it belongs to."""
    if key == "step":
        if group.get("fused") or group.get("capturable"):
            return value.to(dtype=torch.float32, device=stepped.device)
        return value
    if stepped.is_floating_point():
        return value.to(dtype=stepped.dtype, device=stepped.device)
    return value.to(device=stepped.device)


def _match_param_groups(engine: Engine, saved: list[dict] | None, reader: CheckpointReader) -> list[tuple[dict, dict]]:
    """Pair every current param group with the saved group holding the same parameter names; refuses any other
    grouping, naming the group and the parameters."""
    if saved is None:
        raise CheckpointError(f"{reader.path}: has no {PARAM_GROUPS_KEY!r}; load it with load_optimizer_states=False")
    names = _names_by_tensor(engine)
    saved_group_of: dict[str, int] = {n: si for si, g in enumerate(saved) for n in g["params"]}
    matches: list[tuple[dict, dict]] = []
    advice = (
        "build the optimizer with the same param groups (the same parameters in each) as the run that saved it, "
        "or load with load_optimizer_states=False"
    )
    for gi, group in enumerate(engine._optimizer.optimizer.param_groups):
        here = [names[id(p)] for p in group["params"]]  # every name of each parameter
        missing = [ns[0] for ns in here if not any(n in saved_group_of for n in ns)]
        if missing:
            raise CheckpointError(
                f"{reader.path}: param group {gi} holds {_list(missing)}, which no param group of the checkpoint "
                f"holds; {advice}"
            )
        found = {next(saved_group_of[n] for n in ns if n in saved_group_of) for ns in here}
        if len(found) > 1:
            detail = ", ".join(
                f"saved group {si}: {_list([ns[0] for ns in here if any(saved_group_of.get(n) == si for n in ns)])}"
                for si in sorted(found)
            )
            raise CheckpointError(
                f"{reader.path}: param group {gi} holds parameters that the checkpoint has in different groups "
                f"({detail}); {advice}"
            )
        (si,) = found if found else (None,)
        if si is None:  # an empty group here: match an empty saved group
            si = next((j for j, g in enumerate(saved) if not g["params"]), None)
            if si is None:
                raise CheckpointError(f"{reader.path}: param group {gi} is empty and no saved group is; {advice}")
        known = {n for ns in here for n in ns}
        extra = [n for n in saved[si]["params"] if n not in known]
        if extra:
            raise CheckpointError(
                f"{reader.path}: the checkpoint's param group {si} also holds {_list(extra)}, which param group "
                f"{gi} here does not; {advice}"
            )
        matches.append((group, saved[si]))
    unmatched = [si for si in range(len(saved)) if all(s is not saved[si] for _, s in matches)]
    if unmatched:
        si = unmatched[0]
        raise CheckpointError(
            f"{reader.path}: the checkpoint's param group {si} ({_list(saved[si]['params'])}) matches no param group "
            f"here; {advice}"
        )
    return matches


def _list(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
