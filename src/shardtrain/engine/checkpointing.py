"""What an engine saves into a checkpoint and how it takes it back, in any layout.

[Note: engine checkpoint contents]
Logical tensors (the storage side: docs/checkpoint-format.md, "What the engine stores"):

* ``model/<name>``: every parameter and buffer under its first state-dict name (tied names are aliases), zero-element
  and non-contiguous ones included; stepped parameters as the optimizer steps them (fp32 masters under mixed precision);
* ``optim/<name>/<key>``: each state tensor of a stepped parameter, *element-wise* (shaped and sliced like it) or
  *scalar* (0-dim, e.g. ``step``, stored once); ``optimizer/state_kinds`` says which (shapes cannot, for 0-dim ones).

Each rank passes what it holds: its ``FlatSlice`` at stages 1-3 (any stage-3 parameter, trainable or frozen); a
tensor every rank holds whole is split into N contiguous slices, so the writes run in parallel. A tensor- or
expert-parallel parameter is this rank's block (``BlockSlice``), its ZeRO fragments ``BlockFlatSlice``, a block held
whole split into shares ([Note: split parameters] in ``zero/layout.py``). Global objects: param groups (with names),
state kinds, scheduler and loss-scaler states, counters, saving topology, ``client_state``, ``hf/config`` for
transformers models (:mod:`shardtrain.checkpoint.hf_config`); per rank, RNG states. All are JSON and safetensors, never
pickled ([Note: checkpoint objects] in ``checkpoint/objects.py``): a ``client_state`` value other than plain data,
tensors and numpy arrays is refused at save, naming where it sits. Loading reads the elements this rank now needs,
whatever layout saved them (N ranks at stage s load at M ranks, stage s'); param groups match by parameter names, not
position; optimizer state is cast as ``Optimizer.load_state_dict`` casts it (``step`` keeps its own); RNG states are
restored only at the saving world, tensor- and expert-parallel sizes.

[Note: the accumulation boundary at resume]
The engine steps the optimizer when ``(micro_steps + 1) % gradient_accumulation_steps == 0`` (as DeepSpeed; the
Trainer integration and the DeepSpeed shim test it so too). So ``micro_steps`` is ``global_step * gas +`` the
micro-batches since the last optimizer step, for the run's current ``gas``: a load recomputes it from the saved
counters and the saving run's ``gradient_accumulation_steps`` (``engine/topology``), never restores it as is (from
world 2 to world 1 with the accumulation doubled, a restored odd count made every later step straddle two
accumulations). A checkpoint saved at a boundary resumes at any ``gas`` (world size, micro-batch and accumulation
may all change while the global batch stays) and continues as one process would. One saved mid-accumulation (its
accumulated gradients are not saved: the accumulation goes on from zero gradients) resumes only at its own ``gas``
and is refused at another, naming both. Without a recorded ``gas`` (DeepSpeed's checkpoints) a count that is a
multiple of ``global_step`` is a boundary; any other is kept as saved.

[Note: checkpoint failures are collective]
A save or load may fail on one rank only (its file is damaged, its disk is full, a bug). Every exception on
any rank is caught and carried in the next object gather, so every rank raises one ``CheckpointError``
naming the failing ranks and their causes within seconds, instead of the others waiting for the collective
timeout. A failed save publishes nothing: ``latest`` still names the previous checkpoint.
"""

from __future__ import annotations

import logging
import random
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from shardtrain.checkpoint import FlatSlice, SavePiece, open_checkpoint, save
from shardtrain.checkpoint.async_save import AsyncSaver
from shardtrain.checkpoint.format import MANIFEST_NAME, BlockFlatSlice, BlockSlice, numel
from shardtrain.checkpoint.hf_config import hf_config_objects
from shardtrain.checkpoint.latest import recover
from shardtrain.checkpoint.owner import SaveDirOwner, owned_elsewhere, run_id
from shardtrain.checkpoint.reader import CheckpointReader
from shardtrain.checkpoint.writer import prepare
from shardtrain.distributed.communicator import Communicator
from shardtrain.engine.optimizer_needs import state_keys_needed
from shardtrain.errors import CheckpointError
from shardtrain.runtime.interface import Runtime
from shardtrain.tensor_parallel import assemble_blocks
from shardtrain.weights.loading import (
    KeyMapper,
    load_safetensors,
    load_state_dict_from_rank0,
    safetensors_files,
    weight_destinations,
)
from shardtrain.zero.layout import ParamRecord, ShardLayout, SplitBlock, state_tensors
from shardtrain.zero.optimizer import ShardedOptimizer

