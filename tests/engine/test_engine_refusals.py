"""A configuration ``initialize`` refuses leaves everything as it was: the model's parameters are the same objects
with the same values, and no swap directory was made (the refusal comes before the model, its parameters or the disk
are touched)."""

from __future__ import annotations

import pytest
import torch

import shardtrain
from shardtrain.errors import ConfigError
from shardtrain.models.gpt import GPT, GPTConfig
from shardtrain.testing import run_distributed

NVME = {"device": "nvme", "nvme_path": "<tmp>"}
CASES = {
    "a unit class the model does not have": (
        {"stage": 3, "stage3_unit_classes": ["DecoderLayer"], "offload_param": NVME},
        {},
        "zero_optimization.stage3_unit_classes: no module of class 'DecoderLayer' in the model",
    ),
}


def _refused(case: str, path: str) -> dict:
    from shardtrain.tensor_parallel import GPT_TP_PLAN

    zero, extra, _ = CASES[case]
    zero = {k: ({**v, "nvme_path": path} if v is NVME else v) for k, v in zero.items()}
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=2, n_head=4))
    before = [(n, p, p.detach().clone()) for n, p in model.named_parameters()]
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero, **extra}
    tp_plan = GPT_TP_PLAN if "tensor_parallel" in extra else None
    try:
        shardtrain.initialize(model, config, torch.optim.AdamW(model.parameters()), tp_plan=tp_plan)
    except ConfigError as err:
        message = str(err)
    else:
        message = "not refused"
    after = list(model.named_parameters())
    return {
        "message": message,
        "same_objects": [n for n, _ in after] == [n for n, _, _ in before]
        and all(p is q for (_, p), (_, q, _) in zip(after, before)),
        "same_values": all(torch.equal(p.detach(), v) for (_, p), (_, _, v) in zip(after, before)),
        "plain_parameters": all(type(p) is torch.nn.Parameter for _, p in after),
    }


@pytest.mark.parametrize("case", CASES)
def test_a_refusal_leaves_the_model_and_the_disk_untouched(case, tmp_path):
    """Failed before for graph mode: the refusal came at the end of Engine.__init__, after the parameters had been
    sharded into flat buffers and the swap directories (3 entries) were made and left behind."""
    for r in run_distributed(_refused, 2, case, str(tmp_path)):
        assert CASES[case][2] in r["message"], r["message"]
        assert r["same_objects"] and r["same_values"] and r["plain_parameters"], r
    assert list(tmp_path.iterdir()) == []  # no swap directory made, none left behind
