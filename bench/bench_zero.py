"""ZeRO stages against torch DDP (and FSDP2) at world 2, steps interleaved so ratios survive a noisy machine.

    python bench/bench_zero.py [--variants ddp,stage0,stage1,stage2] [--steps 10] [--warmup 2] [--layers 11]
    python bench/bench_zero.py --shape gpt2-10m --variants ddp,stage0,stage1,stage2,stage3 --repeats 2 --steps 7
    python bench/bench_zero.py --shape gpt2-10m --profile /tmp/traces   # + one torch.profiler trace per variant
    python bench/bench_zero.py --variants ddp,stage0,stage3,fsdp2
    python bench/bench_zero.py --memory-scaling          # stage 3 at world 1, 2, 4 on a ~50M-parameter GPT
    python bench/bench_zero.py --variants ddp,stage2,stage2:bf16,stage3,stage3:bf16 --layers 2 --steps 3
    python bench/bench_zero.py --shape gpt2-10m --variants ddp,stage1,stage1:sync,stage2,stage2:sync,stage3 --run 3
    python bench/bench_zero.py --shape gpt2-10m --variants ddp,stage3,stage3-nocheck,stage3:graph --counts 6

Every rank builds the same GPT once per variant. Each iteration runs ``--run`` consecutive training steps of each
variant, in a rotating order, and waits for what the engine left in flight (ZeRO-1/2's all-gathers after the step
are waited for where the next forward needs them, [Note: gathers after the step]; the wait is timed, so no variant
hides work behind another's steps); a step's time is the slowest rank's time of the run divided by ``--run``.
``stageN:sync`` waits for those all-gathers at the end of each step, as before the overlap (the same numbers).
Prints the median step time of each variant, its ratio of medians to DDP and the median (with quartiles) of the
per-iteration ratios to DDP's step of the same iteration ("paired"), a per-phase breakdown (forward, including the
waits for the last step's all-gathers; backward including the reductions it waits for; step including norm,
optimizer and, with ``:sync``, the all-gather; each phase the slowest rank's), the time the engine spent blocked in
collectives (and of it in parameter all-gathers, ``AG wait``: what the overlap did not hide; at stage 3 the units'
too), the median per-iteration ratio of CPU time (all ranks' threads, gloo's included; other jobs on the machine
disturb it much less than wall time), communication bytes per step (from engine.comm_stats(): the bus-bandwidth
convention and the bytes actually sent) and, from separate fresh processes per variant, the peak RSS per rank.

``--counts N`` measures instead what load disturbs little, per step and rank, over N steps of each variant after 2
warm-up steps (variants interleaved): the process's CPU time (user + system, every thread: ``getrusage``), the main
thread's (``time.thread_time``; the rest is gloo's threads), the time blocked per collective kind and the number of
collectives (``engine.comm_stats()``); then from one step under ``torch.profiler`` (rank 0): ATen operators
dispatched, ``aten::copy_`` calls and the bytes they wrote, and the operators that allocated (their outputs: count
and bytes). ``stage3:graph``
and ``stage3:inductor`` run graph mode (``graph.compiler`` ``aot_eager`` or ``inductor``; captured in the warm-up).

Shapes (``--shape``):
* ``bench``: the project's benchmark GPT: d_model 256, 11 layers (``--layers``), vocab 8192, tied embeddings,
  sequence 128, micro-batch 8, exact GELU.
* ``gpt2-10m``: issue 15's GPT-2-style model, 10.58M parameters: vocab 8192, d_model 256, 8 layers, 8 heads,
  sequence 256, micro-batch 4 per rank, untied LM head, pre-LN, GELU-tanh MLP, no dropout.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import platform
import resource
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import shardtrain
from shardtrain.models.gpt import GPT, GPTConfig, num_parameters
from shardtrain.testing import run_distributed


@dataclass(frozen=True)
class Shape:
    """A model and its micro-batch per rank."""

    gpt: GPTConfig
    micro_batch: int


def make_shape(name: str, layers: int) -> Shape:
    if name == "bench":
        cfg = GPTConfig(vocab_size=8192, seq_len=128, d_model=256, n_layer=layers, n_head=8, tie_embeddings=True)
        return Shape(cfg, micro_batch=8)
    if name == "gpt2-10m":
        cfg = GPTConfig(vocab_size=8192, seq_len=256, d_model=256, n_layer=8, n_head=8, gelu_approximate="tanh")
        return Shape(cfg, micro_batch=4)
    raise SystemExit(f"unknown --shape {name!r}: use bench or gpt2-10m")


def torch_baseline(variant: str, model: torch.nn.Module):
    """``ddp`` (DistributedDataParallel) or ``fsdp2`` (``fully_shard`` on every block and the root, its defaults)
    around ``model``, with AdamW and gradient clipping 1.0: (step function as in :func:`build`, wrapped module)."""
    if variant == "ddp":
        wrapped = DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)

    def step(x, y, marks):
        loss = wrapped(x, y)
        marks.append(time.perf_counter())
        loss.backward()
        marks.append(time.perf_counter())
        torch.nn.utils.clip_grad_norm_(wrapped.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=variant != "ddp")  # DDP keeps its bucket views

    return step, wrapped


def build(variant: str, shape: Shape):
    """Returns (step function, engine or None, the callable computing the loss) for one variant. A step
    function takes (x, y, marks) and appends ``time.perf_counter()`` to ``marks`` after forward and after
    backward."""
    torch.manual_seed(0)
    model = GPT(shape.gpt)
    if variant in ("ddp", "fsdp2"):
        step, wrapped = torch_baseline(variant, model)
        return step, None, wrapped
    name, *flags = variant.split(":")  # e.g. stage3:bf16, stage2:backend-rs
    config = {
        "train_micro_batch_size_per_gpu": shape.micro_batch,
        "gradient_clipping": 1.0,
        # DDP's default bucket is 25 MB; ours is counted in elements
        "zero_optimization": {"stage": int(name[5]), "reduce_bucket_size": 25_000_000 // 4},
    }
    if "bf16" in flags:  # on this AVX2 CPU bf16 matmuls are ~16x slower
        config["bf16"] = {"enabled": True}
    if name == "stage3-nocheck":  # what the unit-order check costs
        config["zero_optimization"]["stage3_gather_check"] = False
    if "graph" in flags or "inductor" in flags:
        config["graph"] = {"enabled": True, "compiler": "inductor" if "inductor" in flags else "aot_eager"}
    engine = shardtrain.initialize(model, config=config, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4))
    if "backend-rs" in flags:  # the backend's own reduce-scatter (gloo: an all-reduce on the wire)
        engine.comm.reduce_scatter_impl = "backend"
    gathers = getattr(engine._optimizer, "gathers", None)  # absent before the overlap: always synchronous
    if "sync" in flags and gathers is not None:
        gathers.overlap = False

    def engine_step(x, y, marks):
        loss = engine(x, y)
        marks.append(time.perf_counter())
        engine.backward(loss)
        marks.append(time.perf_counter())
        engine.step()

    return engine_step, engine, engine


def settle(engine) -> None:
    """Wait for what a step left in flight (the all-gathers after a ZeRO-1/2 step; nothing in older versions)."""
    wait = getattr(getattr(engine, "_optimizer", None), "wait_gathers", None)
    if wait is not None:
        wait()


def batch(shape: Shape, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, shape.gpt.vocab_size, (shape.micro_batch, shape.gpt.seq_len), generator=g)
    return x, torch.roll(x, -1, 1)


def timing_body(
    variants: list[str], steps: int, warmup: int, repeats: int, shape: Shape, profile: str, run: int = 1
) -> dict:
    """``repeats`` rounds of (``warmup`` untimed + ``steps`` timed) iterations; every variant is rebuilt per round.
    An iteration times ``run`` consecutive steps of each variant and the wait for what they left in flight."""
    rank = dist.get_rank()
    times: dict[str, list[float]] = {v: [] for v in variants}
    phases: dict[str, list[list[float]]] = {v: [] for v in variants}  # [forward, backward, step] per timed step
    waits: dict[str, list[float]] = {v: [] for v in variants}
    gather_waits: dict[str, list[float]] = {v: [] for v in variants}  # the part blocked in parameter all-gathers
    cpus: dict[str, list[float]] = {v: [] for v in variants}
    comm: dict[str, dict] = {}
    losses: dict[str, list[float]] = {v: [] for v in variants}
    for repeat in range(repeats):
        runners = {v: build(v, shape) for v in variants}
        for it in range(warmup + steps):
            k = (it + repeat) % len(variants)
            order = variants[k:] + variants[:k]  # rotate so no variant always runs first
            batches = [batch(shape, seed=1000 * it + 10 * j + rank) for j in range(run)]
            for v in order:
                step, engine, _ = runners[v]
                if engine is not None:
                    engine.comm_stats(reset=True)
                    engine.comm.reset_wait_seconds()
                dist.barrier()
                cpu0 = time.process_time()
                start = time.perf_counter()
                spans = torch.zeros(4, dtype=torch.float64)  # forward, backward, step (summed over the run), all
                for x, y in batches:
                    marks = [time.perf_counter()]
                    step(x, y, marks)
                    marks.append(time.perf_counter())
                    spans[:3] += torch.tensor([b - a for a, b in itertools.pairwise(marks)], dtype=torch.float64)
                if engine is not None:
                    settle(engine)
                spans[3] = time.perf_counter() - start
                spans /= run
                cpu = torch.tensor([(time.process_time() - cpu0) / run], dtype=torch.float64)
                # each phase and the whole step as the slowest rank saw them
                dist.all_reduce(spans, op=dist.ReduceOp.MAX)
                dist.all_reduce(cpu)  # CPU seconds of all ranks' threads (gloo's included)
                if it >= warmup:
                    times[v].append(float(spans[-1]))
                    cpus[v].append(float(cpu))
                    phases[v].append(spans[:-1].tolist())
                    if engine is not None:
                        blocked = engine.comm.wait_seconds()
                        waits[v].append(sum(blocked.values()) / run)
                        gather_waits[v].append(blocked.get("all_gather", 0.0) / run)
                if engine is not None:
                    comm[v] = {
                        kind: {key: c[key] / run for key in ("calls", "bytes", "sent")}
                        for kind, c in engine.comm_stats().items()
                    }
        # the loss of one more step of every variant on the same batch: they must agree
        x, y = batch(shape, seed=7 + rank)
        for v in variants:
            losses[v].append(_eval_loss(runners[v][2], x, y))
        if profile and repeat == 0:
            _profile(runners, shape, profile)
        states = {v: e.state_bytes() for v, (_, e, _) in runners.items() if e is not None}
        del runners
    return {
        "times": times,
        "cpus": cpus,
        "phases": phases,
        "waits": waits,
        "gather_waits": gather_waits,
        "comm": comm,
        "states": states,
        "losses": losses,
    }


def _eval_loss(model, x, y) -> float:
    """The mean over ranks of the loss on this rank's (x, y), without gradients."""
    with torch.no_grad():
        t = model(x, y).detach().clone()
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _profile(runners: dict, shape: Shape, folder: str) -> None:
    """One step of each variant under torch.profiler: a Chrome trace per variant and rank, and the top operators
    of rank 0 printed (collectives waited on appear as their ``gloo:`` records / ``wait``)."""
    import os

    from torch.profiler import ProfilerActivity, profile

    os.makedirs(folder, exist_ok=True)
    rank = dist.get_rank()
    x, y = batch(shape, seed=99 + rank)
    for v, (step, _, _) in runners.items():
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(x, y, [])
        prof.export_chrome_trace(os.path.join(folder, f"{shape_name_of(shape)}-{v}-rank{rank}.json"))
        if rank == 0:
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
            print(f"\n## profile {v} (rank 0, one step)\n{table}", flush=True)


