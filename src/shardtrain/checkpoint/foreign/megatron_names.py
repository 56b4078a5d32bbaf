"""How the tensors of a Megatron ``torch_dist`` checkpoint map onto a Hugging Face Llama (dense) or Mixtral (MoE)
model's names: each Hugging Face tensor is a list of runs of Megatron tensors.

[Note: Megatron tensor layout]
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
(:class:`MegatronTensorEntry`); reading one never reads more than the stacked layer slab it lies in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from shardtrain.checkpoint.foreign.megatron_architecture import Architecture
from shardtrain.checkpoint.foreign.megatron_format import OPTIMIZER_STATE, MegatronSource
from shardtrain.checkpoint.format import SizedTensor, numel
from shardtrain.errors import CheckpointError


@dataclass(frozen=True)
class MegatronTensorEntry(SizedTensor):
    """A Hugging Face tensor of a Megatron checkpoint: ``runs`` are ``(source key, flat start, length)`` of Megatron
    tensors whose elements, concatenated, are this tensor's flattened elements."""

    name: str
    global_shape: tuple[int, ...]
    dtype: str
    runs: tuple[tuple[str, int, int], ...]
    aliases: tuple[str, ...] = ()
    value: float | None = None  # a scalar megatron keeps in its common state (the optimizer's step count)

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
    per_group = arch.heads // g  # query heads of a group, then its key and value heads ([Note: Megatron tensor layout])
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
            if stacked in parts:  # [Note: Megatron tensor layout]: experts x [gate; up] x hidden
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
