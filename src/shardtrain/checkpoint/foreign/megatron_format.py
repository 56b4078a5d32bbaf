"""What a Megatron-Core ``torch_dist`` checkpoint holds, read without running code from it, and how its tensors map
onto a Hugging Face Llama (dense) or Mixtral (MoE) model's names.

[Note: Megatron torch_dist checkpoints]
Megatron-LM saves ``<save>/iter_<7 digits>/`` (and ``<save>/latest_checkpointed_iteration.txt``); the directory is a
torch DCP checkpoint (``.metadata``, ``__<rank>_<n>.distcp``) plus ``common.pt`` (``torch.save`` of what is not
sharded: ``args``, ``iteration``, ...) and ``metadata.json`` (``"sharded_backend": "torch_dist"``). Each tensor is
stored under its ``ShardedTensor`` key with its *global* shape, whatever tp x pp x ep wrote it:

* the layers of the decoder are one stacked tensor with a leading layer axis (``decoder.layers.<rest>``, layers
  numbered globally across pipeline stages), or one tensor per layer (``decoder.layers.<N>.<rest>``);
* the experts of an MoE layer add an expert axis after it (``mlp.experts.experts.linear_fc1.weight``: layers x
  experts x ...), numbered globally across expert-parallel ranks;
* the SwiGLU ``linear_fc1`` is stored as [gate; up] of the whole model (megatron's swiglu sharded factory splits
  each rank's [gate_r; up_r] into the two halves), so gate is its first half, up its second;
* the fused ``linear_qkv`` holds, per query group, that group's query heads, then its key head, then its value head
  (rows of ``head_dim``), groups in order;
* the input norm is ``self_attention.linear_qkv.layer_norm_weight`` and the pre-MLP norm
  ``mlp.linear_fc1.layer_norm_weight`` (TransformerEngine's fused names, which the local spec keeps), or
  ``input_layernorm.weight`` / ``pre_mlp_layernorm.weight`` (a separate norm module).

Each Hugging Face tensor is therefore a list of runs (contiguous element ranges) of one or more Megatron tensors
(:class:`MegatronTensorEntry`); reading one never reads more than the stacked layer slab it lies in. The model's
shape (heads, query groups, experts) comes from Megatron-LM's ``args`` in ``common.pt``, read through
``torch.load(weights_only=True)`` with inert stand-ins for ``argparse.Namespace`` and megatron's enums
(:func:`load_common`); the ``.metadata`` pickle through ``safe_pickle.py`` with DCP's classes plus the save plans
megatron caches in it (:func:`load_megatron_metadata`).
"""

from __future__ import annotations

import functools
import json
import pickle
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from shardtrain.checkpoint.foreign.dcp_format import METADATA_NAME, dcp_metadata_globals
from shardtrain.checkpoint.format import DTYPES, dtype_name, numel
from shardtrain.checkpoint.safe_pickle import restricted_loads
from shardtrain.errors import CheckpointError, UnsafePickleError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

COMMON_NAME, MEGATRON_METADATA_NAME = "common.pt", "metadata.json"
LATEST_ITERATION_NAME = "latest_checkpointed_iteration.txt"


def find_megatron_checkpoint(path: str | Path, tag: str | None) -> Path | None:
    """The Megatron ``torch_dist`` checkpoint directory ``path`` names, or None when it is none: the directory
    itself, ``path/tag``, or (a Megatron-LM save directory) the ``iter_*`` directory its
    ``latest_checkpointed_iteration.txt`` names."""
    path = Path(path)
    if tag is not None:
        path = path / tag
    if _is_torch_dist(path):
        return path
    latest = path / LATEST_ITERATION_NAME
    if tag is None and latest.is_file():
        text = latest.read_text().strip()
        if not text.isdigit():
            raise CheckpointError(
                f"{latest}: holds {text[:40]!r}, not an iteration number (release checkpoints are not read)"
            )
        ckpt = path / f"iter_{int(text):07d}"
        if not _is_torch_dist(ckpt):
            if (ckpt / "mp_rank_00").is_dir() or (ckpt / "mp_rank_00_000").is_dir():
                raise CheckpointError(
                    f"{ckpt}: a legacy Megatron checkpoint (mp_rank_* pickles); only torch_dist checkpoints are read "
                    "(save with --ckpt-format torch_dist, or convert with Megatron-LM's checkpoint converter)"
                )
            raise CheckpointError(
                f"{latest} names iteration {text}, but {ckpt} is not a complete torch_dist "
                "checkpoint (no .metadata or metadata.json)"
            )
        return ckpt
    return None


