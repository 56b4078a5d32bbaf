"""``load_full_state_dict(path, key_map=...)`` with a conversion of our own, no transformers: a GPT whose fused
``qkv`` weights are stored as three tensors, made back by a :class:`Conversion` that concatenates them. At tp 2 the
fused weight is a strided block ([Note: strided blocks]), cut from the converted whole; at ZeRO-3 each rank keeps
its fragment of it ([Note: converted rows]: a conversion that is not stacked reads all its sources)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import shardtrain
from shardtrain.errors import ShardtrainError
from shardtrain.models.gpt import GPT, GPTConfig
from shardtrain.tensor_parallel import GPT_TP_PLAN
from shardtrain.testing import run_distributed
from shardtrain.weights.loading import Conversion, KeyMap

GPT_CONFIG = GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_layer=2, n_head=4)


def split_qkv(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in state.items():
        if name.endswith("attn.qkv.weight"):
            for part, piece in zip("qkv", value.chunk(3, dim=0), strict=True):
                out[name.replace("attn.qkv.", f"attn.{part}.")] = piece.clone()
        else:
            out[name] = value.clone()
    return out


def joined_qkv(headers) -> KeyMap:
    """The stored q, k and v of each block make its fused qkv weight (concatenated on dim 0)."""
    renamed, converted = {}, []
    for key in headers:
        if ".attn.q.weight" in key:
            fused = key.replace(".attn.q.", ".attn.qkv.")
            sources = tuple((p, (key.replace(".attn.q.", f".attn.{p}."),)) for p in "qkv")

            def run(loaders, fused=fused):
                return {fused: torch.cat([loaders[p][0]() for p in "qkv"], dim=0)}

            rows = sum(headers[k].shape[0] for _, (k,) in sources)
            converted.append(Conversion(sources=sources, run=run, shapes={fused: (rows, headers[key].shape[1])}))
        elif ".attn.k.weight" not in key and ".attn.v.weight" not in key:
            renamed[key] = key
    return KeyMap(renamed=renamed, converted=tuple(converted), by="joined_qkv")


def _load(path: str, config: dict) -> dict:
    torch.manual_seed(1)  # other values than the stored ones
    with shardtrain.zero.Init(config):
        model = GPT(GPT_CONFIG)
    tp_plan = GPT_TP_PLAN if "tensor_parallel" in config else None
    engine = shardtrain.initialize(model, config, lambda ps: torch.optim.SGD(ps, lr=0.1), tp_plan=tp_plan)
    engine.load_full_state_dict(path, key_map=joined_qkv)
    state = engine.full_state_dict()
    engine.close()
    return state


@pytest.mark.parametrize("layout", ["tp2", "zero3"])
def test_a_conversion_loads_into_blocks_and_fragments(layout, tmp_path):
    torch.manual_seed(0)
    want = GPT(GPT_CONFIG).state_dict()
    stored = split_qkv(want)
    save_file({k: v.contiguous() for k, v in stored.items()}, str(tmp_path / "model.safetensors"))
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}
    if layout == "tp2":
        config["tensor_parallel"] = {"size": 2}
    state = run_distributed(_load, 2, str(tmp_path), config)[0]
    for name, value in want.items():
        assert torch.equal(state[name], value), name


def test_without_the_key_map_the_names_are_named(tmp_path):
    """The same file without the conversion: the fused weights are missing and q, k, v unexpected; the error names
    both and does not suggest strict=False (they are the same weights under other names)."""
    torch.manual_seed(0)
    model = GPT(GPT_CONFIG)
    save_file({k: v.contiguous() for k, v in split_qkv(model.state_dict()).items()}, str(tmp_path / "w.safetensors"))
    engine = shardtrain.initialize(model, {"train_micro_batch_size_per_gpu": 1}, lambda ps: torch.optim.SGD(ps, 0.1))
    with pytest.raises(ShardtrainError) as err:
        engine.load_full_state_dict(tmp_path / "w.safetensors")
    message = str(err.value)
    assert "missing: blocks.0.attn.qkv.weight, blocks.1.attn.qkv.weight; unexpected: blocks.0.attn.k.weight" in message
    assert "no key conversion was given" in message and "strict=False" not in message
    engine.load_full_state_dict(tmp_path / "w.safetensors", key_map=joined_qkv)
    engine.close()
