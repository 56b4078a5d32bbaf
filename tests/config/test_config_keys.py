"""Every key the config table calls supported has an effect: this file walks the table and shows it, key by key.

For each supported key of :data:`shardtrain.config.deepspeed_keys.RULES` (sections aside: a section's effect is its
keys') one check below builds engines that differ only in that key, in a mode where the key has an effect, and asserts
what changes: the update applied, the buckets laid out, the collectives issued, the files written, the lines logged. The
modes where a key has no effect are :data:`~shardtrain.config.deepspeed_keys.NO_EFFECT_WHEN`'s; the second half checks
that ``shardtrain config check`` names each of them for a config that combines them. A key added to the table as
supported without a check here, or a check without its key, fails :func:`test_every_supported_key_has_an_effect_check`.

Checks are cheap: world 1, run together in one worker process (each key is still its own test), and one world-2 run
for what needs two ranks (tensor parallelism, the desync check, the collective timeout).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardtrain
from shardtrain.cli import main
from shardtrain.config.deepspeed_keys import NO_EFFECT_WHEN, RULES, Kind
from shardtrain.config.sections import inspect_config
from shardtrain.distributed.mesh import pick_device
from shardtrain.errors import (
    CollectiveTimeoutError,
    ConfigError,
    GraphCaptureError,
    LayoutError,
    OptimizerError,
    RankMismatchError,
    ShardtrainError,
)
from shardtrain.models.gpt import GPT, GPTConfig
from shardtrain.tensor_parallel import GPT_TP_PLAN
from shardtrain.testing import run_distributed

_Z = "zero_optimization."
SUPPORTED = [r.path for r in RULES if r.kind is Kind.SUPPORTED]
SECTIONS = {r.path for r in RULES if r.kind is Kind.SUPPORTED and r.values == "section"}
KEYS = [p for p in SUPPORTED if p not in SECTIONS]

# Keys whose effect in one mode is shown elsewhere: graph mode at stage 3, where `stage3_prefetch_bucket_size` and
# `overlap_comm` act on the captured graphs' schedule
# (tests/graph/test_graph_zero3.py::test_the_schedule_follows_prefetch_
# and_overlap_and_its_peak_is_measured_from_the_graphs; `stage3_gather_check` has none there, see NO_EFFECT_WHEN), and
# `collective_timeout_s` for a process group the user made before initialize
# (tests/reliability/test_reliability_groups.py).

EFFECTS: dict[str, Callable[[Path], None]] = {}
"""key -> check, run at world 1 with a scratch directory of its own."""
TWO_RANKS = (
    "tensor_parallel.size",
    "tensor_parallel.autotp_size",
    "desync_check",
    "collective_timeout_s",
    _Z + "mics_shard_size",
    "sequence_parallel_size",
    "context_parallel_size",
    "expert_parallel_size",
    "moe.ep_size",
    "expert_parallel.autoep_size",
    "expert_parallel.enabled",
    "pipeline_parallel_size",
    "pipeline.schedule",
    "pipeline.stages_per_rank",
    "pipeline.activation_checkpoint_interval",
)
"""Keys shown by the world-2 run (:func:`_two_ranks`)."""
FOUR_RANKS = (_Z + "zero_hpz_partition_size",)
"""Keys shown by the world-4 run (:func:`_four_ranks`): an hpZ group must be smaller than the data-parallel size."""


class Skip(Exception):
    """A check that cannot run on this machine (no CUDA, a package not installed): the test is skipped, with why."""


def effect(*paths: str) -> Callable:
    def register(fn: Callable[[Path], None]) -> Callable[[Path], None]:
        for p in paths:
            assert p not in EFFECTS, f"two checks for {p}"
            EFFECTS[p] = fn
        return fn

    return register


# -- what the checks build ------------------------------------------------------------------------------------------

VOCAB, SEQ = 64, 16


def _gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_layer=2, n_head=4))


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    return x, torch.roll(x, -1, dims=1)


_STAGE3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
"""Stage 3 with every parameter in a unit (the GPT's are all below the default persistence threshold)."""


def _sgd(lr: float = 0.1) -> Callable:
    return lambda params: torch.optim.SGD(params, lr=lr)


def _engine(config: dict, model: nn.Module | None = None, optimizer: Any = "sgd", **kwargs: Any) -> shardtrain.Engine:
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6, **config}
    if optimizer == "sgd":
        optimizer = None if "optimizer" in config else _sgd()
    return shardtrain.initialize(model if model is not None else _gpt(), config=config, optimizer=optimizer, **kwargs)


def _mixtral() -> nn.Module:
    """A tiny random Mixtral (4 experts, top-2): the model expert_parallel_size splits."""
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=16, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, attn_implementation="eager",
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config)


def _micro_step(engine: shardtrain.Engine, batch: tuple | None = None) -> float:
    x, y = batch or _batch()
    loss = engine(x.to(engine.device), y.to(engine.device))
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def _params(engine: shardtrain.Engine) -> torch.Tensor:
    return torch.cat([t.detach().flatten().double() for t in engine.full_state_dict().values()])


def _update(config: dict, steps: int = 1, **kwargs: Any) -> torch.Tensor:
    """The parameters' change over ``steps`` micro-steps of a fresh engine."""
    engine = _engine(config, **kwargs)
    before = _params(engine)
    for _ in range(steps):
        _micro_step(engine)
    return _params(engine) - before


# a change of fp32 parameters is known to within their rounding: one ulp of the largest (LayerNorm's 1.0)
_ROUNDING = 2 * torch.finfo(torch.float32).eps


def _micro_steps_per_update(config: dict) -> int:
    engine = _engine(config)
    for n in range(1, 9):
        _micro_step(engine)
        if engine.global_step == 1:
            return n
    raise AssertionError("no optimizer step in 8 micro-steps")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> _Records:
        logger = logging.getLogger("shardtrain")
        self._level = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        logger = logging.getLogger("shardtrain")
        logger.removeHandler(self)
        logger.setLevel(self._level)


def _spy(obj: Any, name: str, on_call: Callable) -> None:
    """Let ``on_call(result, *args, **kwargs)`` see every call of the bound method ``obj.name``."""
    inner = getattr(obj, name)

    def spied(*args: Any, **kwargs: Any) -> Any:
        out = inner(*args, **kwargs)
        return on_call(out, *args, **kwargs)

    setattr(obj, name, spied)


