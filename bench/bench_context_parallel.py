"""Context parallelism: keys and values all-gathered or passed around a ring, and a step of Ulysses vs ring attention.

    python bench/bench_context_parallel.py [--lengths 4096 16384] [--kv-heads 2] [--head-dim 64] [--repeats 20]
        [--step-lengths 2048 4096]

1. **Gather or ring** ([Note: why not torch's context_parallel] in ``shardtrain/sequence_parallel/ring.py``): at
   world 2 and 3 (gloo), one layer's keys and values ``[1, kv, S / C, d]`` fp32 on each rank reach every rank either
   by one all-gather of each or by ``C - 1`` ring steps of ``isend``/``irecv`` to the next rank (what the engine
   does, ``Communicator.ring_step``, before any overlap with compute). Both move the same bytes per rank, ``2 * S *
   kv * d * 4 * (C - 1) / C``; the median of ``--repeats`` runs is reported.
2. **A training step** of the project's GPT (fp32, ZeRO-1, one sequence of ``S`` tokens shared by both ranks) at world
   2 under ``sequence_parallel_size 2`` (Ulysses) and ``context_parallel_size 2``: seconds per step (median of 3
   after one warm-up) and the bytes this rank's sequence group moved in one step, against the formulas: Ulysses ``8
   * L * (S / P) * d * 4 * (P - 1) / P`` (q, k, v and the output, forward and backward), context ``4 * L * S * d_kv
   * 4 * (C - 1) / C`` (keys and values passed around in forward, their gradients reduce-scattered in backward),
   plus the engine's real-token count exchange (a few bytes).
3. **Gathered or merged attention** ([Note: which context attention] in ``shardtrain/sequence_parallel/ring.py``):
   one attention's forward and backward (queries ``[1, 8, S / C, 64]``, keys and values ``[1, 2, S / C, 64]`` fp32,
   causal) by each path at world 2 and 3: seconds (median of ``--attention-repeats``) and the bytes its autograd
   saved for backward on one rank (``torch.autograd.graph.saved_tensors_hooks``).
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

import shardtrain
from shardtrain.distributed.communicator import Communicator
from shardtrain.models.gpt import GPT, GPTConfig
from shardtrain.testing import run_distributed

FP32 = 4


def _gather(comm: Communicator, kv: torch.Tensor) -> None:
    comm.all_gather_dim(kv, -2, what="keys and values (all-gather)")


def _ring(comm: Communicator, kv: torch.Tensor) -> None:
    held = kv
    for _ in range(comm.size - 1):  # each step: what was last received goes on to the next rank
        received = torch.empty_like(held)
        comm.ring_step(received, held, what="keys and values (ring)")
        held = received


def _gather_vs_ring(lengths: list[int], kv_heads: int, head_dim: int, repeats: int) -> dict:
    comm = Communicator(dist.group.WORLD, 60.0)
    out = {}
    for length in lengths:
        kv = torch.randn(2, 1, kv_heads, length // comm.size, head_dim)  # keys and values, stacked as the engine does
        times = {}
        for name, fn in (("gather", _gather), ("ring", _ring)):
            fn(comm, kv)  # warm-up
            samples = []
            for _ in range(repeats):
                dist.barrier()
                started = time.perf_counter()
                fn(comm, kv)
                samples.append(time.perf_counter() - started)
            times[name] = statistics.median(samples)
        out[length] = times
    return out


def _step_job(lengths: list[int], d_model: int, layers: int) -> dict:
    out = {}
    for name, key in (("Ulysses sp 2", "sequence_parallel_size"), ("ring cp 2", "context_parallel_size")):
        for length in lengths:
            torch.manual_seed(0)
            model = GPT(GPTConfig(vocab_size=1024, seq_len=length, d_model=d_model, n_layer=layers, n_head=4))
            config = {
                "train_micro_batch_size_per_gpu": 1,
                "steps_per_print": 10**9,
                "zero_optimization": {"stage": 1},
                key: 2,
            }
            engine = shardtrain.initialize(model, config=config, optimizer=torch.optim.AdamW(model.parameters()))
            x = torch.randint(0, 1024, (1, length), generator=torch.Generator().manual_seed(1))
            y = torch.roll(x, -1, dims=1)
            samples, moved = [], 0
            for i in range(4):
                before = sum(s["bytes"] for s in engine._sp.comm.stats().values())
                started = time.perf_counter()
                engine.backward(engine(x, y))
                engine.step()
                if i:  # the first is a warm-up
                    samples.append(time.perf_counter() - started)
                moved = sum(s["bytes"] for s in engine._sp.comm.stats().values()) - before
            out[(name, length)] = (statistics.median(samples), moved)
            engine.close()
    return out


def _attention_paths(lengths: list[int], repeats: int) -> dict:
    from shardtrain.sequence_parallel.ring import context_attention
    from shardtrain.sequence_parallel.ring_attention import ContextSplit

    comm = Communicator(dist.group.WORLD, 60.0)
    out = {}
    for length in lengths:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, 8, length // comm.size, 64, generator=g, requires_grad=True)
        k, v = (torch.randn(1, 2, length // comm.size, 64, generator=g, requires_grad=True) for _ in range(2))
        for merged in (False, True):
            samples, saved = [], []

            def keep(t: torch.Tensor, saved: list[int] = saved) -> torch.Tensor:
                saved.append(t.numel() * t.element_size())
                return t

            for i in range(repeats + 1):
                saved.clear()
                dist.barrier()
                started = time.perf_counter()
                with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                    attended = context_attention(q, k, v, comm, ContextSplit(length), merged=merged)
                attended.sum().backward()
                dist.barrier()
                if i:  # the first is a warm-up
                    samples.append(time.perf_counter() - started)
            out[(length, merged)] = (statistics.median(samples), sum(saved))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--step-lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--attention-lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--attention-repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"# {' '.join(sys.argv)}")
    print(f"# machine: {platform.machine()}, {os.cpu_count()} cores (shared), torch {torch.__version__}, gloo")
    print("\n| world | S | keys+values bytes received per rank | all-gather (ms) | ring (ms) | ring / gather |")
    print("|---|---|---|---|---|---|")
    for world in (2, 3):
        lengths = [n for n in args.lengths if n % (2 * world) == 0] or [args.lengths[0] // 6 * 6]
        got = run_distributed(_gather_vs_ring, world, lengths, args.kv_heads, args.head_dim, args.repeats)[0]
        for length, t in got.items():
            nbytes = 2 * length * args.kv_heads * args.head_dim * FP32 * (world - 1) // world
            print(
                f"| {world} | {length} | {nbytes} | {t['gather'] * 1e3:.2f} | {t['ring'] * 1e3:.2f} | "
                f"{t['ring'] / t['gather']:.2f} |"
            )
    print(f"\n## one step, GPT d {args.d_model}, {args.layers} layers, 4 heads (d_kv = d), world 2, ZeRO-1")
    print("| layout | S | step (s) | bytes moved by the sequence group | formula | ratio |")
    print("|---|---|---|---|---|---|")
    got = run_distributed(_step_job, 2, args.step_lengths, args.d_model, args.layers, init_process_group=False)[0]
    for (name, length), (seconds, moved) in got.items():
        if name.startswith("Ulysses"):
            formula = 8 * args.layers * (length // 2) * args.d_model * FP32 // 2
        else:
            formula = 4 * args.layers * length * args.d_model * FP32 // 2
        print(f"| {name} | {length} | {seconds:.3f} | {moved} | {formula} | {moved / formula:.4f} |")
    print("\n## one attention, forward and backward: gathered vs merged (log-sum-exp) ring")
    print("| world | S | gathered (s) | merged (s) | merged / gathered | saved for backward: gathered | merged |")
    print("|---|---|---|---|---|---|---|")
    for world in (2, 3):
        lengths = [n // (2 * world) * 2 * world for n in args.attention_lengths]
        got = run_distributed(_attention_paths, world, lengths, args.attention_repeats, threads=1)[0]
        for length in lengths:
            (gathered, kept), (merged, held) = got[(length, False)], got[(length, True)]
            print(f"| {world} | {length} | {gathered:.3f} | {merged:.3f} | {merged / gathered:.2f} | {kept} | {held} |")


if __name__ == "__main__":
    main()
