"""Engine checkpoints of CUDA tensors: the writer stages pieces in pinned host memory, the reader's values are
copied onto each parameter's device. Exact resume (bitwise) at world 1, and at world 2 over NCCL when there are two
GPUs. Skipped without CUDA."""

from __future__ import annotations

import os

import pytest
import torch

from shardtrain.distributed.mesh import ensure_process_group
from shardtrain.testing import run_distributed

from helpers.resume import exact_resume, make_engine

pytestmark = pytest.mark.gpu  # engine checkpoints of CUDA tensors (NCCL at world 2)


def _resume_on_cuda(root: str) -> list[str]:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS: the two runs must agree
    torch.use_deterministic_algorithms(True, warn_only=True)
    ensure_process_group(300.0)  # NCCL on this rank's GPU (LOCAL_RANK)
    engine = make_engine(0, 3, "adamw")
    where = {t.device.type for t in (*engine.module.parameters(), *engine.module.buffers())}
    problems = [] if where == {"cuda"} else [f"the model lives on {where}, not on CUDA"]
    problems += exact_resume(root, [0, 1, 2, 3], ["sgd", "adamw"])
    problems += exact_resume(root, [2, 3], ["adamw"], "bf16")
    return problems


@pytest.mark.parametrize("world", [1, 2])
def test_exact_resume_on_cuda(tmp_path, world):
    if torch.cuda.device_count() < world:
        pytest.skip(
            f"world {world} needs {world} GPUs (one per NCCL rank); this machine has {torch.cuda.device_count()}"
        )
    results = run_distributed(_resume_on_cuda, world, str(tmp_path), init_process_group=False, timeout=600)
    problems = [f"rank {r}: {p}" for r, ps in enumerate(results) for p in ps]
    assert not problems, "\n".join(problems)
