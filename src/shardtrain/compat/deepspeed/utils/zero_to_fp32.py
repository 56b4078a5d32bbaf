"""``deepspeed.utils.zero_to_fp32``: the full fp32 weights of a checkpoint, as DeepSpeed's script names them.

They read shardtrain's checkpoints (any world size, any stage; the model tensors there are the fp32 masters under
mixed precision) and DeepSpeed's own, through :func:`shardtrain.checkpoint.reader.open_checkpoint`; ``checkpoint_dir``
is the directory ``save_checkpoint`` was given (with ``tag``, or the one ``latest`` names) or the checkpoint itself.
Unlike DeepSpeed's script, a tensor is read from its pieces without loading every rank's file whole.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from shardtrain.checkpoint.consolidate import MODEL_PREFIX, consolidate, parse_size
from shardtrain.checkpoint.reader import open_checkpoint
from shardtrain.compat.deepspeed.unsupported import not_provided


def _refuse_frozen(exclude_frozen_parameters: bool, what: str) -> None:
    if exclude_frozen_parameters:
        raise not_provided(
            f"{what}(exclude_frozen_parameters=True)",
            "frozen parameters are saved with the others: drop their names from the state dict returned",
        )


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, torch.Tensor]:
    """The model's full state dict in fp32 on the host (other dtypes, e.g. integer buffers, kept), tied parameters
    under each of their names."""
    _refuse_frozen(exclude_frozen_parameters, "get_fp32_state_dict_from_zero_checkpoint")
    if lazy_mode:
        raise not_provided(
            "get_fp32_state_dict_from_zero_checkpoint(lazy_mode=True)",
            "`shardtrain checkpoint consolidate` writes the weights one tensor at a time",
        )
    reader = open_checkpoint(checkpoint_dir, tag)
    state: dict[str, torch.Tensor] = {}
    for name, entry in reader.manifest.tensors.items():
        if not name.startswith(MODEL_PREFIX):
            continue
        dtype = torch.float32 if entry.torch_dtype.is_floating_point else None
        value = reader.read(name, dtype=dtype)
        for each in (name, *getattr(entry, "aliases", ())):
            state[each.removeprefix(MODEL_PREFIX)] = value
    return state


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    max_shard_size: str = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """Write the fp32 weights to ``output_dir``: ``model.safetensors`` with ``safe_serialization``, else
    ``pytorch_model.bin``, split into shards of ``max_shard_size`` with an index file as DeepSpeed does."""
    _refuse_frozen(exclude_frozen_parameters, "convert_zero_checkpoint_to_fp32_state_dict")
    output_dir = Path(output_dir)
    if safe_serialization:
        reader = open_checkpoint(checkpoint_dir, tag)
        consolidate(reader, output_dir, dtype=torch.float32, max_shard_size=parse_size(max_shard_size),
                    progress=False)  # fmt: skip
        return
    import json

    from huggingface_hub import split_torch_state_dict_into_shards

    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    split = split_torch_state_dict_into_shards(
        state, filename_pattern="pytorch_model{suffix}.bin", max_shard_size=max_shard_size
    )
    output_dir.mkdir(parents=True, exist_ok=True)
    for filename, names in split.filename_to_tensors.items():
        torch.save({n: state[n].contiguous() for n in names}, output_dir / filename)
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (output_dir / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))


def load_state_dict_from_zero_checkpoint(
    model: nn.Module, checkpoint_dir: str | os.PathLike, tag: str | None = None
) -> nn.Module:
    """Load the checkpoint's fp32 weights into ``model`` (moved to the host first, as DeepSpeed does; strict) and
    return it. A model to keep training needs ``initialize`` again: its engine's state is not this model's."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=True)
    return model
