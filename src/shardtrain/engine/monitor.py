"""Training metrics as DeepSpeed's monitors write them (TensorBoard, CSV, Weights & Biases) and the wall-clock
breakdown; the engine owns one :class:`TrainingMonitor` and feeds it from ``forward``/``backward``/``step``.

[Note: monitor metrics]
After every optimizer step rank 0 writes to the monitors (as DeepSpeed's do), and logs every ``steps_per_print``
steps (never without it, DeepSpeed's default), against samples seen (DeepSpeed's ``global_samples``,
``train_batch_size`` per step, skipped fp16 steps included), under ``Train/Samples/``:

* ``train_loss``: mean of rank 0's micro-batch losses (DeepSpeed's value; not averaged: monitoring adds no collective);
* ``lr`` (``engine.get_lr()[0]``), ``grad_norm`` (before clipping), ``loss_scale`` (1.0 without fp16);
* ``step_time_ms``: from the end of the previous step (first step: its first forward), so data loading counts;
* ``tokens_per_second``: rank 0's tokens x data-parallel size / step time (equal tokens per rank assumed). Tokens are
  the elements of the first integer tensor of each ``engine(...)`` call (positionals, then keywords; dicts searched;
  ``input_ids`` with padding), or ``engine.step(tokens=n)`` for the micro-step it ends;
* with ``wall_clock_breakdown`` (or ``flops_profiler.enabled``, as in DeepSpeed): ``elapsed_time_ms_forward`` /
  ``_backward`` / ``_step`` (also logged, ``shardtrain``);
* with ``flops_profiler.enabled``: ``tflops_per_rank`` and ``mfu`` (see [Note: model FLOPs and MFU]).

Names are TensorBoard tags; the CSV monitor writes ``<output_path>/<job_name>/Train_Samples_<metric>.csv`` as
DeepSpeed's ``csvMonitor`` (header ``step,<metric>`` only in a new file, so a resumed run appends). Nothing here
communicates: other ranks only count micro-steps.

[Note: model FLOPs and MFU]
With ``flops_profiler.enabled`` rank 0 counts, with ``FlopCounterMode``, the forward FLOPs of its share at optimizer
step ``profile_step + 1`` (as DeepSpeed), once: a step's shapes don't change, and counting every step would slow each.
Model FLOPs per step are ``3 x`` that; with activation checkpointing the hardware FLOPs, ``(3 + recompute_fwd_factor)
x``, are reported beside them, never in MFU. Later print steps write TFLOP/s per rank = model FLOPs / step time and MFU
= that / peak (``flops_profiler.peak_tflops``, else a known GPU's dense 16-bit peak for bf16/fp16; fp32 or the CPU: no
MFU). Nothing synchronizes. The profile step's report gives forward, model and hardware FLOPs, and with ``detailed`` the
per-module table.
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
from torch.utils.flop_counter import FlopCounterMode

from shardtrain.config.sections import Config, MonitorConfig, WandbConfig
from shardtrain.errors import ConfigError
from shardtrain.tree import iter_tensors

log = logging.getLogger("shardtrain")

Event = tuple[str, float, int]  # (metric name, value, samples seen)

DENSE_16BIT_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "GH200": 989.0, "A100": 312.0, "A800": 312.0}
"""Dense bf16/fp16 tensor-core peaks (the vendor's figures, without sparsity), by a word of the device's name."""


def known_peak_tflops(device_name: str) -> float | None:
    """The dense 16-bit peak of the GPU called ``device_name`` (``torch.cuda.get_device_name``), if known."""
    words = device_name.replace("-", " ").split()
    return next((v for k, v in DENSE_16BIT_PEAK_TFLOPS.items() if k in words), None)


@dataclass(frozen=True)
class StepMetrics:
    """What the engine reports after an optimizer step: all the monitor reads of it (the monitor never sees the
    engine itself)."""

    global_step: int
    global_samples: int
    lr: float  # the first param group's, after the step
    # before clipping; None when the step computed none. The engine hands the device tensors over as they are: the
    # monitor reads them on the host only at a print step (see [Note: reading device values a step later])
    grad_norm: float | torch.Tensor | None
    loss_scale: float | torch.Tensor


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
    """``output_path/job_name``; an empty ``output_path`` is the working directory, as in DeepSpeed (see
    :class:`MonitorConfig`)."""
    return Path(cfg.output_path) / cfg.job_name


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
        # DeepSpeed's flops profiler turns the breakdown on too (its config ORs the two)
        self.breakdown = (config.wall_clock_breakdown or config.flops_profiler.enabled) and rank == 0
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
        self.flops = config.flops_profiler
        self._counted_forward = 0  # FLOPs of the profile step's forwards so far
        self._table = ""
        self.forward_flops: int | None = None
        """Forward FLOPs of one optimizer step on this rank, once counted (rank 0)."""
        self.peak_tflops = self.flops.peak_tflops
        sixteen_bit = config.bf16.enabled is True or config.fp16.enabled is True
        if self.peak_tflops is None and device.type == "cuda" and sixteen_bit:
            self.peak_tflops = known_peak_tflops(torch.cuda.get_device_name(device))

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

    @contextmanager
    def counting_flops(self, global_step: int) -> Iterator[None]:
        """Count the block's FLOPs when it is a forward of the profile step (rank 0; see [Note: model FLOPs and
        MFU])."""
        if not (self.rank0 and self.flops.enabled and global_step == self.flops.profile_step):
            yield
            return
        depth = self.flops.module_depth if self.flops.module_depth >= 0 else 999
        with FlopCounterMode(display=False, depth=depth) as counter:
            yield
        self._counted_forward += counter.get_total_flops()
        if self.flops.detailed and not self._table:
            self._table = _module_table(counter.get_flop_counts(), depth)

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
        if self._counted_forward and step.global_step == self.flops.profile_step + 1:
            self.forward_flops, self._counted_forward = self._counted_forward, 0
            self._report_flops(step.global_step)
        print_step = self.steps_per_print is not None and step.global_step % self.steps_per_print == 0
        if print_step or self.writers:  # the monitors write every step, as DeepSpeed's do
            step_ms = (now - self._step_start) * 1e3 if self._step_start is not None else float("nan")
            loss = float(self._loss_sum) / self._losses if self._loss_sum is not None else float("nan")
            self.write_metrics(step, loss, step_ms, print_step)
        self._reset_step()
        self._step_start = now  # the next iteration starts now: its data loading counts towards its time

    def _report_flops(self, global_step: int) -> None:
        forward = self.forward_flops or 0
        hardware = (3 + self.flops.recompute_fwd_factor) * forward
        lines = [
            f"flops profiler, step {global_step} (rank 0): forward {forward / 1e9:,.3f} GFLOP per optimizer step; "
            f"model FLOPs (3 x forward) {3 * forward / 1e9:,.3f} GFLOP, hardware FLOPs "
            f"({3 + self.flops.recompute_fwd_factor:g} x forward) {hardware / 1e9:,.3f} GFLOP; TFLOP/s per rank"
            + (f" and MFU (of {self.peak_tflops:g} TFLOP/s)" if self.peak_tflops else "")
            + f" in the monitor from step {global_step + 1} on"
        ]
        if self._table:
            lines.append(self._table)
        report = "\n".join(lines)
        if self.flops.output_file:
            Path(self.flops.output_file).write_text(report + "\n")
        else:
            log.info("%s", report)

    def throughput(self, step_ms: float) -> dict[str, float]:
        """Model TFLOP/s of this rank and MFU over a step of ``step_ms``, once the FLOPs are counted."""
        if self.forward_flops is None or not step_ms > 0:
            return {}
        tflops = 3 * self.forward_flops / (step_ms / 1e3) / 1e12
        out = {"tflops_per_rank": tflops}
        if self.peak_tflops:
            out["mfu"] = tflops / self.peak_tflops
        return out

    def write_metrics(self, step: StepMetrics, loss: float, step_ms: float, print_step: bool = True) -> None:
        """Write the metrics to every monitor, and log them when ``print_step``."""
        lr, norm = step.lr, float(step.grad_norm) if step.grad_norm is not None else None
        rates = self.throughput(step_ms)
        if print_step:
            self._log(step, loss, lr, norm, rates)
        if not self.writers:
            return
        tokens_per_s = self._tokens * self.dp / (step_ms / 1e3) if step_ms > 0 else float("nan")
        values = {
            "train_loss": loss,
            "lr": lr,
            "grad_norm": norm if norm is not None else float("nan"),
            "loss_scale": float(step.loss_scale),
            "step_time_ms": step_ms,
            "tokens_per_second": tokens_per_s,
            **rates,
        }
        if self.breakdown:
            values |= {f"elapsed_time_ms_{phase}": ms for phase, ms in self._ms.items()}
        events = [(f"Train/Samples/{k}", float(v), step.global_samples) for k, v in values.items()]
        for w in self.writers:
            w.write(events)

    def _log(self, step: StepMetrics, loss: float, lr: float, norm: float | None, rates: dict[str, float]) -> None:
        log.info("step %d: loss %.4f, lr %.3g, grad norm %.4g", step.global_step, loss, lr, norm)
        if rates:
            mfu = f", MFU {rates['mfu']:.1%}" if "mfu" in rates else ""
            log.info("step %d: %.3g TFLOP/s per rank%s", step.global_step, rates["tflops_per_rank"], mfu)
        if self.breakdown:
            log.info(
                "step %d: forward %.2f ms, backward %.2f ms, step %.2f ms",
                step.global_step,
                self._ms["forward"],
                self._ms["backward"],
                self._ms["step"],
            )

    def close(self) -> None:
        """Flush and close every writer; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        for w in self.writers:
            w.close()


def _module_table(counts: Mapping[str, Mapping[Any, int]], depth: int) -> str:
    """One line per module to ``depth`` (``FlopCounterMode.get_flop_counts()``: ``Global`` and dotted module names),
    with its forward GFLOP and share of the whole."""
    total = sum(counts.get("Global", {}).values()) or 1
    lines = [f"  {'module':<60} {'GFLOP':>12} {'share':>7}"]
    for name, ops in counts.items():
        if name != "Global" and name.count(".") >= depth:
            continue
        flops = sum(ops.values())
        lines.append(f"  {name:<60} {flops / 1e9:>12,.4f} {flops / total:>7.1%}")
    return "\n".join(lines)


def _first_integer_tensor(values: list[Any]) -> torch.Tensor | None:
    """The first integer tensor in the call's arguments, walked as every module input is (see
    :mod:`shardtrain.tree`): token ids, whether passed alone, in a dict or in a dataclass."""
    for _, t in iter_tensors(values):
        if not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool:
            return t
    return None
