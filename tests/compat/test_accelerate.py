"""accelerate's DeepSpeed path on shardtrain (shardtrain.integrations.accelerate): a plain accelerate loop with a
DeepSpeedPlugin gives real DeepSpeed's losses, learning rates and weights, save_state/load_state resumes it exactly,
and a world size accelerate miscounts on a machine without a GPU is named (the Accelerator and the Trainer).

Real DeepSpeed 0.19.8 is the reference (DS_ACCELERATOR=cpu, gloo; tests/conftest.py sets it); both run the loop of
tests/helpers/accelerate_cases.py at world 2, with ZeRO's stages, accumulation (one accumulation a loader's epoch
cut short), a scheduler of each kind accelerate knows, save_state after the first epoch and get_state_dict.
"""

from __future__ import annotations

import importlib.metadata
import math
import sys
import types

import pytest
import torch

from shardtrain.compat.deepspeed.unsupported import NotProvidedError
from shardtrain.config.sections import load_config
from shardtrain.errors import ShardtrainError
from shardtrain.testing import run_distributed

from helpers import accelerate_cases as cases

pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")

LOSS_RTOL = 1e-5  # fp32 sums in another order (the reduction, the clipping norm)
DEEPSPEED_ENGINE = "deepspeed.runtime.engine.DeepSpeedEngine"
SHIM_ENGINE = "shardtrain.compat.deepspeed.engine.DeepSpeedEngine"


