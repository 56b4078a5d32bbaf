"""A pipeline run's checkpoint consolidates to what ``from_pretrained`` opens: Hugging Face Llama trained at pp 2
(world 2, tied and untied embeddings), saved (each stage writing its own tensors), consolidated by
``shardtrain checkpoint consolidate``; transformers opens it with no missing or unexpected keys, its weights equal
the engine's, and its logits the trained model's."""

from __future__ import annotations

import pytest
import torch

import shardtrain
from shardtrain.cli import main
from shardtrain.testing import run_distributed

from helpers.pipeline import GAS, MICRO, SEQ, VOCAB, global_batches, make_model, make_optimizer

transformers = pytest.importorskip("transformers")


def _train_and_save(path: str, tied: bool) -> dict:
    model = make_model("llama", tied=tied)
    config = {
        "pipeline_parallel_size": 2,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "zero_optimization": {"stage": 1},
    }
    engine = shardtrain.initialize(model, config, optimizer=make_optimizer(model))
    batches = [{"input_ids": x, "labels": y} for x, y in global_batches("llama", 1)]
    for step in range(2):
        engine.train_batch(iter(batches[step * GAS : (step + 1) * GAS]))
    engine.save_checkpoint(path, tag="t")
    out = {"params": engine.full_state_dict()}
    engine.close()
    return out


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_pp2_llama_consolidates_to_what_from_pretrained_opens(tmp_path, tied):
    trained = run_distributed(_train_and_save, 2, str(tmp_path / "run"), tied)[0]["params"]
    assert (
        main(["checkpoint", "consolidate", str(tmp_path / "run"), str(tmp_path / "hf"), "--tag", "t", "--no-progress"])
        == 0
    )
    opened, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert opened.config.num_hidden_layers == 4 and opened.config.tie_word_embeddings == tied
    got = opened.state_dict()
    for name, value in trained.items():
        assert torch.equal(got[name], value), name
    # the trained weights, put in a model built from the same config, give the same logits
    reference = make_model("llama", tied=tied)
    reference.load_state_dict(trained, strict=not tied)
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(opened.eval()(input_ids=x).logits, reference.eval()(input_ids=x).logits)
