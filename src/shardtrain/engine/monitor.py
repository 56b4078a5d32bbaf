"""Training metrics as DeepSpeed's monitors write them (TensorBoard, CSV, Weights & Biases) and the wall-clock
breakdown; the engine owns one :class:`TrainingMonitor` and feeds it from ``forward``/``backward``/``step``.

[Note: monitor metrics]
Every ``steps_per_print`` optimizer steps, rank 0 writes (x-axis: samples seen, DeepSpeed's ``global_samples``,
``train_batch_size`` per optimizer step, skipped fp16 steps included as in DeepSpeed):

* ``Train/Samples/train_loss``: mean of rank 0's micro-batch losses of that optimizer step (DeepSpeed's value:
  rank 0's, not averaged over ranks, so that monitoring never adds a collective);
* ``Train/Samples/lr``: the first param group's learning rate after the step (``engine.get_lr()[0]``);
* ``Train/Samples/grad_norm``: the global gradient norm before clipping (``engine.get_global_grad_norm()``);
* ``Train/Samples/loss_scale``: the fp16 loss scale (1.0 without fp16);
* ``Train/Samples/step_time_ms``: wall-clock time of the whole iteration, from the end of the previous optimizer
  step (for the first step: its first forward) to the end of this one, so data loading counts;
* ``Train/Samples/tokens_per_second``: tokens of the step / step time. Rank 0 counts the elements of the first
  integer tensor of each ``engine(...)`` call (positional arguments first, then keyword arguments; a dict
  argument is searched too), e.g. ``input_ids`` including padding; ``engine.step(tokens=n)`` replaces that count
  for the micro-step it ends. The global rate assumes every rank processes as many tokens as rank 0
  (``rank-0 tokens x data-parallel size``), as fixed-shape batches do;
* with ``wall_clock_breakdown``: ``Train/Samples/elapsed_time_ms_forward`` / ``_backward`` / ``_step`` (DeepSpeed's
  names): milliseconds spent in ``engine.forward``, ``engine.backward`` (summed over the step's micro-steps) and
  ``engine.step`` (the optimizer step), also logged on logger ``shardtrain``.

Names with ``/`` are TensorBoard tags as they stand; the CSV monitor writes one file per metric,
``<output_path>/<job_name>/Train_Samples_train_loss.csv`` with header ``step,train_loss`` and rows
``<samples>,<value>``, as DeepSpeed's ``csvMonitor`` does (the header is written only when the file is new, so a
resumed run appends rows). Nothing here communicates: ranks other than 0 only count micro-steps.
"""

from __future__ import annotations

import csv
import importlib.util
import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardtrain.config.schema import Config, MonitorConfig, WandbConfig
from shardtrain.errors import ConfigError
from shardtrain.tree import iter_tensors

log = logging.getLogger("shardtrain")

Event = tuple[str, float, int]  # (metric name, value, samples seen)


@dataclass(frozen=True)
class StepMetrics:
    """What the engine reports after an optimizer step: all the monitor reads of it (the monitor never sees the
    engine itself)."""

    global_step: int
    global_samples: int
    lr: float  # the first param group's, after the step
    grad_norm: float | None  # before clipping; None when the step computed none
    loss_scale: float


def check_monitor_packages(config: Config) -> None:
    """Fail at ``initialize`` (every rank, before the model is touched) when an enabled monitor lacks its package."""
    needs = {"tensorboard": config.tensorboard.enabled, "wandb": config.wandb.enabled}
    for package, enabled in needs.items():
        if enabled and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"{package}.enabled is true but the {package!r} package is not installed; "
                f"`pip install {package}`, or set {package}.enabled to false"
            )


def log_dir(cfg: MonitorConfig) -> Path:
    """``output_path/job_name``; an empty ``output_path`` means ``./runs`` (see :class:`MonitorConfig`)."""
    return Path(cfg.output_path or "runs") / cfg.job_name


class _TensorBoardWriter:
    def __init__(self, cfg: MonitorConfig) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when enabled

        directory = log_dir(cfg)
        directory.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(directory))

    def write(self, events: list[Event]) -> None:
        for name, value, samples in events:
            self.writer.add_scalar(name, value, samples)
        self.writer.flush()  # as DeepSpeed: a crashed run keeps every point written so far

    def close(self) -> None:
        self.writer.close()


class _CsvWriter:
    def __init__(self, cfg: MonitorConfig) -> None:
        self.directory = log_dir(cfg)
        self.directory.mkdir(parents=True, exist_ok=True)

    def write(self, events: list[Event]) -> None:
        for name, value, samples in events:
            path = self.directory / (name.replace("/", "_").replace(" ", "_") + ".csv")
            new = not path.exists() or path.stat().st_size == 0
            with open(path, "a", newline="") as f:
                out = csv.writer(f)
                if new:
                    out.writerow(["step", name.rsplit("/", 1)[-1]])
                out.writerow([samples, repr(float(value))])  # repr: the float reads back exactly

    def close(self) -> None:
        pass  # every write opens and closes its file