log = logging.getLogger("shardtrain")

COUNTERS = ("global_step", "micro_steps", "skipped_steps", "global_samples")


@dataclass
class TrainingState:
    """What a checkpoint saves and restores, handed over by the engine: the checkpoint code reads the layout and
    the optimizer wrapper's public methods, never the engine's fields."""

    module: nn.Module
    layout: ShardLayout
    optimizer: ShardedOptimizer
    comm: Communicator  # every rank of the job: the save and load protocols run over it
    lr_scheduler: Any  # an LRScheduler or None
    scaler: Any  # a LossScaler or None
    counters: dict[str, int]  # COUNTERS
    run: dict[str, Any]  # compute_dtype, gradient_accumulation_steps (recorded; the latter read by a resume)
    owner: SaveDirOwner | None = None  # the engine's save directories ([Note: one job per save directory])
    stage_comm: Communicator | None = None  # pipeline parallelism: the ranks holding the other stages
    # pipeline parallelism: the ids of parameters another stage writes (a weight tied across the first and last
    # stage is written by the first: [Note: weights tied across stages] in pipeline_parallel/cut.py)
    written_elsewhere: frozenset[int] = frozenset()


PARAM_GROUPS_KEY = "optimizer/param_groups"
STATE_KINDS_KEY = "optimizer/state_kinds"
ELEMENTWISE, SCALAR = "elementwise", "scalar"


