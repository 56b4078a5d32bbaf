"""TRL's trainers on shardtrain (shardtrain.integrations.trl_trainers): SFTTrainer and DPOTrainer at ZeRO-3.

Tested with TRL 1.16 (transformers 5.23, datasets 5.2, peft 0.21). At ZeRO-3, world 2 (gloo), a tiny Llama's per-step
losses, gradient norms, learning rates and TRL's own metrics equal TRL's plain trainer in one process on the same
global batch, data order and seed, including an accumulation cut short by the end of an epoch; SFT resumes from a
checkpoint, save_model writes what from_pretrained opens, a LoRA adapter (peft_config) saves non-empty; DPO's
separate reference model is sharded like the trained one and its log-probabilities equal the plain run's.
"""

from __future__ import annotations

import math

import pytest
import torch

from shardtrain.testing import run_distributed

from helpers import hf_trainer_cases as cases
from helpers.parity import assert_params_near

pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")

# 20 rows, 4 per global micro-batch: 5 micro-batches an epoch, so with accumulation 2 the third step of each epoch
# has one micro-batch (the Trainer steps early; the engine must follow)
ROWS, STEPS, SAVE_AT = 20, 4, 2
LOSS_TOL = 1e-6  # relative: fp32 sums in another order over two ranks


def _close(a: float, b: float, rel: float) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=rel)


def _assert_logs_equal(got: list, want: list, metrics: tuple[str, ...], what: str, skip: tuple[str, ...] = ()) -> None:
    assert [g[0] for g in got] == [w[0] for w in want], (what, got, want)
    for g, w in zip(got, want, strict=True):
        step = g[0]
        assert _close(g[1], w[1], LOSS_TOL), f"{what} step {step}: loss {g[1]!r} vs {w[1]!r}"
        assert _close(g[2], w[2], 1e-5), f"{what} step {step}: grad_norm {g[2]!r} vs {w[2]!r}"
        assert g[3] == pytest.approx(w[3], rel=1e-12), f"{what} step {step}: learning_rate {g[3]} vs {w[3]}"
        for name, a, b in zip(metrics, g[4:], w[4:], strict=True):
            if name in skip:
                continue
            assert _close(a, b, 1e-5), f"{what} step {step}: {name} {a!r} vs {b!r}"


def test_sft_zero3_world2_equals_plain_sft_resumes_saves_and_lora(tmp_path):
    ref = run_distributed(
        cases.plain_sft_run, 1, str(tmp_path / "ref"), 4, 2, STEPS, ROWS, init_process_group=False, timeout=300
    )[0]
    final, adapter = tmp_path / "final", tmp_path / "adapter"
    rank0 = run_distributed(
        cases.shardtrain_sft_run,
        2,
        str(tmp_path / "st"),
        2,
        2,
        STEPS,
        ROWS,
        SAVE_AT,
        str(final),
        str(adapter),
        timeout=400,
    )[0]
    assert rank0["stage"] == 3

    # per-step losses (token-weighted over padded batches of unequal token counts), gradient norms (clipped at
    # max_grad_norm=0.5), learning rates and TRL's token counts, accuracies and entropies
    assert [s for s, *_ in ref["logs"]] == list(range(1, STEPS + 1))
    assert any(norm > 0.5 for _, _, norm, *_ in ref["logs"]), "max_grad_norm must clip for the check to test it"
    _assert_logs_equal(rank0["logs"], ref["logs"], cases.SFT_METRICS, "ShardtrainSFTTrainer vs SFTTrainer")
    init = cases.tiny_llama().state_dict()
    assert_params_near(rank0["weights"], ref["weights"], init, require_moved=True, what="after SFT: ")

    # resume_from_checkpoint: steps 3-4 again, equal to the uninterrupted run, with Adam's continued state (TRL's
    # num_tokens is a count of this trainer's own steps: it restarts on resume, with the plain SFTTrainer too)
    resumed = rank0["resumed_logs"][SAVE_AT:]
    _assert_logs_equal(resumed, rank0["logs"][SAVE_AT:], cases.SFT_METRICS, "resumed", skip=("num_tokens",))
    assert rank0["resumed_adam_step"] == STEPS
    for name, value in rank0["weights"].items():
        torch.testing.assert_close(rank0["resumed_weights"][name], value, rtol=0, atol=1e-6, msg=name)

    # save_model: from_pretrained opens it and holds the engine's weights
    model = transformers.AutoModelForCausalLM.from_pretrained(final)
    assert type(model).__name__ == "LlamaForCausalLM"
    state = model.state_dict()
    assert state.keys() == rank0["weights"].keys()
    for name, value in rank0["weights"].items():
        assert torch.equal(state[name], value), name

    # LoRA through SFTTrainer's peft_config: the adapter holds the trained LoRA weights (lora_B starts at zero)
    from safetensors.torch import load_file

    saved = load_file(adapter / "adapter_model.safetensors")
    assert len(saved) == 8 and all(t.numel() > 0 for t in saved.values()), {k: t.shape for k, t in saved.items()}
    trained = {k.replace(".default", ""): v for k, v in rank0["lora_weights"].items()}
    assert saved.keys() == trained.keys()
    for name, value in saved.items():
        assert torch.equal(value, trained[name]), name
    assert all(saved[k].abs().max() > 0 for k in saved if "lora_B" in k)