class _WandbWriter:
    def __init__(self, cfg: WandbConfig) -> None:
        import wandb

        self.run = wandb.init(project=cfg.project, group=cfg.group, entity=cfg.team)

    def write(self, events: list[Event]) -> None:
        by_step: dict[int, dict[str, float]] = {}
        for name, value, samples in events:
            by_step.setdefault(samples, {})[name] = value
        for samples, values in by_step.items():
            self.run.log(values, step=samples)

    def close(self) -> None:
        self.run.finish()


class TrainingMonitor:
    """Measures and writes the metrics of [Note: monitor metrics] on rank 0; on other ranks does nothing."""

    def __init__(self, config: Config, rank: int, device: torch.device, data_parallel_size: int) -> None:
        self.steps_per_print = config.steps_per_print
        self.breakdown = config.wall_clock_breakdown and rank == 0
        self.dp = data_parallel_size
        self.rank0 = rank == 0
        self._sync_cuda = device.type == "cuda" and self.breakdown  # kernels are asynchronous: time them finished
        self._device = device
        self.writers: list[Any] = []
        if self.rank0:
            if config.tensorboard.enabled:
                self.writers.append(_TensorBoardWriter(config.tensorboard))
            if config.csv_monitor.enabled:
                self.writers.append(_CsvWriter(config.csv_monitor))
            if config.wandb.enabled:
                self.writers.append(_WandbWriter(config.wandb))
        self._reset_step()
        self._step_start: float | None = None
        self._closed = False

    def _reset_step(self) -> None:
        self._loss_sum: torch.Tensor | None = None
        self._losses = 0
        self._micro_tokens = 0
        self._tokens = 0
        self._ms = {"forward": 0.0, "backward": 0.0, "step": 0.0}

    # -- fed by the engine ------------------------------------------------------------------------
    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the wall-clock time of the block to ``phase`` (rank 0; CUDA synchronized with the breakdown on)."""
        if not self.rank0:
            yield
            return
        if self._sync_cuda:
            torch.cuda.synchronize(self._device)
        start = time.perf_counter()
        if phase == "forward" and self._step_start is None:
            self._step_start = start
        try:
            yield
        finally:
            if self._sync_cuda:
                torch.cuda.synchronize(self._device)
            self._ms[phase] += (time.perf_counter() - start) * 1e3

    def count_tokens(self, args: tuple, kwargs: Mapping[str, Any]) -> None:
        if self.rank0:
            t = _first_integer_tensor([*args, *kwargs.values()])
            self._micro_tokens += t.numel() if t is not None else 0

    def record_loss(self, loss: torch.Tensor) -> None:
        if self.rank0:  # a device-side sum: no host synchronization until a print step reads it
            value = loss.detach().float()
            self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
            self._losses += 1

    def end_micro_step(self, tokens: int | None) -> None:
        """Called by ``engine.step()``: ``tokens`` (if given) replaces the micro-step's automatic count."""
        if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0):
            raise ValueError(f"engine.step(tokens=...) expects a non-negative int, got {tokens!r}")
        if self.rank0:
            self._tokens += tokens if tokens is not None else self._micro_tokens
            self._micro_tokens = 0

    def end_optimizer_step(self, step: StepMetrics) -> None:
        """After an optimizer step: at every ``steps_per_print``-th, log and write the metrics."""
        if not self.rank0:
            return
        now = time.perf_counter()
        if step.global_step % self.steps_per_print == 0:
            step_ms = (now - self._step_start) * 1e3 if self._step_start is not None else float("nan")
            loss = float(self._loss_sum) / self._losses if self._loss_sum is not None else float("nan")
            self.write_metrics(step, loss, step_ms)
        self._reset_step()
        self._step_start = now  # the next iteration starts now: its data loading counts towards its time

    def write_metrics(self, step: StepMetrics, loss: float, step_ms: float) -> None:
        lr, norm = step.lr, step.grad_norm
        log.info("step %d: loss %.4f, lr %.3g, grad norm %.4g", step.global_step, loss, lr, norm)
        if self.breakdown:
            log.info(
                "step %d: forward %.2f ms, backward %.2f ms, step %.2f ms",
                step.global_step,
                self._ms["forward"],
                self._ms["backward"],
                self._ms["step"],
            )
        if not self.writers:
            return
        tokens_per_s = self._tokens * self.dp / (step_ms / 1e3) if step_ms > 0 else float("nan")
        values = {
            "train_loss": loss,
            "lr": lr,
            "grad_norm": norm if norm is not None else float("nan"),
            "loss_scale": step.loss_scale,
            "step_time_ms": step_ms,
            "tokens_per_second": tokens_per_s,
        }
        if self.breakdown:
            values |= {f"elapsed_time_ms_{phase}": ms for phase, ms in self._ms.items()}
        events = [(f"Train/Samples/{k}", float(v), step.global_samples) for k, v in values.items()]
        for w in self.writers:
            w.write(events)

    def close(self) -> None:
        """Flush and close every writer; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        for w in self.writers:
            w.close()


def _first_integer_tensor(values: list[Any]) -> torch.Tensor | None:
    """The first integer tensor in the call's arguments, walked as every module input is (see
    :mod:`shardtrain.tree`): token ids, whether passed alone, in a dict or in a dataclass."""
    for _, t in iter_tensors(values):
        if not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool:
            return t
    return None
