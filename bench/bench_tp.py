"""Tensor parallelism against data parallelism on a GPT whose MLP dominates, steps interleaved per world size.

    python bench/bench_tp.py [--steps 10] [--warmup 2] [--global-batch 16] [--seq 64] [--d-model 512] [--layers 2]

Layouts (the same model and the same global batch for all, so a step does the same work everywhere):

* world 2: ``dp2-z0`` (dp 2, ZeRO-0: the DDP-like reference), ``dp2-z3`` (dp 2, ZeRO-3), ``tp2`` (tp 2, dp 1);
* world 4: ``dp4-z0`` (dp 4, ZeRO-0: world 4's own reference), ``dp2tp2-z1`` and ``dp2tp2-z3`` ((dp 2, tp 2) with
  ZeRO-1 and ZeRO-3 over the dp axis).

Each world size is one job in which every rank builds every layout of that world once; each iteration runs one
training step of each layout in a rotating order, a step's time being the slowest rank's. Printed per layout: the
median step time and its ratio to the reference of the same job (ratio of medians, and the median of per-iteration
ratios), the CPU time of all ranks per step and its ratio (gloo blocks without spinning, so CPU time is work, and
other jobs on the machine disturb it less than wall time), the ratio to the world-2 reference of the other job (not
interleaved, and at world 4 four ranks share the 2 cores); the bytes autograd saves for backward during one forward
per rank (activations only: parameter storages are left out), split into the MLPs and the rest; the loss of one more
step (the same in every layout: a check that they train the same model); for tp layouts, the time of one tp
all-reduce of an activation alone; and the bytes per step of every collective of the dp, tp and world communicators
next to the formula it should follow.

[Note: what is counted as activation memory]
A pack hook of ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor autograd saves for backward; each
distinct storage that is not a parameter's (ZeRO-3's gathered buffers included) counts once with its full size, in
the module region (an MLP, or anything else) where it was first saved. That is the memory a forward keeps alive
until backward, not a peak: temporaries freed within the forward, gradients and the allocator's slack are not in it.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

import shardtrain
from shardtrain.models.gpt import GPT, GPTConfig, num_parameters
from shardtrain.tensor_parallel import GPT_TP_PLAN
from shardtrain.testing import run_distributed

FP32 = 4  # bytes per element: everything here trains in fp32


@dataclass(frozen=True)
class Layout:
    name: str
    world: int
    tp: int
    stage: int

    @property
    def dp(self) -> int:
        return self.world // self.tp


LAYOUTS = [
    Layout("dp2-z0", 2, 1, 0),  # the reference of world 2 (listed first)
    Layout("dp2-z3", 2, 1, 3),
    Layout("tp2", 2, 2, 0),  # dp 1: nothing for ZeRO to shard
    Layout("dp4-z0", 4, 1, 0),  # the reference of world 4
    Layout("dp2tp2-z1", 4, 2, 1),
    Layout("dp2tp2-z3", 4, 2, 3),
]


@dataclass(frozen=True)
class Shape:
    global_batch: int
    seq: int
    d_model: int
    layers: int
    vocab: int

    def gpt(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=self.vocab,
            seq_len=self.seq,
            d_model=self.d_model,
            n_layer=self.layers,
            n_head=8,
            tie_embeddings=True,
        )


def build(layout: Layout, shape: Shape):
    torch.manual_seed(0)
    model = GPT(shape.gpt())
    config = {
        "train_micro_batch_size_per_gpu": shape.global_batch // layout.dp,
        "gradient_clipping": 1.0,
        "tensor_parallel": {"size": layout.tp},
        "zero_optimization": {
            "stage": layout.stage,
            "reduce_bucket_size": 25_000_000 // 4,  # DDP's default bucket, in elements
            "stage3_param_persistence_threshold": 0,  # every parameter sharded: the 3P(N-1)/N formula is exact
        },
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return shardtrain.initialize(model, config=config, optimizer=optimizer, tp_plan=GPT_TP_PLAN)


def rows(engine, shape: Shape, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the global batch: its dp rank's, the same on every rank of a tp group."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, shape.vocab, (shape.global_batch, shape.seq), generator=g)
    micro = shape.global_batch // engine.topology.dp
    lo = engine.topology.dp_rank * micro
    return x[lo : lo + micro], torch.roll(x, -1, 1)[lo : lo + micro]


def communicators(engine) -> dict[str, object]:
    """dp (ZeRO), tp (the layers) and world (the gradient norm on a (dp, tp) mesh), each counted once."""
    comms = {"dp": engine.comm}
    if engine.tp_comm is not None:
        comms["tp"] = engine.tp_comm
    if engine.world_comm is not engine.comm:
        comms["world"] = engine.world_comm
    return comms


def train_step(engine, x: torch.Tensor, y: torch.Tensor) -> None:
    engine.backward(engine(x, y))
    engine.step()


@contextmanager
def count_saved(model: torch.nn.Module, regions: dict[str, str]):
    """Yields {region: bytes} of the activations saved for backward ([Note: what is counted as activation memory]).

    ``regions`` maps a module-name suffix (``"mlp"``) to a region name; other modules count as ``"other"``."""
    totals: dict[str, int] = {}
    seen: set[int] = set()
    active: list[str] = []
    hooks = []

    def enter(region: str, *_) -> None:
        active.append(region)

    def leave(*_) -> None:  # returns None: the module's output stays as it is
        active.pop()

    for name, module in model.named_modules():
        region = next((r for suffix, r in regions.items() if name.endswith(suffix)), None)
        if region is not None:
            hooks.append(module.register_forward_pre_hook(partial(enter, region)))
            hooks.append(module.register_forward_hook(leave, always_call=True))

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in seen:
            seen.add(key)
            # looked up at each save: ZeRO-3 parameters point into their unit's gathered buffer only while gathered
            if key not in {p.untyped_storage()._cdata for p in model.parameters()}:
                region = active[-1] if active else "other"
                totals[region] = totals.get(region, 0) + storage.nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield totals
    finally:
        for h in hooks:
            h.remove()


def body(layouts: list[Layout], shape: Shape, steps: int, warmup: int) -> dict:
    rank = dist.get_rank()
    engines = {lay.name: build(lay, shape) for lay in layouts}
    names = list(engines)
    times: dict[str, list[float]] = {n: [] for n in names}  # wall seconds, the slowest rank's
    cpu: dict[str, list[float]] = {n: [] for n in names}  # CPU seconds, summed over ranks
    comm: dict[str, dict] = {}
    for it in range(warmup + steps):
        k = it % len(names)
        for name in names[k:] + names[:k]:  # rotate so no layout always runs first
            engine = engines[name]
            x, y = rows(engine, shape, seed=it)
            for c in communicators(engine).values():
                c.reset_stats()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            train_step(engine, x, y)
            elapsed = torch.tensor(time.perf_counter() - t0)
            cpu_s = torch.tensor(time.process_time() - c0)  # this process's threads, gloo's included
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step ends when the slowest rank ends
            dist.all_reduce(cpu_s)
            if it >= warmup:
                times[name].append(float(elapsed))
                cpu[name].append(float(cpu_s))
                comm[name] = {axis: c.stats() for axis, c in communicators(engine).items()}
    saved, losses, isolated = {}, {}, {}
    for name, engine in engines.items():  # one more step each, with the saved-tensor hook around its forward
        x, y = rows(engine, shape, seed=warmup + steps)
        with count_saved(engine.module, {"mlp": "mlp"}) as totals:
            loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        saved[name] = dict(totals)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)  # replicated over tp: the mean over all ranks is the mean over dp ranks
        losses[name] = float(mean_loss) / dist.get_world_size()
        if engine.tp_comm is not None:
            isolated[name] = time_activation_all_reduce(engine, x)
        engine.close()
    return {
        "rank": rank,
        "times": times,
        "cpu": cpu,
        "comm": comm,
        "saved": saved,
        "loss": losses,
        "isolated_all_reduce": isolated,
    }


def time_activation_all_reduce(engine, x: torch.Tensor, repeats: int = 20) -> float:
    """Median seconds of one tp all-reduce of a [b, s, h] fp32 activation alone (the slowest rank's), i.e. what
    each of the layers' all-reduces would cost without waiting for a slower rank."""
    activation = torch.ones(*x.shape, engine.module.cfg.d_model)
    out = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        engine.tp_comm.all_reduce(activation, what="isolated activation all-reduce")
        elapsed = torch.tensor(time.perf_counter() - t0)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        out.append(float(elapsed))
    return statistics.median(out)


# -- formulas (bytes per optimizer step, comm.py's bus-bandwidth convention) ----------------------------------------
def params_per_tp_rank(shape: Shape, tp: int) -> int:
    """Parameters one tp rank holds under GPT_TP_PLAN: the split matrices (and column biases) divided by tp."""
    d, layers, vocab, seq = shape.d_model, shape.layers, shape.vocab, shape.seq
    qkv, proj_w, fc, fc_out_w = 3 * d * d + 3 * d, d * d, 4 * d * d + 4 * d, 4 * d * d
    split = vocab * d + layers * (qkv + proj_w + fc + fc_out_w)  # tok (tied with head), column and row weights
    replicated = seq * d + layers * (2 * 2 * d + d + d) + 2 * d  # pos, ln1+ln2, row biases, ln_f
    return split // tp + replicated


def dp_formula(layout: Layout, shape: Shape) -> dict[str, int]:
    n, p = layout.dp, params_per_tp_rank(shape, layout.tp) * FP32
    if layout.stage == 0:
        return {"all_reduce": 2 * p * (n - 1) // n}
    if layout.stage == 3:  # parameters gathered in forward and again in backward, gradients reduce-scattered
        return {"all_gather": 2 * p * (n - 1) // n, "reduce_scatter": p * (n - 1) // n}
    return {"reduce_scatter": p * (n - 1) // n, "all_gather": p * (n - 1) // n}  # stages 1, 2


def tp_formula(layout: Layout, shape: Shape) -> dict[str, int]:
    """Per micro-step (one per step here): an all-reduce of a [b, s, h] activation per row-parallel layer and the
    vocab-parallel embedding in forward (g), and per column-parallel layer and the head in backward (f); plus the
    vocab-parallel loss's all-reduces of [b*s] (max) and [2, b*s] (sums)."""
    t = layout.tp
    if t == 1:
        return {}
    tokens = shape.global_batch // layout.dp * shape.seq
    activation = tokens * shape.d_model * FP32
    forward_g = (1 + 2 * shape.layers) * 2 * activation * (t - 1) // t  # tok, then attn.proj and mlp.2 per layer
    backward_f = (2 * shape.layers + 1) * 2 * activation * (t - 1) // t  # attn.qkv and mlp.0 per layer, then head
    loss = 2 * (tokens * FP32) * (t - 1) // t + 2 * (2 * tokens * FP32) * (t - 1) // t
    return {"all_reduce": forward_g + backward_f + loss}


def human(nbytes: int) -> str:
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:.3f} MiB"
    return f"{nbytes / 2**10:.1f} KiB" if nbytes >= 2**10 else f"{nbytes} B"


def comm_rows(layout: Layout, shape: Shape, measured: dict[str, dict]) -> list[str]:
    formulas = {"dp": dp_formula(layout, shape), "tp": tp_formula(layout, shape)}
    out = []
    for axis, kinds in measured.items():
        for kind, c in kinds.items():
            if c["bytes"] == 0 and kind != "all_reduce":
                continue
            want = formulas.get(axis, {}).get(kind)
            text = f"{axis:5} {kind:15} {c['calls']:3d} calls {human(c['bytes']):>12}"
            if want:
                text += f"   formula {human(want):>12}   measured/formula {c['bytes'] / want:.4f}"
            out.append(text)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--worlds", default="2,4")
    args = parser.parse_args()
    shape = Shape(args.global_batch, args.seq, args.d_model, args.layers, args.vocab)
    n = num_parameters(GPT(shape.gpt()))
    assert params_per_tp_rank(shape, 1) == n, "the parameter formula no longer matches the GPT"
    mlp = shape.layers * (8 * shape.d_model**2 + 5 * shape.d_model)
    print(
        f"# bench_tp: {n / 1e6:.2f}M-parameter GPT (d_model {shape.d_model}, {shape.layers} layers, vocab "
        f"{shape.vocab}, tied embeddings; MLPs {mlp / n:.0%} of the parameters), fp32 AdamW, global batch "
        f"{shape.global_batch}x{shape.seq} per step for every layout"
    )
    print(f"# machine: {platform.machine()}, {torch.get_num_threads()} cores, torch {torch.__version__}, gloo")
    print(f"# command: python {' '.join(sys.argv)}")
    worlds = [int(w) for w in args.worlds.split(",")]
    results: dict[str, dict] = {}
    for world in worlds:
        layouts = [lay for lay in LAYOUTS if lay.world == world]
        t0 = time.perf_counter()
        per_rank = run_distributed(
            body, world, layouts, shape, args.steps, args.warmup, timeout=900, threads=max(1, 2 // world)
        )
        print(f"# world {world}: {time.perf_counter() - t0:.0f}s, {world} ranks x {max(1, 2 // world)} thread")
        for lay in layouts:
            results[lay.name] = {
                "times": per_rank[0]["times"][lay.name],
                "cpu": per_rank[0]["cpu"][lay.name],
                "comm": per_rank[0]["comm"][lay.name],
                "saved": max((r["saved"][lay.name] for r in per_rank), key=lambda s: sum(s.values())),
                "loss": per_rank[0]["loss"][lay.name],
                "isolated_all_reduce": per_rank[0]["isolated_all_reduce"].get(lay.name),
            }
    report(results, shape)


def report(results: dict[str, dict], shape: Shape) -> None:
    layouts = [lay for lay in LAYOUTS if lay.name in results]
    ref_of = {}  # world -> its reference, the first layout of that world
    for lay in layouts:
        ref_of.setdefault(lay.world, results[lay.name])
    cross_ref = ref_of.get(2)
    print(
        f"\n{'layout':10} {'world':>5} {'dp':>3} {'tp':>3} {'ZeRO':>4} {'median step':>12} {'min-max':>11} "
        f"{'vs ref':>8} {'paired':>8} {'CPU s/step':>11} {'CPU vs ref':>11} {'vs dp2-z0':>10}"
    )
    for lay in layouts:
        r, ref = results[lay.name], ref_of[lay.world]
        med, cpu = statistics.median(r["times"]), statistics.median(r["cpu"])
        paired = statistics.median(t / t_ref for t, t_ref in zip(r["times"], ref["times"]))  # same iteration
        spread = f"{min(r['times']) * 1000:.0f}-{max(r['times']) * 1000:.0f}"
        cross = f"{med / statistics.median(cross_ref['times']):9.3f}x" if cross_ref else f"{'-':>10}"
        print(
            f"{lay.name:10} {lay.world:5d} {lay.dp:3d} {lay.tp:3d} {lay.stage:4d} {med * 1000:10.0f}ms {spread:>11} "
            f"{med / statistics.median(ref['times']):7.3f}x {paired:7.3f}x {cpu:10.2f}s "
            f"{cpu / statistics.median(ref['cpu']):10.3f}x {cross}"
        )
    print(
        f"\n{'layout':10} {'samples/rank':>12} {'saved/rank':>11} {'in MLPs':>10} {'per sample':>11} "
        f"{'MLPs/sample':>12} {'loss':>8}"
    )
    for lay in layouts:
        saved = results[lay.name]["saved"]
        samples = shape.global_batch // lay.dp  # per rank and step
        total, in_mlp = sum(saved.values()), saved.get("mlp", 0)
        print(
            f"{lay.name:10} {samples:12d} {total / 2**20:7.2f} MiB {in_mlp / 2**20:6.2f} MiB "
            f"{total / samples / 2**20:7.3f} MiB {in_mlp / samples / 2**20:8.3f} MiB {results[lay.name]['loss']:8.5f}"
        )
    print(
        "(activations saved for backward during one forward, the largest rank; loss: the step after the timed "
        "ones, the same batches for every layout)"
    )
    for lay in layouts:
        alone = results[lay.name]["isolated_all_reduce"]
        if alone is not None:
            calls = results[lay.name]["comm"]["tp"]["all_reduce"]["calls"]
            activation_calls = calls - 2  # the loss's two all-reduces are tiny
            med = statistics.median(results[lay.name]["times"])
            print(
                f"{lay.name}: one tp all-reduce of a [b, s, h] activation alone takes {alone * 1000:.1f} ms; "
                f"{activation_calls} per step would be {activation_calls * alone * 1000:.0f} ms "
                f"({activation_calls * alone / med:.1%} of the median step)"
            )
    print("\nbytes per step per collective (rank 0; dp: ZeRO over the dp axis, tp: the layers, world: the grad norm)")
    for lay in layouts:
        print(f"{lay.name}:")
        for line in comm_rows(lay, shape, results[lay.name]["comm"]):
            print(f"  {line}")


if __name__ == "__main__":
    main()
