"""Graph mode against eager mode, DDP and FSDP2 at world 2 (ZeRO-2 and ZeRO-3), steps interleaved so ratios
survive a noisy machine.

    python bench/bench_graph.py [--steps 8] [--layers 11] [--variants ddp,fsdp2,stage2,...] [--no-rss]
    python bench/bench_graph.py --shape gpt2-10m --variants ddp,stage3,stage3:graph,stage3:inductor --steps 8
    python bench/bench_graph.py --variants ddp,stage3,stage3:graph --profile stage3,stage3:graph
    python bench/bench_graph.py --shape gpt2-10m --gpt n_layer=16,d_model=512 --variants stage3,stage3:graph --rss-only
    TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 python bench/bench_graph.py   # cold Inductor: every pass runs, slow capture

Every rank builds the same GPT (``--shape``, those of bench/bench_zero.py: ``bench``, the default, vocab 8192,
d_model 256, sequence 128, tied embeddings, micro-batch 8 per rank; ``gpt2-10m``, issue 15's 10.6M GPT-2), fp32
AdamW (lr 1e-4) and gradient clipping 1.0 once per variant, and runs it once (graph variants capture here) and
once more; the capture time is the first step minus the second. Then
each iteration runs one training step of each variant in a rotating order, all on the same batch; a step's time
(and each phase's) is the slowest rank's. The default ``--variants`` is the whole comparison of issue 12 (on the
loaded 2-core machine about 9 minutes at 8 steps, 10 at 16, peak-RSS processes included).

Variants: ``ddp`` (torch DistributedDataParallel); ``fsdp2`` (torch ``fully_shard`` on every block and the root,
its defaults: parameters resharded after forward and gathered again in backward); ``stageN``
(shardtrain eager, ZeRO stage N); ``stageN:graph`` (captured, graphs run as traced: ``aot_eager``);
``stageN:inductor`` (captured and compiled by Inductor); either with ``-static`` (``stage3:graph-static``):
graphs specialized on the input sizes (``graph.dynamic_shapes: false``). Stage 3 runs with DeepSpeed's defaults
(persistence threshold 1e5 elements: biases and norms stay whole and are reduced like stage 2's, in eager and
graph mode alike).

Columns of the table:
* ``median step [q1-q3]``: median step time over the timed iterations, with its quartiles.
* ``/ ddp``, ``/ fsdp2``, ``/ stage2``, ``/ stage3`` (each when that variant runs): ratio of median step times.
* ``fwd``, ``bwd``, ``opt``: median forward, backward (including the reductions it waits for and, in graph mode,
  the re-gathers), and optimizer step (norm, clipping, AdamW, and at ZeRO-1/2 the all-gather of updated shards).
* ``CPU``: median CPU seconds of a step, both ranks' processes summed (all threads; gloo does not spin while it
  waits, so this is work done, much less disturbed by other jobs on the machine than wall time).
* ``capture``: first step minus second step (graph variants; Inductor's on-disk cache makes it vary), wall time and
  CPU time (both ranks' processes, every thread: what load disturbs less).
* ``RSS/rank``: peak RSS of the larger rank in a fresh pair of processes running ``--rss-steps`` (3) steps of that
  variant alone.
  A second table breaks it down (rank 0, ``rss_phases``): ``start`` (interpreter, torch and shardtrain imported),
  ``compile stack`` (graph variants: what importing AOT autograd and its partitioners adds, and for
  ``:inductor`` Inductor's ``compile_fx``, imported before the model is built so that it is counted apart; the
  capture imports them anyway; TorchDynamo is in ``start``: importing shardtrain imports it),
  ``built`` (model, engine, optimizer), ``1st step peak`` (the capture's peak for graph variants), ``peak`` (the
  whole run), and after the last step: ``live`` (RSS after ``gc.collect()`` and glibc's ``malloc_trim(0)``, what is
  really held: optimizer state, shards, the compiled graphs and the compiler's state) and ``allocator`` (RSS before
  the trim minus after: memory freed but kept by the allocator); ``Python heap`` is the growth in pymalloc blocks
  since ``built`` (Python objects: Dynamo's and the graphs' state), ``modules`` the modules imported since then, and
  ``saved`` the bytes autograd saved for backward in one more step (distinct storages: activations, and the
  gathered parameters the graph keeps for backward).
* ``gathers``: ZeRO-3 units gathered at once at the worst point: ``graph_stats()["most_gathered"]`` for graph
  variants (the schedule pass's count; ``?`` when Inductor's cache served the compiled graph and the pass did
  not run), ``engine._runtime.max_gathered`` for eager ZeRO-3; ``-`` where nothing is gathered per unit.
* ``captures/reuses``: the graph cache's counts.
Two more tables give the paired ratios of step time and of CPU time: the median, with quartiles, of per-iteration
ratios to each reference's step of the same iteration (steadier than the ratio of medians when the machine's
load changes during a run).

``--gpt key=value,...`` changes the shape's GPTConfig (``n_layer=16,d_model=512``: a larger model, to tell a
fixed cost of graph mode from one that grows with the model). ``--rss-only`` skips the timed loop and prints the
peak RSS runs alone (``--rss-steps`` steps each, 3 by default): both ranks' peaks, their ratio to eager ZeRO-3's
(``stage3``, when it runs) and the breakdown.

``--profile V1,V2``: after the timed loop, ``--profile-steps`` (3) more steps of each named variant under
``torch.profiler`` on rank 0; prints where the time of a step went: in collectives (``wait_tensor`` of graph
collectives, the ``c10d::`` ops of eager ones, FSDP2's all-gather scopes), ATen compute, other recorded ops, and
the wall time no operator accounts for (Python), then the operators with the most self time.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import itertools
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.distributed as dist

import shardtrain
from bench_zero import Shape, batch, make_shape, torch_baseline
from shardtrain.models.gpt import GPT, num_parameters
from shardtrain.testing import run_distributed

_LIBC = ctypes.CDLL(ctypes.util.find_library("c")) if sys.platform.startswith("linux") else None

ALL_VARIANTS = "ddp,fsdp2,stage2,stage2:graph,stage2:inductor,stage3,stage3:graph,stage3:inductor"
REFERENCES = ("ddp", "fsdp2", "stage2", "stage3")


@dataclass
class Runner:
    """One variant: ``step(x, y, marks)`` runs a training step and appends ``time.perf_counter()`` after forward
    and after backward; ``engine`` is the shardtrain engine (None for DDP and FSDP2)."""

    step: Callable[[torch.Tensor, torch.Tensor, list[float]], None]
    engine: Any = None


def build(variant: str, shape: Shape) -> Runner:
    torch.manual_seed(0)
    model = GPT(shape.gpt)
    if variant in ("ddp", "fsdp2"):
        return Runner(torch_baseline(variant, model)[0])
    stage, _, mode = variant.partition(":")
    mode, static = mode.removesuffix("-static"), mode.endswith("-static")
    if not stage.startswith("stage") or mode not in ("", "graph", "inductor") or (static and not mode):
        raise SystemExit(
            f"unknown variant {variant!r}: use ddp, fsdp2, stageN, stageN:graph or stageN:inductor "
            "(the last two with -static: graph.dynamic_shapes false)"
        )
    config = {
        "train_micro_batch_size_per_gpu": shape.micro_batch,
        "gradient_clipping": 1.0,
        # DDP's default bucket is 25 MB; ours is counted in elements
        "zero_optimization": {"stage": int(stage.removeprefix("stage")), "reduce_bucket_size": 25_000_000 // 4},
    }
    if mode:
        compiler = "inductor" if mode == "inductor" else "aot_eager"
        config["graph"] = {"enabled": True, "compiler": compiler, "dynamic_shapes": not static}
    engine = shardtrain.initialize(model, config=config, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4))

    def engine_step(x, y, marks):
        loss = engine(x, y)
        marks.append(time.perf_counter())
        engine.backward(loss)
        marks.append(time.perf_counter())
        engine.step()

    return Runner(engine_step, engine)


def _timed(runner: Runner, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """[forward, backward, optimizer step, whole step] as the slowest rank saw each, then the CPU seconds of the
    step summed over the ranks (every thread, gloo's included; a rank blocked in a gloo collective does not spin,
    so this is the work done, which other jobs on the machine disturb much less than wall time)."""
    dist.barrier()
    cpu0 = time.process_time()
    marks = [time.perf_counter()]
    runner.step(x, y, marks)
    marks.append(time.perf_counter())
    cpu = torch.tensor([time.process_time() - cpu0], dtype=torch.float64)
    spans = torch.tensor([b - a for a, b in itertools.pairwise(marks)] + [marks[-1] - marks[0]], dtype=torch.float64)
    dist.all_reduce(spans, op=dist.ReduceOp.MAX)  # a step ends when the slowest rank ends
    dist.all_reduce(cpu)
    return spans.tolist() + cpu.tolist()


def gathers_in_flight(variant: str, runner: Runner) -> str:
    """See the module docstring's ``gathers`` column."""
    engine = runner.engine
    if engine is None or not engine._runtime.units:
        return "-"
    stats = engine.graph_stats()
    if stats is None:
        return str(engine._runtime.max_gathered)
    return str(stats["most_gathered"]) if stats["collectives"] else "?"


