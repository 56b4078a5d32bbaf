"""Merge a checkpoint's pieces into Hugging Face-style safetensors files, one tensor in memory at a time.

Model tensors are the logical tensors named ``model/<parameter name>``; they are written under ``<parameter name>``.
A tensor with aliases (tied weights) is written once, under its primary name, as Hugging Face does; the aliases are
listed in the file's metadata (``"tied"``). Files: ``model.safetensors``, or, when the tensors exceed
``max_shard_size``, ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``.

[Note: streaming] ``safetensors.torch.save_file`` needs every tensor of a file in memory at once. Here the header
(names, dtypes, shapes, offsets) is computed from the manifest first, then each tensor is assembled from its pieces
straight into the output dtype, written and freed (``safetensors_io.write_streaming``). Pieces of every kind (ZeRO
fragments, tensor-parallel blocks with their stride, ZeRO fragments of blocks, any mix) are assembled by
``CheckpointReader.read`` chunk by chunk, so each tensor comes out whole, in its global (Hugging Face) layout. Peak
memory is one assembled tensor plus a chunk of the piece being copied into it, whatever the model size. The output
is read back by ``safetensors`` itself in the tests.

A checkpoint of a Hugging Face ``transformers`` model carries its configuration (global objects
:data:`HF_CONFIG_KEY` and :data:`HF_GENERATION_CONFIG_KEY`, JSON text); it is written as ``config.json`` (with
``dtype`` set to the dtype of the written weights) and ``generation_config.json``, so that
``AutoModelForCausalLM.from_pretrained(out_dir)`` opens the output with no other step.

A peft run (global object :data:`PEFT_CONFIG_KEY`) is written merged or as adapters, never under the
``PeftModel``'s own names (see ``peft_consolidate.py``).

With ``optimizer=True`` a ``torch.optim.Optimizer.state_dict()`` is also written (``optimizer.pt``). It needs the
global object :data:`OPTIMIZER_LAYOUT_KEY` (see there); ``torch.save`` holds this dict in memory, so this part is
not streamed.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from shardtrain.checkpoint.reader import CheckpointReader
from shardtrain.checkpoint.safetensors_io import write_streaming
from shardtrain.errors import CheckpointError

MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"
# Global object the engine saves for consolidation of the optimizer: a list of param groups, each a dict of
# hyperparameters plus "params": the parameter names (without "model/") in the order the group holds them.
# Optimizer state of parameter P is stored as tensors "optim/P/<state key>" (e.g. exp_avg, exp_avg_sq, step).
OPTIMIZER_LAYOUT_KEY = "optimizer/param_groups"
# Written by the engine for transformers models (shardtrain.compat.hf_pretrained); the checkpoint layer only copies the
# text.
HF_CONFIG_KEY = "hf/config"
HF_GENERATION_CONFIG_KEY = "hf/generation_config"
# A peft model's adapters: JSON text, see [Note: a peft run in a checkpoint] in hf_config.py.
PEFT_CONFIG_KEY = "hf/peft_config"

DTYPE_CHOICES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_size(text: str) -> int:
    """``2GB`` (10^9), ``500MB``, ``1.5GiB`` (2^30), ``4096`` (bytes) -> bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20}
    units |= {"GIB": 2**30, "TIB": 2**40}
    s = text.strip().upper()
    num = s.rstrip("KMGTIB")
    try:
        value = float(num) * units[s[len(num) :]]
    except (ValueError, KeyError):
        raise CheckpointError(
            f"cannot read size {text!r}; write e.g. 2GB, 500MB, 1.5GiB or a number of bytes"
        ) from None
    if value < 1:
        raise CheckpointError(f"size {text!r} must be at least one byte")
    return int(value)


@dataclass(frozen=True)
class _Out:
    name: str  # name in the output file
    shape: tuple[int, ...]
    dtype: torch.dtype
    load: Callable[[], torch.Tensor]  # the tensor, whole, in ``dtype``

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _shards(outs: list[_Out], max_bytes: int | None) -> list[list[_Out]]:
    shards: list[list[_Out]] = [[]]
    size = 0
    for o in outs:
        if max_bytes is not None and shards[-1] and size + o.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(o)
        size += o.nbytes
    return shards