def _my_chunk(numel: int, rank: int, world: int) -> tuple[int, int]:
    per = -(-numel // world)
    return min(rank * per, numel), min((rank + 1) * per, numel)


def _stepped(state: TrainingState, t: torch.Tensor) -> torch.Tensor | None:
    """What the optimizer steps for ``t`` (its fp32 master or its fragment), None for a tensor it does not step."""
    try:
        return state.optimizer.stepped_of(t)
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


def _names_by_tensor(state: TrainingState) -> dict[int, list[str]]:
    """Every state-dict name of each parameter, keyed by the parameter and by what the optimizer steps for it."""
    names: dict[int, list[str]] = {}
    with torch._C.DisableTorchFunctionSubclass():
        for ns, t in state_tensors(state.module):
            names[id(t)] = ns
            stepped = _stepped(state, t)
            if stepped is not None:
                names[id(stepped)] = ns
    return names


def _block_of(record: ParamRecord | None, layout: ShardLayout) -> BlockSlice | None:
    """The block this rank holds of a parameter split by tensor or expert parallelism ([Note: split parameters] in
    ``zero/layout.py``), else None."""
    split = layout.block_of(record)
    if split is None:
        return None
    return BlockSlice(split.placement.dim, split.index, split.count, split.placement.stride)


def _pieces(
    name: str,
    value: torch.Tensor,
    shape: tuple[int, ...],
    split: SplitBlock | None,
    fragment: tuple[int, int] | None,
    layout: ShardLayout,
) -> list[SavePiece]:
    """This rank's pieces of one logical tensor of global ``shape``.

    ``value`` is this rank's ZeRO fragment ``(start, length)`` of its (local) tensor, or, with ``fragment`` None,
    the whole local tensor, which every rank holding the same block holds (every data-parallel rank, or the
    expert-data-parallel ranks of an expert block): then each writes one contiguous share, so the writes run in
    parallel. ``split``: the tensor- or expert-parallel block the local tensor is (None: every tp rank holds the
    same tensor, and tp rank 0's copy is written)."""
    block = None if split is None else BlockSlice(split.placement.dim, split.index, split.count, split.placement.stride)
    rank, world = (layout.dp_rank, layout.dp) if split is None else (split.replica, split.replicas)
    if block is None and layout.tp_rank != 0:
        return []
    if fragment is None:
        flat = value.detach().reshape(-1)  # a copy when ``value`` is not contiguous
        start, end = _my_chunk(flat.numel(), rank, world)
        fragment, value = (start, end - start), flat[start:end]
    start, length = fragment
    if not length and not (numel(shape) == 0 and rank == 0):
        return []  # an empty piece describes an empty tensor once
    where = FlatSlice(start, length) if block is None else BlockFlatSlice(block, start, length)
    return [SavePiece(name, shape, where, value.reshape(-1))]


def collect_pieces(state: TrainingState) -> tuple[list[SavePiece], dict[str, str], dict[str, Any]]:
    """(this rank's pieces, aliases, the optimizer's global objects) for a save."""
    layout = state.layout
    sharded = layout.policy.shard_optimizer_state
    opt = state.optimizer
    pieces: list[SavePiece] = []
    aliases: dict[str, str] = {}
    kinds: dict[str, str] = {}
    with torch._C.DisableTorchFunctionSubclass():  # stage-3 parameters: only metadata and fragments are read
        for names, t in state_tensors(state.module):
            name = names[0]
            aliases.update({f"model/{alias}": f"model/{name}" for alias in names[1:]})
            if id(t) in state.written_elsewhere:
                continue
            record = layout.record_of(t)
            split = layout.block_of(record)
            shape = tuple(record.global_shape) if record is not None else tuple(t.shape)
            if record is None or record.bucket is None:  # a buffer or a parameter held whole outside buckets
                pieces += _pieces(f"model/{name}", t, shape, split, None, layout)
                continue
            bucket, f = record.bucket, record.fragment
            # a bucketed parameter, trainable or (in a stage-3 unit) frozen: whole at stage 0, else this rank's
            # fragment of it
            fragment = bucket.shard[f.shard_offset : f.shard_offset + f.length] if sharded else t
            stepped = _stepped(state, t)
            value = opt.readable(stepped) if stepped is not None else fragment  # an offloaded master: mapped
            span = (f.start, f.length) if sharded else None
            pieces += _pieces(f"model/{name}", value, shape, split, span, layout)
            opt_state = opt.state_of(stepped) if stepped is not None else {}  # offloaded state: mapped files
            for k, v in opt_state.items():
                if not torch.is_tensor(v):
                    raise CheckpointError(f"optimizer state {k!r} of {name!r} is not a tensor ({type(v).__name__})")
                kind = _state_kind(k, v, value, name)
                if kind is not None and kinds.setdefault(k, kind) != kind:
                    raise CheckpointError(
                        f"optimizer state {k!r} is a scalar for some parameters and element-wise for others "
                        f"({name!r}); this optimizer's state cannot be checkpointed"
                    )
                if kind == SCALAR:  # identical on every rank, stored once
                    if layout.tp_rank == 0 or layout.tp == 1:
                        pieces.append(SavePiece(f"optim/{name}/{k}", (), FlatSlice(0, 1), v))
                else:
                    pieces += _pieces(f"optim/{name}/{k}", v, shape, split, span, layout)
        # a state seen only on 0-dim parameters stepped whole: torch's optimizers make only "step" a scalar
        for k in {k for st in opt.optimizer.state.values() for k in st if k not in kinds}:
            kinds[k] = SCALAR if k == "step" else ELEMENTWISE
    names = _names_by_tensor(state)
    groups = []
    for gi, group in enumerate(opt.optimizer.param_groups):
        entry = {k: v for k, v in group.items() if k != "params"}
        try:
            entry["params"] = [names[id(p)][0] for p in group["params"]]
        except KeyError:
            raise CheckpointError(
                f"optimizer param group {gi} holds a tensor that is not a parameter of the model"
            ) from None
        groups.append(entry)
    return pieces, aliases, {PARAM_GROUPS_KEY: groups, STATE_KINDS_KEY: dict(sorted(kinds.items()))}


def _describe_failure(err: BaseException) -> str:
    return str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}"


def _merge_stage_param_groups(stage_comm: Communicator, global_objects: dict[str, Any]) -> None:
    """[Note: param groups across stages] Under pipeline parallelism a rank's optimizer holds its stages' parameters
    only; the checkpoint records each param group with every stage's names, so that any layout, pipelined or not,
    matches its groups by name ([Note: engine checkpoint contents])."""
    stages = stage_comm.all_gather_object(global_objects.get(PARAM_GROUPS_KEY), what="param groups of every stage")
    if PARAM_GROUPS_KEY not in global_objects or any(groups is None for groups in stages):
        return  # a rank failed to collect: the save is abandoned on every rank
    merged = [  # a weight tied across stages is in both stages' groups: named once
        dict(group, params=list(dict.fromkeys(n for groups in stages for n in groups[gi]["params"])))
        for gi, group in enumerate(stages[0])
    ]
    global_objects[PARAM_GROUPS_KEY] = merged


