""":class:`StatisticsSubscriber`: per-step statistics of every module output and gradient, written as JSON Lines.

File layout (what ``shardtrain compare`` reads)::

    OUTPUT_DIR/rank_<r>/step_<step, 6 digits>.jsonl

One file per step per rank; each rank writes only its own directory, so no file has two writers. Inside a file,
one JSON object per line in execution order: forward records as module forwards finish (children before their
parent, the root last), backward records as gradients arrive. With gradient accumulation the micro-steps of one
optimizer step go into the same file one after the other; ``call`` numbers the repeated records of one
``(direction, name, output)`` within a step (micro-step k, or the k-th call of a module used twice).

A record::

    {"seq": 12, "dir": "forward", "name": "blocks.0.mlp.0", "output": "", "call": 0,
     "shape": [2, 16, 128], "dtype": "float32", "numel": 4096,
     "min": ..., "max": ..., "mean": ..., "std": ..., "norm": ...,
     "nan": 0, "inf": 0, "zero": 0, "pos": ..., "neg": ...}

Records are never lost: each is handed to the operating system as soon as it is computed (the file is line
buffered), so the files hold every record made up to the moment a run ends, however it ends: normally without
``unsubscribe``, on an exception, killed (SIGKILL, the OOM killer) or from a ``multiprocessing`` worker that leaves
with ``os._exit`` (no ``atexit`` handler runs there, so a flush at step boundaries or at exit would not be enough).
One ``write`` per record costs about 1.5 us, against far more for its statistics.

``name`` is the module's qualified name (``""`` for the root) or the name given to ``inspect_activation``;
``output`` is the path of the tensor inside the module's outputs (``""`` for a bare tensor, ``[0]``, ``['logits']``).
The statistics are defined in :mod:`shardtrain.debug.tensor_summary` (population std, finite values only).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import weakref
from collections import defaultdict
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
from torch import nn

from shardtrain.debug.subscriber import Subscriber
from shardtrain.debug.tensor_summary import stats_from_summary, summary_tensors, tensor_stats
from shardtrain.tree import iter_tensors


def current_rank() -> int:
    """This process's rank: the process group's if initialized, else torchrun's ``RANK``, else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


_RANK_DIR = re.compile(r"rank_\d+$")


def rank_dir_name(rank: int) -> str:
    return f"rank_{rank}"


def step_file_name(step: int) -> str:
    return f"step_{step:06d}.jsonl"