def timing_body(variants: list[str], steps: int, shape: Shape, profile: list[str], profile_steps: int) -> dict:
    rank = dist.get_rank()
    runners = {v: build(v, shape) for v in variants}
    first = {v: _timed(runners[v], *batch(shape, seed=rank)) for v in variants}  # captures happen here
    second = {v: _timed(runners[v], *batch(shape, seed=7 + rank)) for v in variants}
    phases: dict[str, list[list[float]]] = {v: [] for v in variants}
    for it in range(steps):
        k = it % len(variants)
        x, y = batch(shape, seed=1000 * it + rank)
        for v in variants[k:] + variants[:k]:  # rotate so no variant always runs first
            phases[v].append(_timed(runners[v], x, y))
    profiles = {v: _profile(runners[v], shape, profile_steps) for v in profile}
    graph = {v: r.engine.graph_stats() for v, r in runners.items() if r.engine is not None and r.engine.graph_stats()}
    return {
        "phases": phases,
        "capture": {v: first[v][3] - second[v][3] for v in variants},
        "capture_cpu": {v: first[v][4] - second[v][4] for v in variants},
        "graph": graph,
        "gathers": {v: gathers_in_flight(v, r) for v, r in runners.items()},
        "profiles": profiles,
    }


_COMM_WORDS = ("wait", "c10d", "gloo", "all_gather", "allgather", "reduce_scatter", "all_to_all", "allreduce",
               "all_reduce", "barrier", "nccl")  # fmt: skip