def save_engine(
    state: TrainingState,
    save_dir: str | Path,
    tag: str,
    client_state: dict | None,
    saver: AsyncSaver | None = None,
) -> Path:
    """Collective; see [Note: checkpoint failures are collective]. With ``saver``, returns once this rank's
    snapshot is taken and the plan agreed, and ``saver`` writes and publishes in the background ([Note:
    asynchronous checkpoints]); the caller must have waited for its previous save."""
    failure, pieces, aliases, global_objects, rng = None, [], {}, {}, {}
    # the same save done again (a restart of this job reaching a step it had saved): the tag is replaced, safely;
    # another job's checkpoint is not (its run id differs), see [Note: one job per save directory]
    same_save = {"engine/counters": {k: state.counters[k] for k in COUNTERS}, "engine/run_id": run_id()}
    try:
        pieces, aliases, optimizer_objects = collect_pieces(state)
        global_objects = {
            **optimizer_objects,
            "engine/counters": {k: state.counters[k] for k in COUNTERS},
            "engine/topology": {
                "world_size": state.comm.size,
                "dp": state.layout.dp,
                "tp": state.layout.tp,
                "ep": state.layout.ep,
                "zero_stage": state.layout.policy.stage,
                **state.run,
            },
            "engine/scheduler": state.lr_scheduler.state_dict() if state.lr_scheduler is not None else None,
            "engine/scaler": state.scaler.state_dict() if state.scaler is not None else None,
            "client_state": client_state if client_state is not None else {},
            **({"engine/run_id": same_save["engine/run_id"]} if same_save["engine/run_id"] is not None else {}),
            **hf_config_objects(state.module),  # a transformers model's config: consolidation writes config.json
        }
        rng = {
            "torch": torch.get_rng_state(),
            # a run that uses CUDA has set it up; asking otherwise would make a context on GPU 0 for a CPU engine
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None,
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        }
    except Exception as err:  # the save is abandoned on every rank (see the Note)
        failure = f"collecting what to save: {_describe_failure(err)}"
    if state.stage_comm is not None:  # outside the try: every rank of the pipeline group exchanges
        _merge_stage_param_groups(state.stage_comm, global_objects)
    what = {
        "rank_objects": {"rng": rng},
        "global_objects": global_objects,
        "aliases": aliases,
        "failure": failure,
        "same_save": same_save,
    }
    if saver is None:
        return save(save_dir, tag, state.comm, pieces, owner=state.owner, **what).path
    commit_comm = saver.commit_comm(state.comm)  # collective the first time: before anything can fail alone
    prepared = prepare(save_dir, tag, state.comm, pieces, snapshot=True, owner=state.owner, **what)
    saver.start(prepared, commit_comm)
    return prepared.save_dir / prepared.tag


def load_engine(state: TrainingState, load_dir: str | Path, tag: str | None, load_optimizer_states: bool) -> dict:
    """Restore ``state`` from a checkpoint; returns the saved ``client_state`` (``state.counters`` is updated in
    place: counters missing from an old checkpoint are left out). Collective.

    A rank reads only what it needs, so a damaged file may fail on one rank only: the outcome is shared,
    and every rank raises the failing ranks' messages (see [Note: checkpoint failures are collective])."""
    _recover(state, load_dir)
    error, client_state = None, {}
    whole_groups = _whole_model_groups(state) if load_optimizer_states else None
    try:
        client_state = _load(state, load_dir, tag, load_optimizer_states, whole_groups)
    except Exception as err:
        error = _describe_failure(err)
        cause = err
    outcomes = state.comm.all_gather_object(error, what="checkpoint load outcome")
    failed = [(r, e) for r, e in enumerate(outcomes) if e is not None]
    if failed:
        where = f"{load_dir}" + (f" (tag {tag!r})" if tag is not None else "")
        message = "; ".join(f"rank {r} failed to load checkpoint {where}: {e}" for r, e in failed)
        if error is not None:
            raise CheckpointError(message) from cause
        raise CheckpointError(message)
    return client_state


