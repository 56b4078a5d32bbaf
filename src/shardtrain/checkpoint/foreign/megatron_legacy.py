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
With expert parallelism the directory gains ``_<ep:03d>`` (``mp_rank_<tp:02d>_<ep:03d>`` at pp 1, which the args
tell apart from a pipeline rank): expert rank z holds its ``experts / ep`` local experts
(``mlp.experts.local_experts.<i>``), global expert ``z * experts / ep + i``; every other tensor is the same on each
expert rank (rank 0's is read).
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
_LOCAL_EXPERT = re.compile(r"(.*\.mlp\.experts\.local_experts\.)(\d+)(\..+)")
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
    if key.endswith(("layernorm.weight", "layer_norm_weight", "mlp.router.weight")):
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
        numbered = self._rank_files()
        loaded = {
            numbers: load_megatron_pickle(f, "checkpoint", inert=RNG_STATE_NAMES, mmap=True)
            for numbers, f in numbered.items()
        }
        first_file = numbered[min(numbered)]
        args = loaded[min(numbered)].get("args")
        if args is None:
            raise CheckpointError(f"{first_file}: holds no 'args'; the model's shape cannot be known")
        self.arch = Architecture.from_args(args, self.path)
        ranks = self._ranks(vars(args), list(numbered))
        self._files = {ranks[n]: f for n, f in numbered.items()}
        self._loaded = {ranks[n]: d for n, d in loaded.items()}
        self.tp, self.pp, self.ep = self._grid(vars(args))
        first = self._loaded[(0, 0, 0)]
        self.common = {"iteration": first.get("iteration")}
        self._where: dict[str, tuple[str, int, int, str | None]] = {}  # key -> (local key, stage, expert rank, state)
        sources = self._model_sources()
        tensors = hf_entries(sources, self.arch, self.path)
        step = self._optimizer_sources(sources)
        tensors |= optimizer_entries(tensors, sources, step)
        self._sources: dict[str, MegatronSource] = sources
        self.manifest = MegatronManifest(self.path.name, self.tp * self.pp * self.ep, tensors)
        self._objects: dict[str, Any] | None = None
        self._last: tuple[str, torch.Tensor] | None = None  # the last stitched tensor: q, k and v read one in turn

    # -- the files --------------------------------------------------------------------------------
    def _rank_files(self) -> dict[tuple[int, ...], Path]:
        """Each rank directory's file by the numbers of its name (what they mean: ``_ranks``)."""
        files = {}
        for d in sorted(self.path.iterdir()):
            m = LEGACY_RANK_DIR.fullmatch(d.name)
            if m is None:
                continue
            if not (d / LEGACY_RANK_FILE).is_file():
                raise CheckpointError(f"{d / LEGACY_RANK_FILE}: missing; every rank directory holds one")
            files[tuple(int(g) for g in m.groups() if g is not None)] = d / LEGACY_RANK_FILE
        if not files:
            raise CheckpointError(f"{self.path}: no mp_rank_* directory holding {LEGACY_RANK_FILE}")
        return files

    def _ranks(self, args: dict[str, Any], numbered: list[tuple[int, ...]]) -> dict[tuple[int, ...], tuple[int, ...]]:
        """(tp, pp, ep) rank of each directory's numbers: the second number is the pipeline rank at pp > 1, else
        the expert rank ([Note: legacy Megatron checkpoints])."""
        pp_named = int(args.get("pipeline_model_parallel_size") or 1) > 1
        ep_named = int(args.get("expert_model_parallel_size") or 1) > 1
        out = {}
        for numbers in numbered:
            if len(numbers) != 1 + pp_named + ep_named:
                raise CheckpointError(
                    f"{self.path}: rank directory {_dir_name(*numbers)} does not fit the args "
                    f"(pipeline_model_parallel_size > 1: {pp_named}, expert_model_parallel_size > 1: {ep_named})"
                )
            t, rest = numbers[0], list(numbers[1:])
            p = rest.pop(0) if pp_named else 0
            out[numbers] = (t, p, rest.pop(0) if ep_named else 0)
        return out

    def _grid(self, args: dict[str, Any]) -> tuple[int, int, int]:
        tp = int(args.get("tensor_model_parallel_size") or 1)
        pp = int(args.get("pipeline_model_parallel_size") or 1)
        ep = int(args.get("expert_model_parallel_size") or 1)
        if ep > 1 and (self.arch.experts or 0) % ep:
            raise CheckpointError(f"{self.path}: {self.arch.experts} experts do not split over {ep} expert ranks")
        if uneven := [name for name in _UNEVEN_STAGES if args.get(name)]:
            raise CheckpointError(
                f"{self.path}: pipeline stages set by {uneven}; shardtrain reads legacy checkpoints with "
                "even stages (layers / pipeline_model_parallel_size each)"
            )
        if self.arch.layers % pp:
            raise CheckpointError(f"{self.path}: {self.arch.layers} layers do not split into {pp} even stages")
        grid = f"tp {tp} x pp {pp}" + (f" x ep {ep}" if ep > 1 else "")
        expected = {(t, p, z) for t in range(tp) for p in range(pp) for z in range(ep)}
        if missing := sorted(expected - set(self._files)):
            names = [_dir_name(t, *([p] if pp > 1 else []), *([z] if ep > 1 else [])) for t, p, z in missing]
            raise CheckpointError(f"{self.path}: rank directories {names} missing for {grid}")
        if extra := sorted(set(self._files) - expected):
            raise CheckpointError(f"{self.path}: rank directories {extra} beyond {grid} of its args")
        return tp, pp, ep

    def _model(self, tp_rank: int, stage: int, expert_rank: int = 0) -> dict[str, Any]:
        model = self._loaded[(tp_rank, stage, expert_rank)].get("model")
        if not isinstance(model, dict):
            raise CheckpointError(f"{self._files[(tp_rank, stage, expert_rank)]}: holds no 'model' state dict")
        return model

    def _global_key(self, key: str, stage: int, expert_rank: int = 0) -> str:
        """Layer numbers offset by stage, local experts by expert rank ([Note: legacy Megatron checkpoints])."""
        if m := _LOCAL_EXPERT.fullmatch(key):
            key = f"{m.group(1)}{expert_rank * (self.arch.experts // self.ep) + int(m.group(2))}{m.group(3)}"
        m = _LAYER.fullmatch(key)
        if m is None:
            return key
        return f"decoder.layers.{stage * (self.arch.layers // self.pp) + int(m.group(1))}.{m.group(2)}"

    def _model_sources(self) -> dict[str, MegatronSource]:
        sources = {}
        for stage in range(self.pp):
            for z in range(self.ep):
                for key, value in self._model(0, stage, z).items():
                    if key.endswith("_extra_state") or not isinstance(value, torch.Tensor):
                        continue
                    if z > 0 and not _LOCAL_EXPERT.fullmatch(key):
                        continue  # the same on every expert rank: rank 0's is read
                    shards = [self._model(t, stage, z).get(key) for t in range(self.tp)]
                    if not all(isinstance(s, torch.Tensor) for s in shards):
                        raise CheckpointError(f"{self.path}: tensor {key!r} of stage {stage} missing on some tp rank")
                    split = split_of(key)
                    shape = _stitched_shape(split, [tuple(s.shape) for s in shards], key)
                    name = self._global_key(key, stage, z)
                    if name in sources:
                        raise CheckpointError(f"{self.path}: {name!r} is held by more than one pipeline/expert rank")
                    sources[name] = MegatronSource(name, shape, _dtype(value, key), ())
                    self._where[name] = (key, stage, z, None)
        return sources

    # -- the optimizer ----------------------------------------------------------------------------
    def _optimizer_sources(self, sources: dict[str, MegatronSource]) -> float | None:
        """``optimizer.state.<kind>.<global key>`` for the plain optimizer's state ([Note: legacy Megatron
        checkpoints]); its step count (one for all), or None without optimizer state."""
        steps: set[float] = set()
        groups = self._groups = None
        for (t, p, z), data in sorted(self._loaded.items()):
            saved = data.get("optimizer")
            if isinstance(saved, dict) and "fp32_from_fp16_params" in saved:  # a bf16/fp16 run: masters not read
                saved = saved.get("optimizer")
            if not (isinstance(saved, dict) and isinstance(saved.get("state"), dict) and saved["state"]):
                return None  # none saved, or the distributed optimizer's (in distrib_optim.pt): not read
            groups = saved.get("param_groups")
            by_position = self._positions(saved, t, p, z)
            for position, state in saved["state"].items():
                key = by_position[position]
                if z > 0 and not _LOCAL_EXPERT.fullmatch(key):
                    continue  # as the model's: rank 0's is read
                name = self._global_key(key, p, z)
                for kind, value in state.items():
                    if kind == "step":
                        steps.add(float(value))
                        continue
                    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(
                        self._model(t, p, z)[key].shape
                    ):
                        raise CheckpointError(
                            f"{self._files[(t, p, z)]}: optimizer state {kind!r} of position {position} does not "
                            f"have the shape of {key!r}, the tensor megatron's grouping puts there"
                        )
                    state_key = f"{OPTIMIZER_STATE}{kind}.{name}"
                    if t == 0:
                        sources[state_key] = MegatronSource(state_key, sources[name].global_shape, "float32", ())
                        self._where[state_key] = (key, p, z, kind)
        if len(steps) > 1:
            raise CheckpointError(f"{self.path}: the optimizer's step counts differ ({sorted(steps)})")
        self._groups = groups
        return steps.pop() if steps else None

    def _positions(self, saved: dict[str, Any], t: int, p: int, z: int = 0) -> dict[int, str]:
        """Position -> local model key, by megatron's default grouping ([Note: legacy Megatron checkpoints])."""
        model = self._model(t, p, z)
        names = [k for k, v in model.items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")]
        out = {}
        for group in saved.get("param_groups") or []:
            no_decay = group.get("wd_mult", 1.0) == 0.0
            mine = [n for n in names if (model[n].dim() == 1 or n.endswith(".bias")) == no_decay]
            if len(mine) != len(group.get("params", ())):
                raise CheckpointError(
                    f"{self._files[(t, p, z)]}: a param group of {len(group.get('params', ()))} parameters, where "
                    f"megatron's default grouping gives {len(mine)}; other groupings are not read (load with "
                    "load_optimizer_states=False)"
                )
            out.update(zip(group["params"], mine))
        if missing := set(saved["state"]) - set(out):
            raise CheckpointError(
                f"{self._files[(t, p, z)]}: optimizer state for positions {sorted(missing)[:5]} that no param "
                "group lists"
            )
        return out

    # -- reading ----------------------------------------------------------------------------------
    def _read_source(self, key: str, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        if self._last is None or self._last[0] != key:
            self._last = (key, self._stitch(key))
        return self._last[1].reshape(-1)[lo:hi].to(dtype)

    def _stitch(self, key: str) -> torch.Tensor:
        local, stage, z, kind = self._where[key]
        shards = []
        for t in range(self.tp):
            if kind is None:
                shards.append(self._model(t, stage, z)[local])
                continue
            saved = self._loaded[(t, stage, z)]["optimizer"]
            saved = saved.get("optimizer", saved) if "fp32_from_fp16_params" in saved else saved
            position = {v: k for k, v in self._positions(saved, t, stage, z).items()}[local]
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


def _dir_name(tp_rank: int, *more: int) -> str:
    """Megatron-LM's rank directory name: ``mp_rank_<tp:02d>`` then ``_<pp:03d>`` and ``_<ep:03d>`` where > 1."""
    return f"mp_rank_{tp_rank:02d}" + "".join(f"_{n:03d}" for n in more)


def _dtype(value: torch.Tensor, key: str) -> str:
    try:
        return dtype_name(value.dtype)
    except CheckpointError:
        raise CheckpointError(
            f"Megatron tensor {key!r} has dtype {value.dtype}, which shardtrain cannot load"
        ) from None
