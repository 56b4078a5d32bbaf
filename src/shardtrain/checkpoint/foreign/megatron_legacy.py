"""Read a legacy Megatron-LM checkpoint (``--ckpt-format torch``) through the interface of
:class:`~shardtrain.checkpoint.reader.CheckpointReader`, under the Hugging Face Llama model's names, as
``megatron_reader.py`` reads ``torch_dist`` ones.

[Note: legacy Megatron checkpoints]
Megatron-LM's ``save_checkpoint`` with ``--ckpt-format torch`` writes, per tensor- and pipeline-parallel rank (data
rank 0 only), ``iter_<7 digits>/mp_rank_<tp:02d>[_<pp:03d>]/model_optim_rng.pt``: ``torch.save`` of ``args``,
``iteration``, the rank's ``model`` state dict (its own blocks: local shapes, layers numbered from 0 on every pipeline
stage), the optimizer's ``state_dict()`` and RNG states. A tensor of the whole model is stitched from its tp ranks:
column-parallel ones (``linear_qkv``, the vocabulary of ``word_embeddings`` and ``output_layer``) along rows, each
rank's fused QKV holding its own query groups whole, so rank order is group order; row-parallel ones
(``linear_proj``, ``linear_fc2``) along columns; the SwiGLU ``linear_fc1`` of rank r is [gate_r; up_r], so the
whole tensor is [gate_0 .. gate_n; up_0 .. up_n] (the ``torch_dist`` layout of [Note: Megatron tensor layout]); norms
are replicated (rank 0's is read). Pipeline stage p's local layer i is layer ``p * layers / pp + i`` (uniform
stages; Megatron-LM's uneven splits are refused by name). The stitched tensors get ``torch_dist``'s names, and
``megatron_names.py`` maps them as for a ``torch_dist`` checkpoint.
The optimizer's state is indexed by position: its param groups list positions, and megatron fills each group from
``named_parameters()`` in order (its default rule: 1-D tensors and biases in the group with ``wd_mult`` 0), so a
position is matched to a model tensor by that rule and checked by shape. Files are read by
``torch.load(weights_only=True, mmap=True)``: nothing runs, and a tensor's bytes are read when it is stitched, one
whole-model tensor at a time.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from shardtrain.checkpoint.foreign.megatron_architecture import Architecture
from shardtrain.checkpoint.foreign.megatron_format import (
    LEGACY_RANK_DIR,
    LEGACY_RANK_FILE,
    OPTIMIZER_STATE,
    RNG_STATE_NAMES,
    MegatronSource,
    load_megatron_pickle,
)
from shardtrain.checkpoint.foreign.megatron_names import MegatronManifest, hf_entries
from shardtrain.checkpoint.foreign.megatron_optimizer import optimizer_entries
from shardtrain.checkpoint.foreign.megatron_reader import MegatronReader
from shardtrain.checkpoint.format import dtype_name
from shardtrain.errors import CheckpointError

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
# Megatron-LM arguments that make pipeline stages uneven (layer offsets this reader does not compute)
_UNEVEN_STAGES = (
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "num_layers_per_virtual_pipeline_stage",
    "num_virtual_stages_per_pipeline_rank",
    "pipeline_model_parallel_layout",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
)


def split_of(key: str) -> str:
    """How a Megatron tensor is split over tensor-parallel ranks ([Note: legacy Megatron checkpoints])."""
    if key.endswith(("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")):
        return "rows"
    if key.endswith("linear_fc1.weight"):
        return "swiglu"
    if key.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "columns"
    if key.endswith(("layernorm.weight", "layer_norm_weight")):
        return "replicated"
    raise CheckpointError(f"Megatron tensor {key!r}: no known tensor-parallel split (a Llama-style GPT has none such)")


def _stitched_shape(split: str, shapes: list[tuple[int, ...]], key: str) -> tuple[int, ...]:
    first = shapes[0]
    if split == "replicated":
        return first
    dim = 1 if split == "columns" else 0
    if any(len(s) != len(first) or s[:dim] + s[dim + 1 :] != first[:dim] + first[dim + 1 :] for s in shapes):
        raise CheckpointError(
            f"Megatron tensor {key!r}: its tensor-parallel shards have shapes {shapes}, not one split"
        )
    return first[:dim] + (sum(s[dim] for s in shapes),) + first[dim + 1 :]


def stitch(split: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The whole tensor from its tensor-parallel shards, in rank order ([Note: legacy Megatron checkpoints])."""
    if split == "replicated":
        return shards[0].clone()
    if split == "columns":
        return torch.cat(shards, dim=1)
    if split == "swiglu":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=0)


