"""Monitors (TensorBoard, CSV, wandb) and the wall-clock breakdown: what rank 0 writes is what the engine reports."""

from __future__ import annotations

import csv
import logging
import time
from pathlib import Path

import pytest
import torch

import shardtrain
from shardtrain.errors import ConfigError
from shardtrain.models.gpt import GPT, GPTConfig
from shardtrain.testing import run_distributed

VOCAB, SEQ, MICRO, GAS, STEPS, EVERY = 32, 8, 2, 2, 4, 2
METRICS = ["train_loss", "lr", "grad_norm", "loss_scale", "step_time_ms", "tokens_per_second"]
TIMES = ["elapsed_time_ms_forward", "elapsed_time_ms_backward", "elapsed_time_ms_step"]
FORWARD_SLEEP = 0.02


class SlowGPT(GPT):
    """Forward takes at least FORWARD_SLEEP seconds, so the measured forward time has a known lower bound."""

    def forward(self, idx, targets=None):
        time.sleep(FORWARD_SLEEP)
        return super().forward(idx, targets)


def _config(out: str, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0,
        "steps_per_print": EVERY,
        "zero_optimization": {"stage": 2},
        "tensorboard": {"enabled": True, "output_path": out, "job_name": "tb"},
        "csv_monitor": {"enabled": True, "output_path": out, "job_name": "csv"},
        **extra,
    }


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _train(out: str, pass_tokens: bool, breakdown: bool, every: int | float | None = EVERY) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    records = _Records()
    logger = logging.getLogger("shardtrain")
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    torch.manual_seed(0)
    model = SlowGPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=16, n_layer=2, n_head=2))
    engine = shardtrain.initialize(
        model,
        config={
            k: v
            for k, v in _config(out, wall_clock_breakdown=breakdown, steps_per_print=every).items()
            if v is not None
        },
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)),  # lr moves
    )
    g = torch.Generator().manual_seed(rank)
    reported = []
    for _ in range(STEPS):
        losses = []
        for _ in range(GAS):
            x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
            loss = engine(x, x)
            engine.backward(loss)
            losses.append(loss.item())
            engine.step(tokens=5 if pass_tokens else None)
        reported.append(
            {
                "samples": engine.global_samples,
                "train_loss": sum(losses) / GAS,
                "lr": engine.get_lr()[0],
                "grad_norm": engine.get_global_grad_norm(),
                "loss_scale": engine.loss_scale,
            }
        )
    engine.close()
    engine.close()  # idempotent
    logger.removeHandler(records)
    return {"reported": reported, "log": records.messages}


def _read_csv(directory: Path) -> dict[str, list[tuple[int, float]]]:
    out = {}
    for path in sorted(directory.glob("*.csv")):
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
        metric = path.stem.removeprefix("Train_Samples_")
        assert rows[0] == ["step", metric], path
        out[metric] = [(int(s), float(v)) for s, v in rows[1:]]
    return out