def _recover(state: TrainingState, load_dir: str | Path) -> None:
    """Rank 0 finishes a save that a crash interrupted after it was committed (or drops one that never was) before
    any rank reads ``latest``: a resumed run loads the newest complete checkpoint ([Note: the publish journal] in
    ``checkpoint/latest.py``). Collective (one gather); writes nothing when nothing was interrupted."""
    error = None
    if state.comm.rank == 0:
        try:
            path = Path(load_dir)
            owner = owned_elsewhere(path) if path.is_dir() else None
            if owner is not None:  # its own saves finish what they interrupted: [Note: one job per save directory]
                log.info("checkpoint directory %s belongs to a running job (%s): loaded as it is", path, owner)
            elif path.is_dir() and not (path / MANIFEST_NAME).is_file():
                for line in recover(path):
                    log.warning("checkpoint directory %s: %s", path, line)
        except Exception as err:
            error = f"finishing an interrupted save: {_describe_failure(err)}"
    outcome = state.comm.all_gather_object(error, what="checkpoint recovery")[0]
    if outcome is not None:
        raise CheckpointError(f"rank 0 failed to load checkpoint {load_dir}: {outcome}")


def _whole_model_groups(state: TrainingState) -> list[list[list[str]]] | None:
    """Under pipeline parallelism, each param group's parameter names (every name of each) on every stage, which
    the checkpoint's groups are matched against ([Note: param groups across stages]); None without it. Collective
    over the pipeline group, before anything that can fail on one rank only."""
    if state.stage_comm is None:
        return None
    names = _names_by_tensor(state)
    mine = [[names[id(p)] for p in group["params"]] for group in state.optimizer.optimizer.param_groups]
    stages = state.stage_comm.all_gather_object(mine, what="param groups of every stage")
    return [[ns for groups in stages for ns in groups[gi]] for gi in range(len(mine))]


def _load(
    state: TrainingState,
    load_dir: str | Path,
    tag: str | None,
    load_optimizer_states: bool,
    whole_groups: list[list[list[str]]] | None = None,
) -> dict:
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
    topology = objects.get("engine/topology", {})
    same_layout = (topology.get("tp", 1), topology.get("ep", 1), topology.get("pp", 1), manifest.world_size) == (
        state.layout.tp,
        state.layout.ep,
        state.run.get("pp", 1),
        state.comm.size,
    )
    rng = reader.rank_objects(state.comm.rank).get("rng") if same_layout else None
    # everything that can be refused without reading tensors is checked before the engine is touched
    dests = weight_destinations(state.module, state.layout, state.optimizer)
    for dest in dests:
        entry = manifest.resolve(entry_name(dest.names, "model/"))
        if tuple(entry.global_shape) != tuple(dest.shape):
            raise CheckpointError(
                f"{entry.name!r}: shape {tuple(entry.global_shape)} in the checkpoint, {tuple(dest.shape)} in the model"
            )
    counters = _resumed_counters(objects, state.run["gradient_accumulation_steps"], reader)
    if load_optimizer_states:
        group_matches = _match_param_groups(state, objects.get(PARAM_GROUPS_KEY), reader, whole_groups)
        _check_state_keys(state, reader, entry_name)

    for dest in dests:
        name = entry_name(dest.names, "model/")
        if dest.block is not None:  # this rank's tensor-parallel block, from pieces of any layout
            b = dest.block
            block = BlockSlice(b.placement.dim, b.index, b.count, b.placement.stride)
            dest.write_block(reader.read_slice(name, block))
            continue
        lo, hi = dest.needed_range()
        if hi > lo:
            direct = None
            if isinstance(reader, CheckpointReader):  # ours reads into place; DeepSpeed's and DCP's make tensors
                direct = dest.readable_target(lo, hi, manifest.resolve(name).torch_dtype)
            if direct is not None:  # read straight into the parameter or master, then copy to the other targets
                values = reader.read(name, (lo, hi), out=direct.detach().view(-1))
            else:
                values = reader.read(name, (lo, hi))
            dest.write_slice(values, lo)

    if load_optimizer_states:
        _load_optimizer_state(state, reader, entry_name)
        for group, saved in group_matches:
            group.update({k: v for k, v in saved.items() if k != "params"})
        if state.lr_scheduler is not None and objects.get("engine/scheduler") is not None:
            _check_scheduler_form(state.lr_scheduler, objects["engine/scheduler"], reader)
            state.lr_scheduler.load_state_dict(objects["engine/scheduler"])
    if state.scaler is not None and objects.get("engine/scaler") is not None:
        state.scaler.load_state_dict(objects["engine/scaler"])
    state.counters.clear()
    state.counters.update(counters)
    if same_layout:
        if rng is not None:  # read (and so checked) before the engine was touched
            torch.set_rng_state(rng["torch"])
            if rng["cuda"] is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
            np.random.set_state(rng["numpy"])
            random.setstate(rng["python"])
    else:
        warnings.warn(
            f"checkpoint saved by {manifest.world_size} ranks (tensor parallel {topology.get('tp', 1)}, expert "
            f"parallel {topology.get('ep', 1)}) loaded by {state.comm.size} (tensor parallel {state.layout.tp}, "
            f"expert parallel {state.layout.ep}): per-rank RNG states "
            "are not restored",
            stacklevel=4,
        )
    return objects.get("client_state", {})