def _process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _minor_faults() -> int:
    """Minor page faults of this process so far: first touches of memory the kernel has to zero and map."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def counts_body(variants: list[str], steps: int, shape: Shape) -> dict:
    """See ``--counts`` in the module docstring: per variant, lists over steps (CPU) and one profiled step's counts."""
    from torch.profiler import ProfilerActivity, profile

    rank = dist.get_rank()
    runners = {v: build(v, shape) for v in variants}
    out: dict[str, dict] = {
        v: {"cpu": [], "main": [], "faults": [], "blocked": collections.Counter()} for v in variants
    }
    for it in range(2 + steps):
        k = it % len(variants)
        for v in variants[k:] + variants[:k]:
            step, engine, _ = runners[v]
            if engine is not None:
                engine.comm_stats(reset=True)
                engine.comm.reset_wait_seconds()
            dist.barrier()
            cpu0, main0, faults0 = _process_cpu(), time.thread_time(), _minor_faults()
            step(*batch(shape, seed=1000 * it + rank), [])
            if engine is not None:
                settle(engine)
            if it >= 2:
                out[v]["cpu"].append(_process_cpu() - cpu0)
                out[v]["main"].append(time.thread_time() - main0)
                out[v]["faults"].append(_minor_faults() - faults0)
                if engine is not None:
                    out[v]["blocked"].update(engine.comm.wait_seconds())
                    out[v]["calls"] = {kind: c["calls"] for kind, c in engine.comm_stats().items()}
    for v in variants:
        step, engine, _ = runners[v]
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True) as prof:
            step(*batch(shape, seed=99 + rank), [])
            if engine is not None:
                settle(engine)
        aten = copies = copied = allocs = allocated = 0
        for e in prof.events():
            if e.name.startswith("aten::"):
                aten += 1
                if e.self_cpu_memory_usage > 0:  # what the operator itself left allocated: its outputs
                    allocs, allocated = allocs + 1, allocated + e.self_cpu_memory_usage
                if e.name == "aten::copy_" and e.input_shapes and e.input_shapes[0]:
                    item = torch.empty((), dtype=_DTYPES.get(e.input_dtypes[0], torch.float32)).element_size()
                    copies, copied = copies + 1, copied + item * int(torch.Size(e.input_shapes[0]).numel())
        out[v].update(aten=aten, copies=copies, copied=copied, allocs=allocs, allocated=allocated)
        out[v]["blocked"] = {kind: s / steps for kind, s in out[v]["blocked"].items()}
    return out


