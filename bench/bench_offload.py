"""NVMe optimizer offload at world 2: a GPT whose Adam state is several times the memory allowed for it.

    python bench/bench_offload.py                        # ~310M-parameter GPT (d 1024, 24 layers), 2 timed steps
    python bench/bench_offload.py --layers 6 --steps 2   # a quicker ~85M one
    python bench/bench_offload.py --nvme-path /mnt/nvme  # swap files elsewhere (default /tmp/shardtrain-bench-swap)
    python bench/bench_offload.py --offload-param        # unit shards in swap files too
    python bench/bench_offload.py --host-step            # the host step alone: one pass against many (below)

Runs, each in fresh processes (two ranks, one thread each, ZeRO stage 3, fp32, AdamW):

1. raw disk: both ranks at once write (``pwritev`` + ``fdatasync``, then dropped from the page cache) and read
   back a file of ``--raw-mib`` MiB each, through the swapper's own file code: the bandwidth the disk gives two
   writers/readers, measured in this run;
2. offload: the model with ``offload_optimizer: {device: nvme}``, ``sub_group_size`` and ``buffer_count`` chosen
   so that the buffers (the memory allowed to optimizer state) are at most a quarter of a rank's state; per
   step: forward+backward time, optimizer step time, bytes read and written by the swapper, the bandwidth that
   is (bytes / step time, both ranks), and its ratio to the raw disk's;
3. in memory: the same model without offload (when it fits), step times, ratio offload / in memory;
4. small in memory: a model with a quarter of the layers, its step time scaled by the parameter ratio.

Peak RSS per rank (``ru_maxrss``) of each run. A step's time is the slowest rank's median over the timed steps
(the first step is warm-up: it creates the state). Prints one table and the machine.

``--host-step`` (one process, all of its intra-op threads): the host step of ``offload_optimizer: {device: cpu}`` on
``--params`` fp32 masters with bf16 fragments and AdamW, through :class:`OptimizerOffload`, in one pass ([Note: one
pass over a sub-group]) and in the multi-pass step it replaces (clip, the optimizer's step, the rounding, each a sweep
of its own); against the memory bandwidth measured in the same run (a STREAM-style triad ``a = b + s * c`` and a copy
over 512 MiB tensors): the bytes per parameter each moves (counted from the ops), its time, the bandwidth that is, and
its ratio to the floor (bytes at the triad's bandwidth). Medians of ``--repeats`` steps after one that makes the state.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import shardtrain
from shardtrain.models.gpt import GPT, GPTConfig, num_parameters
from shardtrain.testing import run_distributed

SEQ, MICRO = 64, 1


def gpt(layers: int, d_model: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=8192, seq_len=SEQ, d_model=d_model, n_layer=layers, n_head=16))


def raw_disk(path: str, mib: int) -> dict:
    """Write then read ``mib`` MiB with the swapper's file code (synced, dropped from the cache)."""
    from shardtrain.offload.swap import ScratchDir, SwapFiles

    scratch = ScratchDir(path, dist.get_rank(), "bench")
    files = SwapFiles(scratch, dist.get_rank())
    chunk = torch.full((64 << 20,), 1.0, dtype=torch.float32)  # 256 MiB per file
    count = max(1, mib // 256)
    dist.barrier()
    start = time.perf_counter()
    for i in range(count):
        files.write(i, "raw", chunk)
    wrote = time.perf_counter() - start
    dist.barrier()
    start = time.perf_counter()
    for i in range(count):
        files.read(i, "raw", chunk)
    read = time.perf_counter() - start
    files.close()
    scratch.remove()
    return {"bytes": count * chunk.numel() * 4, "write_s": wrote, "read_s": read}


def train(layers: int, d_model: int, steps: int, zero: dict) -> dict:
    model = gpt(layers, d_model)
    params = num_parameters(model)
    config = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 3, **zero}}
    engine = shardtrain.initialize(model, config, torch.optim.AdamW(model.parameters(), lr=1e-4))
    g = torch.Generator().manual_seed(dist.get_rank())
    offload = engine._optimizer.offload
    files = offload.files if offload is not None else None
    times = []
    for s in range(steps + 1):
        x = torch.randint(0, 8192, (MICRO, SEQ), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        engine.backward(engine(x, torch.roll(x, -1, 1)))
        t1 = time.perf_counter()
        before = (files.bytes_read, files.bytes_written) if files else (0, 0)
        engine.step()
        t2 = time.perf_counter()
        after = (files.bytes_read, files.bytes_written) if files else (0, 0)
        if s > 0:  # the first step creates the state
            times.append((t1 - t0, t2 - t1, after[0] - before[0], after[1] - before[1]))
    out = {
        "params": params,
        "fwd_bwd": statistics.median(t[0] for t in times),
        "step": statistics.median(t[1] for t in times),
        "read": statistics.median(t[2] for t in times),
        "written": statistics.median(t[3] for t in times),
        "state_bytes": engine.state_bytes(),
        "peak_held": offload.peak_held_bytes if offload is not None and files else 0,
        # an empty fragment (a rank's share of padding only) has no file
        "offloaded_bytes": sum(
            p.stat().st_size for i, keys in offload._saved.items() for k in keys if (p := files.path(i, k)).exists()
        )
        if files
        else 0,
    }
    engine.close()
    out["max_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


# DRAM bytes per parameter of the host step, from the ops each path runs on fp32 tensors (reads + writes; a bf16
# fragment written: 2). Multi-pass (torch's single-tensor AdamW with weight decay): the clip (g r+w, 8), decay (p r+w,
# 8), lerp_ of m (m, g r; m w, 12), mul_ and addcmul_ of v (8 + 12), sqrt and div into temporaries (8 + 8), add_ (8),
# addcdiv_ (p, m, denom r; p w, 16), the rounding (p r, 4 + 2). One pass: g, p, m, v each read and written back (32)
# and the fragment written (2).
MULTI_PASS_BYTES = 8 + 8 + 12 + 8 + 12 + 8 + 8 + 8 + 16 + 6
# with torch's fused CPU AdamW (``--fused``, what bench/gpu_validate.py steps): the clip (8), the fused update (g r,
# p, m, v r+w: 28), the rounding (6)
MULTI_PASS_FUSED_BYTES = 8 + 28 + 6
ONE_PASS_BYTES = 32 + 2


def memory_bandwidth(mib: int = 512, repeats: int = 5) -> dict:
    """Bytes per second of a triad (``a = b + s * c``: two reads, one write) and of a copy (one read, one write)
    over ``mib``-MiB fp32 tensors, on torch's intra-op threads, best of ``repeats``."""
    n = mib * 2**20 // 4
    a, b, c = torch.ones(n), torch.ones(n), torch.ones(n)  # touched: no page faults in the timings
    triad, copy = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.add(b, c, alpha=0.5, out=a)
        triad.append(3 * n * 4 / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        a.copy_(b)
        copy.append(2 * n * 4 / (time.perf_counter() - t0))
    return {"triad": max(triad), "copy": max(copy)}


def host_step(params: int, sub_group_size: int, repeats: int, block: int | None, fused: bool = False) -> dict:
    """Median seconds of the offloaded host step over ``params`` elements, multi-pass and one pass, and whether
    both ended bitwise equal (they start from the same values and take the same gradients)."""
    from shardtrain.offload.optimizer_state import OptimizerOffload, make_sub_groups

    sizes = [min(4 * 2**20, params - k) for k in range(0, params, 4 * 2**20)]  # 4M-element fragments
    gen = torch.Generator().manual_seed(0)
    coef = torch.tensor(0.6)

    def build():
        masters = [torch.randn(n, generator=torch.Generator().manual_seed(k)) for k, n in enumerate(sizes)]
        fragments = [m.to(torch.bfloat16) for m in masters]
        optimizer = torch.optim.AdamW(masters, lr=1e-4, weight_decay=0.01, fused=fused)
        groups = make_sub_groups(sizes, sub_group_size)
        offload = OptimizerOffload(optimizer, masters, groups, None, 1, None, fragments=fragments)
        if block is not None:
            offload._one_pass_step.block = block
        return offload, fragments

    runs = {}
    grads = [torch.randn(n, generator=gen) for n in sizes]
    for one in (False, True):
        offload, fragments = build()
        offload.one_pass = one
        times = []
        for r in range(repeats + 1):
            step_grads = [g.clone() for g in grads]
            t0 = time.perf_counter()
            if one and r > 0:
                offload.step(step_grads, factors=(coef,))  # the clip in the pass, the fragments written in it
            else:  # the multi-pass step as ShardedOptimizer runs it: clip, sub-group steps, the rounding
                torch._foreach_mul_(step_grads, coef)
                offload.step(step_grads)
                torch._foreach_copy_(fragments, offload.stepped)
            if r > 0:
                times.append(time.perf_counter() - t0)
        runs[one] = (statistics.median(times), offload, fragments)
        offload.close()
    (multi_s, a, fa), (one_s, b, fb) = runs[False], runs[True]
    same = all(torch.equal(x, y) for x, y in zip(a.stepped + fa, b.stepped + fb)) and all(
        torch.equal(a.optimizer.state[x][k], b.optimizer.state[y][k])
        for x, y in zip(a.stepped, b.stepped)
        for k in a.optimizer.state[x]
    )
    return {"multi": multi_s, "one": one_s, "bitwise": same}


def host_step_report(args: argparse.Namespace) -> None:
    from shardtrain.offload.one_pass import BLOCK_ELEMENTS

    print(
        f"machine: {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads"
    )
    bw = memory_bandwidth()
    print(f"memory bandwidth: triad {bw['triad'] / 1e9:.1f} GB/s, copy {bw['copy'] / 1e9:.1f} GB/s")
    p = args.params
    print(
        f"host step: {p / 1e6:.0f}M fp32 masters, bf16 fragments, {'fused ' if args.fused else ''}AdamW (weight "
        "decay), clip; "
        f"sub_group_size {args.sub_group_size:,}"
    )
    print(f"{'path':<24} {'bytes/param':>11} {'step s':>8} {'GB/s':>6} {'floor s':>8} {'step / floor':>12}")
    result = None
    for block in args.blocks or [BLOCK_ELEMENTS]:
        result = host_step(p, args.sub_group_size, args.repeats, block, args.fused)
        multi_bytes = MULTI_PASS_FUSED_BYTES if args.fused else MULTI_PASS_BYTES
        for name, key, nbytes in (
            ("multi-pass", "multi", multi_bytes),
            (f"one pass, block {block}", "one", ONE_PASS_BYTES),
        ):
            floor = nbytes * p / bw["triad"]
            s = result[key]
            print(f"{name:<24} {nbytes:>11} {s:>8.3f} {nbytes * p / s / 1e9:>6.1f} {floor:>8.3f} {s / floor:>12.2f}")
        print(f"multi-pass / one pass: {result['multi'] / result['one']:.2f}x; bitwise equal: {result['bitwise']}")


def slowest(results: list[dict], key: str) -> float:
    return max(r[key] for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--nvme-path", default="/tmp/shardtrain-bench-swap")
    parser.add_argument("--raw-mib", type=int, default=1024)
    parser.add_argument("--buffer-count", type=int, default=3)
    parser.add_argument("--skip-in-memory", action="store_true")
    parser.add_argument("--offload-param", action="store_true", help="also offload_param: nvme (max_in_cpu 0)")
    parser.add_argument("--host-step", action="store_true", help="the host step alone, one pass against multi-pass")
    parser.add_argument("--params", type=int, default=64 * 2**20, help="--host-step: elements stepped")
    parser.add_argument("--sub-group-size", type=int, default=1_000_000_000, help="--host-step: DeepSpeed's default")
    parser.add_argument("--repeats", type=int, default=3, help="--host-step: timed steps of each path")
    parser.add_argument("--blocks", type=int, nargs="*", help="--host-step: block sizes to try (elements)")
    parser.add_argument("--fused", action="store_true", help="--host-step: torch's fused CPU AdamW")
    parser.add_argument("--threads", type=int, help="--host-step: torch's intra-op threads (the pass's workers)")
    args = parser.parse_args()
    if args.host_step:
        if args.threads:
            torch.set_num_threads(args.threads)
        host_step_report(args)
        return
    Path(args.nvme_path).mkdir(parents=True, exist_ok=True)
    n = num_parameters(gpt(args.layers, args.d_model))
    per_rank_state = n // 2 * 8  # AdamW exp_avg + exp_avg_sq of a rank's half, fp32
    # buffers for at most a quarter of a rank's state: sub_group_size elements x 8 bytes x buffer_count
    sub_group = per_rank_state // 4 // (8 * args.buffer_count)
    zero = {
        "sub_group_size": sub_group,
        "offload_optimizer": {"device": "nvme", "nvme_path": args.nvme_path, "buffer_count": args.buffer_count},
    }
    if args.offload_param:
        zero["offload_param"] = {"device": "nvme", "nvme_path": args.nvme_path, "max_in_cpu": 0}
    timeout = 3600
    print(
        f"machine: {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}; swap dir {Path(args.nvme_path).resolve()}"
    )
    print(
        f"model: GPT d_model {args.d_model}, {args.layers} layers, {n / 1e6:.1f}M parameters; world 2, stage 3, "
        f"fp32 AdamW; sub_group_size {sub_group:,}, buffer_count {args.buffer_count}"
    )
    raw = run_distributed(raw_disk, 2, args.nvme_path, args.raw_mib, timeout=timeout, threads=1)
    raw_write = sum(r["bytes"] for r in raw) / slowest(raw, "write_s")
    raw_read = sum(r["bytes"] for r in raw) / slowest(raw, "read_s")
    raw_mixed = 2 * sum(r["bytes"] for r in raw) / (slowest(raw, "write_s") + slowest(raw, "read_s"))
    print(
        f"raw disk, 2 ranks at once: write {raw_write / 1e6:.0f} MB/s, read {raw_read / 1e6:.0f} MB/s, "
        f"write+read {raw_mixed / 1e6:.0f} MB/s"
    )
    off = run_distributed(train, 2, args.layers, args.d_model, args.steps, zero, timeout=timeout, threads=1)
    io = sum(r["read"] + r["written"] for r in off)
    achieved = io / slowest(off, "step")
    rows = [("offload nvme", off)]
    print(
        f"offload: optimizer state on disk {max(r['offloaded_bytes'] for r in off) / 2**20:.0f} MiB per rank, "
        f"swap buffers held at most {max(r['peak_held'] for r in off) / 2**20:.0f} MiB per rank "
        f"({max(r['offloaded_bytes'] for r in off) / max(r['peak_held'] for r in off):.1f}x less); "
        f"step moved {io / 1e6:.0f} MB (both ranks): {achieved / 1e6:.0f} MB/s = "
        f"{achieved / raw_mixed:.2f} x raw write+read"
    )
    if not args.skip_in_memory:
        rows.append(
            (
                "in memory",
                run_distributed(train, 2, args.layers, args.d_model, args.steps, {}, timeout=timeout, threads=1),
            )
        )
    small_layers = max(1, args.layers // 4)
    small = run_distributed(train, 2, small_layers, args.d_model, args.steps, {}, timeout=timeout, threads=1)
    scale = n / small[0]["params"]
    rows.append((f"in memory, {small_layers} layers, x{scale:.2f}", small))
    print(f"{'run':<28} {'fwd+bwd s':>10} {'step s':>10} {'total s':>10} {'peak RSS/rank MiB':>18}")
    ref_total = None
    for name, res in rows:
        f, s = slowest(res, "fwd_bwd"), slowest(res, "step")
        if name.startswith("in memory,"):
            f, s = f * scale, s * scale
        total = f + s
        ref_total = ref_total or total
        print(
            f"{name:<28} {f:>10.2f} {s:>10.2f} {total:>10.2f} {max(r['max_rss'] for r in res) / 2**20:>18.0f}"
            + ("" if name == "offload nvme" else f"   offload / this: {ref_total / total:.2f}x")
        )
    try:
        import deepspeed  # noqa: F401

        print("deepspeed is installed: compare with its ZeRO-Infinity by hand (not automated here)")
    except ImportError:
        print("deepspeed is not installed in this environment: no ZeRO-Infinity comparison")


if __name__ == "__main__":
    main()