def test_dpo_zero3_world2_sharded_reference_equals_plain_dpo(tmp_path):
    ref = run_distributed(
        cases.plain_dpo_run, 1, str(tmp_path / "ref"), 4, 2, STEPS, ROWS, init_process_group=False, timeout=300
    )[0]
    rank0 = run_distributed(cases.shardtrain_dpo_run, 2, str(tmp_path / "st"), 2, 2, STEPS, ROWS, timeout=400)[0]

    # the reference model differs from the policy: its log-probabilities move the loss and rewards from step 1
    assert ref["logs"][0][1] != pytest.approx(math.log(2), rel=1e-6), "the reference model must matter from step 1"
    _assert_logs_equal(rank0["logs"], ref["logs"], cases.DPO_METRICS, "ShardtrainDPOTrainer vs DPOTrainer")
    init = cases.tiny_llama().state_dict()
    assert_params_near(rank0["weights"], ref["weights"], init, require_moved=True, what="after DPO: ")

    # the reference model was sharded (ZeRO-3 units of its own: this rank holds about half of it), gathered once
    # per micro-step's forward (7 micro-batches: 2 + 2 + 1 + 2), released after, and frozen
    reference = rank0["reference"]
    assert reference["held"] <= reference["numel"] // 2 + 64, reference
    assert reference["gathers"] == [7] * len(reference["gathers"]) and len(reference["gathers"]) == 3, reference
    assert reference["states"] == {"sharded"} and not reference["requires_grad"]
    whole = reference["stage2"]
    assert whole == {"units": None, "types": {"Parameter"}, "requires_grad": False, "training": False, "equal": True}

    assert "sync_ref_model" in rank0["sync_refused"] and "stage 1 or 2" in rank0["sync_refused"]


@pytest.mark.soak
def test_dpo_lora_without_reference_model_equals_plain_dpo(tmp_path):
    """DPO on a peft model: no reference model, TRL disables the adapter for the reference forward (on the engine's
    module, outside the engine's forward)."""
    ref = run_distributed(
        cases.plain_dpo_run, 1, str(tmp_path / "ref"), 4, 2, STEPS, ROWS, True, init_process_group=False, timeout=300
    )[0]
    rank0 = run_distributed(cases.shardtrain_dpo_run, 2, str(tmp_path / "st"), 2, 2, STEPS, ROWS, True, timeout=400)[0]
    # rewards are differences of nearly equal log-probabilities here (the adapter starts at zero): compared absolutely
    what = "LoRA DPO: ShardtrainDPOTrainer vs DPOTrainer"
    _assert_logs_equal(rank0["logs"], ref["logs"], cases.DPO_METRICS, what, skip=cases.DPO_METRICS)
    for got, want in zip(rank0["logs"], ref["logs"], strict=True):
        for name, a, b in zip(cases.DPO_METRICS, got[4:], want[4:], strict=True):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), f"step {got[0]}: {name} {a!r} vs {b!r}"
    assert rank0["weights"].keys() == ref["weights"].keys()
    lora_b = [k for k in ref["weights"] if "lora_B" in k]
    assert lora_b and all(ref["weights"][k].abs().max() > 0 for k in lora_b), "the adapter must have trained"
    for name, value in rank0["weights"].items():
        torch.testing.assert_close(value, ref["weights"][name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.soak
def test_sft_world3_equals_plain_sft(tmp_path):
    """SFT at an odd world size: 3 ranks x 1 row against one process x 3 rows (15 rows: 5 micro-batches an epoch)."""
    rows = 15
    ref = run_distributed(
        cases.plain_sft_run, 1, str(tmp_path / "ref"), 3, 2, STEPS, rows, init_process_group=False, timeout=300
    )[0]
    args = (str(tmp_path / "st"), 1, 2, STEPS, rows, SAVE_AT, str(tmp_path / "final"), str(tmp_path / "adapter"))
    rank0 = run_distributed(cases.shardtrain_sft_run, 3, *args, timeout=600)[0]
    _assert_logs_equal(rank0["logs"], ref["logs"], cases.SFT_METRICS, "world 3: ShardtrainSFTTrainer vs SFTTrainer")
    init = cases.tiny_llama().state_dict()
    assert_params_near(rank0["weights"], ref["weights"], init, require_moved=True, what="world 3, after SFT: ")