_DTYPES = {"float": torch.float32, "c10::BFloat16": torch.bfloat16, "c10::Half": torch.float16, "double": torch.float64,
           "long int": torch.int64, "int": torch.int32, "bool": torch.bool}  # fmt: skip


def print_counts(variants: list[str], results: list[dict]) -> None:
    print(
        f"\n{'variant':16} {'CPU/step r0, r1':>16} {'main thread':>12} {'other threads':>13} {'blocked':>8}"
        f" {'faults':>8} {'ATen ops':>8} {'copy_ (MiB)':>13} {'allocating (MiB)':>17}  collectives per step"
    )
    for v in variants:
        cpu = [statistics.median(r[v]["cpu"]) * 1000 for r in results]
        main = [statistics.median(r[v]["main"]) * 1000 for r in results]
        faults = [statistics.median(r[v]["faults"]) for r in results]
        r0 = results[0][v]
        blocked = f"{sum(r0['blocked'].values()) * 1000:6.0f}ms" if r0["blocked"] else f"{'-':>8}"
        calls = ", ".join(f"{k} {c}" for k, c in r0.get("calls", {}).items()) or "(DDP: its own all-reduces)"
        print(
            f"{v:16} {cpu[0]:6.0f}, {cpu[1]:5.0f}ms {main[0]:10.0f}ms {cpu[0] - main[0]:11.0f}ms {blocked}"
            f" {faults[0]:8.0f} {r0['aten']:8d} {r0['copies']:5d} ({r0['copied'] / 2**20:5.1f})"
            f" {r0['allocs']:8d} ({r0['allocated'] / 2**20:6.1f})"
            f"  {calls}"
        )
        if r0["blocked"]:
            print(
                f"{'':16}   blocked per kind: " + ", ".join(f"{k} {s * 1000:.0f}ms" for k, s in r0["blocked"].items())
            )