class LegacyMegatronReader(MegatronReader):
    """Reads the model tensors (and the plain optimizer's state) of one legacy Megatron-LM iteration directory."""

    format_name = "Megatron-LM legacy (mp_rank_*)"

    def __init__(self, path: Path) -> None:  # deliberately not MegatronReader's: no DCP metadata here
        self.path = Path(path)
        self.verify_reads = False  # the files store no checksums
        self._files = self._rank_files()
        self._loaded = {
            rank: load_megatron_pickle(f, "checkpoint", inert=RNG_STATE_NAMES, mmap=True)
            for rank, f in self._files.items()
        }
        first = self._loaded[(0, 0)]
        args = first.get("args")
        if args is None:
            raise CheckpointError(f"{self._files[(0, 0)]}: holds no 'args'; the model's shape cannot be known")
        self.arch = Architecture.from_args(args, self.path)
        self.tp, self.pp = self._grid(vars(args))
        self.common = {"iteration": first.get("iteration")}
        self._where: dict[str, tuple[str, int, str | None]] = {}  # global key -> (local key, stage, state kind)
        sources = self._model_sources()
        tensors = hf_entries(sources, self.arch, self.path)
        step = self._optimizer_sources(sources)
        tensors |= optimizer_entries(tensors, sources, step)
        self._sources: dict[str, MegatronSource] = sources
        self.manifest = MegatronManifest(self.path.name, self.tp * self.pp, tensors)
        self._objects: dict[str, Any] | None = None
        self._last: tuple[str, torch.Tensor] | None = None  # the last stitched tensor: q, k and v read one in turn

    # -- the files --------------------------------------------------------------------------------
    def _rank_files(self) -> dict[tuple[int, int], Path]:
        files = {}
        for d in sorted(self.path.iterdir()):
            m = LEGACY_RANK_DIR.fullmatch(d.name)
            if m is None:
                continue
            if m.group(3) is not None:
                raise CheckpointError(
                    f"{d}: a legacy Megatron checkpoint with expert parallelism; shardtrain reads legacy "
                    "checkpoints of dense models (MoE models: save with --ckpt-format torch_dist)"
                )
            if not (d / LEGACY_RANK_FILE).is_file():
                raise CheckpointError(f"{d / LEGACY_RANK_FILE}: missing; every rank directory holds one")
            files[(int(m.group(1)), int(m.group(2) or 0))] = d / LEGACY_RANK_FILE
        return files

    def _grid(self, args: dict[str, Any]) -> tuple[int, int]:
        tp = int(args.get("tensor_model_parallel_size") or 1)
        pp = int(args.get("pipeline_model_parallel_size") or 1)
        if uneven := [name for name in _UNEVEN_STAGES if args.get(name)]:
            raise CheckpointError(
                f"{self.path}: pipeline stages set by {uneven}; shardtrain reads legacy checkpoints with "
                "even stages (layers / pipeline_model_parallel_size each)"
            )
        if self.arch.layers % pp:
            raise CheckpointError(f"{self.path}: {self.arch.layers} layers do not split into {pp} even stages")
        expected = {(t, p) for t in range(tp) for p in range(pp)}
        if missing := sorted(expected - set(self._files)):
            names = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") for t, p in missing]
            raise CheckpointError(f"{self.path}: rank directories {names} missing for tp {tp} x pp {pp}")
        if extra := sorted(set(self._files) - expected):
            raise CheckpointError(f"{self.path}: rank directories {extra} beyond tp {tp} x pp {pp} of its args")
        return tp, pp

    def _model(self, tp_rank: int, stage: int) -> dict[str, Any]:
        model = self._loaded[(tp_rank, stage)].get("model")
        if not isinstance(model, dict):
            raise CheckpointError(f"{self._files[(tp_rank, stage)]}: holds no 'model' state dict")
        return model

    def _global_key(self, key: str, stage: int) -> str:
        m = _LAYER.fullmatch(key)
        if m is None:
            return key
        return f"decoder.layers.{stage * (self.arch.layers // self.pp) + int(m.group(1))}.{m.group(2)}"

    def _model_sources(self) -> dict[str, MegatronSource]:
        sources = {}
        for stage in range(self.pp):
            for key, value in self._model(0, stage).items():
                if key.endswith("_extra_state") or not isinstance(value, torch.Tensor):
                    continue
                shards = [self._model(t, stage).get(key) for t in range(self.tp)]
                if not all(isinstance(s, torch.Tensor) for s in shards):
                    raise CheckpointError(f"{self.path}: tensor {key!r} of stage {stage} missing on some tp rank")
                split = split_of(key)
                shape = _stitched_shape(split, [tuple(s.shape) for s in shards], key)
                name = self._global_key(key, stage)
                if name in sources:
                    raise CheckpointError(f"{self.path}: {name!r} is held by more than one pipeline stage")
                sources[name] = MegatronSource(name, shape, _dtype(value, key), ())
                self._where[name] = (key, stage, None)
        return sources

    # -- the optimizer ----------------------------------------------------------------------------
    def _optimizer_sources(self, sources: dict[str, MegatronSource]) -> float | None:
        """``optimizer.state.<kind>.<global key>`` for the plain optimizer's state ([Note: legacy Megatron
        checkpoints]); its step count (one for all), or None without optimizer state."""
        steps: set[float] = set()
        groups = self._groups = None
        for (t, p), data in sorted(self._loaded.items()):
            saved = data.get("optimizer")
            if isinstance(saved, dict) and "fp32_from_fp16_params" in saved:  # a bf16/fp16 run: masters not read
                saved = saved.get("optimizer")
            if not (isinstance(saved, dict) and isinstance(saved.get("state"), dict) and saved["state"]):
                return None  # none saved, or the distributed optimizer's (in distrib_optim.pt): not read
            groups = saved.get("param_groups")
            by_position = self._positions(saved, t, p)
            for position, state in saved["state"].items():
                key = by_position[position]
                name = self._global_key(key, p)
                for kind, value in state.items():
                    if kind == "step":
                        steps.add(float(value))
                        continue
                    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(self._model(t, p)[key].shape):
                        raise CheckpointError(
                            f"{self._files[(t, p)]}: optimizer state {kind!r} of position {position} does not "
                            f"have the shape of {key!r}, the tensor megatron's grouping puts there"
                        )
                    state_key = f"{OPTIMIZER_STATE}{kind}.{name}"
                    if t == 0:
                        sources[state_key] = MegatronSource(state_key, sources[name].global_shape, "float32", ())
                        self._where[state_key] = (key, p, kind)
        if len(steps) > 1:
            raise CheckpointError(f"{self.path}: the optimizer's step counts differ ({sorted(steps)})")
        self._groups = groups
        return steps.pop() if steps else None

    def _positions(self, saved: dict[str, Any], t: int, p: int) -> dict[int, str]:
        """Position -> local model key, by megatron's default grouping ([Note: legacy Megatron checkpoints])."""
        model = self._model(t, p)
        names = [k for k, v in model.items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")]
        out = {}
        for group in saved.get("param_groups") or []:
            no_decay = group.get("wd_mult", 1.0) == 0.0
            mine = [n for n in names if (model[n].dim() == 1 or n.endswith(".bias")) == no_decay]
            if len(mine) != len(group.get("params", ())):
                raise CheckpointError(
                    f"{self._files[(t, p)]}: a param group of {len(group.get('params', ()))} parameters, where "
                    f"megatron's default grouping gives {len(mine)}; other groupings are not read (load with "
                    "load_optimizer_states=False)"
                )
            out.update(zip(group["params"], mine))
        if missing := set(saved["state"]) - set(out):
            raise CheckpointError(
                f"{self._files[(t, p)]}: optimizer state for positions {sorted(missing)[:5]} that no param group lists"
            )
        return out

    # -- reading ----------------------------------------------------------------------------------
    def _read_source(self, key: str, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        if self._last is None or self._last[0] != key:
            self._last = (key, self._stitch(key))
        return self._last[1].reshape(-1)[lo:hi].to(dtype)

    def _stitch(self, key: str) -> torch.Tensor:
        local, stage, kind = self._where[key]
        shards = []
        for t in range(self.tp):
            if kind is None:
                shards.append(self._model(t, stage)[local])
                continue
            saved = self._loaded[(t, stage)]["optimizer"]
            saved = saved.get("optimizer", saved) if "fp32_from_fp16_params" in saved else saved
            position = {v: k for k, v in self._positions(saved, t, stage).items()}[local]
            shards.append(saved["state"][position][kind])
        try:
            whole = stitch(split_of(local), shards)
        except RuntimeError as err:  # a truncated mmapped file fails here, when its bytes are first touched
            raise CheckpointError(f"cannot read tensor {key!r} ({err}); the file is damaged or truncated") from None
        if tuple(whole.shape) != self._sources[key].global_shape:
            raise CheckpointError(f"{key!r}: stitched to {tuple(whole.shape)}, not {self._sources[key].global_shape}")
        return whole

    def verify(self, progress: Any = None) -> list[str]:
        """Stitch every Megatron tensor once; one message per problem (empty: all good)."""
        problems = []
        for key, src in self._sources.items():
            try:
                self._stitch(key)
            except CheckpointError as err:
                problems.append(str(err))
            if progress is not None:
                progress(torch.Size(src.global_shape).numel() * 4)
        return problems


def _dtype(value: torch.Tensor, key: str) -> str:
    try:
        return dtype_name(value.dtype)
    except CheckpointError:
        raise CheckpointError(
            f"Megatron tensor {key!r} has dtype {value.dtype}, which shardtrain cannot load"
        ) from None
