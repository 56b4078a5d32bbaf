"""The pipeline bubble of each schedule, measured against its theory, and the bytes the stages send per step against
the activation-size formula.

    python bench/bench_pipeline.py [--pp 2 4] [--micro-batches 4 16] [--forward-ms 30] [--layers 8] [--steps 2]
        [--schedules GPipe 1F1B Interleaved1F1B ZBVZeroBubble InterleavedZeroBubble]

Each run trains a stack of ``--layers`` equal layers at ``world = pp`` (one rank per pipeline stage rank, gloo on
CPU) through ``shardtrain.initialize`` with ``pipeline_parallel_size = pp``, for every schedule (``GPipe``, ``1F1B``,
and with two stages per rank ``Interleaved1F1B`` and the zero-bubble ``ZBVZeroBubble`` and ``InterleavedZeroBubble``)
and every micro-batch count ``m`` (``gradient_accumulation_steps``).

[Note: equal stage costs by sleeping]
A layer's forward sleeps ``--forward-ms`` and its backward twice that, half on the way to its input and half on the
way to its weight (autograd Functions around a per-channel scale), so a zero-bubble schedule's input pass and weight
pass each cost a forward, the zero-bubble paper's ``T_F = T_B = T_W``: every stage costs the same, whatever the
machine's load, and the sleeping ranks leave the shared cores to each other. A rank's useful work per step is then
``W = m * (layers / pp) * 3 * forward_ms``, and the bubble is the rest of the step's wall time ``T`` (rank 0's,
median over the timed steps; the step's loss broadcast makes every rank's the same): ``bubble = 1 - W / T``. Theory
for equal stages is the planner's (``shardtrain.estimate.axes.bubble_fraction``): ``(p - 1) / (m + p - 1)`` for
GPipe and 1F1B, and for the multi-stage schedules the idle slots of torch's own action lists ([Note: a schedule's
bubble from its own actions] in pipeline_parallel/order.py): ``(p - 1) / (2 m + p - 1)`` for Interleaved1F1B,
``(p - 1) / (6 m + p - 1)`` for the zero-bubble ones at two stages per rank once ``m >= 2p``. What exceeds it is
the schedule's own time (Python, the p2p hand-offs, the optimizer step and the loss broadcast), printed as
``overhead ms``.

Bytes: every ``isend`` that ``torch.distributed.pipelining`` issues goes through its ``_batch_p2p``, wrapped here to
add up the tensors' bytes (the first step, which also sends the shapes, is not counted). Formula per step, all ranks
together: each of the ``B`` stage boundaries between two ranks (``S - 1`` of the ``S = v p`` stages; a V-shaped
schedule's middle one, stages ``p - 1`` and ``p`` on one rank, hands over in memory) carries each micro-batch's
activation forward and its gradient back, ``2 m B b t d 4`` bytes for fp32 activations of ``[b, t, d]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import shardtrain
from shardtrain.estimate.axes import bubble_fraction
from shardtrain.pipeline_parallel import stage_ids_of_rank
from shardtrain.testing import run_distributed

FP32 = 4
SCHEDULES = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2, "ZBVZeroBubble": 2, "InterleavedZeroBubble": 2}
"""Each schedule and the stages per rank it runs here."""


class _Sleep(torch.autograd.Function):
    """``x`` unchanged, after sleeping ``forward_s``; its gradient unchanged, after sleeping ``backward_s``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad, None, None


class SleepLayer(nn.Module):
    """``x * scale``: a forward's sleep on the input's path, and a backward's sleep on each of the input's and the
    weight's paths ([Note: equal stage costs by sleeping])."""

    def __init__(self, width: int, forward_s: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))
        self.forward_s = forward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        to_input = _Sleep.apply(x, self.forward_s, self.forward_s)
        return to_input * _Sleep.apply(self.scale, 0.0, self.forward_s)


class SleepStack(nn.Module):
    """``layers`` equal layers, this rank's stages' only (pipeline_parallel/cut.py's [Note: a model built as its
    stage]): stage ``s`` of ``num_stages`` holds layers ``s * k`` to ``(s + 1) * k``."""

    def __init__(self, layers: int, num_stages: int, stage_ids: list[int], width: int, forward_s: float) -> None:
        super().__init__()
        self.per_stage, self.num_stages, self.stage_ids = layers // num_stages, num_stages, stage_ids
        held = [i for s in stage_ids for i in range(s * self.per_stage, (s + 1) * self.per_stage)]
        self.layers = nn.ModuleDict({str(i): SleepLayer(width, forward_s) for i in held})

    def pipeline_stages(self, num_stages: int, stage_ids: list[int]) -> tuple[list[nn.Module], object]:
        assert (num_stages, stage_ids) == (self.num_stages, self.stage_ids), (num_stages, stage_ids)
        parts = [
            nn.Sequential(*(self.layers[str(i)] for i in range(s * self.per_stage, (s + 1) * self.per_stage)))
            for s in stage_ids
        ]
        return parts, lambda out, target: ((out - target) ** 2).mean()