class _Tiny(nn.Module):
    """A two-layer regression for graph mode (captured in a second, unlike the GPT)."""

    def __init__(self, graph_break: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.graph_break = nn.Linear(4, 8), nn.Linear(8, 1), graph_break

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if self.graph_break:
            torch._dynamo.graph_break()  # a construct TorchDynamo cannot put in the graph
        return ((self.b(h) - y) ** 2).mean()


def _graph_engine(graph: dict, model: nn.Module | None = None) -> shardtrain.Engine:
    return shardtrain.initialize(
        model if model is not None else _Tiny(),
        config={"train_micro_batch_size_per_gpu": 2, "graph": {"enabled": True, **graph}},
        optimizer=_sgd(),
    )


def _tiny_step(engine: shardtrain.Engine, rank: int = 2) -> None:
    shape = (2, 4) if rank == 2 else (2, 3, 4)
    x, y = torch.randn(shape, device=engine.device), torch.randn((*shape[:-1], 1), device=engine.device)
    engine.backward(engine(x, y))
    engine.step()


# -- batch sizes ------------------------------------------------------------------------------------------------------


@effect("train_batch_size")
def _train_batch_size(tmp: Path) -> None:
    # micro-batch 2 on one rank: the global batch says how many micro-steps make one optimizer step
    assert _micro_steps_per_update({"train_batch_size": 8}) == 4
    assert _micro_steps_per_update({"train_batch_size": 2}) == 1


@effect("train_micro_batch_size_per_gpu")
def _micro_batch(tmp: Path) -> None:
    assert _micro_steps_per_update({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4}) == 2
    assert _micro_steps_per_update({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}) == 4


@effect("gradient_accumulation_steps")
def _accumulation(tmp: Path) -> None:
    assert _micro_steps_per_update({"gradient_accumulation_steps": 3}) == 3
    # the loss is divided by the steps: three identical micro-batches move the model as one does at 1 step
    three, one = _update({"gradient_accumulation_steps": 3}, steps=3), _update({})
    torch.testing.assert_close(three, one, rtol=0, atol=_ROUNDING)


# -- optimizer and scheduler ----------------------------------------------------------------------------------------


@effect("optimizer.type")
def _optimizer_type(tmp: Path) -> None:
    sgd = _engine({"optimizer": {"type": "SGD", "params": {"lr": 0.01}}}, optimizer=None)
    adamw = _engine({"optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}, optimizer=None)
    adam = _engine({"optimizer": {"type": "Adam", "params": {"lr": 0.01, "adam_w_mode": False}}}, optimizer=None)
    assert (type(sgd.optimizer), type(adamw.optimizer), type(adam.optimizer)) == (
        torch.optim.SGD,
        torch.optim.AdamW,
        torch.optim.Adam,
    )
    # Adam's first step moves every parameter with a gradient by about lr; SGD's by lr x gradient
    d_sgd = _update({"optimizer": {"type": "SGD", "params": {"lr": 0.01}}}, optimizer=None)
    d_adam = _update({"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}}}, optimizer=None)
    assert d_adam.abs().max() == pytest.approx(0.01, rel=1e-3)
    assert d_sgd.abs().max() < 0.005


@effect("optimizer.params.bias_correction")
def _bias_correction(tmp: Path) -> None:
    from shardtrain.optim.adam import DeepSpeedAdam

    def adam(bias_correction: bool) -> dict:
        params = {"lr": 0.01, "weight_decay": 0.0, "bias_correction": bias_correction}
        return {"optimizer": {"type": "Adam", "params": params}}

    assert type(_engine(adam(False), optimizer=None).optimizer) is DeepSpeedAdam
    # first step: corrected moments move each parameter by about lr; raw ones by lr (1 - beta1) / sqrt(1 - beta2)
    corrected = _update(adam(True), optimizer=None)
    raw = _update(adam(False), optimizer=None)
    assert corrected.abs().max() == pytest.approx(0.01, rel=1e-3)
    assert raw.abs().max() == pytest.approx(0.01 * 0.1 / 0.001**0.5, rel=1e-3)


@effect("optimizer.params")
def _optimizer_params(tmp: Path) -> None:
    slow = _update({"optimizer": {"type": "SGD", "params": {"lr": 0.05}}}, optimizer=None)
    fast = _update({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, optimizer=None)
    assert slow.abs().max() > 0
    torch.testing.assert_close(fast, 2 * slow, rtol=0, atol=_ROUNDING)


def _lrs(scheduler: dict, steps: int = 4) -> list[float]:
    engine = _engine({"scheduler": scheduler})
    out = []
    for _ in range(steps):
        _micro_step(engine)
        out.append(engine.get_lr()[0])
    return out


_WARMUP = {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 2, "warmup_type": "linear"}


@effect("scheduler.type")
def _scheduler_type(tmp: Path) -> None:
    warmup = _lrs({"type": "WarmupLR", "params": _WARMUP})
    decay = _lrs({"type": "WarmupDecayLR", "params": {**_WARMUP, "total_num_steps": 3}})
    assert warmup[-1] == pytest.approx(0.1)  # stays at the maximum
    # decays to 0 at total_num_steps: the lr after 4 steps is DeepSpeed's formula at last_batch_iteration 3
    assert decay[-1] == pytest.approx(0.0, abs=1e-12)
    # ratios of the optimizer's lr (0.1): linear warm-up over 2 steps, then a cosine down to cos_min_ratio at step 4
    cosine = {"total_num_steps": 4, "warmup_num_steps": 2, "warmup_type": "linear", "cos_min_ratio": 0.1}
    assert _lrs({"type": "WarmupCosineLR", "params": cosine}) == pytest.approx([0.0, 0.05, 0.055, 0.01])
    # up from 0.01 to 0.11 over 2 steps and back over 2: the lr after each step
    one_cycle = {"cycle_min_lr": 0.01, "cycle_max_lr": 0.11, "cycle_first_step_size": 2, "cycle_momentum": False}
    assert _lrs({"type": "OneCycle", "params": one_cycle}) == pytest.approx([0.06, 0.11, 0.06, 0.01])


@effect("scheduler.params")
def _scheduler_params(tmp: Path) -> None:
    assert _lrs({"type": "WarmupLR", "params": _WARMUP})[-1] == pytest.approx(0.1)
    assert _lrs({"type": "WarmupLR", "params": {**_WARMUP, "warmup_max_lr": 0.03}})[-1] == pytest.approx(0.03)
    # linear warm-up over 2 steps: half-way after the first
    assert _lrs({"type": "WarmupLR", "params": _WARMUP}, steps=1)[0] < 0.1


class _SGDWithItsOwnStep(torch.optim.SGD):
    def step(self, closure=None):
        return super().step(closure)


@effect("zero_allow_untested_optimizer")
def _untested_optimizer(tmp: Path) -> None:
    config = {"zero_optimization": {"stage": 1}}
    with pytest.raises(OptimizerError, match="zero_allow_untested_optimizer"):
        _engine(config, optimizer=lambda p: _SGDWithItsOwnStep(p, lr=0.1))
    engine = _engine(
        {**config, "zero_allow_untested_optimizer": True}, optimizer=lambda p: _SGDWithItsOwnStep(p, lr=0.1)
    )
    assert type(engine.optimizer) is _SGDWithItsOwnStep


# -- precision --------------------------------------------------------------------------------------------------------


def _first_bucket_reduction(config: dict) -> tuple[str, torch.Tensor]:
    """(op, input) of the first gradient-bucket reduce-scatter of a stage-2 micro-step (world 1)."""
    engine = _engine({"zero_optimization": {"stage": 2}, **config})
    sent: list[tuple[str, torch.Tensor]] = []

    def record(out: Any, out_tensor: torch.Tensor, inp: torch.Tensor, op: str = "sum", **kwargs: Any) -> Any:
        sent.append((op, inp.clone()))  # the input as sent (a reduction over one rank leaves it as it is)
        return out

    _spy(engine.comm, "reduce_scatter", record)
    _micro_step(engine)
    return sent[0]


@effect("prescale_gradients")
def _prescale(tmp: Path) -> None:
    # DeepSpeed's prescale: divide by the data-parallel size (1 here), then sum, instead of averaging in the reduction
    assert _first_bucket_reduction({})[0] == "avg"
    op, sent = _first_bucket_reduction({"prescale_gradients": True})
    assert op == "sum"
    torch.testing.assert_close(sent, _first_bucket_reduction({})[1], rtol=0, atol=0)  # divided by 1


@effect("gradient_predivide_factor")
def _predivide(tmp: Path) -> None:
    plain = _first_bucket_reduction({})[1]
    op, sent = _first_bucket_reduction({"gradient_predivide_factor": 2.0})
    assert op == "sum"
    torch.testing.assert_close(sent, plain / 2, rtol=0, atol=0)  # what goes on the wire is divided by the factor


class _SeesInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.seen = nn.Linear(4, 1), None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = x.dtype
        return self.lin(x.to(self.lin.weight.dtype)).float().square().mean()


@effect("fp16.auto_cast")
def _auto_cast(tmp: Path) -> None:
    def seen(auto_cast: bool) -> torch.dtype:
        model = _SeesInput()
        engine = _engine({"fp16": {"enabled": True, "auto_cast": auto_cast}}, model=model)
        engine.backward(engine(torch.randn(2, 4, device=engine.device)))
        return model.seen

    assert (seen(False), seen(True)) == (torch.float32, torch.float16)


@effect("communication_data_type")
def _communication_dtype(tmp: Path) -> None:
    def reduced_dtypes(config: dict) -> set[torch.dtype]:
        engine = _engine({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}, **config})
        seen: set[torch.dtype] = set()

        def record(out: Any, out_tensor: torch.Tensor, inp: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            seen.add(inp.dtype)
            return out

        _spy(engine.comm, "reduce_scatter", record)
        _micro_step(engine)
        return seen

    assert reduced_dtypes({}) == {torch.bfloat16}  # DeepSpeed's default: the compute dtype
    assert reduced_dtypes({"communication_data_type": "fp32"}) == {torch.float32}


@effect(_Z + "stage3_gather_16bit_weights_on_model_save")
def _gather_16bit(tmp: Path) -> None:
    from shardtrain.compat.deepspeed.engine import DeepSpeedEngine

    def saved(flag: bool) -> tuple[bool, bool]:
        zero = {**_STAGE3, "stage3_gather_16bit_weights_on_model_save": flag}
        engine = DeepSpeedEngine(_engine({"zero_optimization": zero}))
        done = engine.save_16bit_model(str(tmp / str(flag)))
        return done, (tmp / str(flag) / "pytorch_model.bin").exists()

    assert saved(False) == (False, False)  # as DeepSpeed: nothing written at stage 3 without it
    assert saved(True) == (True, True)


@effect("data_types.grad_accum_dtype")
def _grad_accum_dtype(tmp: Path) -> None:
    def grads(config: dict, stage: int) -> torch.dtype:
        engine = _engine({"bf16": {"enabled": True}, "zero_optimization": {"stage": stage}, **config})
        reducer = engine._reducer
        return {g.dtype for g in (reducer.full_grads or reducer.shard_grads)}

    for stage in (1, 2):
        assert grads({}, stage) == {torch.bfloat16}  # DeepSpeed's default: the compute dtype
        assert grads({"data_types": {"grad_accum_dtype": "fp32"}}, stage) == {torch.float32}


@effect("bf16.enabled")
def _bf16(tmp: Path) -> None:
    engine = _engine({"bf16": {"enabled": True}})
    assert {p.dtype for p in engine.module.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in _engine({}).module.parameters()} == {torch.float32}


@effect("bf16.check_grad_overflow")
def _bf16_overflow(tmp: Path) -> None:
    def update(check: bool) -> torch.Tensor:
        model = _gpt()
        bf16 = {"enabled": True, "check_grad_overflow": check}
        engine = _engine({"bf16": bf16, "zero_optimization": {"stage": 1}}, model=model)
        model.blocks[0].mlp[0].weight.register_hook(lambda g: torch.full_like(g, float("nan")))
        before = _params(engine)
        _micro_step(engine)
        return _params(engine) - before

    skipped = update(True)
    assert torch.equal(skipped, torch.zeros_like(skipped))  # skipped, as DeepSpeed skips it
    assert update(False).isnan().any()  # applied: the NaN reaches the weights


def _fp16_engine(fp16: dict) -> tuple[shardtrain.Engine, dict]:
    """An fp16 engine and a switch that puts an inf into one gradient of the next backward."""
    model = _gpt()
    engine = _engine({"fp16": {"enabled": True, **fp16}}, model=model)
    plant = {"on": False}

    def poison(grad: torch.Tensor) -> torch.Tensor:
        if plant["on"]:
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
        return grad

    model.blocks[0].mlp[0].weight.register_hook(poison)
    return engine, plant


def _scales(fp16: dict, overflows: list[bool]) -> list[float]:
    engine, plant = _fp16_engine(fp16)
    out = [engine.loss_scale]
    for overflow in overflows:
        plant["on"] = overflow
        _micro_step(engine)
        out.append(engine.loss_scale)
    return out


@effect("fp16.enabled")
def _fp16(tmp: Path) -> None:
    engine, _ = _fp16_engine({})
    assert {p.dtype for p in engine.module.parameters()} == {torch.float16}
    assert engine.loss_scale == 2.0**16


@effect("fp16.loss_scale")
def _static_scale(tmp: Path) -> None:
    assert _scales({"loss_scale": 128}, [True, False]) == [128.0, 128.0, 128.0]  # static: kept over an overflow
    assert _scales({"hysteresis": 1}, [True]) == [2.0**16, 2.0**15]  # dynamic: halved


@effect("fp16.initial_scale_power")
def _initial_power(tmp: Path) -> None:
    assert _scales({"initial_scale_power": 5}, [])[0] == 32.0
    assert _scales({"initial_scale_power": 3}, [])[0] == 8.0


@effect("fp16.loss_scale_window")
def _window(tmp: Path) -> None:
    # as DeepSpeed counts: the scale doubles on the clean step that follows `loss_scale_window` clean steps
    assert _scales({"initial_scale_power": 4, "loss_scale_window": 2}, [False] * 3) == [16.0, 16.0, 16.0, 32.0]
    assert _scales({"initial_scale_power": 4, "loss_scale_window": 3}, [False] * 3) == [16.0, 16.0, 16.0, 16.0]


@effect("fp16.hysteresis")
def _hysteresis(tmp: Path) -> None:
    assert _scales({"initial_scale_power": 4, "hysteresis": 1}, [True]) == [16.0, 8.0]
    assert _scales({"initial_scale_power": 4, "hysteresis": 2}, [True, True]) == [16.0, 16.0, 8.0]


@effect("fp16.min_loss_scale")
def _min_scale(tmp: Path) -> None:
    fp16 = {"initial_scale_power": 1, "hysteresis": 1}
    assert _scales({**fp16, "min_loss_scale": 0.25}, [True, True]) == [2.0, 1.0, 0.5]
    with pytest.raises(ShardtrainError, match="minimum loss scale"):
        _scales({**fp16, "min_loss_scale": 1}, [True, True])


@effect("gradient_clipping")
def _clipping(tmp: Path) -> None:
    free = _update({"gradient_clipping": 0}, optimizer=_sgd(1.0))
    default = _update({}, optimizer=_sgd(1.0))
    clipped = _update({"gradient_clipping": 1e-3}, optimizer=_sgd(1.0))
    assert free.norm() > 1.0  # SGD at lr 1: the update is the (clipped) gradient
    assert default.norm() == pytest.approx(1.0, rel=1e-3)  # DeepSpeed's default: 1.0
    assert clipped.norm() == pytest.approx(1e-3, rel=1e-3)


@effect("optimizer.params.torch_adam")
def _torch_adam(tmp: Path) -> None:
    adamw = {"type": "AdamW", "params": {"lr": 0.1}}
    fused_default = _update({"optimizer": adamw}, optimizer=None)  # DeepSpeed's FusedAdam: weight_decay 0.0
    no_decay = _update({"optimizer": {**adamw, "params": {"lr": 0.1, "weight_decay": 0.0}}}, optimizer=None)
    torch_default = _update({"optimizer": {**adamw, "params": {"lr": 0.1, "torch_adam": True}}}, optimizer=None)
    decay = _update({"optimizer": {**adamw, "params": {"lr": 0.1, "weight_decay": 0.01}}}, optimizer=None)
    assert torch.equal(fused_default, no_decay) and torch.equal(torch_default, decay)
    assert not torch.equal(fused_default, torch_default)


# -- ZeRO -----------------------------------------------------------------------------------------------------------


@effect(_Z + "stage")
def _stage(tmp: Path) -> None:
    def grads_after_backward(stage: int) -> tuple[bool, int]:
        engine = _engine({"zero_optimization": {**_STAGE3, "stage": stage}})
        x, y = _batch()
        engine.backward(engine(x, y))
        held = all(p.grad is not None for p in engine.module.parameters())
        return held, len(engine.layout.unit_buckets)

    # stages 0-1 keep whole gradients in .grad, stages 2-3 free them into sharded buffers; stage 3 makes units
    assert grads_after_backward(0) == (True, 0)
    assert grads_after_backward(1) == (True, 0)
    assert grads_after_backward(2) == (False, 0)
    held, units = grads_after_backward(3)
    assert not held and units > 0


@effect(_Z + "reduce_bucket_size")
def _reduce_bucket_size(tmp: Path) -> None:
    model = _gpt()
    trainable = sum(1 for p in model.parameters() if p.requires_grad)
    assert len(_engine({"zero_optimization": {"reduce_bucket_size": 0}}, model=model).layout.buckets) == trainable
    assert len(_engine({"zero_optimization": {"reduce_bucket_size": 10**9}}).layout.buckets) == 1


@effect(_Z + "allgather_bucket_size")
def _allgather_bucket_size(tmp: Path) -> None:
    def most_in_flight(size: int) -> tuple[int, int, int]:
        engine = _engine({"zero_optimization": {"stage": 1, "reduce_bucket_size": 4000, "allgather_bucket_size": size}})
        flight = {"now": 0, "most": 0, "calls": 0}

        class Counted:
            def __init__(self, handle: Any, n: int) -> None:
                self.handle, self.n = handle, n

            def wait(self) -> None:
                self.handle.wait()
                flight["now"] -= self.n

        def record(out: Any, out_tensor: torch.Tensor, inp: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            flight["calls"] += 1
            flight["now"] += out_tensor.numel()
            flight["most"] = max(flight["most"], flight["now"])
            return Counted(out, out_tensor.numel())

        _spy(engine.comm, "all_gather", record)
        _micro_step(engine)
        largest = max(b.padded_numel for b in engine.layout.buckets)
        return flight["most"], flight["calls"], largest

    most, calls, largest = most_in_flight(1)
    assert calls > 2 and most == largest  # one bucket at a time
    everything, _, _ = most_in_flight(10**9)
    assert everything > 2 * largest  # every bucket at once


@effect(_Z + "overlap_comm")
def _overlap(tmp: Path) -> None:
    def staging(overlap: bool) -> tuple[int, int]:
        zero = {"stage": 2, "reduce_bucket_size": 4000, "overlap_comm": overlap}
        engine = _engine({"zero_optimization": zero})
        _micro_step(engine)
        return engine._reducer.max_staging, len(engine.layout.buckets)

    most, buckets = staging(True)
    assert buckets > 3 and most <= 2  # each bucket reduced as soon as it is complete
    assert staging(False) == (buckets, buckets)  # every bucket waits for the end of backward


def _offloaded(zero: dict) -> shardtrain.Engine:
    engine = _engine({"zero_optimization": {"stage": 2, **zero}}, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    _micro_step(engine)
    return engine


def _nvme(tmp: Path, **offload: Any) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    return {"device": "nvme", "nvme_path": str(tmp), **offload}


@effect(_Z + "sub_group_size")
def _sub_group_size(tmp: Path) -> None:
    small = _offloaded({"sub_group_size": 2000, "offload_optimizer": _nvme(tmp / "a")})
    large = _offloaded({"offload_optimizer": _nvme(tmp / "b")})
    assert len(large._optimizer.offload.groups) == 1
    assert len(small._optimizer.offload.groups) > 3


@effect(_Z + "offload_optimizer.device")
def _optimizer_offload_device(tmp: Path) -> None:
    resident = _offloaded({})
    swapped = _offloaded({"sub_group_size": 2000, "offload_optimizer": _nvme(tmp)})
    # Adam's moments of all but the sub-groups in flight live in the swap files
    assert swapped.state_bytes()["optimizer"] < resident.state_bytes()["optimizer"] / 2
    assert any(f.stat().st_size > 0 for f in tmp.rglob("*") if f.is_file())


@effect(_Z + "offload_optimizer.nvme_path")
def _optimizer_nvme_path(tmp: Path) -> None:
    for where in (tmp / "one", tmp / "two"):
        engine = _offloaded({"offload_optimizer": _nvme(where)})  # its swap directory lives as long as the engine
        assert any(where.iterdir()), f"no swap directory in {where}"
        engine.close()


@effect(_Z + "offload_optimizer.pin_memory")
def _optimizer_pin_memory(tmp: Path) -> None:
    if pick_device().type != "cuda":  # the engine's device (the suite trains on the CPU, also beside a GPU)
        raise Skip("page-locked host memory needs an engine on CUDA")
    for pin in (True, False):
        engine = _engine(
            {
                "bf16": {"enabled": True},
                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": pin}},
            }
        )
        masters = [m for m in engine._optimizer.masters.values() if m.numel()]
        assert masters and all(m.device.type == "cpu" and m.is_pinned() == pin for m in masters)


@effect(_Z + "offload_param.pin_memory")
def _param_pin_memory(tmp: Path) -> None:
    # A CPU-only torch cannot page-lock: the choice is checked where it is made, the plan for a GPU machine, whose
    # value the parameter uploads' host buffers are asked for with (tests/offload/test_pin_memory.py runs that far)
    from shardtrain.config.plan import resolve_plan
    from shardtrain.config.sections import load_config

    for pin in (True, False):
        zero = {
            "stage": 3,
            "offload_optimizer": {"device": "cpu"},
            "offload_param": {"device": "cpu", "pin_memory": pin},
        }
        plan = resolve_plan(load_config({"zero_optimization": zero}), 2, "cuda")
        assert plan.offload.param.pin_memory == pin and plan.offload.optimizer.pin_memory


@effect(_Z + "offload_optimizer.buffer_count")
def _optimizer_buffer_count(tmp: Path) -> None:
    def held(count: int, where: Path) -> int:
        engine = _offloaded({"sub_group_size": 2000, "offload_optimizer": _nvme(where, buffer_count=count)})
        _micro_step(engine)  # the second step reads back what the first wrote
        return engine._optimizer.offload.peak_held_bytes

    one, four = held(1, tmp / "a"), held(4, tmp / "b")
    assert 0 < one < four  # more sub-groups in memory at once


def _zenflow_trace(steps: int, **rule: Any) -> list[dict]:
    """Per step of a fresh ZenFlow engine: what the rule holds after it ([Note: the ZenFlow rule])."""
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {"update_interval": 2, **rule}}
    engine = _engine({"zero_optimization": zero}, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    zf, trace = engine._optimizer.zenflow, []
    for _ in range(steps):
        _micro_step(engine)
        tok = zf.selected[0]  # tok.weight (64 x 32), the first stepped tensor
        trace.append({"tok": tok, "selected": 0 if tok is None else tok.numel()})
        trace[-1].update(landing=zf.landing, accumulated=zf.accumulated)
    engine.close()
    return trace


@effect(
    _Z + "zenflow.topk_ratio",
    _Z + "zenflow.select_strategy",
    _Z + "zenflow.select_interval",
    _Z + "zenflow.update_interval",
    _Z + "zenflow.overlap_step",
    _Z + "zenflow.full_warm_up_rounds",
    _Z + "zenflow.auto_ratio",
)
def _zenflow(tmp: Path) -> None:
    adamw = {"optimizer": lambda p: torch.optim.AdamW(p, lr=1e-2)}
    plain = _update({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, 3, **adamw)
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {"update_interval": 2}}
    assert not torch.allclose(_update({"zero_optimization": zero}, 3, **adamw), plain)  # the split changes it
    # topk_ratio: a quarter (8) or half (16) of tok.weight's 32 columns, 64 rows each
    assert _zenflow_trace(1, topk_ratio=0.25)[0]["selected"] == 8 * 64
    assert _zenflow_trace(1, topk_ratio=0.5)[0]["selected"] == 16 * 64
    # full_warm_up_rounds: no columns selected during the plain full updates
    assert [t["selected"] for t in _zenflow_trace(3, full_warm_up_rounds=2)] == [0, 0, 3 * 64]  # 0.1 x 32
    # update_interval: gradients accumulate for that many steps, then the host update restarts the sum
    assert [t["accumulated"] for t in _zenflow_trace(3, update_interval=3)] == [1, 2, 0]
    # update_interval "auto" with auto_ratio: 0 asks no weight to call for it (a host update every step); 1 asks all
    assert [t["accumulated"] for t in _zenflow_trace(3, update_interval="auto", auto_ratio=0.0)] == [0, 0, 0]
    assert [t["accumulated"] for t in _zenflow_trace(3, update_interval="auto", auto_ratio=1.0)] != [0, 0, 0]
    # overlap_step: the host update is still to land after its step, instead of landing at once
    assert [t["landing"] for t in _zenflow_trace(2, overlap_step=True)] == [False, True]
    assert [t["landing"] for t in _zenflow_trace(2)] == [False, False]
    # select_strategy "step" with select_interval 2: reselected at step 3; "auto" (no data loader): selected once
    every = _zenflow_trace(3, select_strategy="step", select_interval=2)
    once = _zenflow_trace(3)
    assert every[1]["tok"] is every[0]["tok"] and every[2]["tok"] is not every[0]["tok"]
    assert once[2]["tok"] is once[0]["tok"]


@effect(_Z + "offload_optimizer.ratio")
def _optimizer_ratio(tmp: Path) -> None:
    def offloaded(ratio: float, where: Path) -> tuple[int, int]:
        engine = _offloaded({"sub_group_size": 2000, "offload_optimizer": _nvme(where, ratio=ratio)})
        groups = engine._optimizer.offload.groups
        return sum(g.offloaded for g in groups), len(groups)

    some, total = offloaded(0.5, tmp / "a")
    assert 0 < some < total
    assert offloaded(1.0, tmp / "b") == (total, total)


def _param_offload_built() -> None:
    if pick_device().type == "cuda":
        raise Skip("offload_param on CUDA needs offload_optimizer beside it; these cases set it alone")


@effect(_Z + "offload_param.device", _Z + "offload_param.nvme_path")
def _param_offload(tmp: Path) -> None:
    _param_offload_built()
    resident = _engine({"zero_optimization": _STAGE3})
    swapped = _engine({"zero_optimization": {**_STAGE3, "offload_param": _nvme(tmp, max_in_cpu=0)}})
    _micro_step(swapped)
    assert swapped.state_bytes()["params"] < resident.state_bytes()["params"] / 2  # shards in mapped files
    assert [f for f in tmp.rglob("param-*.bin") if f.stat().st_size > 0], "no parameter swap file in nvme_path"


@effect(_Z + "offload_param.buffer_count")
def _param_buffer_count(tmp: Path) -> None:
    _param_offload_built()

    def most_ahead(count: int, where: Path) -> int:
        offload = {**_nvme(where, max_in_cpu=0), "buffer_count": count}
        engine = _engine({"zero_optimization": {**_STAGE3, "offload_param": offload}})
        _micro_step(engine)
        # ask for every unit ahead of its gather (as a deep prefetch would): the offload reads `count` of them
        units = engine._runtime.units
        for u in units:
            engine._param_offload.will_need(u)
        engine._param_offload.done_with(units)
        return engine._param_offload.most_ahead

    assert most_ahead(1, tmp / "a") == 1
    assert most_ahead(3, tmp / "b") == 3


@effect(_Z + "offload_param.max_in_cpu")
def _param_max_in_cpu(tmp: Path) -> None:
    _param_offload_built()

    def mapped(max_in_cpu: int, where: Path) -> tuple[int, int]:
        engine = _engine({"zero_optimization": {**_STAGE3, "offload_param": _nvme(where, max_in_cpu=max_in_cpu)}})
        return len(engine._param_offload.mapped_units), len(engine.layout.unit_buckets)

    everything, units = mapped(0, tmp / "a")
    assert everything == units > 1
    assert mapped(10**9, tmp / "b") == (0, units)  # all units fit in memory: no unit on disk


@effect(_Z + "stage3_param_persistence_threshold")
def _persistence(tmp: Path) -> None:
    def whole(threshold: int) -> int:
        engine = _engine({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold}})
        return sum(1 for r in engine.layout.records if r.bucket is None or r.bucket.gather_after_step)

    assert whole(0) == 0
    assert whole(10**9) == len(list(_gpt().parameters()))  # everything stays whole


@effect(_Z + "stage3_prefetch_bucket_size")
def _prefetch(tmp: Path) -> None:
    def prefetches(size: int | None) -> int:
        zero = {**_STAGE3, **({} if size is None else {"stage3_prefetch_bucket_size": size})}
        engine = _engine({"zero_optimization": zero})
        for _ in range(2):  # the first step records the order, the second prefetches along it
            _micro_step(engine)
        return sum(u.prefetches for u in engine._runtime.units)

    assert prefetches(None) > 0
    assert prefetches(0) == 0


@effect(_Z + "stage3_unit_classes")
def _unit_classes(tmp: Path) -> None:
    def names(classes: list[str] | None) -> list[str]:
        zero = {**_STAGE3, **({} if classes is None else {"stage3_unit_classes": classes})}
        return [name for name, _, _ in _engine({"zero_optimization": zero}).layout.unit_buckets]

    assert {"blocks.0", "blocks.1"} <= set(names(None))
    assert {"blocks.0.attn", "blocks.1.attn"} <= set(names(["CausalSelfAttention"]))
    assert "blocks.0" not in names(["CausalSelfAttention"])


_AC = "activation_checkpointing"


def _block_forwards(config: dict) -> tuple[int, int]:
    """Calls of the first block's forward in one micro-step, and the block inputs the engine put in host memory."""
    engine = _engine(config)
    calls = []
    engine.module.blocks[0].register_forward_pre_hook(lambda *_: calls.append(1))
    _micro_step(engine)
    offloads = [
        hook.__self__.offloaded
        for hook in engine.module.blocks[0]._forward_pre_hooks.values()
        if type(getattr(hook, "__self__", None)).__name__ == "HostOffload"
    ]
    return len(calls), sum(offloads)


@effect(f"{_AC}.policy")
def _ac_policy(tmp: Path) -> None:
    # full and selective run each block's forward again in backward
    assert _block_forwards({}) == (1, 0)
    assert _block_forwards({_AC: {"policy": "full"}}) == (2, 0)
    assert _block_forwards({_AC: {"policy": "selective"}}) == (2, 0)


@effect(f"{_AC}.cpu_checkpointing")
def _ac_cpu(tmp: Path) -> None:
    # one input of each of the two blocks, moved to host memory and back
    assert _block_forwards({_AC: {"policy": "full", "cpu_checkpointing": True}}) == (2, 2)


def _budget(gib: float, seq: int = SEQ) -> dict:
    return {_AC: {"policy": "budget", "memory_budget_gib": gib, "budget_seq_len": seq}}


@functools.cache
def _every_block_full_gib() -> float:
    """The planner's peak of :func:`_engine`'s GPT with every block checkpointed fully: the tightest budget that
    fits."""
    from shardtrain.estimate.activation_budget import _ladder_for

    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6}
    ladder, rungs = _ladder_for(_gpt, config, 1, SEQ, pick_device().type, None, "sgd", None)
    return ladder.measure(rungs[-1], False).peak / 2**30


@effect(f"{_AC}.memory_budget_gib")
def _ac_budget(tmp: Path) -> None:
    assert _block_forwards(_budget(1000.0)) == (1, 0)  # a loose budget: nothing recomputed
    assert _block_forwards(_budget(_every_block_full_gib())) == (2, 0)  # the tightest: every block recomputed


@effect(f"{_AC}.budget_seq_len")
def _ac_budget_seq_len(tmp: Path) -> None:
    try:  # the tightest budget at SEQ tokens, planned for sequences 8 times longer: nothing fits
        _engine(_budget(_every_block_full_gib(), 8 * SEQ))
    except ConfigError as e:
        assert "no choice of checkpointing fits" in str(e) and f"x {8 * SEQ} tokens" in str(e), e
    else:
        raise AssertionError("a budget_seq_len nothing fits was accepted")


@effect(f"{_AC}.partition_activations")
def _ac_partition(tmp: Path) -> None:
    from shardtrain.config.plan import resolve_plan
    from shardtrain.config.sections import load_config

    # what the engine reads: each tensor-parallel rank keeps 1/tp of the block inputs (run at tp 2 in
    # tests/activations/test_checkpointing_parity.py::test_partitioned_inputs_under_tensor_parallelism)
    tp = {"tensor_parallel": {"size": 2}}
    assert not resolve_plan(load_config({_AC: {"policy": "full"}, **tp}), 2).activations.partition_inputs
    on = {_AC: {"policy": "full", "partition_activations": True}, **tp}
    assert resolve_plan(load_config(on), 2).activations.partition_inputs


@effect(f"{_AC}.contiguous_memory_optimization", f"{_AC}.synchronize_checkpoint_boundary", f"{_AC}.profile")
def _ac_unbuilt(tmp: Path) -> None:
    from shardtrain.config.sections import load_config

    for key in ("contiguous_memory_optimization", "synchronize_checkpoint_boundary", "profile"):
        load_config({_AC: {"policy": "full", key: False}})
        try:
            load_config({_AC: {"policy": "full", key: True}})
        except ConfigError as e:
            assert f"{key}: true with policy 'full'" in str(e), e
        else:
            raise AssertionError(f"{key}: true with a policy was accepted")


@effect(_Z + "stage3_gather_check")
def _gather_check(tmp: Path) -> None:
    def checks(on: bool) -> int:
        engine = _engine({"zero_optimization": {**_STAGE3, "stage3_gather_check": on}})
        _micro_step(engine)
        return engine.comm_stats().get("gather_check", {}).get("calls", 0)

    assert checks(True) > 0
    assert checks(False) == 0


# -- logging and monitors ---------------------------------------------------------------------------------------------


def _logged(config: dict, steps: int = 4) -> list[str]:
    with _Records() as records:
        engine = _engine(config, model=_Tiny())
        for _ in range(steps):
            _tiny_step(engine)
    return [line for line in records.lines if line.startswith("step ")]


@effect("steps_per_print")
def _steps_per_print(tmp: Path) -> None:
    assert [line.split(":")[0] for line in _logged({"steps_per_print": 2})] == ["step 2", "step 4"]
    assert len(_logged({"steps_per_print": 1})) == 4
    assert _logged({"steps_per_print": float("inf")}) == []  # accelerate's value: never, as DeepSpeed
    assert _logged({"steps_per_print": None}) == []  # DeepSpeed's default: never


@effect("checkpoint.writer.decoupled")
def _decoupled_checkpoint_writer(tmp: Path) -> None:
    """With it, save_checkpoint returns while the files are still to be written (the write is held until after the
    call returned); without it, the checkpoint is published when the call returns."""
    from shardtrain.checkpoint import writer

    gate, write = threading.Event(), writer._write_rank_files

    def held(*args, **kwargs):
        gate.wait(timeout=60)
        return write(*args, **kwargs)

    for decoupled in (False, True):
        root = tmp / str(decoupled)
        engine = _engine({"checkpoint": {"writer": {"decoupled": decoupled}}})
        _micro_step(engine)
        gate.clear()
        writer._write_rank_files = held
        try:
            if not decoupled:
                gate.set()  # a synchronous save would wait for the gate forever
            engine.save_checkpoint(root)
            assert (root / "latest").exists() is not decoupled
            gate.set()
            engine.close()
        finally:
            writer._write_rank_files = write
        assert (root / "latest").read_text().strip() == "global_step1"


@effect("wall_clock_breakdown")
def _wall_clock(tmp: Path) -> None:
    assert not any("forward" in line for line in _logged({"steps_per_print": 2}))
    timed = [line for line in _logged({"steps_per_print": 2, "wall_clock_breakdown": True}) if "forward" in line]
    assert len(timed) == 2 and "backward" in timed[0] and "ms" in timed[0]


def _monitor_files(monitor: str, section: dict) -> set[Path]:
    engine = _engine({"steps_per_print": 1, monitor: section}, model=_Tiny())
    _tiny_step(engine)
    engine.monitor.close()
    root = Path(section.get("output_path") or "runs")
    return {p for p in root.rglob("*") if p.is_file()} if root.exists() else set()


def _monitor_check(monitor: str, tmp: Path, key: str) -> None:
    out = tmp / "out"
    enabled = {"enabled": True, "output_path": str(out), "job_name": "job"}
    if key == "enabled":
        assert _monitor_files(monitor, {**enabled, "enabled": False}) == set()
        assert {p.parent for p in _monitor_files(monitor, enabled)} == {out / "job"}
    elif key == "output_path":
        other = tmp / "elsewhere"
        assert {p.parent for p in _monitor_files(monitor, {**enabled, "output_path": str(other)})} == {other / "job"}
    else:
        assert {p.parent for p in _monitor_files(monitor, {**enabled, "job_name": "other"})} == {out / "other"}


for _monitor in ("tensorboard", "csv_monitor"):
    for _key in ("enabled", "output_path", "job_name"):
        effect(f"{_monitor}.{_key}")(lambda tmp, m=_monitor, k=_key: _monitor_check(m, tmp, k))


@effect("wandb.enabled")
def _wandb_enabled(tmp: Path) -> None:
    try:
        import wandb  # noqa: F401
    except ImportError:  # then turning it on asks for the package, naming it
        with pytest.raises(ConfigError, match="'wandb' package is not installed"):
            _engine({"wandb": {"enabled": True}})
        return
    _wandb_run({}, tmp)


def _wandb_run(section: dict, tmp: Path) -> Any:
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise Skip("the wandb package is not installed") from None
    os.environ["WANDB_MODE"], os.environ["WANDB_DIR"] = "offline", str(tmp)
    engine = _engine({"steps_per_print": 1, "wandb": {"enabled": True, **section}})
    run = next(w.run for w in engine.monitor.writers if hasattr(w, "run"))
    engine.monitor.close()
    return run


@effect("wandb.group")
def _wandb_group(tmp: Path) -> None:
    assert _wandb_run({"group": "g1"}, tmp).group == "g1"


@effect("wandb.team")
def _wandb_team(tmp: Path) -> None:
    assert _wandb_run({"team": "t1"}, tmp).entity == "t1"


@effect("wandb.project")
def _wandb_project(tmp: Path) -> None:
    assert _wandb_run({"project": "p1"}, tmp).project == "p1"


def _profiled(section: dict, tmp: Path, steps: int = 3) -> tuple[shardtrain.Engine, str]:
    """``steps`` optimizer steps of two micro-steps with the flops profiler ``section``, printing every step: the
    engine and what it logged (with a CSV monitor in ``tmp``)."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("shardtrain")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        engine = _engine(
            {
                "gradient_accumulation_steps": 2,
                "steps_per_print": 1,
                "csv_monitor": {"enabled": True, "output_path": str(tmp), "job_name": "job"},
                "flops_profiler": section,
            }
        )
        for _ in range(2 * steps):
            _micro_step(engine)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return engine, "\n".join(records)


def _forward_flops() -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        _gpt()(*_batch())
    return counter.get_total_flops()


@effect("flops_profiler.enabled")
def _flops_enabled(tmp: Path) -> None:
    engine, logged = _profiled({"enabled": True}, tmp)
    assert engine.monitor.forward_flops == 2 * _forward_flops()  # the step's two micro-steps, rank 0's batch
    assert "flops profiler, step 2" in logged and "TFLOP/s per rank" in logged
    rows = (tmp / "job" / "Train_Samples_tflops_per_rank.csv").read_text().splitlines()
    assert rows[0] == "step,tflops_per_rank" and len(rows) == 1 + 2 and float(rows[1].split(",")[1]) > 0
    engine, logged = _profiled({"enabled": False}, tmp / "off")
    assert engine.monitor.forward_flops is None and "flops profiler" not in logged


@effect("flops_profiler.profile_step")
def _flops_profile_step(tmp: Path) -> None:
    engine, logged = _profiled({"enabled": True, "profile_step": 2}, tmp, steps=2)
    assert engine.monitor.forward_flops is None  # counted during step 3
    engine, logged = _profiled({"enabled": True, "profile_step": 2}, tmp / "3", steps=3)
    assert engine.monitor.forward_flops == 2 * _forward_flops() and "flops profiler, step 3" in logged


@effect("flops_profiler.module_depth")
def _flops_module_depth(tmp: Path) -> None:
    _, shallow = _profiled({"enabled": True, "module_depth": 1}, tmp, steps=2)
    _, deep = _profiled({"enabled": True, "module_depth": 2}, tmp / "2", steps=2)
    assert "  GPT " in shallow and "GPT.head" not in shallow and "GPT.head" in deep


@effect("flops_profiler.detailed")
def _flops_detailed(tmp: Path) -> None:
    _, detailed = _profiled({"enabled": True}, tmp, steps=2)
    _, brief = _profiled({"enabled": True, "detailed": False}, tmp / "brief", steps=2)
    assert "GFLOP   share" in detailed and "GFLOP   share" not in brief and "flops profiler" in brief


@effect("flops_profiler.output_file")
def _flops_output_file(tmp: Path) -> None:
    report = tmp / "flops.txt"
    _, logged = _profiled({"enabled": True, "output_file": str(report)}, tmp, steps=2)
    assert "flops profiler, step 2" in report.read_text() and "flops profiler" not in logged


@effect("flops_profiler.recompute_fwd_factor")
def _flops_recompute(tmp: Path) -> None:
    engine, logged = _profiled({"enabled": True, "recompute_fwd_factor": 0.5}, tmp, steps=2)
    hardware = 3.5 * engine.monitor.forward_flops / 1e9
    assert f"hardware FLOPs (3.5 x forward) {hardware:,.3f} GFLOP" in logged
    assert engine.monitor.throughput(1000.0)["tflops_per_rank"] == 3 * engine.monitor.forward_flops / 1e12


@effect("flops_profiler.peak_tflops")
def _flops_peak(tmp: Path) -> None:
    engine, logged = _profiled({"enabled": True, "peak_tflops": 1e-3}, tmp, steps=3)
    rates = engine.monitor.throughput(1000.0)
    assert rates["mfu"] == pytest.approx(rates["tflops_per_rank"] / 1e-3) and "MFU" in logged
    assert (tmp / "job" / "Train_Samples_mfu.csv").is_file()
    engine, logged = _profiled({"enabled": True}, tmp / "none", steps=3)
    assert "mfu" not in engine.monitor.throughput(1000.0) and "MFU" not in logged  # no peak known on the CPU


@effect("pipeline.stages")
def _pipeline_stages(tmp: Path) -> None:
    # DeepSpeed reads no value of it (the stages are the pipeline's size); a value naming another size is refused
    assert _engine({"pipeline": {"stages": "auto"}}).config.pipeline.stages == 1  # "auto": the pipeline's size
    assert _engine({"pipeline": {"stages": 1}}).config.pipeline.stages == 1
    with pytest.raises(ConfigError, match=r"pipeline.stages 2 but the pipeline has 1 stage\(s\)"):
        _engine({"pipeline": {"stages": 2}})


# -- shardtrain's own keys -------------------------------------------------------------------------------------------


@effect("seed")
def _seed(tmp: Path) -> None:
    def draws(seed: int) -> tuple[float, float, float]:
        random.seed(12345)
        np.random.seed(12345)
        torch.manual_seed(12345)
        _engine({"seed": seed}, model=nn.Linear(2, 2))  # a model made before: initialize itself draws nothing
        return random.random(), float(np.random.rand()), float(torch.rand(()))

    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    seeded = (random.random(), float(np.random.rand()), float(torch.rand(())))
    assert draws(7) == seeded
    assert draws(8) != seeded


@effect("device")
def _device(tmp: Path) -> None:
    from unittest import mock

    # a machine with a GPU, as this process sees it, under the harness's gloo group
    with (
        mock.patch.object(torch.cuda, "is_available", lambda: True),
        mock.patch.object(torch.cuda, "device_count", lambda: 1),
        mock.patch.dict(os.environ, {"SHARDTRAIN_DEVICE": ""}),
    ):
        engine = _engine({"device": "cpu"})
        assert engine.device == torch.device("cpu")
        _micro_step(engine)
        with pytest.raises(LayoutError, match=r"uses 'gloo' but this rank's device is cuda:0"):
            _engine({})  # unset, with a GPU in sight: CUDA, which the CPU group cannot carry
    with mock.patch.object(torch.cuda, "is_available", lambda: False), pytest.raises(LayoutError, match="sees no CUDA"):
        _engine({"device": "cuda"})  # a machine without a GPU, also where there is one


def _vocab_and_mlp_products(config: dict) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]], float]:
    """One micro-step of the GPT: the shapes of the matrix products whose outputs are logits (``VOCAB`` wide) or
    MLP intermediates (``4 d`` wide), in forward and backward, and the loss."""
    from torch.utils._python_dispatch import TorchDispatchMode

    wide: dict[int, list[tuple[int, ...]]] = {VOCAB: [], 128: []}

    class Products(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm) and out.shape[-1] in wide:
                wide[out.shape[-1]].append(tuple(out.shape))
            return out

    engine = _engine(config)  # d_model 32: the MLP's intermediate is 128 wide
    with Products():
        loss = _micro_step(engine)
    return wide[VOCAB], wide[128], loss


@effect("tiled_logits_loss", "tiled_logits_loss_shards")
def _tiled_logits_loss(tmp: Path) -> None:
    # untiled: the logits of all 2 x 16 tokens at once; tiled: in tiles, the largest of 32 / shards tokens, the
    # forward's tiles recomputed in backward; the same loss
    whole, _, untiled = _vocab_and_mlp_products({})
    assert max(s[0] for s in whole) == 2 * SEQ
    for shards, tile in ((None, 2 * SEQ), (4, 8)):  # the default: fp32 logits in tiles of 1 GiB, one tile here
        config = {"tiled_logits_loss": True, **({"tiled_logits_loss_shards": shards} if shards else {})}
        tiled, _, loss = _vocab_and_mlp_products(config)
        assert sorted({s[0] for s in tiled}) == [tile] and len(tiled) == 2 * (2 * SEQ // tile), tiled
        assert abs(loss - untiled) <= 1e-6 * abs(untiled)


@effect("tiled_mlp_compute", "tiled_mlp_shards")
def _tiled_mlp_compute(tmp: Path) -> None:
    # per block, 128-wide products: untiled, the intermediate [32 tokens, 128] in forward, its gradient and the
    # second weight's gradient ([d, 4d] = [32, 128]) in backward; tiled, the intermediate once more per tile in
    # backward (the recompute), and with 4 tiles of the 16 tokens the token products are [2 rows x 4, 128], the
    # weight's gradient one [32, 128] per tile
    _, whole, untiled = _vocab_and_mlp_products({})
    assert whole == [(2 * SEQ, 128)] * 3 * 2, whole
    _, tiled, loss = _vocab_and_mlp_products({"tiled_mlp_compute": True})  # ALST's ceil(16 / 32): 1 tile
    assert tiled == [(2 * SEQ, 128)] * 4 * 2, tiled
    assert abs(loss - untiled) <= 1e-6 * abs(untiled)
    _, tiled, loss = _vocab_and_mlp_products({"tiled_mlp_compute": True, "tiled_mlp_shards": 4})
    assert sorted(tiled) == sorted([(8, 128)] * 3 * 4 * 2 + [(32, 128)] * 4 * 2), tiled  # weight grads per tile
    assert abs(loss - untiled) <= 1e-6 * abs(untiled)


@effect("graph.enabled")
def _graph_enabled(tmp: Path) -> None:
    off = shardtrain.initialize(_Tiny(), config={"train_micro_batch_size_per_gpu": 2}, optimizer=_sgd())
    _tiny_step(off)
    assert off.graph_stats() is None
    on = _graph_engine({})
    _tiny_step(on)
    assert on.graph_stats()["captures"] == 1


@effect("graph.strict")
def _graph_strict(tmp: Path) -> None:
    lenient = _graph_engine({}, model=_Tiny(graph_break=True))
    _tiny_step(lenient)
    assert lenient.graph_stats()["fallbacks"], "the graph break should be reported as a fallback"
    strict = _graph_engine({"strict": True}, model=_Tiny(graph_break=True))
    with pytest.raises(GraphCaptureError, match=r"graph\.strict"):
        _tiny_step(strict)


@effect("graph.cache_size")
def _graph_cache_size(tmp: Path) -> None:
    def stats(size: int) -> tuple[int, int]:
        engine = _graph_engine({"cache_size": size})
        for rank in (2, 3, 2):  # two input schemas (2-D and 3-D inputs), the first one again
            _tiny_step(engine, rank)
        s = engine.graph_stats()
        return s["captures"], s["evictions"]

    assert stats(1) == (3, 2)  # the first schema was evicted by the second, captured again
    assert stats(2) == (2, 0)


@effect("graph.dynamic_shapes")
def _graph_dynamic_shapes(tmp: Path) -> None:
    def captures(dynamic: bool) -> int:
        engine = _graph_engine({"dynamic_shapes": dynamic})
        for batch in (2, 3):  # one input schema with dynamic sizes, two with static ones
            x, y = torch.randn(batch, 4), torch.randn(batch, 1)
            engine.backward(engine(x, y))
            engine.step()
        return engine.graph_stats()["captures"]

    assert captures(True) == 1
    assert captures(False) == 2


@effect("graph.compiler")
def _graph_compiler(tmp: Path) -> None:
    # Inductor would compile C++ here for a minute (the graph tests run it); what the key chooses is whether each
    # captured graph is handed to Inductor's compile_fx, so that is what is watched (the graph then runs as traced)
    import torch._inductor.compile_fx as inductor

    handed: list[int] = []
    real = inductor.compile_fx

    def watched(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        handed.append(len(gm.graph.nodes))
        return gm.forward

    inductor.compile_fx = watched
    try:
        _tiny_step(_graph_engine({"compiler": "aot_eager"}))
        assert handed == []
        _tiny_step(_graph_engine({"compiler": "inductor"}))
        assert len(handed) == 1
    finally:
        inductor.compile_fx = real


def _fp8_engine(fp8: dict, config: dict | None = None) -> shardtrain.Engine:
    return _engine({"fp8": {"enabled": True, "emulate": True, **fp8}, **(config or {})})


@effect("fp8.enabled")
def _fp8_enabled(tmp: Path) -> None:
    from torchao.float8.float8_linear import Float8Linear

    assert type(_engine({}).module.blocks[0].mlp[0]) is nn.Linear
    engine = _fp8_engine({})
    assert type(engine.module.blocks[0].mlp[0]) is Float8Linear and engine.fp8.kept == {"head": "output head"}
    _micro_step(engine)


@effect("fp8.recipe")
def _fp8_recipe(tmp: Path) -> None:
    from torchao.float8.config import ScalingGranularity

    def granularity(recipe: str) -> ScalingGranularity:
        return _fp8_engine({"recipe": recipe}).module.blocks[0].mlp[0].config.cast_config_input.scaling_granularity

    assert granularity("tensorwise") is ScalingGranularity.TENSORWISE
    assert granularity("rowwise") is ScalingGranularity.AXISWISE


@effect("fp8.emulate")
def _fp8_emulate(tmp: Path) -> None:
    assert _fp8_engine({}).module.blocks[0].mlp[0].config.emulate
    with pytest.raises(ConfigError, match=r"fp8\.emulate"):  # the CPU has no float8 matmuls
        _engine({"fp8": {"enabled": True}})


@effect("fp8.gather_in_float8")
def _fp8_gather_in_float8(tmp: Path) -> None:
    def gathered(on: bool) -> dict:
        engine = _fp8_engine({"gather_in_float8": on}, {"zero_optimization": _STAGE3})
        _micro_step(engine)
        return engine.comm_stats()

    assert "all_gather_float8" not in gathered(False)
    assert gathered(True)["all_gather_float8"]["calls"] > 0


@effect("fp8.filter.exclude")
def _fp8_filter_exclude(tmp: Path) -> None:
    engine = _fp8_engine({"filter": {"exclude": ["blocks.0.*"]}})
    assert type(engine.module.blocks[0].mlp[0]) is nn.Linear and type(engine.module.blocks[1].mlp[0]) is not nn.Linear
    assert engine.fp8.kept["blocks.0.mlp.0"] == "fp8.filter.exclude 'blocks.0.*'"


# -- the runs -------------------------------------------------------------------------------------------------------


def _run_checks(keys: list[str], root: str) -> dict[str, tuple[str, str]]:
    """In one worker: each key's check, with a scratch directory of its own; key -> (outcome, detail)."""
    out = {}
    for key in keys:
        tmp = Path(root) / key
        tmp.mkdir(parents=True)
        os.chdir(tmp)  # monitors write ./runs by default
        started = time.perf_counter()
        try:
            EFFECTS[key](tmp)
            out[key] = ("ok", f"{time.perf_counter() - started:.1f}s")
        except Skip as why:
            out[key] = ("skip", str(why))
        except BaseException:  # pytest.raises fails with a BaseException: reported by the key's own test
            out[key] = ("fail", traceback.format_exc())
    return out


@pytest.fixture(scope="module")
def world_1_outcomes(tmp_path_factory) -> dict[str, tuple[str, str]]:
    keys = [k for k in EFFECTS if k not in TWO_RANKS]
    (outcomes,) = run_distributed(_run_checks, 1, keys, str(tmp_path_factory.mktemp("keys")), timeout=280)
    return outcomes


def test_every_supported_key_has_an_effect_check():
    checked = set(EFFECTS) | set(TWO_RANKS) | set(FOUR_RANKS)
    missing = [k for k in KEYS if k not in checked]
    assert not missing, f"supported keys without a check of their effect: {missing}"
    assert checked <= set(KEYS), f"checks of keys the table does not call supported: {checked - set(KEYS)}"
    for section in SECTIONS:  # a section's effect is its keys'
        assert any(k.startswith(section + ".") for k in checked), section


@pytest.mark.parametrize("key", [k for k in KEYS if k in EFFECTS and k not in TWO_RANKS])
def test_supported_key_has_its_effect(key, world_1_outcomes):
    outcome, detail = world_1_outcomes[key]
    if outcome == "skip":
        pytest.skip(detail)
    assert outcome == "ok", f"{key}: its effect is gone or wrong:\n{detail}"


# ring steps of one layer at cp 2: its keys and values forward (c - 1), again in backward (c - 1), and their
# gradients home (c): sequence_parallel/ring_attention.py
RING_CALLS_CP2 = 1 + 1 + 2


def _two_ranks(timeout_s: float) -> dict[str, Any]:
    """World 2 (the group made by initialize): tensor parallelism, the desync check, the collective timeout."""
    out: dict[str, Any] = {}
    x, y = _batch()
    timeout = {"collective_timeout_s": timeout_s}
    # the first initialize makes the process group with collective_timeout_s; the later ones reuse it (same timeout)
    engine = _engine({"tensor_parallel": {"size": 2}, **timeout}, tp_plan=GPT_TP_PLAN)
    rank = dist.get_rank()
    out["size"] = (engine.topology.tp, engine.topology.dp, tuple(engine.module.blocks[0].mlp[0].weight.shape))
    engine = _engine({"tensor_parallel": {"autotp_size": 2}, **timeout}, tp_plan=GPT_TP_PLAN)
    out["autotp_size"] = (engine.topology.tp, tuple(engine.module.blocks[0].mlp[0].weight.shape))
    whole = tuple(_gpt().blocks[0].mlp[0].weight.shape)
    out["whole"] = whole
    # mics_shard_size: groups of 1 rank hold everything; the gradients are all-reduced across the 2 replicas
    for size in (1, -1):
        engine = _engine({"zero_optimization": {"stage": 2, "mics_shard_size": size}, **timeout})
        _micro_step(engine)
        grads = engine.comm_stats(by_group=True)
        out[f"mics {size}"] = (
            engine.topology.replicas,
            {b.world for b in engine.layout.buckets},
            "replicate" in grads and grads["replicate"]["all_reduce"]["calls"] > 0,
        )
    # sequence_parallel_size 2: both ranks share one sequence (one data-parallel rank), each attends half the heads
    # of the whole sequence after an all-to-all of q, k, v and one of the output per layer, and back in backward
    engine = _engine({"sequence_parallel_size": 2, **timeout})
    loss = _micro_step(engine)
    calls = engine._sp.comm.stats()["all_to_all"]["calls"]
    out["sequence_parallel_size"] = (engine.topology.sp, engine.topology.dp, engine.topology.sp_rank, calls, loss)
    # context_parallel_size 2: both ranks share one sequence, holding chunks 0 and 3, 1 and 2 of 4; each layer
    # passes its keys and values around the ring and, in backward, their gradients ([Note: which context attention])
    engine = _engine({"context_parallel_size": 2, **timeout})
    loss = _micro_step(engine)
    moved = engine._sp.comm.stats()
    calls = (moved["ring"]["calls"], "reduce_scatter" in moved)
    out["context_parallel_size"] = (engine.topology.cp, engine.topology.dp, engine.topology.cp_rank, calls, loss)
    # expert_parallel_size 2: each rank holds 2 of a tiny Mixtral's 4 experts and sends tokens to the other's
    engine = _engine({"expert_parallel_size": 2, **timeout}, model=_mixtral())
    engine.backward(engine(input_ids=torch.arange(6).view(1, 6), labels=torch.arange(6).view(1, 6)).loss)
    engine.step()
    experts = engine.module.model.layers[0].mlp.experts
    exchanged = engine.comm_stats(by_group=True)["ep"]["all_to_all"]["calls"]
    shape = tuple(experts.gate_up_proj.shape)
    out["expert_parallel_size"] = (engine.topology.ep, experts.expert_range, shape, exchanged)
    # DeepSpeed-MoE's moe.ep_size and AutoEP's expert_parallel.autoep_size (with enabled: true) are the same size;
    # AutoEP's section with enabled: false splits nothing
    for key, section in (
        ("moe.ep_size", {"moe": {"ep_size": 2, "drop_tokens": False}}),
        ("expert_parallel.autoep_size", {"expert_parallel": {"enabled": True, "autoep_size": 2}}),
        ("expert_parallel.enabled", {"expert_parallel": {"enabled": False, "autoep_size": 2}}),
    ):
        engine = _engine({**section, **timeout}, model=_mixtral())
        experts = engine.module.model.layers[0].mlp.experts
        out[key] = (engine.topology.ep, getattr(experts, "expert_range", None), tuple(experts.gate_up_proj.shape))
        engine.close()
    # pipeline_parallel_size 2: each rank holds one of the GPT's two blocks; pipeline.schedule orders the last stage's
    # forwards (F) and backwards (B) of a step's 2 micro-batches: GPipe all forwards first, 1F1B alternating
    for schedule in ("GPipe", "1F1B"):
        pipe = {"pipeline_parallel_size": 2, "gradient_accumulation_steps": 2, "pipeline": {"schedule": schedule}}
        engine = _engine({**pipe, **timeout})
        order: list[str] = []

        def record(module: nn.Module, args: Any, output: torch.Tensor, order: list[str] = order) -> None:
            order.append("F")
            output.register_hook(lambda grad: order.append("B"))

        engine._pipeline.parts[0].register_forward_hook(record)
        engine.train_batch(iter([_batch(), _batch(2)]))  # the first step also infers the stages' shapes
        order.clear()
        engine.train_batch(iter([_batch(), _batch(2)]))
        blocks = sorted({n.split(".")[1] for n, _ in engine.module.named_parameters() if n.startswith("blocks.")})
        out[f"pipeline {schedule}"] = (engine.topology.pp, engine.topology.pp_rank, blocks, "".join(order))
        engine.close()
    # pipeline.stages_per_rank 2: 4 stages of a 4-block GPT, stages 0 and 2 on rank 0, 1 and 3 on rank 1
    torch.manual_seed(0)
    four = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_layer=4, n_head=4))
    pipe = {"pipeline_parallel_size": 2, "gradient_accumulation_steps": 2}
    engine = _engine({**pipe, "pipeline": {"schedule": "Interleaved1F1B", "stages_per_rank": 2}, **timeout}, four)
    engine.train_batch(iter([_batch(), _batch(2)]))
    out["stages_per_rank"] = [part.layer_ids for part in engine._pipeline.parts]
    engine.close()
    # pipeline.activation_checkpoint_interval 1: each held block recomputed whole in backward (its first norm runs
    # twice per micro-batch), as activation_checkpointing.policy "full"; 0: once
    for interval in (0, 1):
        engine = _engine({**pipe, "pipeline": {"activation_checkpoint_interval": interval}, **timeout})
        runs = {"n": 0}
        for block in engine.module.blocks.values():
            block.ln1.register_forward_hook(lambda *_, runs=runs: runs.__setitem__("n", runs["n"] + 1))
        engine.train_batch(iter([_batch(), _batch(2)]))  # the first step also infers the stages' shapes
        runs["n"] = 0
        engine.train_batch(iter([_batch(), _batch(2)]))
        out[f"interval {interval}"] = (engine.plan.activations.recompute, runs["n"])
        engine.close()
    # a rank that skips a micro-step: with the desync check both ranks fail at once, naming where each one is
    engine = _engine({"zero_optimization": {"stage": 2}, **timeout})
    _micro_step(engine)
    started = time.monotonic()
    try:
        engine.backward(engine(x, y))
        if rank == 0:  # rank 0 takes a second micro-step, rank 1 steps
            engine.backward(engine(x, y))
        engine.step()
        out["desync"] = "no error"
    except RankMismatchError as err:
        out["desync"] = str(err)
    out["desync_s"] = time.monotonic() - started
    engine = _engine({"zero_optimization": {"stage": 2}, "desync_check": False, **timeout})
    _micro_step(engine)
    out["phase_exchanges"] = engine._phase_check.comm is not None
    # the lone collective: rank 1 stays alive elsewhere, rank 0's reduction waits collective_timeout_s
    started = time.monotonic()
    if rank == 0:
        try:
            engine.backward(engine(x, y))
            out["timeout"] = "no error"
        except CollectiveTimeoutError as err:
            out["timeout"] = str(err)
    else:
        time.sleep(timeout_s * 3)
    out["timeout_s"] = time.monotonic() - started
    return out


def test_keys_that_need_two_ranks():
    timeout_s = 5.0
    results = run_distributed(_two_ranks, 2, timeout_s, init_process_group=False, timeout=180)
    for r in results:  # tensor_parallel.size and its DeepSpeed name autotp_size split each layer across 2 ranks
        out_features, in_features = r["whole"]
        assert r["size"] == (2, 1, (out_features // 2, in_features))
        assert r["autotp_size"] == (2, (out_features // 2, in_features))
        # desync_check: the diverging ranks fail at once, each naming where the other is
        assert "rank" in r["desync"] and "backward" in r["desync"] and "step" in r["desync"], r["desync"]
        assert r["desync_s"] < timeout_s
        assert r["phase_exchanges"] is False  # desync_check false: nothing is exchanged before each call
        # mics_shard_size 1: 2 replicas of 1-rank shards, gradients all-reduced across them; -1: one group of 2
        assert r["mics 1"] == (2, {1}, True) and r["mics -1"] == (1, {2}, False), (r["mics 1"], r["mics -1"])
    # sequence_parallel_size 2: sp ranks 0 and 1 of one group, 4 all-to-alls per layer each way (2 layers), and
    # the loss of the whole sequence on both
    layers = 2
    assert [r["sequence_parallel_size"][:4] for r in results] == [(2, 1, 0, 8 * layers), (2, 1, 1, 8 * layers)]
    assert results[0]["sequence_parallel_size"][4] == results[1]["sequence_parallel_size"][4]
    # context_parallel_size 2: cp ranks 0 and 1 of one group, keys and values of 2 layers, the whole sequence's loss
    assert [r["context_parallel_size"][:4] for r in results] == [
        (2, 1, 0, (RING_CALLS_CP2 * layers, False)),
        (2, 1, 1, (RING_CALLS_CP2 * layers, False)),
    ]
    assert results[0]["context_parallel_size"][4] == results[1]["context_parallel_size"][4]
    # expert_parallel_size 2: experts [0, 2) and [2, 4) of each MoE layer, the token exchange through the ep group
    assert [r["expert_parallel_size"][:3] for r in results] == [(2, (0, 2), (2, 48, 16)), (2, (2, 4), (2, 48, 16))]
    assert all(r["expert_parallel_size"][3] > 0 for r in results)
    for key in ("moe.ep_size", "expert_parallel.autoep_size"):
        assert [r[key] for r in results] == [(2, (0, 2), (2, 48, 16)), (2, (2, 4), (2, 48, 16))], key
    assert [r["expert_parallel.enabled"] for r in results] == [(1, None, (4, 48, 16))] * 2
    # pipeline_parallel_size 2: block 0 on rank 0, block 1 on rank 1; the last stage's order is the schedule's
    assert [r["pipeline GPipe"][:3] for r in results] == [(2, 0, ["0"]), (2, 1, ["1"])]
    assert results[1]["pipeline GPipe"][3] == "FFBB" and results[1]["pipeline 1F1B"][3] == "FBFB"
    assert [r["stages_per_rank"] for r in results] == [[["0"], ["2"]], [["1"], ["3"]]]
    assert [(r["interval 0"], r["interval 1"]) for r in results] == [(("none", 2), ("full", 4))] * 2
    # collective_timeout_s: the lone reduction fails after that many seconds, naming it
    message, waited = results[0]["timeout"], results[0]["timeout_s"]
    assert f"collective timeout {timeout_s:g}s" in message, message
    assert timeout_s * 0.5 <= waited < timeout_s * 3


def _four_ranks() -> dict[str, Any]:
    """World 4, stage 3: one micro-step's parameter all-gathers by group, without and with hpZ groups of 2."""
    out = {}
    for size in (1, 2):
        engine = _engine({"zero_optimization": {**_STAGE3, "zero_hpz_partition_size": size}})
        _micro_step(engine)
        by_group = engine.comm_stats(by_group=True)
        out[size] = {g: s["all_gather"]["bytes"] for g, s in by_group.items() if "all_gather" in s}
        engine.close()
    return out


def test_keys_that_need_four_ranks():
    for r in run_distributed(_four_ranks, 4, timeout=240):
        # zero_hpz_partition_size 2: the backward re-gathers (here the first block's) move within groups of 2 ranks
        # instead of over all 4; the forward gathers do not change
        plain, hpz = r[1], r[2]
        assert set(plain) == {"shard"} and set(hpz) == {"shard", "hpz"}, r
        moved_out = plain["shard"] - hpz["shard"]  # the backward gathers' bytes over 4 ranks: 3/4 of their size
        assert moved_out > 0 and hpz["hpz"] == moved_out * 4 // 3 // 2, r  # the same bytes over 2 ranks: 1/2


# -- the modes without effect: config check names them --------------------------------------------------------------

# for each entry of NO_EFFECT_WHEN: a config that gives the key in that mode
MODE_EXAMPLES: list[tuple[str, dict]] = [
    *(
        (_Z + key, {"zero_optimization": {"stage": 2, key: value}})
        for key, value in (
            ("stage3_param_persistence_threshold", 10),
            ("stage3_prefetch_bucket_size", 10),
            ("stage3_unit_classes", ["Block"]),
            ("stage3_gather_check", False),
        )
    ),
    (
        _Z + "stage3_gather_check",
        {"zero_optimization": {"stage": 3, "stage3_gather_check": True}, "graph": {"enabled": True}},
    ),
    (_Z + "allgather_bucket_size", {"zero_optimization": {"stage": 0, "allgather_bucket_size": 10}}),
    ("zero_allow_untested_optimizer", {"zero_allow_untested_optimizer": True}),
    (_Z + "sub_group_size", {"zero_optimization": {"stage": 1, "sub_group_size": 10}}),
    (_Z + "offload_optimizer.nvme_path", {"zero_optimization": {"stage": 1, "offload_optimizer": {"nvme_path": "/x"}}}),
    (
        _Z + "offload_optimizer.buffer_count",
        {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "buffer_count": 2}}},
    ),
    (
        _Z + "offload_optimizer.pin_memory",
        {"zero_optimization": {"stage": 1, "offload_optimizer": {"pin_memory": True}}},
    ),
    (_Z + "offload_optimizer.ratio", {"zero_optimization": {"stage": 1, "offload_optimizer": {"ratio": 0.5}}}),
    (_Z + "offload_param.device", {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}),
    (_Z + "zero_hpz_partition_size", {"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}}),
    (_Z + "offload_param.nvme_path", {"zero_optimization": {"stage": 3, "offload_param": {"nvme_path": "/x"}}}),
    (_Z + "offload_param.max_in_cpu", {"zero_optimization": {"stage": 3, "offload_param": {"max_in_cpu": 0}}}),
    (_Z + "offload_param.buffer_count", {"zero_optimization": {"stage": 3, "offload_param": {"buffer_count": 2}}}),
    *((f"fp16.{key}", {"fp16": {key: 2}}) for key in ("loss_scale", "loss_scale_window", "hysteresis")),
    *((f"fp16.{key}", {"fp16": {"enabled": True, "loss_scale": 128, key: 2}}) for key in ("initial_scale_power",)),
    ("fp16.min_loss_scale", {"fp16": {"enabled": True, "loss_scale": 128, "min_loss_scale": 2}}),
    *(
        (f"{m}.{key}", {m: {key: "x"}})
        for m, keys in (
            ("tensorboard", ("output_path", "job_name")),
            ("csv_monitor", ("output_path", "job_name")),
            ("wandb", ("group", "team", "project")),
        )
        for key in keys
    ),
    *(
        (f"flops_profiler.{key}", {"flops_profiler": {key: value}})
        for key, value in (
            ("profile_step", 2),
            ("module_depth", 1),
            ("detailed", False),
            ("output_file", "x"),
            ("recompute_fwd_factor", 0.5),
            ("peak_tflops", 100.0),
        )
    ),
    ("gradient_predivide_factor", {"prescale_gradients": True, "gradient_predivide_factor": 2.0}),
    ("fp16.auto_cast", {"fp16": {"auto_cast": True}}),
    ("tiled_logits_loss_shards", {"tiled_logits_loss_shards": 4}),
    ("tiled_mlp_shards", {"tiled_mlp_shards": 4}),
    ("fp8.recipe", {"fp8": {"recipe": "rowwise"}}),
    ("fp8.emulate", {"fp8": {"emulate": True}}),
    ("fp8.filter.exclude", {"fp8": {"filter": {"exclude": ["head"]}}}),
    ("fp8.gather_in_float8", {"fp8": {"gather_in_float8": False}}),
    ("fp8.gather_in_float8", {"fp8": {"enabled": True, "gather_in_float8": False}, "graph": {"enabled": True}}),
    ("fp8.gather_in_float8", {"fp8": {"enabled": True, "gather_in_float8": False}, "zero_optimization": {"stage": 2}}),
    (
        "fp8.gather_in_float8",
        {
            "fp8": {"enabled": True, "recipe": "rowwise", "gather_in_float8": False},
            "zero_optimization": {"stage": 3},
        },
    ),
    ("graph.strict", {"graph": {"strict": True}}),
    ("graph.cache_size", {"graph": {"cache_size": 2}}),
    ("graph.compiler", {"graph": {"compiler": "inductor"}}),
    ("graph.dynamic_shapes", {"graph": {"dynamic_shapes": False}}),
    *(
        (f"activation_checkpointing.{key}", {"activation_checkpointing": {key: True}})
        for key in (
            "cpu_checkpointing",
            "partition_activations",
            "contiguous_memory_optimization",
            "synchronize_checkpoint_boundary",
            "profile",
        )
    ),
    (
        "activation_checkpointing.partition_activations",
        {"activation_checkpointing": {"policy": "full", "partition_activations": True}},
    ),
]


def test_every_mode_without_effect_has_an_example():
    assert {path for path, _ in MODE_EXAMPLES} == {n.path for n in NO_EFFECT_WHEN}
    assert all(n.path in KEYS for n in NO_EFFECT_WHEN), "NO_EFFECT_WHEN names a key the table does not support"


@pytest.mark.parametrize(("path", "config"), MODE_EXAMPLES, ids=[p for p, _ in MODE_EXAMPLES])
def test_config_check_names_keys_without_effect_in_the_given_combination(path, config, tmp_path, capsys):
    report = inspect_config(config)
    assert report.ok, report.problems
    assert [n for n in report.no_effect if n.startswith(f"{path}: no effect ")], report.no_effect
    file = tmp_path / "ds.json"
    file.write_text(json.dumps(config))
    assert main(["config", "check", str(file)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"  no effect  {path}: ")]
    assert len(lines) == 1, lines


def _offload_param_below_stage_3(where: str) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    base = {"zero_optimization": {"stage": 2}}
    offload = {"device": "nvme", "nvme_path": where, "max_in_cpu": 0}
    given = {"zero_optimization": {"stage": 2, "offload_param": offload}}
    return _update(base, steps=2), _update(given, steps=2), [str(p) for p in Path(where).rglob("*")]


def test_offload_param_below_stage_3_is_ignored_as_deepspeed_ignores_it(tmp_path):
    ((plain, given, files),) = run_distributed(_offload_param_below_stage_3, 1, str(tmp_path), timeout=120)
    assert plain.abs().max() > 0
    assert torch.equal(plain, given)
    assert files == []  # no swap directory either
    report = inspect_config({"zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"}}})
    (note,) = [n for n in report.no_effect if "offload_param" in n]
    assert note.startswith(_Z + "offload_param.device: no effect at ZeRO stages 0-2: ")


def test_keys_in_a_mode_where_they_act_are_not_reported():
    config = {
        "zero_optimization": {
            "stage": 3,
            "stage3_prefetch_bucket_size": 10,
            "allgather_bucket_size": 10,
            "sub_group_size": 10,
            "offload_optimizer": {"device": "nvme", "nvme_path": "/x", "buffer_count": 2, "ratio": 0.5},
            "offload_param": {"device": "nvme", "nvme_path": "/x", "max_in_cpu": 0, "buffer_count": 2},
        },
        "fp16": {"enabled": True, "hysteresis": 1, "min_loss_scale": 2},
        "tensorboard": {"enabled": True, "job_name": "x"},
        "zero_allow_untested_optimizer": True,
    }
    graph = {"graph": {"enabled": True, "cache_size": 2, "compiler": "inductor"}, "wandb": {"project": "p"}}
    assert inspect_config(config).ok and inspect_config(config).no_effect == []
    assert [line.split(":")[0] for line in inspect_config(graph).no_effect] == ["wandb.project"]