def _assert_close_lists(got: list[float], want: list[float], rtol: float, what: str) -> None:
    assert len(got) == len(want), (what, got, want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == pytest.approx(w, rel=rtol, abs=rtol), f"{what}: micro-batch {i}: {g!r} vs {w!r}"


def _compare(stages: list[int], variant: str, tmp_path) -> None:
    reference = run_distributed(cases.run, 2, False, stages, variant, str(tmp_path / "ds"), timeout=400)
    ours = run_distributed(cases.run, 2, True, stages, variant, str(tmp_path / "st"), timeout=400)
    init = cases.Net(0).state_dict()
    for stage in stages:
        for rank in (0, 1):
            want, got = reference[rank][stage], ours[rank][stage]
            what = f"stage {stage} {variant} rank {rank}"
            # the route was taken: accelerate ran real DeepSpeed's engine on one side and the shim's on the other,
            # over both processes
            assert (want["engine"], got["engine"]) == (DEEPSPEED_ENGINE, SHIM_ENGINE), what
            assert want["num_processes"] == got["num_processes"] == 2, what
            _assert_close_lists(got["losses"], want["losses"], LOSS_RTOL, what + " losses")
            assert got["lrs"] == pytest.approx(want["lrs"], rel=1e-12), what
            # the resume from save_state (a model built from another seed) continues the uninterrupted run exactly
            _assert_close_lists(got["resumed"], got["losses"][5:], 1e-7, what + " resumed vs uninterrupted")
            _assert_close_lists(want["resumed"], want["losses"][5:], 1e-7, what + " DeepSpeed's own resume")
            assert got["resumed_lr"] == pytest.approx(want["resumed_lr"], rel=1e-12), what
        want, got = reference[0][stage], ours[0][stage]
        assert set(got["weights"]) == set(want["weights"]) == set(init), stage
        for name, value in want["weights"].items():
            assert not torch.equal(value, init[name]), f"{name} did not move: the comparison would prove nothing"
            torch.testing.assert_close(got["weights"][name], value, rtol=1e-5, atol=1e-6, msg=f"stage {stage} {name}")
            torch.testing.assert_close(got["resumed_weights"][name], got["weights"][name], rtol=0, atol=1e-7)


def test_accelerate_loop_equals_deepspeed_at_zero3(tmp_path):
    """The default case: ZeRO-3, DeepSpeed's own scheduler class (deepspeed.runtime.lr_schedules, stepped by the
    engine), gradient accumulation with a short last accumulation, save_state/load_state, get_state_dict."""
    _compare([3], "deepspeed_scheduler", tmp_path)


@pytest.mark.soak
@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant", cases.VARIANTS)
def test_accelerate_loop_equals_deepspeed_every_stage(variant, tmp_path):
    _compare([1, 2, 3], variant, tmp_path)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_configs_accelerate_writes_are_taken(stage):
    """The config DeepSpeedPlugin writes from its arguments (``steps_per_print: inf``, offload sections with
    ``nvme_path: None``), with what ``prepare`` adds: the batch sizes and ``zero_allow_untested_optimizer``."""
    from accelerate.utils import DeepSpeedPlugin

    offload = "cpu" if stage else "none"  # offload needs ZeRO (DeepSpeed refuses it at stage 0 too)
    plugin = DeepSpeedPlugin(
        zero_stage=stage, gradient_clipping=1.0, offload_optimizer_device=offload, zero3_init_flag=False
    )
    config = dict(plugin.deepspeed_config)
    assert config["steps_per_print"] == math.inf
    config.update(
        train_batch_size=8,
        train_micro_batch_size_per_gpu=2,
        gradient_accumulation_steps=2,
        zero_allow_untested_optimizer=True,
    )
    cfg = load_config(config)
    assert (cfg.steps_per_print, cfg.zero_optimization.stage) == (None, stage)  # inf: never, as absent


def test_cpu_world_miscounted_by_accelerate_is_named():
    """Under torchrun on a machine without a GPU, accelerate counts one process unless told to use the CPU; the
    Trainer then derives one process's batch sizes, and an Accelerator gives every rank every batch."""
    if torch.cuda.is_available():
        pytest.skip("accelerate counts the processes right where there is a GPU")
    trainer = run_distributed(cases.trainer_without_use_cpu, 2, "unused-dir", init_process_group=False)[0]
    assert "TrainingArguments sees 1 process(es), but 2 were launched" in trainer, trainer
    assert "use_cpu=True" in trainer, trainer
    accelerator = run_distributed(cases.accelerator_without_a_backend_on_cpu, 2, init_process_group=False)[0]
    assert "the Accelerator sees 1 process(es), but 2 were launched" in accelerator, accelerator
    assert "InitProcessGroupKwargs(backend='gloo')" in accelerator, accelerator


@pytest.fixture
def clean_deepspeed_modules():
    """This process's ``deepspeed`` modules and metadata finders as they were, after the test put the shim there."""
    saved = {k: m for k, m in sys.modules.items() if k == "deepspeed" or k.startswith("deepspeed.")}
    meta_path = list(sys.meta_path)
    for name in saved:
        del sys.modules[name]
    try:
        yield
    finally:
        for name in [k for k in sys.modules if k == "deepspeed" or k.startswith("deepspeed.")]:
            del sys.modules[name]
        sys.modules.update(saved)
        sys.meta_path[:] = meta_path


def test_deepspeed_import_is_the_shim_and_its_metadata_the_shims(clean_deepspeed_modules):
    from accelerate.utils import is_deepspeed_available
    from accelerate.utils.versions import compare_versions

    import shardtrain.deepspeed
    from shardtrain.integrations.accelerate import use_shardtrain_for_deepspeed

    use_shardtrain_for_deepspeed()
    use_shardtrain_for_deepspeed()  # a second call does nothing
    import deepspeed
    import deepspeed.comm
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES, WarmupLR

    from shardtrain.optim.schedulers import WarmupLR as ShardtrainWarmupLR

    assert deepspeed is shardtrain.deepspeed and deepspeed.comm is shardtrain.deepspeed.comm
    assert WarmupLR is ShardtrainWarmupLR
    # what accelerate asks the package metadata: installed, and which release (the shim's, whatever is installed)
    assert importlib.metadata.version("deepspeed") == deepspeed.__version__ == "0.19.8"
    assert is_deepspeed_available() and compare_versions("deepspeed", ">=", "0.18.2")
    assert VALID_LR_SCHEDULES == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    with pytest.raises(ImportError, match=r"deepspeed\.runtime\.sequence_parallel is not provided by shardtrain"):
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF  # noqa: F401
    with pytest.raises(NotProvidedError, match=r"deepspeed\.runtime\.engine is not provided"):
        deepspeed.runtime.engine  # noqa: B018


def test_refused_after_the_real_deepspeed_was_imported(clean_deepspeed_modules):
    from shardtrain.integrations.accelerate import use_shardtrain_for_deepspeed

    sys.modules["deepspeed"] = types.ModuleType("deepspeed")  # as `import deepspeed` leaves it, for this check
    with pytest.raises(ShardtrainError, match="the real deepspeed was imported before it"):
        use_shardtrain_for_deepspeed()