def consolidate(
    reader: CheckpointReader,
    out_dir: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: int | None = None,
    optimizer: bool = False,
    progress: bool = True,
    merge_adapters: bool = False,
    adapters_only: bool = False,
) -> list[Path]:
    """Write the model (and with ``optimizer`` the optimizer state dict) of ``reader``'s checkpoint to ``out_dir``.

    ``dtype`` converts floating-point tensors (others keep theirs). Returns the files written.

    A peft run (one with :data:`PEFT_CONFIG_KEY`) is written as its users load it, never as the ``PeftModel``'s own
    tensor names, which ``from_pretrained`` would not find (it would return a random model): merged, the adapters
    folded into the base weights by peft (the default, or ``merge_adapters``), or with ``adapters_only`` the
    adapters as ``PeftModel.save_pretrained`` writes them. See ``peft_consolidate.py``.
    """
    peft_text = reader.objects.get(PEFT_CONFIG_KEY) if hasattr(reader, "objects") else None
    if merge_adapters and adapters_only:
        raise CheckpointError("--merge-adapters and --adapters-only exclude each other: choose one output")
    if peft_text is None and (merge_adapters or adapters_only):
        flag = "--adapters-only" if adapters_only else "--merge-adapters"
        raise CheckpointError(
            f"{reader.path}: {flag} needs a peft run, and this checkpoint has no peft adapters (no "
            f"{PEFT_CONFIG_KEY!r} object); consolidate it without {flag}"
        )
    out_dir = Path(out_dir)
    outs = []
    tied: dict[str, str] = {}
    if peft_text is not None:
        from shardtrain.checkpoint import peft_consolidate as pc

        adapters, active, prefix = pc.peft_configs(reader, peft_text)
        model = pc.meta_peft_model(reader, reader.objects.get(HF_CONFIG_KEY), adapters, active)
        if adapters_only:
            return _write_adapters(reader, out_dir, model, prefix, adapters, progress)
        outs = [_Out(*o) for o in pc.merged_outputs(reader, model, prefix, dtype)]
        names = {o.name for o in outs}
        for name, entry in reader.manifest.tensors.items():
            for alias in entry.aliases:
                short = alias.removeprefix(MODEL_PREFIX).removeprefix(pc.PEFT_PREFIX)
                if short not in names and name.removeprefix(MODEL_PREFIX).removeprefix(pc.PEFT_PREFIX) in names:
                    tied[short] = name.removeprefix(MODEL_PREFIX).removeprefix(pc.PEFT_PREFIX)
    else:
        for name, entry in reader.manifest.tensors.items():
            if not name.startswith(MODEL_PREFIX):
                continue
            target = dtype if dtype is not None and entry.torch_dtype.is_floating_point else entry.torch_dtype
            load = functools.partial(reader.read, name, dtype=target)
            outs.append(_Out(name[len(MODEL_PREFIX) :], entry.global_shape, target, load))
            for alias in entry.aliases:
                tied[alias.removeprefix(MODEL_PREFIX)] = name[len(MODEL_PREFIX) :]
    if not outs:
        raise CheckpointError(f"{reader.path}: no model tensors (names starting with {MODEL_PREFIX!r}) to consolidate")
    _check_before_writing(reader)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = _write_model(out_dir, outs, tied, max_shard_size, progress, "model")
    written += _write_hf_configs(reader, out_dir, next((o.dtype for o in outs if o.dtype.is_floating_point), None))
    if optimizer:
        written.append(_write_optimizer(reader, out_dir / "optimizer.pt"))
    return written


def _check_before_writing(reader: CheckpointReader) -> None:
    # a shape that disagrees with its optimizer state would be written as it is: refused before anything is written
    if problems := getattr(reader, "shape_problems", list)():
        raise CheckpointError(f"{problems[0]}; nothing was written")
    if isinstance(reader, CheckpointReader):  # every file and header checked before the first byte is written
        for name in reader.manifest.tensors:
            if name.startswith(MODEL_PREFIX):
                reader.check_pieces(name)


