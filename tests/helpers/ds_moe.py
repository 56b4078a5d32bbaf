"""DeepSpeed AutoEP checkpoints of a tiny random Mixtral, written by DeepSpeed itself (CPU accelerator, gloo):
:func:`write_autoep_checkpoint` runs on every rank of a ``run_distributed`` job and returns the global losses before
and after the save. ``python tests/helpers/ds_moe.py`` rewrites ``tests/data/deepspeed_autoep`` (world 4,
``autoep_size`` 2, ZeRO stage 2: each expert group's param group partitioned over 2 ranks), which the default
suite reads without running DeepSpeed ([Note: DeepSpeed AutoEP checkpoints] in
``checkpoint/foreign/deepspeed_moe.py``).

DeepSpeed 0.19.8's AutoEP calls ``registry.get(key, default)`` on transformers' output-recorder registry, whose
``get`` takes one argument since transformers 5.2x: :func:`_registry_accepts_a_default` gives it dict's signature
back in the writing processes only.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported anywhere in this process

import torch
import torch.distributed as dist

VOCAB, SEQ, ROWS, LR, EXPERTS = 32, 6, 8, 1e-2, 4
SAVE_AT, STEPS = 2, 4
DATA = Path(__file__).parents[1] / "data" / "deepspeed_autoep"


def tiny_mixtral(seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=24, num_local_experts=EXPERTS, num_experts_per_tok=2, max_position_embeddings=32,
        tie_word_embeddings=False, attn_implementation="eager", output_router_logits=False, initializer_range=0.2,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(cfg)


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (ROWS, SEQ), generator=g) for _ in range(STEPS)]


def _registry_accepts_a_default() -> None:
    from transformers.utils import output_capturing

    def get(self, key, *default):
        if default:  # dict's signature, which DeepSpeed's AutoEP calls
            return dict.get(self, key, *default)
        return dict.get(self, str(key.__class__)) or {}

    output_capturing._CanRecordRegistry.get = get


def write_autoep_checkpoint(save_dir: str, ep: int, stage: int) -> dict:
    """Train ``SAVE_AT`` steps with DeepSpeed AutoEP (``autoep_size`` ``ep``), save (tag ``t``), train to ``STEPS``;
    the mean over ranks of each step's loss."""
    import deepspeed

    _registry_accepts_a_default()
    model = tiny_mixtral()
    world, rank = dist.get_world_size(), dist.get_rank()
    config = {
        "train_micro_batch_size_per_gpu": ROWS // world,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
        "expert_parallel": {"enabled": True, "autoep_size": ep, "preset_model": "mixtral", "use_grouped_mm": False},
    }
    with contextlib.redirect_stdout(io.StringIO()):
        engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    losses = []
    rows = ROWS // world
    for step, ids in enumerate(batches()):
        if step == SAVE_AT:
            engine.save_checkpoint(save_dir, tag="t")
        ids = ids[rank * rows : (rank + 1) * rows]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        t = loss.detach().double()
        dist.all_reduce(t)
        losses.append(float(t) / world)
    return {"before": losses[:SAVE_AT], "after": losses[SAVE_AT:]}


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parents[2] / "src"))
    from shardtrain.testing import run_distributed

    tmp = DATA.with_name("deepspeed_autoep.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    losses = run_distributed(write_autoep_checkpoint, 4, str(tmp), 2, 2, timeout=600)[0]
    for script in tmp.glob("*.py"):  # zero_to_fp32.py and its kin, which DeepSpeed copies next to a save
        script.unlink()
    (tmp / "losses.json").write_text(json.dumps(losses, indent=1) + "\n")
    (tmp / "README").write_text(
        "Written by DeepSpeed 0.19.8 (AutoEP, autoep_size 2, ZeRO stage 2, world 4, CPU) from tests/helpers/ds_moe.py; "
        "losses.json: DeepSpeed's global losses before the save and after it.\n"
    )
    shutil.rmtree(DATA, ignore_errors=True)
    tmp.rename(DATA)


if __name__ == "__main__":
    main()
