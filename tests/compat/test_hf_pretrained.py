"""Hugging Face round trip: save_pretrained -> shardtrain.from_pretrained (sharded) -> train -> save_checkpoint ->
``shardtrain checkpoint consolidate`` -> ``AutoModelForCausalLM.from_pretrained`` with nothing else done."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import shardtrain
from shardtrain.cli import main
from shardtrain.errors import ShardtrainError
from shardtrain.testing import run_distributed

transformers = pytest.importorskip("transformers")  # a dev dependency; always installed by `make test`

VOCAB, SEQ, MICRO, STEPS = 64, 8, 2, 3


def hf_config(kind: str):
    if kind == "llama":  # untied head, RoPE buffers, RMSNorm
        return transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            tie_word_embeddings=False,
        )
    return transformers.GPT2Config(  # tied head, stored once by save_pretrained
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, tie_word_embeddings=True
    )


def save_pretrained(kind: str, path) -> None:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(kind))
    model.generation_config.max_new_tokens = 5  # a non-default value that must survive the round trip
    model.save_pretrained(path)


def _train(kind: str, src: str, ckpt: str, stage: int) -> dict:
    import torch.distributed as dist

    zero = {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}
    model_cls = transformers.AutoModelForCausalLM if kind == "llama" else transformers.GPT2LMHeadModel
    engine = shardtrain.from_pretrained(
        model_cls,
        src,
        config={"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": zero},
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
    )
    sharded = bool(engine._runtime.units) and all(len(u.buckets) > 0 for u in engine._runtime.units)
    loaded = engine.full_state_dict()
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(STEPS):
        x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    engine.save_checkpoint(ckpt)
    return {"loaded": loaded, "trained": engine.full_state_dict(), "sharded": sharded}


CASES = [("llama", 3), ("gpt2", 3), ("gpt2", 0), ("llama", 2)]


@pytest.mark.parametrize(("kind", "stage"), CASES, ids=[f"{k}-stage{s}" for k, s in CASES])
def test_pretrained_round_trip(kind, stage, tmp_path):
    src, ckpt, out = tmp_path / "pretrained", tmp_path / "ckpt", tmp_path / "out"
    save_pretrained(kind, src)
    rank0, _ = run_distributed(_train, 2, kind, str(src), str(ckpt), stage, timeout=180)
    assert rank0["sharded"] == (stage == 3)

    # the weights the engine started from are the pretrained ones, bit for bit (tied head included)
    stored = load_file(src / "model.safetensors")
    loaded = rank0["loaded"]
    for name, value in stored.items():
        assert torch.equal(loaded[name], value), name
    if kind == "gpt2":
        assert "lm_head.weight" not in stored and torch.equal(
            loaded["lm_head.weight"], stored["transformer.wte.weight"]
        )
    assert not torch.equal(
        rank0["trained"]["model.norm.weight" if kind == "llama" else "transformer.ln_f.weight"],
        loaded["model.norm.weight" if kind == "llama" else "transformer.ln_f.weight"],
    )

    assert main(["checkpoint", "consolidate", str(ckpt), str(out), "--no-progress"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM" if kind == "llama" else "GPT2LMHeadModel"]
    assert json.loads((out / "generation_config.json").read_text())["max_new_tokens"] == 5

    reopened = transformers.AutoModelForCausalLM.from_pretrained(out)
    fresh = transformers.AutoModelForCausalLM.from_config(hf_config(kind))
    fresh.load_state_dict(rank0["trained"])
    assert reopened.generation_config.max_new_tokens == 5
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        got, want = reopened(input_ids=x).logits, fresh.eval()(input_ids=x).logits
    assert (got - want).abs().max().item() <= 1e-6


def test_bad_pretrained_directories_are_named(tmp_path):
    with pytest.raises(ShardtrainError, match="is not a directory"):
        shardtrain.from_pretrained(transformers.AutoModelForCausalLM, tmp_path / "missing")
    with pytest.raises(ShardtrainError, match=r"has no config\.json"):
        shardtrain.from_pretrained(transformers.AutoModelForCausalLM, tmp_path)
    hf_config("gpt2").save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ShardtrainError, match=r"neither model.safetensors .* \(it holds pytorch_model.bin"):
        shardtrain.from_pretrained(transformers.AutoModelForCausalLM, tmp_path)


def test_plain_module_checkpoint_has_no_hf_config():
    from shardtrain.compat.hf_pretrained import hf_config_objects

    assert hf_config_objects(torch.nn.Linear(2, 2)) == {}
    objects = hf_config_objects(transformers.GPT2LMHeadModel(hf_config("gpt2")))
    assert json.loads(objects["hf/config"])["n_embd"] == 32