def _resumed_counters(objects: dict, gas: int, reader: CheckpointReader) -> dict[str, int]:
    """The saved counters, ``micro_steps`` placed for this run's ``gas`` ([Note: the accumulation boundary at
    resume]). Refuses a checkpoint saved mid-accumulation at another ``gradient_accumulation_steps``."""
    saved = objects.get("engine/counters", {})
    counters = {k: saved[k] for k in COUNTERS if k in saved}
    if "micro_steps" not in counters:
        return counters
    step, micro = counters.get("global_step", 0), counters["micro_steps"]
    saved_gas = objects.get("engine/topology", {}).get("gradient_accumulation_steps")
    if saved_gas is None:  # not recorded (a DeepSpeed checkpoint): a boundary when micro_steps = step x some gas
        at_boundary = micro % step == 0 if step else micro == 0
        if not at_boundary:
            return counters  # cannot tell where in an accumulation it is: as saved
        into = 0
    else:
        into = micro - step * saved_gas
        if not 0 <= into < saved_gas:  # written after a resume that shifted the count: where its own count says
            into = micro % saved_gas
    if into and saved_gas != gas:
        raise CheckpointError(
            f"{reader.path}: saved in the middle of an accumulation ({into} of gradient_accumulation_steps="
            f"{saved_gas} micro-batches after optimizer step {step}), and this run accumulates "
            f"gradient_accumulation_steps={gas}: the accumulation cannot go on at another count. Resume with "
            f"gradient_accumulation_steps={saved_gas}, or from a checkpoint saved at an accumulation boundary "
            "(after the engine.step() that stepped the optimizer)"
        )
    counters["micro_steps"] = step * gas + into
    return counters


def _check_scheduler_form(scheduler: Any, saved: Any, reader: CheckpointReader) -> None:
    """A DeepSpeed scheduler's state (``{'last_batch_iteration': k}``, from a DeepSpeed checkpoint) loads only into
    shardtrain's DeepSpeed-named schedulers: a torch scheduler's ``load_state_dict`` would take it without error
    and without effect."""
    if not (isinstance(saved, dict) and set(saved) == {"last_batch_iteration"}):
        return
    if not type(scheduler).__module__.startswith("shardtrain."):
        raise CheckpointError(
            f"{reader.path}: the LR scheduler state was saved by a DeepSpeed scheduler (last_batch_iteration="
            f"{saved['last_batch_iteration']}), which a {type(scheduler).__name__} cannot take; build the scheduler "
            "from the config's 'scheduler' section (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle) as the "
            "DeepSpeed run did, or load with load_optimizer_states=False"
        )


