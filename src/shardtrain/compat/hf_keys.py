"""Checkpoint keys the way transformers reads them: :func:`hf_key_mapper` builds the
:class:`~shardtrain.weights.loading.KeyMap` of a Hub checkpoint from transformers' own key conversion.

transformers 5 keeps, per model type or class, a list of weight transforms (``conversion_mapping.py``): renamings
(``embed_out.`` -> ``lm_head.`` for GPT-NeoX, ``encoder.layer.`` -> ``layers.`` for ViT, ``block_sparse_moe`` ->
``mlp`` for Mixtral) and converters (per-expert ``experts.N.w1`` / ``experts.N.w3`` stacked and concatenated into one
``experts.gate_up_proj``). ``save_pretrained`` applies them in reverse, so a folder it writes holds the old names;
``from_pretrained`` applies them forward. We call the same functions, in the same order
(``get_model_conversion_mapping``, then ``rename_source_key`` per key in ``dot_natural_key`` order, as
``convert_and_load_state_dict_in_model`` does), and the converters' own operations make the fused tensors; we only
decide which rank reads which entries ([Note: converted rows] in :mod:`shardtrain.weights.loading`). No map of our own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from copy import deepcopy
from typing import Any

import torch
from torch import nn

from shardtrain.errors import ShardtrainError
from shardtrain.weights.loading import Conversion, KeyMap, KeyMapper, Loader, TensorHeader

__all__ = ["hf_key_mapper"]


def hf_key_mapper(model: nn.Module, key_mapping: Mapping[str, str] | None = None) -> KeyMapper:
    """The key mapper for a transformers ``model``: checkpoint headers -> :class:`KeyMap`, as ``from_pretrained``
    would rename and convert them. ``key_mapping``: transformers' ``key_mapping`` argument (regex -> replacement,
    applied first)."""

    def mapper(headers: Mapping[str, TensorHeader]) -> KeyMap:
        return _key_map(model, headers, key_mapping)

    return mapper


def _key_map(model: Any, headers: Mapping[str, TensorHeader], key_mapping: Mapping[str, str] | None) -> KeyMap:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    transforms = get_model_conversion_mapping(model, key_mapping=dict(key_mapping) if key_mapping else None)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    names = dict.fromkeys(model.state_dict(keep_vars=True), True)  # it asks `.get(name) is not None`; no data read
    prefix = model.base_model_prefix

    renamed: dict[str, str] = {}
    unmapped: dict[str, str] = {}
    groups: dict[str, tuple[Any, dict[str, list[str]]]] = {}  # first made name -> (converter, keys per pattern)
    for key in sorted(headers, key=dot_natural_key):
        name, pattern = rename_source_key(key, renamings, converters, prefix, names)
        if name not in names and key in names:  # as transformers: a model name is kept, only the prefix may change
            name, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=names)
        if name not in names:
            unmapped[key] = name
        elif pattern is None:
            if name in renamed:  # two keys for one name: transformers keeps the first, we say so
                unmapped[key] = name
            else:
                renamed[name] = key
        else:
            _, keys = groups.setdefault(name, (deepcopy(by_pattern[pattern]), {}))
            keys.setdefault(pattern, []).append(key)

    converted = tuple(_conversion(model, first, c, keys, headers) for first, (c, keys) in groups.items())
    may_miss, ignored = _ignored_by_the_class(model, names, unmapped)
    unmapped = {k: v for k, v in unmapped.items() if k not in ignored}
    by = f"transformers {_version()}'s conversion for {type(model).__name__}"
    return KeyMap(renamed, converted, unmapped, ignored=ignored, may_miss=may_miss, by=by)


def _ignored_by_the_class(
    model: Any, names: Mapping[str, bool], unmapped: Mapping[str, str]
) -> tuple[frozenset[str], dict[str, str]]:
    """What transformers' own ``_adjust_missing_and_unexpected_keys`` drops from its report: model names the class
    lets a checkpoint lack (``_keys_to_ignore_on_load_missing``), and stored keys it ignores
    (``_keys_to_ignore_on_load_unexpected``, stale ``rotary_emb.inv_freq`` and ``position_ids`` buffers)."""
    adjust = getattr(model, "_adjust_missing_and_unexpected_keys", None)
    if adjust is None:
        return frozenset(), {}
    from transformers.utils.loading_report import LoadStateDictInfo

    info = LoadStateDictInfo(
        missing_keys=set(names),
        unexpected_keys=set(unmapped.values()),
        mismatched_keys=set(),
        error_msgs=[],
        conversion_errors={},
        skipped_pp_keys=set(),
    )
    adjust(info)
    ignored = {k: v for k, v in unmapped.items() if v not in info.unexpected_keys}
    return frozenset(set(names) - info.missing_keys), ignored


def _conversion(
    model: Any, first: str, converter: Any, keys: Mapping[str, list[str]], headers: Mapping[str, TensorHeader]
) -> Conversion:
    """One converter's tensors: ``run`` is its own ``convert`` on the loaders given; the names and shapes it makes
    come from running it on ``meta`` tensors of the headers' shapes."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    def run(loaders: Mapping[str, Sequence[Loader]]) -> dict[str, torch.Tensor]:
        fresh = deepcopy(converter)  # transformers gives each made tensor its own copy, which collects its inputs
        for pattern, fns in loaders.items():
            for fn in fns:
                fresh.add_tensor(first, "", pattern, fn)
        made = fresh.convert(first, model=model, config=model.config)
        return {name: value[0] if isinstance(value, list) else value for name, value in made.items()}

    def on_meta(key: str) -> Loader:
        return lambda: torch.empty(headers[key].shape, dtype=headers[key].dtype, device="meta")

    try:  # on every rank alike, before anything is read or written
        made = run({p: [on_meta(k) for k in ks] for p, ks in keys.items()})
    except Exception as err:
        stored = ", ".join(f"{len(ks)} x {p!r}" for p, ks in keys.items())
        raise ShardtrainError(
            f"{first!r}: transformers' conversion ({', '.join(type(op).__name__ for op in converter.operations)}) "
            f"cannot make it from the checkpoint's {stored} (first {next(iter(keys.values()))[0]!r}): {err}"
        ) from err
    shapes = {name: tuple(t.shape) for name, t in made.items()}
    ops = converter.operations
    stacked = (  # [Note: converted rows]: entry i of each list makes row i, and later operations keep rows apart
        len(ops) > 0
        and isinstance(ops[0], MergeModulelist)
        and ops[0].dim == 0
        and all(isinstance(op, Concatenate) and op.dim >= 1 for op in ops[1:])
    )
    sources = tuple((p, tuple(ks)) for p, ks in keys.items())
    return Conversion(sources=sources, run=run, shapes=shapes, stacked=stacked)


def _version() -> str:
    import transformers

    return transformers.__version__