def _count_sends() -> dict:
    from torch.distributed.pipelining import schedules

    sent = {"bytes": 0}
    original = schedules._batch_p2p

    def counted(p2p_ops, desc=None):
        sent["bytes"] += sum(p.tensor.numel() * p.tensor.element_size() for p in p2p_ops if p.op is dist.isend)
        return original(p2p_ops, desc)

    schedules._batch_p2p = counted
    return sent


def _run(args: argparse.Namespace, pp: int) -> list[dict]:
    sent = _count_sends()
    rank = dist.get_rank()
    shape = (args.rows, args.tokens, args.width)
    out = []
    for schedule in args.schedules:
        per_rank = SCHEDULES[schedule]
        num_stages = pp * per_rank
        stage_ids = stage_ids_of_rank(schedule, pp, per_rank, rank)
        owner = {s: r for r in range(pp) for s in stage_ids_of_rank(schedule, pp, per_rank, r)}
        boundaries = sum(owner[s] != owner[s + 1] for s in range(num_stages - 1))
        for m in args.micro_batches:
            model = SleepStack(args.layers, num_stages, stage_ids, args.width, args.forward_ms / 1000)
            config = {
                "pipeline_parallel_size": pp,
                "pipeline": {"schedule": schedule, "stages_per_rank": per_rank},
                "train_micro_batch_size_per_gpu": args.rows,
                "gradient_accumulation_steps": m,
                "steps_per_print": 10**6,
            }
            engine = shardtrain.initialize(model, config, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3))
            batch = [(torch.randn(shape), torch.randn(shape)) for _ in range(m)]
            times = []
            for step in range(args.steps + 1):
                if step == 1:
                    sent["bytes"] = 0  # the first step also infers and sends the shapes
                dist.barrier()
                start = time.perf_counter()
                engine.train_batch(iter(batch))
                times.append(time.perf_counter() - start)
            total = torch.tensor([float(sent["bytes"])])
            dist.all_reduce(total)
            engine.close()
            step_s = statistics.median(times[1:])
            work_s = m * (args.layers / pp) * 3 * args.forward_ms / 1000
            theory = bubble_fraction(schedule, pp, m, per_rank)
            formula = 2 * m * boundaries * args.rows * args.tokens * args.width * FP32
            out.append(
                {
                    "schedule": schedule,
                    "pp": pp,
                    "v": per_rank,
                    "m": m,
                    "step_ms": step_s * 1000,
                    "bubble": 1 - work_s / step_s,
                    "theory": theory,
                    "overhead_ms": (step_s - work_s / (1 - theory)) * 1000,
                    "bytes": total.item() / args.steps,
                    "formula": formula,
                }
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--layers", type=int, default=8, help="divisible by pp * 2 (the interleaved stages)")
    parser.add_argument("--forward-ms", type=float, default=30.0, help="a layer's forward; its backward twice that")
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2, help="timed steps (after one warm-up step)")
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    args = parser.parse_args()
    print(f"# {' '.join(sys.argv)}")
    machine = f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores"
    print(f"# {machine}, load average {os.getloadavg()[0]:.1f} at start, torch {torch.__version__}")
    print(
        "| schedule | pp | v | m | step ms | bubble measured | theory (planner) | measured / theory | "
        "overhead ms | bytes sent / step | formula 2mBbtd4 | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for pp in args.pp:
        for r in run_distributed(_run, pp, args, pp)[0]:
            print(
                f"| {r['schedule']} | {r['pp']} | {r['v']} | {r['m']} | {r['step_ms']:.0f} | {r['bubble']:.3f} | "
                f"{r['theory']:.3f} | {r['bubble'] / r['theory']:.2f} | {r['overhead_ms']:.0f} | {r['bytes']:.0f} | "
                f"{r['formula']} | {r['bytes'] / r['formula']:.3f} |"
            )


if __name__ == "__main__":
    main()