def _load_optimizer_state(state: TrainingState, reader: CheckpointReader, entry_name) -> None:
    """Replace the optimizer state of every stepped tensor by the checkpoint's, read for this rank's range."""
    manifest, opt = reader.manifest, state.optimizer
    sharded = state.layout.policy.shard_optimizer_state
    saved_kinds = reader.objects.get(STATE_KINDS_KEY)  # absent in checkpoints written before it existed
    by_param = _optim_entries(manifest)
    group_of = {id(p): g for g in opt.optimizer.param_groups for p in g["params"]}
    new_state: dict[torch.Tensor, dict[str, Any]] = {}
    streamed = opt.offload is not None and opt.offload.offloaded  # to the swap files, one tensor at a time
    with torch._C.DisableTorchFunctionSubclass():
        for names, t in state_tensors(state.module):
            frag = opt.fragment_of(t)
            stepped = _stepped(state, t) if frag is not None else None
            if stepped is None:
                continue
            _, bucket, i = frag
            f = bucket.fragments[i]
            lo, hi = (f.start, f.start + f.length) if sharded else (0, t.numel())
            base = entry_name(names, "model/").removeprefix("model/")
            shape_of_stepped = opt.readable(stepped).shape  # an offloaded master is empty between steps
            param_state: dict[str, Any] = {}
            record = state.layout.record_of(t)
            shape = tuple(record.global_shape) if record is not None else tuple(t.shape)
            for key, tensor_name in sorted(by_param.get(base, {}).items()):
                entry = manifest.tensors[tensor_name]
                kind = (saved_kinds or {}).get(key) or _infer_kind(key, entry.global_shape, shape)
                if kind == SCALAR:
                    value = reader.read(tensor_name).reshape(())
                elif tuple(entry.global_shape) != shape:
                    raise CheckpointError(
                        f"{tensor_name!r}: shape {tuple(entry.global_shape)} in the checkpoint, the parameter's is "
                        f"{shape}"
                    )
                else:
                    value = _read_local(reader, tensor_name, record, state.layout, lo, hi).view(shape_of_stepped)
                param_state[key] = _cast_like_torch(key, value, stepped, group_of.get(id(stepped), {}))
            if streamed:
                opt.set_state(stepped, param_state)
            else:
                new_state[stepped] = param_state
    for stepped, param_state in new_state.items():  # like Optimizer.load_state_dict: the checkpoint's replaces all
        opt.set_state(stepped, param_state)


def _optim_entries(manifest) -> dict[str, dict[str, str]]:
    """Parameter name -> state key -> the tensor ``optim/<name>/<key>``."""
    by_param: dict[str, dict[str, str]] = {}
    for tensor_name in manifest.tensors:
        if tensor_name.startswith("optim/"):
            param, _, key = tensor_name.removeprefix("optim/").rpartition("/")
            by_param.setdefault(param, {})[key] = tensor_name
    return by_param


def _check_state_keys(state: TrainingState, reader: CheckpointReader, entry_name) -> None:
    """Refuse, before anything is loaded, a checkpoint holding some optimizer state of a parameter but not every key
    this engine's optimizer needs for it (a DeepSpeed checkpoint without its step counts, or one written by another
    optimizer): torch's optimizers would fail at the first ``step()`` (``KeyError: 'step'``). A parameter without
    any saved state starts fresh, as in torch."""
    opt = state.optimizer.optimizer
    needed = state_keys_needed(opt)
    group_index = {id(p): gi for gi, g in enumerate(opt.param_groups) for p in g["params"]}
    by_param = _optim_entries(reader.manifest)
    with torch._C.DisableTorchFunctionSubclass():
        for names, t in state_tensors(state.module):
            stepped = _stepped(state, t) if state.optimizer.fragment_of(t) is not None else None
            if stepped is None or id(stepped) not in group_index:
                continue
            keys = needed[group_index[id(stepped)]]
            base = entry_name(names, "model/").removeprefix("model/")
            saved = set(by_param.get(base, {}))
            if keys is None or not saved or keys <= saved:
                continue
            raise CheckpointError(
                f"{reader.path}: the optimizer state of {base!r} holds {sorted(saved)} but not "
                f"{sorted(keys - saved)}, which {type(opt).__name__} needs to go on from it (a checkpoint whose "
                "optimizer saved no step count, or one written by another optimizer); build the optimizer the run "
                "that saved it used, or load with load_optimizer_states=False to keep the weights and start the "
                "optimizer afresh"
            )


def _read_local(
    reader: CheckpointReader, name: str, record: ParamRecord | None, layout: ShardLayout, lo: int, hi: int
) -> torch.Tensor:
    """Elements ``[lo, hi)`` of this rank's (local) tensor: of its tensor-parallel block for a split parameter."""
    block = _block_of(record, layout)
    if block is None:
        return reader.read(name, (lo, hi))
    return reader.read_slice(name, BlockFlatSlice(block, lo, hi - lo))


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


