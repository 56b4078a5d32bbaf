"""bf16 under expert parallelism: the first step's gradients are as close to the fp32 truth as one process's bf16
gradients are (the same model and global batch), parameter by parameter, so what drifts later in bf16 runs is
rounding that AdamW's normalized updates amplify, not a gradient the token exchange gets wrong."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardtrain.testing import run_distributed

EXPERTS, ROWS = 4, 2


def _model():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=EXPERTS, num_experts_per_tok=2, max_position_embeddings=32,
        attn_implementation="eager", initializer_range=0.2, output_router_logits=True, router_aux_loss_coef=0.1,
        tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(cfg)


def _first_gradients(ep: int, stage: int) -> dict[str, tuple[float, float]]:
    """Per parameter: (the engine's bf16 gradient error, one process's bf16 gradient error), each relative to the
    norm of one process's fp32 gradient; an expert parameter's over this rank's experts."""
    import shardtrain.deepspeed as deepspeed
    from shardtrain.deepspeed.utils import safe_get_full_grad

    world, rank = dist.get_world_size(), dist.get_rank()
    ids = torch.randint(0, 32, (world * ROWS, 6), generator=torch.Generator().manual_seed(1))

    def mean_loss(model):
        parts = [model(input_ids=ids[r * ROWS : (r + 1) * ROWS], labels=ids[r * ROWS : (r + 1) * ROWS]).loss
                 for r in range(world)]  # fmt: skip
        return sum(parts) / world

    truth, one = _model(), _model().to(torch.bfloat16)
    mean_loss(truth).backward()
    mean_loss(one).backward()
    config = {
        "train_micro_batch_size_per_gpu": ROWS,
        "expert_parallel_size": ep,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "steps_per_print": 10**6,
    }
    model = _model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    mine = ids[rank * ROWS : (rank + 1) * ROWS]
    engine.backward(engine(input_ids=mine, labels=mine).loss)
    lo = engine.shardtrain_engine.topology.ep_rank * (EXPERTS // ep)
    out = {}
    for (name, p), t, o in zip(model.named_parameters(), truth.parameters(), one.parameters(), strict=True):
        cut = slice(lo, lo + EXPERTS // ep) if ".experts." in name else slice(None)
        want, ours, theirs = t.grad[cut], safe_get_full_grad(p), o.grad.float()[cut]
        scale = float(want.norm())
        out[name] = (float((ours - want).norm()) / scale, float((theirs - want).norm()) / scale)
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_gradients_under_expert_parallelism_as_close_as_one_process(stage):
    for errors in run_distributed(_first_gradients, 2, 2, stage):
        assert any(".experts." in n for n in errors)
        for name, (ours, theirs) in errors.items():
            assert 0 < theirs < 0.05, (name, theirs)  # bf16 rounding, measured 0.7-2.1%
            assert ours <= 1.25 * theirs, (name, ours, theirs)  # measured 0.92-1.06x of one process's