def _profile(runner: Runner, shape: Shape, steps: int) -> dict[str, Any]:
    """``steps`` steps under torch.profiler, every number per step. Self CPU time summed per kind of operator on
    this rank's threads: ``comm`` (blocked in or issuing collectives), ``aten`` (other ATen operators: the
    compute), ``other`` (recorded scopes' own time: autograd and compiled-graph wrappers); ``unrecorded`` is the
    wall time of the step less the recorded self time (Python between operators; negative when other threads'
    records, gloo's or autograd's, overlap the main thread's). For shardtrain engines it also returns the time the
    engine measured blocked in its own (eager) collectives, which the ``c10d::`` ops of ``comm`` mostly cover."""
    from torch.profiler import ProfilerActivity, profile

    x, y = batch(shape, seed=99 + dist.get_rank())
    if runner.engine is not None:
        runner.engine.comm.reset_wait_seconds()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            runner.step(x, y, [])
        wall = time.perf_counter() - t0
    # eager shardtrain collectives: the time the engine blocked on them (waits on gloo work are not profiler ops);
    # graph collectives are not counted there (see [Note: collectives in graphs]): their waits are wait_tensor ops
    engine_wait = sum(runner.engine.comm.wait_seconds().values()) / steps if runner.engine is not None else None
    wall /= steps
    kinds = {"comm": 0.0, "aten": 0.0, "other": 0.0}
    top = []
    for e in prof.key_averages():
        seconds = e.self_cpu_time_total / 1e6 / steps
        name = e.key.lower()
        kind = "comm" if any(w in name for w in _COMM_WORDS) else "aten" if name.startswith("aten::") else "other"
        kinds[kind] += seconds
        top.append((seconds, e.key, e.count // steps))
    top.sort(reverse=True)
    unrecorded = wall - sum(kinds.values())
    return {"wall": wall, **kinds, "unrecorded": unrecorded, "engine_wait": engine_wait, "top": top[:12]}


def _status() -> dict[str, int]:
    """VmRSS and VmHWM (the peak so far) of this process, in bytes."""
    with open("/proc/self/status") as f:
        fields = (line.partition(":") for line in f)
        return {k: int(v.split()[0]) * 1024 for k, _, v in fields if k in ("VmRSS", "VmHWM")}


def _trimmed_rss() -> int:
    """RSS once garbage is collected and glibc has returned the free memory it can (``malloc_trim``)."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    return _status()["VmRSS"]


def _saved_bytes(runner: Runner, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for backward during one step (packed by a saved-tensor hook
    around the whole step; the eager ZeRO-3 runtime chains its own hooks to it)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # no plain storage (a subclass): not counted
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        runner.step(x, y, [])
    return sum(storages.values())


def rss_phases(variant: str, steps: int, shape: Shape) -> dict[str, int]:
    """The peak RSS of ``steps`` steps of ``variant`` in this fresh process, broken down (see the module docstring's
    ``RSS/rank``; bytes, block and module counts). Nothing is trimmed before the peak is read."""
    out = {"start": _status()["VmRSS"], "compile stack": 0}
    if ":" in variant:  # what the capture imports anyway, here so that it is measured apart
        before = _status()["VmRSS"]
        import torch._dynamo.backends.common  # AOT autograd
        import torch._functorch.partitioners

        if variant.endswith(":inductor"):  # aot_eager never imports it (tests/graph/test_graph_memory.py)
            import torch._inductor.compile_fx  # noqa: F401

        out["compile stack"] = _status()["VmRSS"] - before
    runner = build(variant, shape)
    out["built"], blocks, modules = _status()["VmRSS"], sys.getallocatedblocks(), len(sys.modules)
    for i in range(steps):
        runner.step(*batch(shape, seed=i), [])
        if i == 0:
            out["1st step peak"] = _status()["VmHWM"]
    out["peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    held = _status()["VmRSS"]
    out["live"] = _trimmed_rss()
    out["allocator"] = held - out["live"]
    out["python blocks"] = sys.getallocatedblocks() - blocks
    out["modules"] = len(sys.modules) - modules
    out["saved"] = _saved_bytes(runner, *batch(shape, seed=steps))
    return out


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return q1, q2, q3


def _print_rss_phases(phases: dict[str, dict[str, int]]) -> None:
    mib = ("start", "compile stack", "built", "1st step peak", "peak", "live", "allocator", "saved")
    print("\npeak RSS broken down (rank 0, MiB; see the module docstring):")
    print(f"{'variant':16}" + "".join(f" {k:>13}" for k in mib) + f" {'Python heap':>13} {'modules':>8}")
    for v, p in phases.items():
        cells = "".join(f" {p[k] / 2**20:13.0f}" for k in mib)
        print(f"{v:16}{cells} {p['python blocks']:>+11d}bl {p['modules']:>+8d}")


def with_changes(shape: Shape, changes: str) -> Shape:
    """``shape`` with its GPTConfig's fields set from ``changes`` (``"n_layer=16,d_model=512"``)."""
    if not changes:
        return shape
    known = {f.name: f.type for f in fields(shape.gpt)}
    values = {}
    for item in changes.split(","):
        key, eq, value = item.partition("=")
        if not eq or key not in known:
            raise SystemExit(f"--gpt {item!r}: give key=value with a GPTConfig field: {', '.join(known)}")
        old = getattr(shape.gpt, key)
        values[key] = value.lower() in ("1", "true") if isinstance(old, bool) else type(old)(value)
    return replace(shape, gpt=replace(shape.gpt, **values))


def _print_rss_only(ranks: dict[str, list[dict[str, int]]]) -> None:
    """Both ranks' peaks and their ratios to eager ZeRO-3's (same rank), then rank 0's breakdown."""
    ref = ranks.get("stage3")
    print(f"\n{'variant':16} {'peak rank 0':>12} {'peak rank 1':>12} {'/ stage3 (0, 1)':>16} {'live rank 0':>12}")
    for v, rs in ranks.items():
        ratio = "/".join(f"{r['peak'] / q['peak']:.3f}" for r, q in zip(rs, ref)) if ref else "-"
        peaks = "".join(f" {r['peak'] / 2**20:8.0f} MiB" for r in rs)
        print(f"{v:16}{peaks} {ratio:>16} {rs[0]['live'] / 2**20:8.0f} MiB")
    _print_rss_phases({v: rs[0] for v, rs in ranks.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=ALL_VARIANTS, help="comma-separated")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per variant")
    parser.add_argument("--shape", default="bench", help="bench (default) or gpt2-10m, as in bench_zero.py")
    parser.add_argument("--layers", type=int, default=11, help="layers of the bench shape")
    parser.add_argument("--gpt", default="", help="GPTConfig changes, e.g. n_layer=16,d_model=512")
    parser.add_argument("--no-rss", action="store_true", help="skip the fresh-process peak RSS runs")
    parser.add_argument("--rss-only", action="store_true", help="only the fresh-process peak RSS runs")
    parser.add_argument("--rss-steps", type=int, default=3, help="steps of each peak RSS run")
    parser.add_argument("--profile", default="", help="comma-separated variants to profile on rank 0")
    parser.add_argument("--profile-steps", type=int, default=3, help="steps per profiled variant")
    args = parser.parse_args()
    variants = args.variants.split(",")
    profile = [v for v in args.profile.split(",") if v]
    if unknown := [v for v in profile if v not in variants]:
        raise SystemExit(f"--profile names variants not in --variants: {', '.join(unknown)}")
    if args.no_rss and args.rss_only:
        raise SystemExit("--no-rss and --rss-only leave nothing to run: give one of them")
    shape = with_changes(make_shape(args.shape, args.layers), args.gpt)
    n = num_parameters(GPT(shape.gpt))
    print(
        f"# bench_graph --shape {args.shape}: {n / 1e6:.1f}M-parameter GPT, fp32 AdamW, world 2 (gloo, 1 thread/rank), "
        f"micro-batch {shape.micro_batch}x{shape.gpt.seq_len}"
    )
    print(f"# machine: {platform.machine()}, {torch.get_num_threads()} cores, torch {torch.__version__}")
    print(f"# command: python {' '.join(sys.argv)}", flush=True)
    started = time.perf_counter()
    if args.rss_only:
        _print_rss_only(
            {v: run_distributed(rss_phases, 2, v, args.rss_steps, shape, timeout=1800, threads=1) for v in variants}
        )
        print(f"\n# total {time.perf_counter() - started:.0f} s")
        return
    result = run_distributed(
        timing_body, 2, variants, args.steps, shape, profile, args.profile_steps, timeout=3600, threads=1
    )[0]
    rss, phases = {}, {}
    if not args.no_rss:
        for v in variants:
            ranks = run_distributed(rss_phases, 2, v, args.rss_steps, shape, timeout=1800, threads=1)
            rss[v], phases[v] = max(r["peak"] for r in ranks), ranks[0]
    times = {v: [p[3] for p in ps] for v, ps in result["phases"].items()}
    cpus = {v: [p[4] for p in ps] for v, ps in result["phases"].items()}
    med = {v: statistics.median(t) for v, t in times.items()}
    refs = [r for r in REFERENCES if r in med]
    cols = "".join(f" {'/ ' + r:>8}" for r in refs)
    print(
        f"\n{'variant':16} {'median step [q1-q3]':>22}{cols} {'fwd':>6} {'bwd':>6} {'opt':>6} {'CPU':>6}"
        f" {'capture (CPU)':>14} {'RSS/rank':>9} {'gathers':>7}  captures/reuses"
    )
    for v in variants:
        q1, _, q3 = _quartiles(times[v])
        spread = f"{med[v] * 1000:.0f}ms [{q1 * 1000:.0f}-{q3 * 1000:.0f}]"
        ratios = "".join(f" {med[v] / med[r]:7.3f}x" for r in refs)
        fwd, bwd, opt = (statistics.median(p[i] for p in result["phases"][v]) * 1000 for i in range(3))
        capture = f"{result['capture'][v]:5.1f}s ({result['capture_cpu'][v]:5.1f})" if ":" in v else f"{'-':>14}"
        mem = f"{rss[v] / 2**20:5.0f} MiB" if rss else f"{'-':>9}"
        g = result["graph"].get(v)
        counts = f"{g['captures']}/{g['reuses']}" if g else "-"
        print(
            f"{v:16} {spread:>22}{ratios} {fwd:4.0f}ms {bwd:4.0f}ms {opt:4.0f}ms {statistics.median(cpus[v]):5.2f}s"
            f" {capture} {mem}"
            f" {result['gathers'][v]:>7}  {counts}"
        )
    if phases:
        _print_rss_phases(phases)
    for what, values in (("step time", times), ("CPU time", cpus)):
        print(f"\npaired {what} ratios, median [q1-q3] of per-iteration ratios:")
        print(f"{'variant':16}" + "".join(f" {'/ ' + r:>21}" for r in refs))
        for v in variants:
            cells = []
            for r in refs:
                q1, q2, q3 = _quartiles([a / b for a, b in zip(values[v], values[r])])
                cells.append(f" {f'{q2:.3f} [{q1:.3f}-{q3:.3f}]':>21}")
            print(f"{v:16}" + "".join(cells))
    for v, g in result["graph"].items():
        if g["collectives"] or g["fallbacks"] or g["guard_recaptures"]:
            print(f"{v}: {g['collectives']}, fallbacks {g['fallbacks']}, guard re-captures {g['guard_recaptures']}")
    for v, p in result["profiles"].items():
        print(
            f"\n## profile {v} (rank 0, per step of {args.profile_steps}): wall {p['wall'] * 1000:.0f} ms"
            f" = comm {p['comm'] * 1000:.0f} ms + aten {p['aten'] * 1000:.0f} ms"
            f" + other recorded {p['other'] * 1000:.0f} ms"
            f" + unrecorded {p['unrecorded'] * 1000:.0f} ms"
            + (f"; engine blocked in its collectives {p['engine_wait'] * 1000:.0f} ms" if p["engine_wait"] else "")
        )
        for seconds, key, count in p["top"]:
            print(f"  {seconds * 1000:8.1f} ms  {count:5d}x  {key}")
    print(f"\n# total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