def _read_tensorboard(directory: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = list(directory.glob("events.out.tfevents.*"))
    assert len(files) == 1, files  # rank 1 wrote nothing
    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {
        tag.removeprefix("Train/Samples/"): [(e.step, e.value) for e in acc.Scalars(tag)]
        for tag in acc.Tags()["scalars"]
    }


def test_tensorboard_and_csv_hold_what_the_engine_reported(tmp_path):
    rank0, rank1 = run_distributed(_train, 2, str(tmp_path), False, False, timeout=120)
    printed = rank0["reported"]  # the monitors write every step, as DeepSpeed's; the log every EVERY steps
    assert [r["samples"] for r in printed] == [s * MICRO * GAS * 2 for s in range(1, STEPS + 1)]
    csv_values = _read_csv(tmp_path / "csv")
    tb_values = _read_tensorboard(tmp_path / "tb")
    assert sorted(csv_values) == sorted(tb_values) == sorted(METRICS)
    for metric in ["train_loss", "lr", "grad_norm", "loss_scale"]:
        want = [(r["samples"], r[metric]) for r in printed]
        assert csv_values[metric] == want, metric  # repr'd floats read back exactly
        for (s, v), (ws, wv) in zip(tb_values[metric], want, strict=True):  # TensorBoard stores float32
            assert s == ws and v == pytest.approx(wv, rel=1e-6), metric
    assert printed[0]["lr"] != printed[1]["lr"]
    tokens = MICRO * SEQ * GAS * 2  # first integer tensor of engine(x, y), both ranks
    for (_, ms), (_, rate), (_, tb_ms) in zip(
        csv_values["step_time_ms"], csv_values["tokens_per_second"], tb_values["step_time_ms"]
    ):
        assert ms >= GAS * FORWARD_SLEEP * 1e3  # the iteration includes GAS sleeping forwards
        assert rate * ms / 1e3 == pytest.approx(tokens, rel=1e-9)
        assert tb_ms == pytest.approx(ms, rel=1e-6)
    assert [m.split(":")[0] for m in rank0["log"] if ": loss" in m] == ["step 2", "step 4"] and rank1["log"] == []


@pytest.mark.parametrize("every", [None, float("inf")])
def test_without_steps_per_print_nothing_is_logged_and_the_monitors_still_write(tmp_path, every):
    """DeepSpeed's default: no periodic log (``inf``, which accelerate writes, says the same); its monitors write
    every step whatever ``steps_per_print`` says."""
    rank0, _ = run_distributed(_train, 2, str(tmp_path), False, False, every, timeout=120)
    assert not [m for m in rank0["log"] if ": loss" in m]
    written = _read_csv(tmp_path / "csv")["train_loss"]
    assert written == [(r["samples"], r["train_loss"]) for r in rank0["reported"]]


def test_step_tokens_and_wall_clock_breakdown(tmp_path):
    rank0, rank1 = run_distributed(_train, 2, str(tmp_path), True, True, timeout=120)
    values = _read_csv(tmp_path / "csv")
    assert sorted(values) == sorted(METRICS + TIMES)
    for (_, ms), (_, rate) in zip(values["step_time_ms"], values["tokens_per_second"]):
        assert rate * ms / 1e3 == pytest.approx(5 * GAS * 2, rel=1e-9)  # engine.step(tokens=5) per micro-step
    for (_, fwd), (_, bwd), (_, step), (_, total) in zip(
        values["elapsed_time_ms_forward"],
        values["elapsed_time_ms_backward"],
        values["elapsed_time_ms_step"],
        values["step_time_ms"],
    ):
        assert fwd >= GAS * FORWARD_SLEEP * 1e3 and bwd > 0 and step > 0
        assert fwd + bwd + step <= total
    lines = [m for m in rank0["log"] if "forward" in m]
    assert len(lines) == STEPS // EVERY and lines[0].startswith("step 2: forward ")
    assert float(lines[0].split("forward ")[1].split(" ms")[0]) == pytest.approx(
        values["elapsed_time_ms_forward"][EVERY - 1][1], abs=0.01
    )
    assert rank1["log"] == []


def _wandb_missing() -> str:
    model = torch.nn.Linear(2, 2)
    before = model.weight.detach().clone()
    with pytest.raises(ConfigError) as err:
        shardtrain.initialize(model, config={"wandb": {"enabled": True}}, optimizer=torch.optim.SGD(model.parameters()))
    assert torch.equal(model.weight, before)  # refused before the model was touched
    return str(err.value)


def test_wandb_without_the_package_is_a_config_error():
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here; the message is for its absence")
    (message,) = run_distributed(_wandb_missing, 1, init_process_group=False)
    assert message == (
        "wandb.enabled is true but the 'wandb' package is not installed; `pip install wandb`, or set wandb.enabled "
        "to false"
    )
