"""The layout of a checkpoint directory written by DeepSpeed's ``save_checkpoint``, as a manifest of ours.

[Note: DeepSpeed checkpoints as a manifest]
:class:`~shardtrain.checkpoint.foreign.deepspeed_reader.DeepSpeedReader` offers what
:class:`~shardtrain.checkpoint.reader.CheckpointReader` offers (a :class:`~shardtrain.checkpoint.format.Manifest` of
``model/<name>`` and ``optim/<name>/<key>`` pieces, ``read``/``read_slice``, ``objects``), so the any-layout load and
consolidation run unchanged on it. What DeepSpeed writes, and the pieces each part becomes:

* stages 1-2: rank ``r``'s ``*zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` holds its contiguous partition of each
  group's flat fp32 masters (``single_partition_of_fp32_groups``) and its state (``base_optimizer_state``). The flat
  tensor is the parameters in ``param_shapes`` order, each followed by its ``param_alignment_paddings`` (the last
  partition's tail padding unsaved): a parameter is one ``FlatSlice`` per partition it overlaps, as ``zero_to_fp32``;
* stage 3: rank ``r`` holds elements ``[r * ceil(n / N), (r + 1) * ceil(n / N))`` of every parameter, back to back in
  ``fp32_flat_groups``; frozen ones alike in ``frozen_param_fragments``;
* stage 0: ``module`` holds the weights, ``optimizer`` the state dict (with bf16/fp16 the fp32 masters in
  ``fp32_groups`` or ``fp32_groups_flat``); no names are saved, so parameters are matched to the module's in order;
* AutoTP: tensor-parallel rank ``t`` writes the files above as ``mp_rank_<t>`` for its shards; a split parameter is
  every rank's pieces, each inside its block ([Note: DeepSpeed tensor parallelism], [Note: DeepSpeed stage 0 with TP]);
* everywhere: buffers from ``module`` (fp32), frozen parameters from ``frozen_param_fragments`` (stages 2-3) or
  ``module`` (0-1), tied ones from ``shared_params``. Weights are the fp32 masters where kept (bitwise
  ``zero_to_fp32``'s); each parameter gets its group's ``step`` ([Note: DeepSpeed's step counts]).

[Note: DeepSpeed's step counts]
The optimizer DeepSpeed built decides how its step count is saved (DeepSpeed 0.19), in the state dict above:

* torch's Adam/AdamW (``torch_adam: true``) or a torch optimizer passed in: ``state[i]['step']``, 0-dim float32;
* ``FusedAdam`` (``Adam``/``AdamW`` without offload, a CPU build under ``DS_ACCELERATOR=cpu``) and
  ``DeepSpeedCPUAdam`` (``offload_optimizer``): ``state[i]['step']``, a Python int. FusedAdam's
  ``param_groups[g]['step']`` is 0 since 0.9; older releases counted only there, so a positive group count is taken
  when the state has none. FusedAdam steps a group with its last parameter's count and increments only that one:
  right at stages 1-3 (one flat tensor per group), but at stage 0 the others keep 0, so every parameter gets the
  group's largest count;
* the "elastic" stage 1-2 layout (``base_optimizer_state_step``) is not read.

Each becomes a float32 scalar ``optim/<name>/step``, torch's form, so torch's Adam family or ``DeepSpeedAdam`` takes
it as its own count; a group's ``step`` is state, not a hyperparameter passed on with ``lr``. Objects:
``engine/counters``, ``engine/scheduler`` (passed through), ``engine/scaler`` (translated), ``client_state`` (the
model-states file's keys DeepSpeed did not write), ``optimizer/param_groups``, ``optimizer/state_kinds``,
``engine/topology`` and ``hf/config`` when the save directory holds the Trainer's ``config.json``.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardtrain.checkpoint.foreign.deepspeed_moe import AutoEPNames, check_expert_shapes
from shardtrain.checkpoint.foreign.deepspeed_pickle import LossScalerState, load_deepspeed_file
from shardtrain.checkpoint.foreign.deepspeed_pipeline import pipeline_modules
from shardtrain.checkpoint.format import (
    DTYPE_NAMES,
    FORMAT_VERSION,
    BlockFlatSlice,
    BlockSlice,
    FileEntry,
    FlatSlice,
    Manifest,
    ObjectRecord,
    Piece,
    Slice,
    TensorEntry,
)
from shardtrain.checkpoint.latest import read_latest
from shardtrain.errors import CheckpointError

LATEST = "latest"
_MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_OPTIM_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
# top-level keys of a model-states file that DeepSpeed writes itself; every other key is the client state
DEEPSPEED_KEYS = frozenset(
    {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "ds_config",
        "ds_version",
        "checkpoint_parallel_dimensions",
        "universal_checkpoint_info",
        "num_experts",
        "ds_autoep_layers",
        "autoep_layers",
    }
)


def _model_files(d: Path) -> list[str]:
    return sorted(p.name for p in d.glob("*_model_states.pt") if _MODEL_FILE.match(p.name))


def find_deepspeed_dir(path: str | os.PathLike, tag: str | None = None) -> Path | None:
    """The tag directory if ``path`` (with ``tag``, or the tag ``latest`` names) is a DeepSpeed checkpoint, else
    None (then it is not one: ours, or nothing)."""
    path = Path(path)
    if not path.is_dir():
        return None
    if tag is None and _model_files(path):
        return path
    if tag is None:
        try:  # confined to ``path``: [Note: latest names a tag inside the save directory] in checkpoint/latest.py
            tag = read_latest(path)
        except CheckpointError:
            return None  # not followed; our own reader then refuses it by name
        if tag is None:
            return None
    ckpt = path / tag
    return ckpt if ckpt.is_dir() and _model_files(ckpt) else None


@dataclass(frozen=True)
class _Source:
    """Where a piece's elements are: ``file``, the keys from the top of its dict down to a tensor, and the
    element of that (flattened) tensor the piece starts at."""

    file: str
    keys: tuple
    offset: int
    number: bool = False  # a Python number in the pickle (a step count: [Note: DeepSpeed's step counts])


def _dig(data: Any, keys: tuple, where: str) -> Any:
    for k in keys:
        try:
            data = data[k]
        except (KeyError, IndexError, TypeError):
            raise CheckpointError(f"{where}: has no {'/'.join(map(str, keys))}; the file is damaged") from None
    return data


class DeepSpeedLayout:
    """Builds the manifest of a DeepSpeed checkpoint (``_build``) and resolves its pieces to the tensors in the
    files (``_tensor``). The reading interface is
    :class:`~shardtrain.checkpoint.foreign.deepspeed_reader.DeepSpeedReader`."""

    path: Path
    optim_files: list[str]
    _files: dict[str, dict[str, Any]]
    _sources: dict[str, _Source]
    _objects: dict[str, Any]

    # -- files ------------------------------------------------------------------------------------
    def _file(self, name: str) -> dict[str, Any]:
        if name not in self._files:
            self._files[name] = load_deepspeed_file(self.path / name)
        return self._files[name]

    def _tensor(self, src: _Source) -> torch.Tensor:
        t = _dig(self._file(src.file), src.keys, str(self.path / src.file))
        if src.number:
            if not _is_count(t):
                raise CheckpointError(
                    f"{self.path / src.file}: {'/'.join(map(str, src.keys))} is a {type(t).__name__}, not a step count"
                )
            return torch.tensor([float(t)], dtype=torch.float32)
        if not torch.is_tensor(t):
            raise CheckpointError(
                f"{self.path / src.file}: {'/'.join(map(str, src.keys))} is a {type(t).__name__}, not a tensor"
            )
        return t

    def _piece(
        self, tensors: dict, name: str, file: str, keys: tuple, offset: int, where: Slice, number: bool = False
    ) -> None:
        key = f"{file}:{'/'.join(map(str, keys))}@{offset}"
        self._sources[key] = _Source(file, keys, offset, number)
        tensors.setdefault(name, []).append(Piece(file, key, where, "none"))

    # -- the manifest -----------------------------------------------------------------------------
    def _build(self) -> Manifest:
        d = self.path
        model_files = _model_files(d)
        mp_ranks = sorted({int(_MODEL_FILE.match(f).group(2)) for f in model_files})
        if mp_ranks != list(range(len(mp_ranks))):
            raise CheckpointError(f"{d}: model-states files of tensor-parallel ranks {mp_ranks}: some are missing")
        self._z3_names = any(f.startswith("zero_pp_rank_") for f in model_files)
        main_name = self._model_name(0)
        main = self._file(main_name)
        where = str(d / main_name)
        for key in ("module", "global_steps"):
            if key not in main:
                raise CheckpointError(f"{where}: has no {key!r}; not a DeepSpeed model-states file")
        self._autoep = AutoEPNames.of(main, d, where)  # [Note: DeepSpeed AutoEP checkpoints]
        # [Note: DeepSpeed pipeline checkpoints]: mp_rank_<s> is pipeline stage s, its module read from layer files
        stage_modules = pipeline_modules(d, [self._model_name(m) for m in mp_ranks], self._file)
        if stage_modules is not None:
            for m, stage_module in zip(mp_ranks, stage_modules):
                self._file(self._model_name(m))["module"] = stage_module
        optim_files: dict[int, dict[int, str]] = {m: {} for m in mp_ranks}  # tp rank -> dp rank -> file
        for p in d.glob("*_optim_states.pt"):
            m = _OPTIM_FILE.match(p.name)
            if m and int(m.group(3)) in optim_files:
                optim_files[int(m.group(3))][int(m.group(2))] = p.name
        for m, files in optim_files.items():
            if sorted(files) != list(range(len(files))) or len(files) != len(optim_files[0]):
                raise CheckpointError(
                    f"{d}: optimizer files of data-parallel ranks {sorted(files)} for tensor-parallel rank {m}: "
                    "some are missing"
                )
        self.optim_files = [optim_files[0][r] for r in sorted(optim_files[0])]
        if self._autoep is not None and (not self.optim_files or mp_ranks[1:]):
            raise CheckpointError(
                f"{d}: a DeepSpeed AutoEP checkpoint "
                + ("with tensor parallelism" if self.optim_files else "at ZeRO stage 0 (expp_rank_*_optim_states.pt)")
                + " is not read ([Note: DeepSpeed AutoEP checkpoints]); save the run at ZeRO stage 1 or 2"
            )
        # per tensor-parallel rank: parameter name -> (its block there, or None when replicated; the logical shape)
        tensor_parallel = mp_ranks[1:] and stage_modules is None
        all_blocks = (
            {m: self._tp_blocks(self._file(self._model_name(m)), m) for m in mp_ranks} if tensor_parallel else {}
        )
        blocks = all_blocks.get(0, {})
        module = main["module"]
        if not isinstance(module, dict):
            raise CheckpointError(f"{where}: 'module' is a {type(module).__name__}, not a state dict")
        shared = dict(main.get("shared_params") or {})  # alias -> name holding the data
        # (file, its module): each pipeline stage's, or the one model-states file's
        module_files = [self._model_name(m) for m in (mp_ranks if stage_modules is not None else [0])]
        buffers = {b for f in module_files for b in (self._file(f).get("buffer_names") or ())}
        tensors: dict[str, list[Piece]] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        dtypes: dict[str, torch.dtype] = {}
        groups: list[dict] = []
        kinds: dict[str, str] = {}

        self._optim_shapes = {}
        if stage_modules is not None:
            stage, world = self._pipeline_pieces(mp_ranks, optim_files, tensors, shapes, dtypes, groups, kinds)
        elif self.optim_files:
            stage, world = self._zero_pieces(main, tensors, shapes, dtypes, groups, kinds, blocks=blocks)
            for m in mp_ranks[1:]:
                files = [optim_files[m][r] for r in sorted(optim_files[m])]
                other = self._file(self._model_name(m))
                self._zero_pieces(other, tensors, shapes, dtypes, groups, kinds, m, files, all_blocks[m])
        else:
            stage, world = 0, int(main.get("dp_world_size") or 1)
            for m in mp_ranks:  # every tensor-parallel rank's module and optimizer: [Note: DeepSpeed stage 0 with TP]
                other = main if m == 0 else self._file(self._model_name(m))
                found = self._stage0_pieces(other, tensors, shapes, dtypes, groups, kinds, m, all_blocks.get(m))
                if m == 0:
                    shared.update(found)
        self.stage = stage
        # everything not stepped by the optimizer: buffers and frozen parameters. A frozen parameter that tensor
        # parallelism splits is in every tensor-parallel rank's files, each holding its block.
        frozen_shapes = main.get("frozen_param_shapes") or {}
        for module_file, ds_name, value in (
            (f, n, v) for f in module_files for n, v in self._file(f)["module"].items()
        ):
            home = module_file  # the file this module entry is in (tensor-parallel rank 0's, or a pipeline stage's)
            name = ds_name if self._autoep is None else self._autoep.model_name(ds_name)
            if name is None or name in shapes or ds_name in shared:
                continue
            block, logical = blocks.get(name, (None, None))
            tp_ranks = mp_ranks if block is not None else [0]
            if name in frozen_shapes:
                local = tuple(frozen_shapes[name])
                n = math.prod(local)
                per = -(-n // world)
                for m in tp_ranks:
                    if stage == 3:  # each data-parallel rank's fragment, as a trainable parameter's
                        spans = [
                            (self._model_name(m, r), FlatSlice(r * per, max(0, min(per, n - r * per))))
                            for r in range(world)
                        ]
                    else:
                        spans = [(home if m == 0 else self._model_name(m), FlatSlice(0, n))]
                    mine = all_blocks[m][name][0] if block is not None else None
                    for file, w in spans:
                        self._piece(
                            tensors, f"model/{name}", file, ("frozen_param_fragments", name), 0, _within(mine, w)
                        )
                dtypes[name] = self._tensor(_Source(home, ("frozen_param_fragments", name), 0)).dtype
                shapes[name] = logical or local
                continue
            if not torch.is_tensor(value):
                raise CheckpointError(f"{where}: module entry {name!r} is a {type(value).__name__}, not a tensor")
            if stage == 3 and name not in buffers:
                raise CheckpointError(
                    f"{where}: parameter {name!r} is neither in the optimizer's partitions nor saved as a frozen "
                    "parameter (saved with exclude_frozen_parameters=True?); it cannot be loaded from this checkpoint"
                )
            shapes[name] = logical or tuple(value.shape)
            # buffers come back in fp32, as zero_to_fp32 gives them
            dtypes[name] = torch.float32 if name in buffers and value.is_floating_point() else value.dtype
            for m in tp_ranks:
                mine = all_blocks[m][name][0] if block is not None else None
                self._piece(
                    tensors,
                    f"model/{name}",
                    home if m == 0 else self._model_name(m),
                    ("module", ds_name),
                    0,
                    _within(mine, FlatSlice(0, value.numel())),
                )
        aliases: dict[str, list[str]] = {}
        for alias, target in shared.items():
            if f"model/{target}" in tensors and f"model/{alias}" not in tensors:
                aliases.setdefault(f"model/{target}", []).append(f"model/{alias}")
        entries = {}
        for name, pieces in tensors.items():
            base = name.removeprefix("model/").removeprefix("optim/")
            if name.startswith("optim/"):
                shape, dtype = self._optim_shapes[name]
            else:
                shape, dtype = shapes[base], dtypes[base]
            if dtype not in DTYPE_NAMES:
                raise CheckpointError(f"{d}: tensor {name!r} has dtype {dtype}, which cannot be read here")
            try:
                entries[name] = TensorEntry(
                    name, shape, DTYPE_NAMES[dtype], tuple(pieces), tuple(aliases.get(name, ()))
                )
            except CheckpointError as err:
                raise CheckpointError(f"{d}: {err}; the checkpoint is damaged or of an unknown layout") from None
        files = {}
        used = {p.file for e in entries.values() for p in e.pieces} | {main_name}
        for f in sorted(used):
            # the rank that wrote it: DeepSpeed's mesh is (data parallel, tensor parallel), tensor parallel innermost
            dp_rank = int((re.search(r"zero_pp_rank_(\d+)", f) or [0, 0])[1])
            tp_rank = int((re.search(r"mp_rank_(\d+)", f) or [0, 0])[1])
            files[f] = FileEntry(f, dp_rank * len(mp_ranks) + tp_rank, (d / f).stat().st_size)
        pp = len(mp_ranks) if stage_modules is not None else 1
        self._objects = self._make_objects(main, groups, kinds, stage, world, len(mp_ranks) // pp, pp)
        return Manifest(
            version=FORMAT_VERSION,
            tag=d.name,
            world_size=world * len(mp_ranks),
            tensors=entries,
            files=files,
            objects={k: ObjectRecord(k, "json") for k in self._objects},
        )

    _optim_shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]

    def _zero_pieces(
        self,
        main,
        tensors,
        shapes,
        dtypes,
        groups,
        kinds,
        mp_rank: int = 0,
        optim_files=None,
        blocks=None,
        known: set[str] | None = None,
    ) -> tuple[int, int]:
        """Pieces of the trainable parameters and their optimizer state at stages 1-3, from the files of tensor
        parallel rank ``mp_rank`` (``main`` is its model-states file). ``blocks``: parameter name -> (the
        tensor-parallel block this rank holds, or None when replicated; the logical shape), for ``mp_rank_XX``
        checkpoints ([Note: DeepSpeed tensor parallelism]). ``known``: names read already (a tied module's copy on
        another pipeline stage, [Note: DeepSpeed pipeline checkpoints]), placed in the flat tensor but not read."""
        blocks = blocks or {}
        known = known or set()
        optim_files = optim_files if optim_files is not None else self.optim_files
        first = self._file(optim_files[0])
        osd = _dig(first, ("optimizer_state_dict",), str(self.path / optim_files[0]))
        stage = int(osd.get("zero_stage", -1))
        world = osd.get("partition_count")
        world = max(world) if isinstance(world, list) else world
        if world != len(optim_files):
            raise CheckpointError(
                f"{self.path}: the optimizer state was partitioned over {world} ranks but {len(optim_files)} "
                "optimizer files are present; the checkpoint is incomplete (a rank did not save?)"
            )
        param_shapes = main.get("param_shapes")
        if not isinstance(param_shapes, list):
            raise CheckpointError(
                f"{self.path}: the model-states file has no 'param_shapes'; the checkpoint is damaged"
            )
        if stage in (1, 2):
            masters, state_keys = (
                ("optimizer_state_dict", "single_partition_of_fp32_groups"),
                (
                    "optimizer_state_dict",
                    "base_optimizer_state",
                ),
            )
        elif stage == 3:
            masters, state_keys = (
                ("optimizer_state_dict", "fp32_flat_groups"),
                (
                    "optimizer_state_dict",
                    "optimizer_state_dict",
                ),
            )
        else:
            raise CheckpointError(f"{self.path}: unknown ZeRO stage {stage!r} in {optim_files[0]}")
        base = _dig(first, state_keys, str(self.path / optim_files[0]))
        if not isinstance(base, dict) or "param_groups" not in base:
            raise CheckpointError(
                f"{self.path / optim_files[0]}: the optimizer state is not a torch optimizer state dict (the "
                "'elastic' layout of some DeepSpeed releases); this reader does not know it: load the checkpoint "
                "into DeepSpeed and save it again with elastic_checkpoint off"
            )
        saved_groups = base["param_groups"]
        paddings = osd.get("param_alignment_paddings")
        for g, group_shapes in enumerate(param_shapes):
            if self._autoep is not None and saved_groups[g].get("moe"):  # [Note: DeepSpeed AutoEP checkpoints]
                if stage == 3:
                    raise CheckpointError(f"{self.path}: a DeepSpeed AutoEP checkpoint at ZeRO stage 3 is not read")
                counts = osd.get("partition_count")
                count = counts[g] if isinstance(counts, list) else counts
                self._expert_pieces(g, group_shapes, optim_files, count, masters, state_keys, base, paddings,
                                    (tensors, shapes, dtypes, groups, kinds))  # fmt: skip
                continue
            if self._autoep is not None:  # the router under the model's name
                group_shapes = {self._autoep.model_name(n) or n: v for n, v in group_shapes.items()}
            names = list(group_shapes)
            state_index = saved_groups[g]["params"][0]
            if mp_rank == 0:  # the same groups and names on every tensor-parallel rank
                groups.append({**_hyperparameters(saved_groups[g]), "params": names})
            lengths = [
                self._tensor(_Source(f, (*masters, g), 0)).numel() for f in optim_files
            ]  # each rank's part of the group
            state0 = base["state"].get(state_index, {})
            elementwise = {k for k, v in state0.items() if torch.is_tensor(v) and v.dim() > 0}
            scalar = _scalar_states(state0, saved_groups[g], state_index, g)
            for k in elementwise:
                kinds[k] = "elementwise"
            for k in scalar:
                kinds[k] = "scalar"
            whole_momentum = stage != 3 and self._whole_momentum(
                saved_groups[g], optim_files, state_keys, state_index, lengths
            )
            if whole_momentum:
                elementwise.discard("momentum_buffer")
            momentum_at = [0] * world  # [Note: DeepSpeed's Muon momentum at ZeRO 1-2]: where each rank's next one is
            offset = 0  # stages 1-2: in the group's flat tensor; stage 3: in each rank's part
            starts = [sum(lengths[:r]) for r in range(world)]
            for i, (name, shape) in enumerate(group_shapes.items()):
                shape = tuple(shape)
                n = math.prod(shape)
                block, logical = blocks.get(name, (None, shape))
                # replicated over tensor parallelism (rank 0's copy), or a tie's copy read from an earlier stage
                replica = (mp_rank > 0 and block is None) or name in known
                shapes[name], dtypes[name] = logical, self._tensor(_Source(optim_files[0], (*masters, g), 0)).dtype
                spans = []  # (rank, offset in the rank's tensor, FlatSlice of the parameter)
                if stage == 3:
                    per = -(-n // world)
                    spans = [(r, offset, FlatSlice(r * per, max(0, min(per, n - r * per)))) for r in range(world)]
                    offset += per
                else:
                    for r in range(world):
                        lo, hi = max(offset, starts[r]), min(offset + n, starts[r] + lengths[r])
                        if hi > lo:
                            spans.append((r, lo - starts[r], FlatSlice(lo - offset, hi - lo)))
                    offset += n + (paddings[g][i] if paddings is not None else 0)
                if block is not None:  # ZeRO fragments of this rank's block
                    spans = [(r, at, BlockFlatSlice(block, w.start, w.length)) for r, at, w in spans]
                if replica:
                    continue
                for r, at, where in spans:
                    f = optim_files[r]
                    self._piece(tensors, f"model/{name}", f, (*masters, g), at, where)
                    for k in elementwise:
                        self._piece(tensors, f"optim/{name}/{k}", f, (*state_keys, "state", state_index, k), at, where)
                for k in elementwise:
                    self._optim_shapes[f"optim/{name}/{k}"] = (logical, state0[k].dtype)
                if whole_momentum:
                    if block is not None:
                        raise CheckpointError(
                            f"{self.path}: {name}: DeepSpeed's Muon momentum of a tensor-parallel block is not read"
                        )
                    key = (*state_keys, "state", state_index, "momentum_buffer")
                    first = spans[0][0]  # every rank whose partition it touches holds it whole: the first one's
                    self._piece(tensors, f"optim/{name}/momentum_buffer", optim_files[first], key, momentum_at[first],
                                FlatSlice(0, n))  # fmt: skip
                    for r, _, _ in spans:
                        momentum_at[r] += n
                    self._optim_shapes[f"optim/{name}/momentum_buffer"] = (logical, state0["momentum_buffer"].dtype)
                if mp_rank > 0:
                    continue
                for k, (keys, dtype, number) in scalar.items():
                    self._piece(
                        tensors, f"optim/{name}/{k}", optim_files[0], (*state_keys, *keys), 0, FlatSlice(0, 1), number
                    )
                    self._optim_shapes[f"optim/{name}/{k}"] = ((), dtype)
            if stage == 3:
                have, used = lengths[0], offset
                mismatch = any(n != offset for n in lengths)
            else:  # the end of the group is padded to a multiple of 2N (zero_to_fp32 checks the same)
                align = 2 * world
                have, used = sum(lengths), offset
                mismatch = -(-have // align) != -(-used // align)
            if mismatch:
                raise CheckpointError(
                    f"{self.path}: param group {g}: the parameters need {have} elements, the saved partitions hold "
                    f"{used}; the checkpoint is damaged or of a layout this reader does not know"
                )
        return stage, world

    def _whole_momentum(
        self, group: dict, optim_files: list[str], state_keys: tuple, state_index: int, lengths: list[int]
    ) -> bool:
        """[Note: DeepSpeed's Muon momentum at ZeRO 1-2]
        DeepSpeed 0.19.8's Muon at ZeRO 1-2 orthogonalizes each parameter whole while it flattens the gradient
        partition (``get_flat_partition``), so a rank's ``momentum_buffer`` (the state of its flat fp32 partition of a
        ``use_muon`` group) is not the partition's size: it is the whole momentum of every parameter that touches the
        rank's partition, in the group's order, unpadded (``_muon_momentum_buffer``). A parameter that straddles two
        partitions is held whole by both ranks (the same values: both stepped it on the same gradient); the reader
        takes the first rank's. Detected by the size, per group: a buffer the partition's size is partitioned, as
        at ZeRO 3, where DeepSpeed keeps each parameter's ``partition_numel`` slice of the momentum at its place in
        the fp32 partition (``_muon_update_sub_group``; tests/compat/test_deepspeed_muon.py reads one)."""
        if not group.get("use_muon"):
            return False
        for f, length in zip(optim_files, lengths):
            states = _dig(self._file(f), (*state_keys, "state"), str(self.path / f))
            buffer = states.get(state_index, {}).get("momentum_buffer")
            if torch.is_tensor(buffer) and buffer.numel() != length:
                return True
        return False

    def _expert_pieces(
        self, g, group_shapes, optim_files, partitions, masters, state_keys, base, paddings, out
    ) -> None:
        """The pieces of the experts' param group ``g`` of a DeepSpeed AutoEP checkpoint at ZeRO stage 1-2: rank
        ``r``'s part is partition ``r // E`` of expert group ``r % E``'s flat group, each local expert tensor a
        slice of transformers' fused tensor ([Note: DeepSpeed AutoEP checkpoints])."""
        tensors, shapes, dtypes, groups, kinds = out
        ep, world = self._autoep.ep, len(optim_files)
        where = str(self.path / optim_files[0])
        if not isinstance(partitions, int) or partitions * ep != world:
            raise CheckpointError(
                f"{where}: the experts' param group {g} is partitioned over {partitions} ranks, but {world} ranks "
                f"with ep_size {ep} hold {world // ep} copies of each expert; the checkpoint is damaged"
            )
        saved = base["param_groups"][g]
        state_index = saved["params"][0]
        state0 = base["state"].get(state_index, {})
        elementwise = {k for k, v in state0.items() if torch.is_tensor(v) and v.dim() > 0}
        scalar = _scalar_states(state0, saved, state_index, g)
        kinds.update({k: "elementwise" for k in elementwise} | {k: "scalar" for k in scalar})
        fused: list[str] = []
        found: dict[str, dict[str, tuple[int, ...]]] = {}
        dtype = self._tensor(_Source(optim_files[0], (*masters, g), 0)).dtype
        for e in range(ep):
            files = [optim_files[e + k * ep] for k in range(partitions)]  # expert group e's partitions, in order
            lengths = [self._tensor(_Source(f, (*masters, g), 0)).numel() for f in files]
            starts = [sum(lengths[:r]) for r in range(partitions)]
            offset = 0
            for i, (name, shape) in enumerate(group_shapes.items()):
                shape = tuple(shape)
                n = math.prod(shape)
                x = self._autoep.expert(name, shape)
                prefix, _, which = name.rpartition(".")
                found.setdefault(prefix, {})[which] = shape
                if x.name not in shapes:
                    fused.append(x.name)
                    shapes[x.name], dtypes[x.name] = x.global_shape, dtype
                    for k in elementwise:
                        self._optim_shapes[f"optim/{x.name}/{k}"] = (x.global_shape, state0[k].dtype)
                    for k, (keys, kdtype, number) in scalar.items():
                        self._piece(tensors, f"optim/{x.name}/{k}", optim_files[0], (*state_keys, *keys), 0,
                                    FlatSlice(0, 1), number)  # fmt: skip
                        self._optim_shapes[f"optim/{x.name}/{k}"] = ((), kdtype)
                for r in range(partitions):
                    lo, hi = max(offset, starts[r]), min(offset + n, starts[r] + lengths[r])
                    if hi <= lo:
                        continue
                    piece, at = x.slice(e, lo - offset, hi - lo), lo - starts[r]
                    self._piece(tensors, f"model/{x.name}", files[r], (*masters, g), at, piece)
                    for k in elementwise:
                        self._piece(tensors, f"optim/{x.name}/{k}", files[r], (*state_keys, "state", state_index, k),
                                    at, piece)  # fmt: skip
                offset += n + (paddings[g][i] if paddings is not None else 0)
            have, align = sum(lengths), 2 * partitions
            if -(-have // align) != -(-offset // align):
                raise CheckpointError(
                    f"{self.path}: the experts' param group {g} of expert group {e}: the parameters need {offset} "
                    f"elements, the saved partitions hold {have}; the checkpoint is damaged"
                )
        check_expert_shapes(found, where)
        groups.append({**_hyperparameters(saved), "params": fused})

    def _tp_blocks(self, main: dict, mp_rank: int) -> dict[str, tuple[BlockSlice | None, tuple[int, ...]]]:
        """[Note: DeepSpeed tensor parallelism]
        AutoTP records, in the model-states file's ``universal_checkpoint_info``, an ``affine_map``: per parameter
        (a regex of its name) the logical shape and, per tensor-parallel rank, the boxes of the logical tensor its
        shard holds. A shard that is one box, block ``i`` of ``n`` equal blocks along one dimension, becomes a
        ``BlockSlice``; a shard equal to the whole tensor is replicated. Anything else (fused sub-parameters,
        padded vocabularies, several boxes) is refused, naming the parameter. ``main``: the model-states file of
        tensor-parallel rank ``mp_rank``."""
        info = main.get("universal_checkpoint_info") or {}
        amap = (info.get("affine_map") or {}).get("params") if isinstance(info, dict) else None
        where = str(self.path)
        if not isinstance(amap, dict):
            raise CheckpointError(
                f"{where}: a DeepSpeed checkpoint with tensor parallelism (mp_rank_XX files) that records no "
                "'affine_map' of how each parameter was split (written by Megatron-DeepSpeed or an older "
                "DeepSpeed); convert it with DeepSpeed's ds_to_universal first"
            )
        patterns = [(re.compile(k), v) for k, v in amap.items()]
        # every parameter's shard shape: the optimizer's (param_shapes; stage 0 saves none), the frozen ones'
        # (frozen_param_shapes, stages 2-3), and the module's (stages 0-1 hold every shard whole there; at stage 3
        # its entries are empty placeholders). Tied aliases are not parameters of their own.
        local_shapes: dict[str, tuple[int, ...]] = {}
        for group in main.get("param_shapes") or []:
            local_shapes.update((name, tuple(shape)) for name, shape in group.items())
        local_shapes.update((n, tuple(s)) for n, s in (main.get("frozen_param_shapes") or {}).items())
        skip = set(main.get("buffer_names") or ()) | set(main.get("shared_params") or {})
        seen: set[tuple] = set()
        for name, t in (main.get("module") or {}).items():
            if name in skip or not torch.is_tensor(t) or t.numel() == 0:
                continue
            ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
            if ident not in seen and name not in local_shapes:  # a second name of the same tensor: tied (stage 0)
                local_shapes[name] = tuple(t.shape)
            seen.add(ident)
        out: dict[str, tuple[BlockSlice | None, tuple[int, ...]]] = {}
        for name, local in local_shapes.items():
            entry = next((v for pat, v in patterns if pat.fullmatch(name)), None)
            if entry is None:
                raise CheckpointError(f"{where}: the tensor-parallel map has no entry for parameter {name!r}")
            out[name] = _block_of(name, entry, mp_rank, local, where)
        return out

    def _pipeline_pieces(
        self, stages: list[int], optim_files: dict[int, dict[int, str]], tensors, shapes, dtypes, groups, kinds
    ) -> tuple[int, int]:
        """[Note: DeepSpeed pipeline checkpoints]: each stage read as a checkpoint of its own parameters (rank 0's
        part, whole), its optimizer's param groups joined to the other stages' group by group."""
        stage, world = 0, int(self._file(self._model_name(0)).get("dp_world_size") or 1)
        for s in stages:
            stage_groups: list[dict] = []
            stage_main = self._file(self._model_name(s))
            if optim_files[s]:
                files = [optim_files[s][r] for r in sorted(optim_files[s])]
                # a tied module's copy on a later stage: the first stage's pieces (kept equal by DeepSpeed)
                stage, world = self._zero_pieces(
                    stage_main, tensors, shapes, dtypes, stage_groups, kinds, 0, files, known=set(shapes)
                )
            else:
                self._stage0_pieces(stage_main, tensors, shapes, dtypes, stage_groups, kinds, file=self._model_name(s))
            for g, group in enumerate(stage_groups):
                if g == len(groups):
                    groups.append({**group, "params": []})
                groups[g]["params"] += [n for n in group["params"] if n not in groups[g]["params"]]
        return stage, world

    def _model_name(self, mp_rank: int, dp_rank: int = 0) -> str:
        """The model-states file of a tensor-parallel rank: one per data-parallel rank at stage 3
        (``zero_pp_rank_<dp>_mp_rank_<tp>``), one per tensor-parallel rank otherwise (``mp_rank_<tp>``)."""
        if self._z3_names:
            return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_model_states.pt"
        return f"mp_rank_{mp_rank:02d}_model_states.pt"

    def _stage0_pieces(
        self, main, tensors, shapes, dtypes, groups, kinds, mp_rank: int = 0, blocks=None, file: str | None = None
    ) -> dict[str, str]:
        """Stage 0: weights from ``module``; the optimizer's parameters matched to the module's in order (no names
        are saved). Returns the tied pairs found (alias -> name), which stage 0 does not record either.

        [Note: DeepSpeed stage 0 with TP]
        With AutoTP every tensor-parallel rank writes a whole stage-0 file of its own (``mp_rank_<tp>``, written by
        its first data-parallel rank): ``module`` holds its shards, ``optimizer`` the optimizer over them (and the
        fp32 masters of a bf16/fp16 run), in the same parameter order on every rank. ``main`` is rank
        ``mp_rank``'s file and ``blocks`` its blocks ([Note: DeepSpeed tensor parallelism]): a split parameter and
        its element-wise states are one ``BlockSlice`` piece per rank; replicated ones, scalar states and the
        param groups are read from rank 0."""
        blocks = blocks or {}
        file = file or self._model_name(mp_rank)  # given: a pipeline stage's ([Note: DeepSpeed pipeline checkpoints])
        where = str(self.path / file)
        module = main["module"]
        if not isinstance(module, dict):
            raise CheckpointError(f"{where}: 'module' is a {type(module).__name__}, not a state dict")
        buffers = set(main.get("buffer_names") or ())
        shared: dict[str, str] = {}
        params: list[str] = []
        seen: dict[tuple, str] = {}
        for name, t in module.items():
            if name in buffers or not torch.is_tensor(t):
                continue
            ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
            if ident in seen and t.numel() > 0:
                shared[name] = seen[ident]
                continue
            seen[ident] = name
            params.append(name)
        opt = main.get("optimizer")
        if opt is None or (mp_rank > 0 and not groups):  # rank 0 offered no optimizer state: neither do the others
            return shared
        if "optimizer_state_dict" in opt:  # bf16 / fp16 wrapper: fp32 masters beside the torch state dict
            inner = opt["optimizer_state_dict"]
            prefix: tuple = ("optimizer", "optimizer_state_dict")
        else:
            inner, prefix = opt, ("optimizer",)
        saved_groups = inner["param_groups"]
        ids = [i for g in saved_groups for i in g["params"]]
        name_of = _match_in_order(ids, params, self._stage0_shapes(opt, inner, saved_groups), module)
        if name_of is None and mp_rank > 0:
            raise CheckpointError(
                f"{where}: the optimizer's parameters of tensor-parallel rank {mp_rank} cannot be matched to its "
                "module's as rank 0's were; the checkpoint is damaged or of a layout this reader does not know"
            )
        if name_of is None:  # the match is not unique: the weights still load, the optimizer state does not
            warnings.warn(
                f"{where}: a ZeRO stage 0 checkpoint's optimizer holds {len(ids)} of the model's {len(params)} "
                "parameters and saves no names; which ones cannot be told from their shapes, so its optimizer "
                "state is not offered (load with load_optimizer_states=False)",
                stacklevel=2,
            )
            return shared
        for g, group in enumerate(saved_groups):
            if mp_rank == 0:
                groups.append({**_hyperparameters(group), "params": [name_of[i] for i in group["params"]]})
            counter = _fused_adam_counter(inner["state"], group)
            flat_offset = 0
            for j, i in enumerate(group["params"]):
                name = name_of[i]
                value = module[name]
                shape, n = tuple(value.shape), value.numel()
                block, logical = blocks.get(name, (None, shape))
                at, flat_offset = flat_offset, flat_offset + n
                if mp_rank > 0 and block is None:  # replicated over tensor parallelism: rank 0's copy
                    continue
                whole = block if block is not None else FlatSlice(0, n)
                shapes[name] = logical
                if "fp32_groups" in opt:  # one fp32 master per parameter
                    master = opt["fp32_groups"][g][j]
                    if tuple(master.shape) != shape:
                        raise CheckpointError(
                            f"{where}: the optimizer's parameter {i} has shape {tuple(master.shape)}, the model's "
                            f"{name!r} {shape}; load it with load_optimizer_states=False"
                        )
                    self._piece(tensors, f"model/{name}", file, ("optimizer", "fp32_groups", g, j), 0, whole)
                    dtypes[name] = master.dtype
                elif "fp32_groups_flat" in opt:
                    self._piece(tensors, f"model/{name}", file, ("optimizer", "fp32_groups_flat", g), at, whole)
                    dtypes[name] = opt["fp32_groups_flat"][g].dtype
                else:
                    self._piece(tensors, f"model/{name}", file, ("module", name), 0, whole)
                    dtypes[name] = value.dtype
                param_state = inner["state"].get(i, {})
                for k, v in param_state.items():
                    if not torch.is_tensor(v) or v.dim() == 0:
                        continue
                    kinds[k] = "elementwise"
                    self._piece(tensors, f"optim/{name}/{k}", file, (*prefix, "state", i, k), 0, whole)
                    self._optim_shapes[f"optim/{name}/{k}"] = (logical, v.dtype)
                if mp_rank > 0:  # scalars: rank 0's
                    continue
                for k, (keys, dtype, number) in _scalar_states(param_state, group, i, g).items():
                    if k == "step" and counter is not None:
                        keys = ("state", counter, "step")
                    kinds[k] = "scalar"
                    self._piece(tensors, f"optim/{name}/{k}", file, (*prefix, *keys), 0, FlatSlice(0, 1), number)
                    self._optim_shapes[f"optim/{name}/{k}"] = ((), dtype)
        return shared

    @staticmethod
    def _stage0_shapes(opt: dict, inner: dict, saved_groups: list) -> dict[int, tuple[int, ...] | None]:
        """The shape of each optimizer parameter where the checkpoint shows it (its fp32 master or an element-wise
        state), else None."""
        out: dict[int, tuple[int, ...] | None] = {}
        for g, group in enumerate(saved_groups):
            for j, i in enumerate(group["params"]):
                shape = None
                if "fp32_groups" in opt:
                    shape = tuple(opt["fp32_groups"][g][j].shape)
                else:
                    for v in inner["state"].get(i, {}).values():
                        if torch.is_tensor(v) and v.dim() > 0:
                            shape = tuple(v.shape)
                out[i] = shape
        return out

    def _make_objects(
        self, main: dict, groups: list, kinds: dict, stage: int, world: int, tp: int = 1, pp: int = 1
    ) -> dict[str, Any]:
        config = main.get("ds_config") if isinstance(main.get("ds_config"), dict) else {}
        gas = int(config.get("gradient_accumulation_steps") or 1) if isinstance(config, dict) else 1
        steps = int(main.get("global_steps", 0))
        objects: dict[str, Any] = {
            "engine/counters": {
                "global_step": steps,
                "micro_steps": steps * gas,
                "skipped_steps": int(main.get("skipped_steps", 0)),
                "global_samples": int(main.get("global_samples", 0)),
            },
            "engine/topology": {
                "world_size": world * tp * pp,
                "dp": world,
                "tp": tp,
                "pp": pp,
                "zero_stage": stage,
                "format": "deepspeed",
                "ds_version": str(main.get("ds_version")),
            },
            "engine/scheduler": main.get("lr_scheduler"),
            "engine/scaler": self._scaler(main, config),
            "client_state": {k: _detach(v) for k, v in main.items() if k not in DEEPSPEED_KEYS},
            "optimizer/param_groups": groups or None,  # None: no optimizer state to offer
            "optimizer/state_kinds": dict(sorted(kinds.items())),
        }
        if self._autoep is not None:  # [Note: DeepSpeed AutoEP checkpoints]
            objects["engine/topology"]["ep"] = self._autoep.ep
        for key, fname in (("hf/config", "config.json"), ("hf/generation_config", "generation_config.json")):
            for d in (self.path.parent, self.path):
                if (d / fname).is_file():
                    text = (d / fname).read_text(encoding="utf-8")
                    try:
                        json.loads(text)
                    except json.JSONDecodeError as err:
                        raise CheckpointError(f"{d / fname}: not valid JSON ({err})") from None
                    objects[key] = text
                    break
        return objects

    def _scaler(self, main: dict, config: dict) -> dict | None:
        """An fp16 run's loss scaler as our ``LossScaler.state_dict()``; None otherwise (bf16 and fp32 runs save a
        static scale of 1, which must not replace the scale of an fp16 engine)."""
        fp16 = config.get("fp16") if isinstance(config, dict) else None
        if not (isinstance(fp16, dict) and fp16.get("enabled")):
            return None
        if self.optim_files:
            s = self._file(self.optim_files[0])["optimizer_state_dict"].get("loss_scaler")
            state = vars(s) if isinstance(s, LossScalerState) else {}
        else:
            state = main.get("optimizer") or {}
        if "cur_scale" not in state:
            return None
        return loss_scaler_from_deepspeed(state)


def loss_scaler_from_deepspeed(state: dict) -> dict:
    """DeepSpeed's ``DynamicLossScaler`` attributes (or the engine's ``optimizer`` dict of a stage-0 fp16 run) as
    our ``LossScaler.state_dict()``: the scale, the hysteresis allowance left, and the clean steps since the last
    overflow (DeepSpeed keeps the step counter and the step of the last overflow, -1 before any; the difference
    less one is its "stable interval", which is what our count means)."""
    cur_iter, last = state.get("cur_iter", 0), state.get("last_overflow_iter", -1)
    return {
        "scale": float(state["cur_scale"]),
        "allowance": int(state.get("cur_hysteresis", state.get("delayed_shift", 1)) or 1),
        "clean_steps": max(0, int(cur_iter) - int(last if last is not None else -1) - 1),
    }


def _block_of(
    name: str, entry: dict, rank: int, local: tuple[int, ...], where: str
) -> tuple[BlockSlice | None, tuple[int, ...]]:
    """(the block rank ``rank`` holds, or None when its shard is the whole tensor; the logical shape) from one
    parameter's entry of an AutoTP affine map."""
    logical = tuple(entry["logical_shape"])
    ranks = entry["ranks"]
    mine = ranks.get(rank, ranks.get(str(rank)))
    refuse = f"{where}: parameter {name!r}: its tensor-parallel split"
    if mine is None:
        raise CheckpointError(f"{refuse} names no shard for rank {rank}")
    pieces = mine["pieces"]
    if len(pieces) != 1:
        raise CheckpointError(f"{refuse} is {len(pieces)} boxes (fused sub-parameters), which is not read here")
    piece = pieces[0]
    shape = tuple(piece["shape"])
    (src, src_strides), (dst, _) = piece["source"], piece["dest"]
    contiguous = [math.prod(logical[i + 1 :]) for i in range(len(logical))]
    if shape != local or dst != 0 or list(src_strides) != contiguous:
        raise CheckpointError(f"{refuse} is not one block of the tensor (box {shape} at {src}); not read here")
    if shape == logical:
        return None, logical
    dims = [i for i in range(len(logical)) if shape[i] != logical[i]]
    if len(dims) != 1 or logical[dims[0]] % shape[dims[0]] or src % (shape[dims[0]] * contiguous[dims[0]]):
        raise CheckpointError(f"{refuse} (box {shape} at {src} of {logical}) is not one of equal blocks")
    d = dims[0]
    return BlockSlice(d, src // (shape[d] * contiguous[d]), logical[d] // shape[d]), logical


def _within(block: BlockSlice | None, where: FlatSlice) -> Slice:
    """``where``, a flat range of a tensor-parallel rank's shard, as a slice of the logical tensor: the same range
    of block ``block`` (None: the shard is the whole tensor)."""
    return where if block is None else BlockFlatSlice(block, where.start, where.length)


def _match_in_order(
    ids: list[int], params: list[str], shapes: dict[int, tuple[int, ...] | None], module: dict
) -> dict[int, str] | None:
    """Pair the optimizer's parameters (in order) with a subsequence of the module's parameters of the same shapes;
    None unless exactly one such pairing exists (the leftmost and the rightmost pairings agree)."""
    if len(ids) == len(params):
        ok = all(shapes[i] is None or shapes[i] == tuple(module[n].shape) for i, n in zip(ids, params))
        return dict(zip(ids, params)) if ok else None
    if any(shapes[i] is None for i in ids):
        return None

    def greedy(order_ids: list[int], order_params: list[str]) -> list[str] | None:
        out, k = [], 0
        for i in order_ids:
            while k < len(order_params) and tuple(module[order_params[k]].shape) != shapes[i]:
                k += 1
            if k == len(order_params):
                return None
            out.append(order_params[k])
            k += 1
        return out

    left = greedy(ids, params)
    right = greedy(ids[::-1], params[::-1])
    if left is None or right is None or left != right[::-1]:
        return None
    return dict(zip(ids, left))


def _is_count(v: Any) -> bool:
    """A step count saved as a Python (or numpy) number, not a bool."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _hyperparameters(group: dict) -> dict:
    """A saved param group's hyperparameters: FusedAdam's group ``step`` is a step count, read as a state
    ([Note: DeepSpeed's step counts])."""
    return {k: v for k, v in group.items() if k not in ("params", "step")}


def _scalar_states(state: dict, group: dict, index: int, g: int) -> dict[str, tuple[tuple, torch.dtype, bool]]:
    """The scalar optimizer states of saved parameter ``index`` of param group ``g``: key -> (the keys leading to
    it from the optimizer state dict, its dtype as read, whether it is a Python number). See [Note: DeepSpeed's
    step counts]."""
    out: dict[str, tuple[tuple, torch.dtype, bool]] = {}
    for k, v in state.items():
        if torch.is_tensor(v) and v.dim() == 0:
            out[k] = (("state", index, k), v.dtype, False)
        elif k == "step" and _is_count(v):
            out[k] = (("state", index, k), torch.float32, True)
    moments = any(torch.is_tensor(v) and v.dim() > 0 for v in state.values())
    count = group.get("step")
    if "step" not in out and moments and _is_count(count) and count > 0:  # FusedAdam before DeepSpeed 0.9
        out["step"] = (("param_groups", g, "step"), torch.float32, True)
    return out


def _fused_adam_counter(state: dict, group: dict) -> int | None:
    """Stage 0 with FusedAdam (whose param groups have a ``step``, and whose per-parameter steps are numbers): the
    saved parameter whose ``step`` is the group's count, else None. FusedAdam updates every parameter of a group
    with one count, that of the last parameter it visits, and increments only that one's ``state['step']``; the
    others keep the count they started with. The largest is the count every parameter was stepped with
    ([Note: DeepSpeed's step counts])."""
    if not _is_count(group.get("step")):
        return None
    counts = {i: state[i]["step"] for i in group["params"] if _is_count(state.get(i, {}).get("step"))}
    return max(counts, key=counts.__getitem__) if counts else None


def _detach(v: Any) -> Any:
    """A client-state value with its tensors copied out of the memory-mapped file."""
    if torch.is_tensor(v):
        return v.clone()
    if isinstance(v, dict):
        return {k: _detach(x) for k, x in v.items()}
    if type(v) in (list, tuple):
        return type(v)(_detach(x) for x in v)
    return v