def _write_model(
    out_dir: Path, outs: list[_Out], tied: dict[str, str], max_shard_size: int | None, progress: bool, stem: str
) -> list[Path]:
    """``<stem>.safetensors``, or shards of at most ``max_shard_size`` bytes and their index."""
    shards = _shards(outs, max_shard_size)
    total = sum(o.nbytes for o in outs)
    meta = {"format": "pt"}
    if tied:
        meta["tied"] = json.dumps(tied)
    written: list[Path] = []
    with tqdm(total=total, unit="B", unit_scale=True, desc="consolidate", disable=not progress) as bar:
        for i, shard in enumerate(shards):
            part = f"-{i + 1:05d}-of-{len(shards):05d}" if len(shards) > 1 else ""
            fname = f"{stem}{part}.safetensors"
            write_streaming(
                out_dir / fname,
                [(o.name, o.dtype, o.shape) for o in shard],
                lambda i, shard=shard: shard[i].load(),
                meta,
                bar.update,
            )
            written.append(out_dir / fname)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {o.name: written[i].name for i, shard in enumerate(shards) for o in shard},
        }
        (out_dir / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2))
        written.append(out_dir / f"{stem}.safetensors.index.json")
    return written


def _write_adapters(
    reader: CheckpointReader, out_dir: Path, model: Any, prefix: str, adapters: dict, progress: bool
) -> list[Path]:
    """What ``PeftModel.save_pretrained`` writes: per adapter ``adapter_model.safetensors`` and
    ``adapter_config.json``, the adapter named ``default`` in ``out_dir``, any other in ``out_dir/<name>``. The
    tensors keep the dtype they were trained in; ``--dtype`` and ``--max-shard-size`` do not apply (peft writes one
    file)."""
    from shardtrain.checkpoint import peft_consolidate as pc

    _check_before_writing(reader)
    written: list[Path] = []
    for name, config in adapters.items():
        outs = [_Out(*o) for o in pc.adapter_outputs(reader, model, prefix, name)]
        target = out_dir if name == "default" else out_dir / name
        target.mkdir(parents=True, exist_ok=True)
        written += _write_model(target, outs, {}, None, progress, "adapter_model")
        # as PeftConfig.save_pretrained writes it
        (target / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        written.append(target / "adapter_config.json")
    return written


def _write_hf_configs(reader: CheckpointReader, out_dir: Path, weights_dtype: torch.dtype | None) -> list[Path]:
    """``config.json`` / ``generation_config.json`` when the checkpoint holds a transformers model's configs."""
    objects = reader.objects
    written = []
    if HF_CONFIG_KEY in objects:
        config = json.loads(objects[HF_CONFIG_KEY])
        if weights_dtype is not None:  # what save_pretrained records: the dtype the weights are stored in
            key = "torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"
            config[key] = str(weights_dtype).removeprefix("torch.")
        (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        written.append(out_dir / "config.json")
    if HF_GENERATION_CONFIG_KEY in objects:
        (out_dir / "generation_config.json").write_text(objects[HF_GENERATION_CONFIG_KEY] + "\n")
        written.append(out_dir / "generation_config.json")
    return written


def _write_optimizer(reader: CheckpointReader, path: Path) -> Path:
    """``{"state": {i: {...}}, "param_groups": [...]}`` with indices assigned as ``Optimizer.state_dict()`` does."""
    groups = reader.objects.get(OPTIMIZER_LAYOUT_KEY)
    if not isinstance(groups, list) or not all(isinstance(g, dict) and "params" in g for g in groups):
        raise CheckpointError(
            f"{reader.path}: --optimizer needs the global object {OPTIMIZER_LAYOUT_KEY!r} (a list of param groups "
            "with 'params' as parameter names); this checkpoint does not have it"
        )
    by_param: dict[str, dict[str, str]] = {}
    for name in reader.manifest.tensors:
        if name.startswith(OPTIM_PREFIX):
            param, _, key = name[len(OPTIM_PREFIX) :].rpartition("/")
            by_param.setdefault(param, {})[key] = name
    state: dict[int, dict[str, torch.Tensor]] = {}
    param_groups = []
    index = 0
    for group in groups:
        ids = []
        for pname in group["params"]:
            if pname in by_param:
                state[index] = {k: reader.read(n) for k, n in sorted(by_param[pname].items())}
            ids.append(index)
            index += 1
        param_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    torch.save({"state": state, "param_groups": param_groups}, path)
    return path
