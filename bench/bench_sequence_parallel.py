"""The longest sequence that trains at world 2 under a memory budget: data parallel, Ulysses, Ulysses + ALST tiling.

    python bench/bench_sequence_parallel.py [--budget-mib 48] [--vocab 8192] [--d-model 128] [--layers 2]
        [--loss-shards 16]

Layouts, all at world 2 on the project's GPT (fp32, ZeRO-1, batch 1 per data-parallel rank):

* ``dp2``: data parallel, each rank trains a whole sequence (the reference);
* ``dp2-tiled``: the same with ``tiled_logits_loss`` and ``tiled_mlp_compute``;
* ``sp2``: ``sequence_parallel_size 2``, the two ranks share one sequence (each holds half of it);
* ``sp2-tiled``: Ulysses with both tilings.

A length fits when one training step (forward, backward, optimizer step) raises no rank's resident memory by more
than the budget above what it held before the step. The peak is the process's high-water mark (``VmHWM``), reset
before each step by writing 5 to ``/proc/self/clear_refs``; glibc is told to map every allocation above 64 KiB on
its own (``MALLOC_MMAP_THRESHOLD_``) so that freed tensors leave the resident set and one probe does not hide the
next. The search doubles the length from 256 tokens until a step no longer fits, then bisects to 256 tokens; both
ranks agree on every verdict. Each rank's rise is set against the formula (``M(s)`` below) at the same length.

[Note: activation memory of the GPT per rank]
With ``s`` tokens on a rank (``S`` for data parallel, ``S / 2`` under Ulysses), ``d`` the model width, ``V`` the
vocabulary, ``L`` layers, fp32:

    M(s) = 4 * s * (L * a * d + k * V)

``a`` counts the ``d``-wide tensors a block keeps for backward per token: layer norm 1's input, the QKV projection's
input, q, k, v and the attention output, the output projection's input, layer norm 2's input (8), and the MLP's
input, its ``4d`` intermediate before and after GELU (1 + 4 + 4): a = 17; with the tiled MLP the block keeps only
the MLP's input: a = 9. ``k`` counts the ``V``-wide tensors alive at the loss's peak (in backward: the saved
log-softmax, its gradient and the logits' gradient): k = 3; tiled in ``n`` tiles, two tiles' worth (a tile's logits
and its exponential in forward, its logits and their gradient in backward): k = 2 / n.
What ``M`` leaves out (the gradients of the ``d``-wide activations while backward runs, the all-to-all buffers,
the allocator) is the measured excess over it.

The all-to-all bytes per rank and step are read from the sequence-parallel communicator (``comm_stats``) and set
against docs/sequence-parallel.md's formula ``2 * L * b * (S/P) * d * 4 * 4 * (P-1)/P`` (``h * d_head = d``; q, k,
v and the output, forward and backward).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import time

import torch
import torch.distributed as dist

import shardtrain
from shardtrain.models.gpt import GPT, GPTConfig, num_parameters
from shardtrain.testing import run_distributed

FP32 = 4
GRAIN = 256  # the search's resolution in tokens
TILED = {"tiled_logits_loss": True, "tiled_mlp_compute": True}
LAYOUTS = {
    "dp2": {},
    "dp2-tiled": TILED,
    "sp2": {"sequence_parallel_size": 2},
    "sp2-tiled": {"sequence_parallel_size": 2, **TILED},
}


def _kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", open("/proc/self/status").read()).group(1))


def formula_bytes(s: int, args: argparse.Namespace, tiled: bool) -> int:
    """M(s) of [Note: activation memory of the GPT per rank]."""
    a = 9 if tiled else 17
    k = 2 / args.loss_shards if tiled else 3
    return int(FP32 * s * (args.layers * a * args.d_model + k * args.vocab))


def _step(engine: shardtrain.Engine, length: int) -> tuple[float, int, int]:
    """One training step at ``length`` tokens: (seconds, resident KiB before, peak KiB during)."""
    g = torch.Generator().manual_seed(length)
    x = torch.randint(0, engine.module.cfg.vocab_size, (engine.topology.dp, length), generator=g)
    x = x[engine.topology.dp_rank : engine.topology.dp_rank + 1]  # batch 1 per data-parallel rank
    y = torch.roll(x, -1, dims=1)
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM := the current resident set
        f.write("5")
    before = _kib("VmRSS")
    started = time.perf_counter()
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    del loss
    return time.perf_counter() - started, before, _kib("VmHWM")


def _search(name: str, args: argparse.Namespace, max_len: int) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=args.vocab, seq_len=max_len, d_model=args.d_model, n_layer=args.layers, n_head=4))
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 1},
        **LAYOUTS[name],
    }
    if "tiled" in name:  # ALST's default (tiles of 1 GiB of logits) would be one tile at these lengths
        config["tiled_logits_loss_shards"] = args.loss_shards
    engine = shardtrain.initialize(model, config=config, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4))
    _step(engine, GRAIN)  # the optimizer's state and every one-time buffer exist before the first measured step
    budget = args.budget_mib * 1024
    probes: dict[int, tuple[bool, int, float]] = {}
    exchanged: dict[int, dict[str, int]] = {}  # length -> this rank's all-to-all calls and bytes in its step

    def a2a() -> dict[str, int]:
        got = engine._sp.comm.stats().get("all_to_all", {}) if engine._sp is not None else {}
        return {"calls": got.get("calls", 0), "bytes": got.get("bytes", 0)}

    def fits(length: int) -> bool:
        start = a2a()
        seconds, before, peak = _step(engine, length)
        exchanged[length] = {k: v - start[k] for k, v in a2a().items()}
        rise = torch.tensor([peak - before], dtype=torch.int64)
        dist.all_reduce(rise, op=dist.ReduceOp.MAX)  # both ranks take the same verdict
        ok = int(rise) <= budget
        probes[length] = (ok, int(rise), seconds)
        return ok

    lo, hi = 0, GRAIN
    while hi <= max_len and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, max_len + GRAIN)
    while hi - lo > GRAIN:
        mid = (lo + hi) // 2 // GRAIN * GRAIN
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    stats = exchanged.get(lo) if engine._sp is not None else None
    return {"longest": lo, "probes": probes, "all_to_all": stats, "sp": engine.topology.sp}


def _job(args: argparse.Namespace, max_len: int) -> dict:
    return {name: _search(name, args, max_len) for name in LAYOUTS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mib", type=int, default=48, help="rise of resident memory a step may cause, per rank")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--max-len", type=int, default=32768)
    parser.add_argument("--loss-shards", type=int, default=16, help="tiled_logits_loss_shards of the tiled layouts")
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by each rank's allocator at its start
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    model = GPT(GPTConfig(vocab_size=args.vocab, seq_len=args.max_len, d_model=args.d_model, n_layer=args.layers))
    print(f"# {' '.join(sys.argv)}")
    print(f"# machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, gloo, world 2")
    print(
        f"# GPT: vocab {args.vocab}, d {args.d_model}, {args.layers} layers, 4 heads, "
        f"{num_parameters(model) / 1e6:.1f}M parameters; budget {args.budget_mib} MiB per rank per step; tiled: "
        f"{args.loss_shards} loss tiles, MLP tiles of {args.d_model} tokens (ALST's ceil(tokens / d))"
    )
    started = time.perf_counter()
    results = run_distributed(_job, 2, args, args.max_len, init_process_group=False, timeout=1800)
    ref = results[0]["dp2"]["longest"]
    print(
        "\n| layout | longest sequence (tokens) | vs dp2 | tokens per rank | measured rise (MiB, max rank) "
        "| M(s) (MiB) | measured / M |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in LAYOUTS:
        r = results[0][name]
        s = r["longest"] // r["sp"]
        rise = r["probes"][r["longest"]][1] / 1024 if r["longest"] else float("nan")
        predicted = formula_bytes(s, args, "tiled" in name) / 2**20
        print(
            f"| {name} | {r['longest']} | {r['longest'] / ref:.2f}x | {s} | {rise:.1f} | {predicted:.1f} | "
            f"{rise / predicted:.2f} |"
        )
    print("\n## all-to-all bytes per rank, one step at the longest length (Ulysses layouts)")
    for name in LAYOUTS:
        for rank, rr in enumerate(results):
            r = rr[name]
            if r["all_to_all"] is None:
                continue
            p, length = r["sp"], r["longest"]
            theory = 2 * args.layers * 1 * (length // p) * args.d_model * FP32 * 4 * (p - 1) // p
            got = r["all_to_all"]
            print(
                f"{name} rank {rank}: {got['bytes']} bytes in {got['calls']} calls; formula {theory} bytes in "
                f"{8 * args.layers} calls: ratio {got['bytes'] / theory:.4f}"
            )
    print("\n## probes (rank 0): length -> fits, rise MiB (max rank), step s")
    for name in LAYOUTS:
        probes = results[0][name]["probes"]
        shown = ", ".join(
            f"{n}: {'ok' if ok else 'over'} {rise / 1024:.0f} {sec:.1f}s"
            for n, (ok, rise, sec) in sorted(probes.items())
        )
        print(f"{name}: {shown}")
    print(f"\n# {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
