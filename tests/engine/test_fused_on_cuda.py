"""A config's Adam, AdamW and SGD are built fused on CUDA, as DeepSpeed builds its fused Adam there (an fp16 overflow
is then skipped in the kernel, without reading it on the host); a section that says ``fused`` or ``foreach`` decides."""

import pytest
import torch

from shardtrain.config.sections import load_config
from shardtrain.engine.optimizers import build_optimizer


def _built(section: dict, device: str) -> torch.optim.Optimizer:
    config = load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": section})
    return build_optimizer(torch.nn.Linear(4, 2), config, None, torch.device(device))


@pytest.mark.parametrize("kind", ["Adam", "AdamW", "SGD"])
def test_a_configs_optimizer_is_fused_on_cuda_only(kind):
    section = {"type": kind, "params": {"lr": 1e-3}}
    on_cuda = _built(section, "cuda")  # built on the CPU's parameters: torch's fused kernels run there too
    assert on_cuda.param_groups[0]["fused"] is True and on_cuda._step_supports_amp_scaling
    assert not _built(section, "cpu").param_groups[0]["fused"]


@pytest.mark.parametrize("given", [{"fused": False}, {"foreach": True}])
def test_a_section_that_chooses_the_implementation_is_kept(given):
    built = _built({"type": "AdamW", "params": {"lr": 1e-3, **given}}, "cuda")
    assert not built.param_groups[0]["fused"]
    assert built.param_groups[0]["foreach"] == given.get("foreach")
