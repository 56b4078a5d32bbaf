"""ShardtrainTrainer (shardtrain.integrations.hf_trainer): the Hugging Face Trainer on shardtrain with a DeepSpeed JSON
whose "auto" values come from TrainingArguments.

Tested with transformers 5.23 (accelerate 1.15, peft 0.21). At ZeRO-3, world 2 (gloo), a tiny Llama's per-step losses,
gradient norms (clipped at max_grad_norm) and learning rates equal the plain Trainer's in one process on the same
global batch, data order and seed, including an accumulation cut short by the end of an epoch; resume_from_checkpoint
continues the same losses and weights; save_model writes what from_pretrained opens; a LoRA adapter saves non-empty.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from shardtrain.testing import run_distributed

from helpers import hf_trainer_cases as cases
from helpers.parity import assert_params_near

transformers = pytest.importorskip("transformers")

# 20 rows, 4 per global micro-batch: 5 micro-batches an epoch, so with accumulation 2 the third step of each epoch
# has one micro-batch (the Trainer steps early; the engine must follow)
ROWS, STEPS, SAVE_AT = 20, 4, 2
LOSS_TOL = 1e-6  # relative: fp32 sums in another order over two ranks


def _close(a: float, b: float, rel: float) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=rel)


def _assert_logs_equal(got: list, want: list, what: str) -> None:
    assert [g[0] for g in got] == [w[0] for w in want], (what, got, want)
    for (step, loss, norm, lr), (_, want_loss, want_norm, want_lr) in zip(got, want, strict=True):
        assert _close(loss, want_loss, LOSS_TOL), f"{what} step {step}: loss {loss!r} vs {want_loss!r}"
        assert _close(norm, want_norm, 1e-5), f"{what} step {step}: grad_norm {norm!r} vs {want_norm!r}"
        assert lr == pytest.approx(want_lr, rel=1e-12), f"{what} step {step}: learning_rate {lr} vs {want_lr}"


def test_zero3_world2_equals_plain_trainer_resumes_and_saves(tmp_path):
    # the reference: the plain Trainer in one process, micro-batch 4 = 2 ranks x 2
    ref = run_distributed(cases.plain_run, 1, str(tmp_path / "ref"), 4, 2, STEPS, ROWS, init_process_group=False)[0]
    final = tmp_path / "final"
    rank0, _ = run_distributed(
        cases.shardtrain_run, 2, str(tmp_path / "st"), 2, 2, STEPS, SAVE_AT, str(final), ROWS, timeout=300
    )
    # the engine followed the Trainer's short accumulation at the end of the epoch (step 3): it counts it whole
    assert rank0["state"] == {"stage": 3, "global_step": STEPS, "dp": 2, "micro_steps": 2 * STEPS}

    # per-step losses, gradient norms (before clipping at max_grad_norm=0.5: every step clips) and learning rates
    assert [s for s, *_ in ref["logs"]] == list(range(1, STEPS + 1))
    assert all(norm > 0.5 for _, _, norm, _ in ref["logs"]), "max_grad_norm must clip for the check to test clipping"
    _assert_logs_equal(rank0["logs"], ref["logs"], "ShardtrainTrainer vs Trainer")
    assert _close(rank0["eval_loss"], ref["eval_loss"], LOSS_TOL), (rank0["eval_loss"], ref["eval_loss"])
    init = cases.tiny_llama().state_dict()
    assert_params_near(rank0["weights"], ref["weights"], init, require_moved=True, what="after training: ")

    # resume_from_checkpoint=checkpoint-2 in a new trainer over a fresh model: steps 3-4 are computed again (1-2 come
    # from trainer_state.json) and equal the uninterrupted run's, and so do the final weights and Adam's step count.
    # (A fresh optimizer would not: Adam's first step moves every element by about lr, its continued steps by
    # m/sqrt(v) times lr, a difference ~1e-3 against a tolerance ~1e-7 here.)
    _assert_logs_equal(rank0["resumed_logs"][SAVE_AT:], rank0["logs"][SAVE_AT:], "resumed vs uninterrupted")
    assert rank0["resumed_adam_step"] == STEPS
    for name, value in rank0["weights"].items():
        torch.testing.assert_close(rank0["resumed_weights"][name], value, rtol=0, atol=1e-6, msg=name)
    checkpoint = tmp_path / "st" / "first" / f"checkpoint-{SAVE_AT}"
    assert (checkpoint / "latest").read_text().strip() == f"global_step{SAVE_AT}"
    assert (checkpoint / "trainer_state.json").is_file() and (checkpoint / "model.safetensors").is_file()

    # save_model: a directory from_pretrained opens, holding the engine's weights
    model = transformers.AutoModelForCausalLM.from_pretrained(final)
    assert type(model).__name__ == "LlamaForCausalLM"
    state = model.state_dict()
    assert state.keys() == rank0["weights"].keys()
    for name, value in rank0["weights"].items():
        assert torch.equal(state[name], value), name


def test_lora_adapter_saves_non_empty_with_config_sections(tmp_path):
    peft = pytest.importorskip("peft")
    adapter = tmp_path / "adapter"
    rank0, _ = run_distributed(cases.lora_run, 2, str(tmp_path / "run"), str(adapter), timeout=300)

    # the config's optimizer and scheduler sections, their "auto" values filled from TrainingArguments as
    # transformers fills them for DeepSpeed (lr 5e-3, warmup_steps 2, max_steps 3, weight_decay 0.01, max_grad_norm
    # 0.5, 2 per device x 1 accumulation x 2 ranks; hidden size 32)
    config = rank0["config"]
    assert rank0["optimizer"] == "AdamW"
    assert config["optimizer"]["params"] == {"lr": 5e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
    assert config["scheduler"]["params"] == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 5e-3,
        "warmup_num_steps": 2,
        "total_num_steps": 3,
        "warmup_type": "linear",
    }
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"]) == (4, 2)
    assert (config["gradient_accumulation_steps"], config["gradient_clipping"]) == (1, 0.5)
    assert config["fp16"]["enabled"] is False and config["bf16"]["enabled"] is False
    zero = config["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"]) == (32 * 32, int(0.9 * 32 * 32))
    assert zero["stage3_param_persistence_threshold"] == 10 * 32
    from safetensors.torch import load_file

    saved = load_file(adapter / "adapter_model.safetensors")
    # r=4 on q_proj and v_proj of 2 layers: lora_A and lora_B of each
    assert len(saved) == 8 and all(t.numel() > 0 for t in saved.values()), {k: t.shape for k, t in saved.items()}
    engine_lora = {k.replace(".default", ""): v for k, v in rank0["weights"].items() if "lora_" in k}
    assert saved.keys() == engine_lora.keys()
    for name, value in saved.items():
        assert torch.equal(value, engine_lora[name]), name
    # lora_B starts at zero: non-zero values are the trained ones
    assert all(saved[k].abs().max() > 0 for k in saved if "lora_B" in k)
    base = cases.tiny_llama()
    loaded = peft.PeftModel.from_pretrained(base, adapter)
    for name, value in loaded.state_dict().items():
        if "lora_" in name:
            assert torch.equal(value, engine_lora[name.replace(".default", "")]), name


@pytest.mark.soak
@pytest.mark.parametrize("world", [3])
def test_config_sections_equal_plain_trainer(world, tmp_path):
    """Optimizer and scheduler from the config's sections (AdamW, WarmupDecayLR with "auto") equal the Trainer's own
    AdamW at weight_decay 0 (see cases.SECTIONS) driven by DeepSpeed's own WarmupDecayLR, as the Trainer with DeepSpeed
    runs that section, at an odd world size. (Not the Trainer's "linear": DeepSpeed's schedule runs one step behind
    it, the first two steps at ``warmup_min_lr``.)"""
    rows = 4 * world  # 4 micro-batches of 1 row a rank, accumulation 2: 2 steps an epoch, 2 epochs
    config = cases.ds_config(**cases.SECTIONS)
    rank0 = run_distributed(
        cases.shardtrain_run,
        world,
        str(tmp_path / "st"),
        1,
        2,
        STEPS,
        SAVE_AT,
        str(tmp_path / "final"),
        rows,
        config,
        weight_decay=0.0,
        timeout=400,
    )[0]
    ref = run_distributed(
        cases.plain_run,
        1,
        str(tmp_path / "ref"),
        world,
        2,
        STEPS,
        rows,
        weight_decay=0.0,
        deepspeed_scheduler=cases.SECTIONS["scheduler"],
        init_process_group=False,
    )[0]
    assert [lr for *_, lr in ref["logs"]] == [0.0, 0.0, 0.0025, 0.005], ref["logs"]  # DeepSpeed's warm-up, then peak
    _assert_logs_equal(rank0["logs"], ref["logs"], f"config sections at world {world} vs Trainer")
    init = cases.tiny_llama().state_dict()
    assert_params_near(rank0["weights"], ref["weights"], init, require_moved=True, what="after training: ")
    _assert_logs_equal(rank0["resumed_logs"][SAVE_AT:], rank0["logs"][SAVE_AT:], "resumed vs uninterrupted")


def test_refusals_and_load_best_model_at_end(tmp_path):
    out = run_distributed(cases.single_rank_checks, 1, str(tmp_path), init_process_group=False)[0]
    messages = out["messages"]
    assert "torch_compile" in messages["torch_compile"] and '"graph"' in messages["torch_compile"]
    assert "gradient_accumulation_steps" in messages["gas_mismatch"] and "auto" in messages["gas_mismatch"]
    assert "bf16.enabled=True" in messages["bf16_mismatch"] and "--bf16" in messages["bf16_mismatch"]
    assert "optimizer.pt" in messages["plain_checkpoint"] and "from_pretrained" in messages["plain_checkpoint"]
    assert os.path.isdir(tmp_path / "refusals" / "plain" / "checkpoint-1")  # the plain Trainer's, refused
    # load_best_model_at_end: the engine's weights are the best checkpoint's (the first), not the last one's
    assert out["best"] == {"best": "checkpoint-1", "equals_best": True, "equals_last": False}


@pytest.mark.soak
def test_example_trains_resumes_and_saves(tmp_path):
    """examples/hf_trainer.py under torchrun at world 2: train, resume from the newest checkpoint, save_model."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")])}
    env["OMP_NUM_THREADS"] = "1"
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [str(root / "examples" / "hf_trainer.py"), "--output-dir", str(out), "--save-steps", "2"]
    for steps, extra in ((2, []), (4, ["--resume"])):
        proc = subprocess.run(
            cmd + ["--steps", str(steps), *extra], capture_output=True, text=True, env=env, timeout=300
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"step {steps}: model in {out / 'final'}" in proc.stdout
    state = (out / "checkpoint-4" / "trainer_state.json").read_text()
    assert '"global_step": 4' in state
    assert (out / "checkpoint-4" / "latest").read_text().strip() == "global_step4"
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "final")
    assert type(model).__name__ == "LlamaForCausalLM"