def shape_name_of(shape: Shape) -> str:
    return "gpt2-10m" if shape.gpt.seq_len == 256 else "bench"


def rss_body(variant: str, steps: int, shape: Shape) -> int:
    step, _, _ = build(variant, shape)
    for i in range(steps):
        step(*batch(shape, seed=i), [])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def scaling_body(layers: int, steps: int) -> dict:
    cfg = GPTConfig(vocab_size=8192, seq_len=128, d_model=512, n_layer=layers, n_head=8, tie_embeddings=True)
    with shardtrain.zero.Init():  # no rank ever holds the whole model
        model = GPT(cfg)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}
    engine = shardtrain.initialize(model, config=config, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4))
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
        engine.backward(engine(x, torch.roll(x, -1, 1)))
        engine.step()
    return {"state": engine.state_bytes(), "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def memory_scaling(layers: int = 14) -> None:
    cfg = GPTConfig(vocab_size=8192, seq_len=128, d_model=512, n_layer=layers, n_head=8, tie_embeddings=True)
    n = num_parameters(GPT(cfg))
    print(f"# memory scaling: ZeRO-3, {n / 1e6:.1f}M-parameter GPT built under shardtrain.zero.Init, fp32 AdamW")
    print(f"# command: python {' '.join(sys.argv)}")
    print(f"\n{'world':>5} {'state bytes/rank':>17} {'bytes/param':>12} {'peak RSS/rank':>14}")
    for world in (1, 2, 4):
        results = run_distributed(scaling_body, world, layers, 2, timeout=1800, threads=max(1, 2 // world))
        state = max(sum(r["state"].values()) for r in results)
        rss = max(r["rss"] for r in results)
        print(f"{world:5d} {state / 2**20:13.1f} MiB {state / n:12.2f} {rss / 2**20:10.0f} MiB")


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="ddp,stage0,stage1,stage2", help="comma-separated; ddp first")
    parser.add_argument("--shape", default="bench", help="bench (default) or gpt2-10m")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="rounds, each building every variant anew")
    parser.add_argument("--run", type=int, default=3, help="consecutive steps of a variant per timed sample")
    parser.add_argument("--layers", type=int, default=11, help="layers of the bench shape")
    parser.add_argument("--profile", default="", help="folder for one torch.profiler trace per variant and rank")
    parser.add_argument("--no-rss", action="store_true", help="skip the peak-RSS processes")
    parser.add_argument("--memory-scaling", action="store_true")
    parser.add_argument("--counts", type=int, default=0, help="steps of CPU time and counts per variant (no timing)")
    args = parser.parse_args()
    if args.memory_scaling:
        memory_scaling()
        return
    variants = args.variants.split(",")
    if variants[0] != "ddp":
        raise SystemExit("--variants must start with ddp (the reference)")
    shape = make_shape(args.shape, args.layers)
    world = 2
    n = num_parameters(GPT(shape.gpt))
    samples = f"{args.repeats} x {args.steps} samples of {args.run} consecutive steps"
    if args.counts:
        samples = f"counts over {args.counts} steps per variant after 2 warm-up steps"
    print(
        f"# bench_zero --shape {args.shape}: {n / 1e6:.2f}M-parameter GPT, fp32 AdamW, world {world} (gloo, "
        f"1 thread/rank), micro-batch {shape.micro_batch}x{shape.gpt.seq_len}, {samples}"
    )
    print(f"# machine: {platform.machine()}, {torch.get_num_threads()} cores, torch {torch.__version__}")
    print(f"# command: python {' '.join(sys.argv)}")
    if args.counts:
        print_counts(
            variants, run_distributed(counts_body, world, variants, args.counts, shape, timeout=3600, threads=1)
        )
        return
    result = run_distributed(
        timing_body,
        world,
        variants,
        args.steps,
        args.warmup,
        args.repeats,
        shape,
        args.profile,
        args.run,
        timeout=3600,
        threads=1,
    )[0]
    rss = {}
    if not args.no_rss:
        rss = {v: max(run_distributed(rss_body, world, v, 3, shape, timeout=900, threads=1)) for v in variants}
    times = result["times"]
    ddp = statistics.median(times["ddp"])
    header = (
        f"{'variant':15} {'median step':>11} {'ratio':>6} {'paired [q1, q3]':>22} {'fwd':>6} {'bwd':>6} {'step':>6}"
        f" {'coll.wait':>9} {'AG wait':>8} {'CPU paired':>10} {'peak RSS':>9} {'state':>10}"
    )
    print(f"\n{header}  bytes/step: bus convention (sent on the wire)")
    for v in variants:
        med = statistics.median(times[v])
        q1, q2, q3 = _quartiles([a / b for a, b in zip(times[v], times["ddp"])])
        cpu_ratio = _quartiles([a / b for a, b in zip(result["cpus"][v], result["cpus"]["ddp"])])[1]
        fwd, bwd, stp = (statistics.median(p[i] for p in result["phases"][v]) * 1000 for i in range(3))
        wait = f"{statistics.median(result['waits'][v]) * 1000:7.0f}ms" if result["waits"][v] else f"{'-':>9}"
        gwait = result["gather_waits"][v]
        gwait = f"{statistics.median(gwait) * 1000:6.0f}ms" if gwait else f"{'-':>8}"
        comm = result["comm"].get(v)
        if v == "fsdp2":
            comm_text = f"~{3 * 4 * n * (world - 1) / world / 2**20:.1f} MiB (computed: 3P(N-1)/N)"
        elif comm is None:
            comm_text = f"all_reduce {2 * 4 * n * (world - 1) / world / 2**20:.1f} MiB (computed: 2P(N-1)/N)"
        else:
            comm_text = ", ".join(
                f"{k} {c['bytes'] / 2**20:.1f} ({c['sent'] / 2**20:.1f}) MiB/{c['calls']:g}" for k, c in comm.items()
            )
        state = result["states"].get(v)
        state_text = f"{sum(state.values()) / 2**20:6.1f} MiB" if state else f"{16 * n / 2**20:6.1f} MiB"
        rss_text = f"{rss[v] / 2**20:5.0f} MiB" if v in rss else f"{'-':>9}"
        print(
            f"{v:15} {med * 1000:9.0f}ms {med / ddp:5.3f}x {q2:6.3f}x [{q1:.3f}, {q3:.3f}] {fwd:4.0f}ms {bwd:4.0f}ms"
            f" {stp:4.0f}ms {wait} {gwait} {cpu_ratio:9.3f}x {rss_text} {state_text}  {comm_text}"
        )
    for v in variants:  # the overlap against the same stage gathering at the step, iteration by iteration
        if f"{v}:sync" in times:
            q1, q2, q3 = _quartiles([a / b for a, b in zip(times[v], times[f"{v}:sync"])])
            print(f"{v} / {v}:sync paired: {q2:.3f}x [{q1:.3f}, {q3:.3f}]")
    print(
        "\nloss after the timed steps, per repeat: "
        + "; ".join(f"{v} {', '.join(f'{x:.6f}' for x in result['losses'][v])}" for v in variants)
    )


if __name__ == "__main__":
    main()