def _is_torch_dist(path: Path) -> bool:
    meta = path / MEGATRON_METADATA_NAME
    if not (meta.is_file() and (path / METADATA_NAME).is_file()):
        return False
    try:
        backend = json.loads(meta.read_text()).get("sharded_backend")
    except (OSError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{meta}: not readable JSON ({err}); the checkpoint is damaged") from None
    if backend != "torch_dist":
        raise CheckpointError(f"{path}: a Megatron {backend!r} checkpoint; only the 'torch_dist' backend is read")
    return True


@functools.cache
def _metadata_globals() -> dict[str, Any]:
    """DCP's metadata classes plus the save plans megatron caches in ``Metadata.all_local_plans`` (dataclasses
    and an enum that only store what they are given)."""
    import torch.distributed.checkpoint.planner as planner

    names = ("SavePlan", "WriteItem", "TensorWriteData", "WriteItemType", "BytesIOWriteData")
    extra = {f"torch.distributed.checkpoint.planner.{n}": getattr(planner, n) for n in names if hasattr(planner, n)}
    return {**dcp_metadata_globals(), **extra}


def load_megatron_metadata(ckpt: Path) -> Metadata:
    """``ckpt/.metadata`` through the allow-list above; anything else is refused by name."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = ckpt / METADATA_NAME
    try:
        data = path.read_bytes()
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read the checkpoint metadata: {err}") from None
    expected = "a Megatron torch_dist .metadata file holds only DCP's metadata and save-plan classes, sizes, dtypes"
    md = restricted_loads(data, _metadata_globals(), source=str(path), expected=expected)
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise CheckpointError(f"{path}: holds a {type(md).__name__}, not DCP metadata; the file is damaged")
    if not isinstance(md.storage_data, dict):
        raise CheckpointError(f"{path}: has no storage records; the checkpoint is incomplete")
    return md


class MegatronArgs:
    """Stand-in for ``argparse.Namespace`` (Megatron-LM's ``args``): records its attributes, runs nothing."""

    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise UnsafePickleError(f"Megatron's args hold a {type(state).__name__}, not a dict of attributes")
        self.__dict__.update(state)


class MegatronValue:
    """Stand-in for a megatron enum or record in ``args`` (``AttnBackend.auto``, ...): keeps its arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"{type(self).__name__}{self.args}"


_REFUSED = re.compile(r"GLOBAL ([\w.]+)")  # how torch's weights-only unpickler names the global it refused


def load_common(ckpt: Path) -> dict[str, Any]:
    """``common.pt`` through ``torch.load(weights_only=True)``: ``argparse.Namespace`` becomes :class:`MegatronArgs`,
    each ``megatron.*`` name an inert :class:`MegatronValue` subclass; any other global is refused by name."""
    path = ckpt / COMMON_NAME
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; a Megatron torch_dist checkpoint keeps its common state there")
    allowed: list[tuple[Any, str]] = [(MegatronArgs, "argparse.Namespace")]
    for _ in range(64):  # each round admits one more megatron name; a file naming more is refused
        try:
            with torch.serialization.safe_globals(allowed):
                data = torch.load(path, map_location="cpu", weights_only=True)
            break
        except pickle.UnpicklingError as err:
            found = _REFUSED.search(str(err))
            name = found.group(1) if found else None
            if name is None or not name.startswith("megatron."):
                what = name or next((ln.strip() for ln in str(err).splitlines() if "GLOBAL" in ln), "an object")
                raise UnsafePickleError(
                    f"{path}: refused to unpickle {what!r}: Megatron's common state holds only "
                    "containers, numbers, strings, tensors, argparse.Namespace and megatron's own enums (nothing from "
                    "it was run)"
                ) from None
            allowed.append((type(name.rsplit(".", 1)[1], (MegatronValue,), {}), name))
        except (RuntimeError, zipfile.BadZipFile, EOFError, OSError, ValueError) as err:
            raise CheckpointError(
                f"{path}: not a readable torch.save file ({type(err).__name__}: {str(err)[:200]}); the file is "
                "damaged or truncated"
            ) from None
    else:
        raise UnsafePickleError(f"{path}: names more than 64 megatron classes; not a Megatron common state")
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: holds a {type(data).__name__}, not the dict megatron saves")
    return data


@dataclass(frozen=True)
class Architecture:
    """The shape of a Megatron GPT model, from Megatron-LM's ``args``: what un-fusing and the Hugging Face
    config need."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    groups: int
    head_dim: int
    vocab: int
    max_positions: int
    eps: float
    rope_theta: float
    tied: bool
    experts: int | None
    top_k: int
    qkv_bias: bool

    @staticmethod
    def from_args(args: Any, source: Path) -> Architecture:
        """Check that ``args`` describe a model a Llama (dense) or Mixtral (MoE) reproduces, and keep its shape."""
        a = vars(args) if not isinstance(args, dict) else args

        def get(key: str, default: Any = None) -> Any:
            return a.get(key, default)

        refusals = [
            (get("normalization", "LayerNorm") != "RMSNorm", f"normalization={get('normalization', 'LayerNorm')!r}"),
            (not get("swiglu", False), "no swiglu (a Llama MLP is SwiGLU)"),
            (get("add_bias_linear", True), "add_bias_linear (Llama's linear layers have no bias)"),
            (get("position_embedding_type", "learned_absolute") != "rope", "position embeddings are not rotary"),
            (get("rotary_interleaved", False), "rotary_interleaved"),
            (get("qk_layernorm", False), "qk_layernorm"),
            (get("multi_latent_attention", False), "multi-latent attention"),
            (get("rotary_percent", 1.0) != 1.0, f"rotary_percent={get('rotary_percent')}"),
            ((get("moe_shared_expert_intermediate_size") or 0) > 0, "shared experts"),
        ]
        if bad := [what for cond, what in refusals if cond]:
            raise CheckpointError(
                f"{source}: a Megatron model with {', '.join(bad)}; shardtrain reads Llama-style GPT models "
                "(RMSNorm, SwiGLU, rotary, no linear bias) and their Mixtral-style MoE versions"
            )
        heads = int(get("num_attention_heads"))
        experts = get("num_experts")
        ffn = get("moe_ffn_hidden_size") if experts else get("ffn_hidden_size")
        return Architecture(
            layers=int(get("num_layers")),
            hidden=int(get("hidden_size")),
            ffn=int(ffn or get("ffn_hidden_size")),
            heads=heads,
            groups=int(get("num_query_groups") or heads) if get("group_query_attention", False) else heads,
            head_dim=int(get("kv_channels") or get("hidden_size") // heads),
            vocab=int(get("padded_vocab_size") or 0),
            max_positions=int(get("max_position_embeddings") or get("seq_length") or 4096),
            eps=float(get("norm_epsilon", 1e-5)),
            rope_theta=float(get("rotary_base", 10000)),
            tied=not get("untie_embeddings_and_output_weights", False),
            experts=int(experts) if experts else None,
            top_k=int(get("moe_router_topk", 2)),
            qkv_bias=bool(get("add_qkv_bias", False)),
        )

    def hf_config(self, dtype: torch.dtype) -> dict[str, Any]:
        """A transformers ``config.json`` of the model (Llama, or Mixtral with experts)."""
        config: dict[str, Any] = {
            "hidden_size": self.hidden,
            "intermediate_size": self.ffn,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.groups,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab,
            "max_position_embeddings": self.max_positions,
            "rms_norm_eps": self.eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tied,
            "hidden_act": "silu",
            "dtype": str(dtype).removeprefix("torch."),
        }
        if self.experts is None:
            return {
                **config,
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "attention_bias": self.qkv_bias,
                "mlp_bias": False,
            }
        if self.qkv_bias:
            raise CheckpointError("a Megatron MoE model with add_qkv_bias has no Mixtral counterpart")
        return {
            **config,
            "model_type": "mixtral",
            "architectures": ["MixtralForCausalLM"],
            "num_local_experts": self.experts,
            "num_experts_per_tok": self.top_k,
            "sliding_window": None,
            "router_aux_loss_coef": 0.0,
        }


@dataclass(frozen=True)
class MegatronSource:
    """One Megatron tensor as the checkpoint stores it: DCP ``key``, global shape, dtype, chunks."""

    key: str
    global_shape: tuple[int, ...]
    dtype: str
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]


@dataclass(frozen=True)
class MegatronTensorEntry:
    """A Hugging Face tensor of a Megatron checkpoint: ``runs`` are ``(source key, flat start, length)`` of Megatron
    tensors whose elements, concatenated, are this tensor's flattened elements."""

    name: str
    global_shape: tuple[int, ...]
    dtype: str
    runs: tuple[tuple[str, int, int], ...]
    aliases: tuple[str, ...] = ()
    value: float | None = None  # a scalar megatron keeps in its common state (the optimizer's step count)

    @property
    def numel(self) -> int:
        return numel(self.global_shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize

    @property
    def chunks(self) -> tuple[tuple[str, int, int], ...]:  # what `checkpoint inspect` counts
        return self.runs


@dataclass(frozen=True)
class MegatronManifest:
    """The part of a manifest that loading reads: ``model/<hf name>`` tensors and the saving world size."""

    tag: str
    world_size: int
    tensors: dict[str, MegatronTensorEntry]

    def resolve(self, name: str) -> MegatronTensorEntry:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(
                f"tensor {name!r} is not in Megatron checkpoint {self.tag!r} ({len(self.tensors)} tensors)"
            ) from None


def sources_of(md: Metadata, ckpt: Path) -> dict[str, MegatronSource]:
    """The tensors of the metadata (optimizer state and megatron's ``_extra_state`` objects aside)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = {}
    for key, meta in md.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata) or (
            key.startswith(("optimizer.", "rng_state")) and not key.startswith(OPTIMIZER_STATE)
        ):
            continue
        try:
            dtype = dtype_name(meta.properties.dtype)
        except CheckpointError:
            raise CheckpointError(
                f"{ckpt}: tensor {key!r} has dtype {meta.properties.dtype}, which shardtrain cannot load"
            ) from None
        chunks = tuple((tuple(map(int, c.offsets)), tuple(map(int, c.sizes))) for c in meta.chunks)
        out[key] = MegatronSource(key, tuple(map(int, meta.size)), dtype, chunks)
    return out


OPTIMIZER_STATE = "optimizer.state."  # + "<state key>.<model key>": megatron's optimizer state in model space
_LAYER = re.compile(r"decoder\.layers\.(?:(\d+)\.)?(.+)")


def hf_entries(sources: dict[str, MegatronSource], arch: Architecture, ckpt: Path) -> dict[str, MegatronTensorEntry]:
    """Every ``model/<hf name>`` of the Llama / Mixtral model, as runs of the Megatron tensors (see the note)."""
    out: dict[str, MegatronTensorEntry] = {}
    by_layer: dict[int, dict[str, tuple[MegatronSource, int]]] = {}  # layer -> rest -> (source, flat offset)
    unmapped = []
    for key, src in sources.items():
        if key.endswith("._extra_state") or "_extra_state/" in key or key.startswith(OPTIMIZER_STATE):
            continue
        whole = {
            "embedding.word_embeddings.weight": "model.embed_tokens.weight",
            "decoder.final_layernorm.weight": "model.norm.weight",
            "output_layer.weight": "lm_head.weight",
        }.get(key)
        if whole is not None:
            out[f"model/{whole}"] = MegatronTensorEntry(
                f"model/{whole}", src.global_shape, src.dtype, ((key, 0, numel(src.global_shape)),)
            )
            continue
        m = _LAYER.fullmatch(key)
        if m is None:
            unmapped.append(key)
            continue
        if m.group(1) is not None:  # one tensor per layer
            by_layer.setdefault(int(m.group(1)), {})[m.group(2)] = (src, 0)
        else:  # stacked: the leading axis numbers the layers
            if src.global_shape[0] != arch.layers:
                raise CheckpointError(f"{ckpt}: {key!r} stacks {src.global_shape[0]} layers, args say {arch.layers}")
            per = numel(src.global_shape[1:])
            for layer in range(arch.layers):
                by_layer.setdefault(layer, {})[m.group(2)] = (
                    MegatronSource(key, src.global_shape[1:], src.dtype, src.chunks),
                    layer * per,
                )
    if unmapped:
        raise CheckpointError(f"{ckpt}: Megatron tensors with no Llama/Mixtral counterpart: {unmapped[:5]}")
    if sorted(by_layer) != list(range(arch.layers)):
        raise CheckpointError(f"{ckpt}: holds layers {sorted(by_layer)}, args say {arch.layers} layers")
    for layer, parts in sorted(by_layer.items()):
        out.update(_layer_entries(layer, parts, arch, ckpt))
    return out


def _layer_entries(
    layer: int, parts: dict[str, tuple[MegatronSource, int]], arch: Architecture, ckpt: Path
) -> dict[str, MegatronTensorEntry]:
    prefix = f"model.layers.{layer}."
    out: dict[str, MegatronTensorEntry] = {}
    used: set[str] = set()

    def add(hf: str, rest: str, shape: tuple[int, ...], rows: list[tuple[int, int]] | None = None) -> None:
        src, base = parts[rest]
        used.add(rest)
        row = numel(src.global_shape[1:]) if src.global_shape else 1
        spans = rows if rows is not None else [(0, src.global_shape[0] if src.global_shape else 1)]
        runs = tuple((src.key, base + a * row, (b - a) * row) for a, b in spans)
        if sum(r[2] for r in runs) != numel(shape):
            raise CheckpointError(
                f"{ckpt}: Megatron tensor {src.key!r} of layer {layer} has shape "
                f"{src.global_shape}, which does not fit {prefix}{hf} {shape} of the args"
            )
        out[f"model/{prefix}{hf}"] = MegatronTensorEntry(f"model/{prefix}{hf}", shape, src.dtype, runs)

    def first(*names: str) -> str:
        found = [n for n in names if n in parts]
        if not found:
            raise CheckpointError(f"{ckpt}: layer {layer} has none of {names}; the checkpoint is incomplete")
        return found[0]

    h, d, g = arch.hidden, arch.head_dim, arch.groups
    per_group = arch.heads // g  # query heads of a group, then its key and value heads ([Note: Megatron ...])
    rows_of = {  # rows of the fused QKV of each of q, k, v: per group
        "q_proj": [(i * (per_group + 2) * d, (i * (per_group + 2) + per_group) * d) for i in range(g)],
        "k_proj": [
            ((i * (per_group + 2) + per_group) * d, (i * (per_group + 2) + per_group + 1) * d) for i in range(g)
        ],
        "v_proj": [((i * (per_group + 2) + per_group + 1) * d, (i + 1) * (per_group + 2) * d) for i in range(g)],
    }
    add("input_layernorm.weight", first("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"), (h,))
    for proj, rows in rows_of.items():
        heads = arch.heads if proj == "q_proj" else g
        add(f"self_attn.{proj}.weight", "self_attention.linear_qkv.weight", (heads * d, h), rows)
        if "self_attention.linear_qkv.bias" in parts:
            add(f"self_attn.{proj}.bias", "self_attention.linear_qkv.bias", (heads * d,), rows)
    add("self_attn.o_proj.weight", "self_attention.linear_proj.weight", (h, arch.heads * d))
    add("post_attention_layernorm.weight", first("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"), (h,))
    f = arch.ffn
    if arch.experts is None:
        add("mlp.gate_proj.weight", "mlp.linear_fc1.weight", (f, h), [(0, f)])
        add("mlp.up_proj.weight", "mlp.linear_fc1.weight", (f, h), [(f, 2 * f)])
        add("mlp.down_proj.weight", "mlp.linear_fc2.weight", (h, f))
    else:
        e = arch.experts
        add("mlp.gate.weight", "mlp.router.weight", (e, h))
        for hf, name, shape in (("gate_up_proj", "linear_fc1", (e, 2 * f, h)), ("down_proj", "linear_fc2", (e, h, f))):
            stacked = f"mlp.experts.experts.{name}.weight"
            if stacked in parts:  # [Note: Megatron torch_dist checkpoints]: experts x [gate; up] x hidden
                add(f"mlp.experts.{hf}", stacked, shape)
                continue
            per_expert = [f"mlp.experts.local_experts.{i}.{name}.weight" for i in range(e)]
            if not all(p in parts for p in per_expert):
                raise CheckpointError(
                    f"{ckpt}: layer {layer}'s experts are stored in a form shardtrain does not read "
                    f"(neither {stacked!r} nor one tensor per expert)"
                )
            runs = []
            for p in per_expert:
                src, base = parts[p]
                used.add(p)
                runs.append((src.key, base, numel(src.global_shape)))
            out[f"model/{prefix}mlp.experts.{hf}"] = MegatronTensorEntry(
                f"model/{prefix}mlp.experts.{hf}", shape, parts[per_expert[0]][0].dtype, tuple(runs)
            )
    if left := sorted(set(parts) - used):
        raise CheckpointError(f"{ckpt}: layer {layer}'s Megatron tensors {left} have no Llama/Mixtral counterpart")
    return out


# [Note: Megatron optimizer state]
# Megatron's optimizer state sharded "in model space" is stored as ``optimizer.state.<state key>.<model key>`` with
# the model tensor's global shape and layout (``exp_avg``, ``exp_avg_sq``), so each Hugging Face tensor's state is
# the same runs of those tensors; the step count is one number in the common state (``optimizer.state.common_step``).
# The param groups (in ``optimizer.param_groups`` of the common state) do not list their parameters; megatron's
# default grouping decides: ``wd_mult`` 0 holds the biases and 1-D parameters (norms), ``wd_mult`` 1 the rest.
# Other groupings (``lr_mult``, decoupled learning rates, experts' groups) are refused by name. ``fp32_param``
# (the masters of a bf16 run) is not read: the engine makes its masters from the weights.

ADAM_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")


def optimizer_entries(
    model: dict[str, MegatronTensorEntry], sources: dict[str, MegatronSource], step: float | None
) -> dict[str, MegatronTensorEntry]:
    """``optim/<hf name>/<state key>`` for every model tensor whose state the checkpoint holds, and its ``step``
    ([Note: Megatron optimizer state])."""
    kinds = sorted({k[len(OPTIMIZER_STATE) :].split(".", 1)[0] for k in sources if k.startswith(OPTIMIZER_STATE)})
    kinds = [k for k in kinds if k != "fp32_param"]
    out: dict[str, MegatronTensorEntry] = {}
    for name, entry in model.items():
        hf = name.removeprefix("model/")
        found = False
        for kind in kinds:
            keys = {key: f"{OPTIMIZER_STATE}{kind}.{key}" for key, _, _ in entry.runs}
            states = [sources.get(k) for k in keys.values()]
            if not all(st is not None and st.global_shape == sources[m].global_shape for m, st in zip(keys, states)):
                continue
            runs = tuple((keys[key], start, length) for key, start, length in entry.runs)
            out[f"optim/{hf}/{kind}"] = MegatronTensorEntry(f"optim/{hf}/{kind}", entry.global_shape, "float32", runs)
            found = True
        if found and step is not None:
            out[f"optim/{hf}/step"] = MegatronTensorEntry(f"optim/{hf}/step", (), "float32", (), value=step)
    return out


def param_groups(saved: Any, model: dict[str, MegatronTensorEntry], ckpt: Path) -> list[dict[str, Any]]:
    """Megatron's param groups with their parameters' Hugging Face names, by megatron's default grouping
    ([Note: Megatron optimizer state])."""
    if not isinstance(saved, list) or not all(isinstance(g, dict) for g in saved):
        raise CheckpointError(f"{ckpt}: common.pt's optimizer.param_groups is not a list of groups; it is damaged")
    odd = [g for g in saved if g.get("lr_mult", 1.0) != 1.0 or g.get("is_expert_parallel") or g.get("is_decoupled_lr")]
    if odd or sorted(g.get("wd_mult", 1.0) for g in saved) not in ([0.0, 1.0], [1.0], [0.0]):
        raise CheckpointError(
            f"{ckpt}: Megatron param groups other than its default (no weight decay for biases and norms) cannot be "
            "matched to parameters (the checkpoint does not list them); load with load_optimizer_states=False"
        )

    def no_decay(entry: MegatronTensorEntry) -> bool:  # megatron's rule on its own (per-layer) tensors
        return len(entry.global_shape) == 1

    groups = []
    for g in saved:
        params = [n.removeprefix("model/") for n, e in model.items() if no_decay(e) == (g.get("wd_mult", 1.0) == 0.0)]
        hyper = {k: (list(g[k]) if isinstance(g[k], tuple) else g[k]) for k in ADAM_HYPERPARAMETERS if k in g}
        groups.append({**hyper, "params": params})
    return groups