class StatisticsSubscriber(Subscriber):
    """Records statistics for steps ``start_step <= step < end_step`` (``None``: unbounded) under ``output_dir``.

    ``output_dir`` must not exist unless ``override_output_dir=True``, which deletes the ``rank_<r>`` directories in
    it (in a multi-rank run, only this rank's) and nothing else. In a multi-rank run other ranks create their
    ``rank_<r>`` directories beside this one at the same time, so there the check is: this rank's directory must
    not exist, and ``output_dir`` may hold nothing but ``rank_<r>`` directories. Build the subscriber after
    ``init_process_group`` (or under ``torchrun``) so that the rank is known.

    Every record is on disk as soon as it is written (see the module docstring); :meth:`close`
    (``SubscriberManager.unsubscribe`` calls it) only releases the open file, which also happens when the
    subscriber is garbage-collected or the interpreter exits.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        start_step: int | None = None,
        end_step: int | None = None,
        override_output_dir: bool = False,
    ) -> None:
        for label, value in (("start_step", start_step), ("end_step", end_step)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"{label} must be a non-negative int or None, got {value!r}")
        if start_step is not None and end_step is not None and end_step <= start_step:
            raise ValueError(f"end_step ({end_step}) must be greater than start_step ({start_step}); it is exclusive")
        self.start_step, self.end_step = start_step, end_step
        self.output_dir = Path(output_dir)
        self.rank = current_rank()
        self.rank_dir = self.output_dir / rank_dir_name(self.rank)
        _prepare_dir(self.output_dir, self.rank_dir, override_output_dir)
        self._file = _StepFile()
        # closes the file of a subscriber that is never unsubscribed: when it is collected, or at interpreter exit
        self._finalizer = weakref.finalize(self, self._file.close)
        self._seq: dict[int, int] = defaultdict(int)
        self._calls: dict[int, dict[tuple[str, str, str], int]] = defaultdict(lambda: defaultdict(int))

    # -- Subscriber callbacks ------------------------------------------------------------------------
    def is_active(self, step: int) -> bool:
        return (self.start_step is None or step >= self.start_step) and (self.end_step is None or step < self.end_step)

    def post_forward(self, step: int, name: str, module: nn.Module, outputs: Any) -> None:
        for path, tensor in iter_tensors(outputs):
            self._record(step, "forward", name, path, tensor)

    def inspect(self, step: int, name: str, tensor: torch.Tensor) -> None:
        self._record(step, "forward", name, "", tensor)

    def output_grad(self, step: int, name: str, path: str, grad: torch.Tensor) -> None:
        if self.is_active(step):
            self._record(step, "backward", name, path, grad)

    # graph mode at ZeRO stage 3: the same statistics, computed inside the captured graph
    def summarize(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return summary_tensors(tensor)

    def record_summary(
        self,
        step: int,
        direction: str,
        name: str,
        path: str,
        shape: list[int],
        dtype: torch.dtype,
        summary: list[torch.Tensor],
    ) -> None:
        self._write(step, direction, name, path, stats_from_summary(shape, dtype, summary))

    # -- files ---------------------------------------------------------------------------------------
    def _record(self, step: int, direction: str, name: str, path: str, tensor: torch.Tensor) -> None:
        self._write(step, direction, name, path, tensor_stats(tensor))

    def _write(self, step: int, direction: str, name: str, path: str, stats: dict[str, Any]) -> None:
        key = (direction, name, path)
        calls = self._calls[step]
        record = {"seq": self._seq[step], "dir": direction, "name": name, "output": path, "call": calls[key]}
        record.update(stats)
        calls[key] += 1
        self._seq[step] += 1
        self._file.write(self.rank_dir, step, json.dumps(record) + "\n")

    def close(self) -> None:
        """Close the open step file (every record is already on disk); recording may continue later (appended)."""
        self._file.close()

    def __enter__(self) -> StatisticsSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _StepFile:
    """The one step file a subscriber has open. Apart from the subscriber, so that its finalizer can close it."""

    def __init__(self) -> None:
        self.file: IO[str] | None = None
        self.step = -1

    def write(self, rank_dir: Path, step: int, line: str) -> None:
        if self.file is None or step != self.step:
            self.close()
            # append: a late backward may come back to a step whose file was already closed. Line buffered: each
            # record reaches the operating system at once and survives any end of the process.
            self.file = open(rank_dir / step_file_name(step), "a", encoding="utf-8", buffering=1)  # noqa: SIM115
            self.step = step
        self.file.write(line)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file, self.step = None, -1


def _prepare_dir(output_dir: Path, rank_dir: Path, override: bool) -> None:
    if output_dir.exists() and not output_dir.is_dir():
        raise NotADirectoryError(f"StatisticsSubscriber output_dir {str(output_dir)!r} exists and is not a directory")
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if override:
        # Only rank_<r> directories are ever deleted, never output_dir itself (it may be a directory the user
        # cares about). Each rank of a multi-rank run deletes only its own: no path is removed by two ranks.
        if distributed:
            stale = [rank_dir] if rank_dir.exists() else []
        else:
            stale = [p for p in output_dir.iterdir() if _RANK_DIR.match(p.name)] if output_dir.exists() else []
        for path in stale:
            shutil.rmtree(path)
    elif output_dir.exists():
        foreign = [p.name for p in output_dir.iterdir() if not (p.is_dir() and _RANK_DIR.match(p.name))]
        if not distributed or rank_dir.exists() or foreign:
            raise FileExistsError(
                f"StatisticsSubscriber output_dir {str(output_dir)!r} already exists; pick a new directory or pass "
                "override_output_dir=True to replace it"
            )
    rank_dir.mkdir(parents=True, exist_ok=True)