def _match_param_groups(
    state: TrainingState,
    saved: list[dict] | None,
    reader: CheckpointReader,
    whole_groups: list[list[list[str]]] | None = None,
) -> list[tuple[dict, dict]]:
    """Pair every current param group with the saved group holding the same parameter names; refuses any other
    grouping, naming the group and the parameters. ``whole_groups``: under pipeline parallelism, each group's names
    on every stage (:func:`_whole_model_groups`), which are matched instead of this rank's."""
    if saved is None:
        raise CheckpointError(f"{reader.path}: has no {PARAM_GROUPS_KEY!r}; load it with load_optimizer_states=False")
    names = _names_by_tensor(state)
    saved_group_of: dict[str, int] = {n: si for si, g in enumerate(saved) for n in g["params"]}
    matches: list[tuple[dict, dict]] = []
    advice = (
        "build the optimizer with the same param groups (the same parameters in each) as the run that saved it, "
        "or load with load_optimizer_states=False"
    )
    for gi, group in enumerate(state.optimizer.optimizer.param_groups):
        # every name of each parameter (of every stage's share of the group under pipeline parallelism)
        here = [names[id(p)] for p in group["params"]] if whole_groups is None else whole_groups[gi]
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


# -- full (unsharded) weights ----------------------------------------------------------------------------------------


def full_state_dict(
    state: TrainingState,
    runtime: Runtime,
    tp_comm: Communicator | None,
    rank: int,
    dp_rank: int,
    device: torch.device,
    ep_comm: Communicator | None = None,
) -> dict[str, torch.Tensor] | None:
    """``Engine.full_state_dict``: the full model state dict on global rank 0 (CPU copies), None elsewhere. Units are
    gathered one at a time; the blocks of split parameters ([Note: split parameters] in ``zero/layout.py``) are
    joined by the ranks of global rank 0's group: tensor-parallel blocks of dp rank 0 over ``tp_comm``, experts of
    the first expert group (dp ranks ``0 .. E - 1``) over ``ep_comm``."""
    layout = state.layout
    first = dp_rank < layout.ep  # a rank whose blocks reach global rank 0 (dp rank 0 without expert parallelism)
    copies: dict[int, torch.Tensor] = {}
    for unit in runtime.units:
        with runtime.gathered([s.param for b in unit.buckets for s in b.slots]):
            for b in unit.buckets:
                for s in b.slots:
                    if first:
                        copies[id(s.param)] = s.param.detach().to("cpu", copy=True)
    if first:
        for r in layout.records:
            split = layout.block_of(r)
            comm = None if split is None else tp_comm if r.tp_split else ep_comm
            if comm is not None:
                local = copies[id(r.param)] if id(r.param) in copies else r.param.detach()
                copies[id(r.param)] = _join_blocks(comm, local.to(device), r, split.placement).cpu()
    if rank != 0:
        return None
    module_state = state.module.state_dict(keep_vars=True)
    return {k: copies[id(v)] if id(v) in copies else v.detach().to("cpu", copy=True) for k, v in module_state.items()}


def _join_blocks(comm: Communicator, local: torch.Tensor, record: ParamRecord, placement: Any) -> torch.Tensor:
    """The full tensor from every rank's block (collective over the tensor-parallel or expert group)."""
    t = comm.size
    everyone = local.new_empty(t * local.numel())
    comm.all_gather(everyone, local.reshape(-1).contiguous(), what=f"blocks of {record.name!r}")
    return assemble_blocks(everyone.view(t, *local.shape).unbind(0), placement)


def load_full_weights(state: TrainingState, source: Any, strict: bool, key_map: KeyMapper | None = None) -> None:
    """``Engine.load_full_state_dict``: each rank keeps what it holds (see :mod:`shardtrain.weights.loading`)."""
    dests = weight_destinations(state.module, state.layout, state.optimizer)
    if isinstance(source, (str, Path, list, tuple)):
        load_safetensors(dests, safetensors_files(source), strict, key_map)
    elif key_map is not None:
        raise TypeError("load_full_state_dict: key_map maps the keys of safetensors files; pass a path, not a dict")
    else:
        load_state_dict_from_rank0(dests, source, state.comm, strict)  # global rank 0's dict
