"""Expert parallelism against ZeRO-3 alone on a random Mixtral-like model: bytes each rank sends per step, by
collective and group, against the formulas; step time; per-rank memory against ``shardtrain estimate``.

    python bench/bench_moe.py [--world 4] [--variants zero3,zero2,ep2,ep4,ep4:z3] [--steps 6] [--run 2]
    python bench/bench_moe.py --no-memory --steps 3          # bytes and time only

Variants: ``zeroS`` is ZeRO stage ``S`` without expert parallelism; ``epE`` is ``expert_parallel_size: E`` at ZeRO
stage 2, ``epE:zS`` at stage ``S`` (all stages 0-3 are built with expert parallelism). A variant ``initialize``
refuses (an ``E`` that does not divide the data-parallel size or the experts) is reported as refused, with the
engine's message, and left out; the rest run. ``zero3`` is the reference of every ratio (it must be among the
variants).

Every rank builds the same model per variant. Each iteration runs ``--run`` consecutive steps of each variant, in a
rotating order, and waits for what the engine left in flight; a step's time is the slowest rank's time of the run
divided by ``--run``. Medians over the iterations, and the median of the per-iteration ratios to ZeRO-3's step of the
same iteration ("paired", with quartiles). Bytes per rank and step come from ``engine.comm_stats(by_group=True)``:
``sent`` (what the rank really puts on the wire, [Note: bytes on the wire] in
``shardtrain/distributed/communicator.py``) per collective kind, summed over the groups (``shard``: every
data-parallel rank; ``ep``: the expert group's token exchange; ``edp``: the expert buckets' group), the mean over
ranks (the exchange's bytes differ between ranks with the routing) and the most any rank sent.

Formulas, per rank and optimizer step (``N`` ranks, fp32 ``b = 4`` bytes; ``P_d`` dense and ``P_e`` expert
parameters of the whole model; ``E`` the expert-parallel size; ``T`` tokens per rank and micro-step, ``k`` experts
per token, ``H`` the hidden size, ``L`` MoE layers; ``f = (E - 1) / E`` the share of routed rows sent to another
rank under balanced routing):

* ZeRO-3 (every parameter in a unit, ``stage3_param_persistence_threshold: 0``): all-gather in forward and
  reduce-scatter ``(P_d + P_e) b (N-1)/N`` each, all-gather again in backward for every unit but the root and the
  last block ([Note: kept after forward]);
* ZeRO-2: reduce-scatter and all-gather after the step, ``(P_d + P_e) b (N-1)/N`` each;
* expert parallelism at stage 2: dense reduce-scatter and all-gather ``P_d b (N-1)/N`` each over all ``N`` ranks;
  expert ones ``(P_e / E) b (M-1)/M`` each over the ``M = N / E`` ranks holding the same experts (nothing at
  ``E = N``); the token exchange ``L (4 f T k H b + f T k 8 + 8 (E-1))``: the rows to their experts and the
  outputs back, forward and backward, the rows' expert ids (int64) and the row counts (docs/expert-parallel.md,
  "What it sends").
* expert parallelism at stage 3: the reduce-scatters as at stage 2; the all-gathers as ZeRO-3's, each over its
  group: the dense ones ``(P_d + P_d - R - B_d) b (N-1)/N`` over all ``N`` ranks (``R`` the root's parameters, ``B_d``
  the last block's dense ones, both kept gathered for backward), the expert ones ``(P_e + P_e - B_e) / E b (M-1)/M``
  over the ``M`` ranks holding the same experts (``B_e`` the last block's experts); the same token exchange.

Memory (skipped with ``--no-memory``): each variant again in fresh processes, ``--mem-steps`` steps, measured as
``tests/estimate/test_estimate.py`` measures (the model state from ``engine.state_bytes()``, the last step's peak of
torch's CPU allocator from the profiler, :class:`shardtrain.estimate.PeakMeter`), rank 0, beside
``shardtrain.estimate.estimate_memory`` for the same layout (``--device cpu``).
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

import shardtrain
from shardtrain.errors import ConfigError
from shardtrain.testing import run_distributed

FP32 = 4


@dataclass(frozen=True)
class Shape:
    """The Mixtral-like model and the batch per rank."""

    vocab: int = 4096
    hidden: int = 256
    intermediate: int = 512
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    experts: int = 8
    top_k: int = 2
    seq: int = 128
    micro_batch: int = 4

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq


def build_model(shape: Shape):
    """A random Mixtral (transformers' own classes, built from a config: nothing is downloaded), the load-balancing
    loss on, as training runs it."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        num_local_experts=shape.experts, num_experts_per_tok=shape.top_k, output_router_logits=True,
        router_aux_loss_coef=0.01, max_position_embeddings=shape.seq, tie_word_embeddings=False,
        attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.MixtralForCausalLM(cfg)


def parameter_counts(shape: Shape) -> dict[str, int]:
    """Dense and expert parameters of the whole model, and the parts ZeRO-3 keeps gathered in backward."""
    model = build_model(shape)
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    dense = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    last = f"model.layers.{shape.layers - 1}."
    root = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("model.layers."))
    last_block = sum(p.numel() for n, p in model.named_parameters() if n.startswith(last))
    last_experts = sum(p.numel() for n, p in model.named_parameters() if n.startswith(last) and ".experts." in n)
    return {"dense": dense, "expert": expert, "root": root, "last_block": last_block, "last_experts": last_experts}


@dataclass(frozen=True)
class Variant:
    name: str
    stage: int
    ep: int


def parse_variant(text: str) -> Variant:
    head, _, tail = text.partition(":")
    if head.startswith("zero") and head[4:].isdigit() and not tail:
        return Variant(text, int(head[4:]), 1)
    if head.startswith("ep") and head[2:].isdigit():
        stage = 2
        if tail:
            if not (tail.startswith("z") and tail[1:].isdigit()):
                raise SystemExit(f"variant {text!r}: write epE or epE:zS (S the ZeRO stage)")
            stage = int(tail[1:])
        return Variant(text, stage, int(head[2:]))
    raise SystemExit(f"unknown variant {text!r}: use zeroS, epE or epE:zS")


def engine_config(v: Variant, shape: Shape) -> dict:
    return {
        "train_micro_batch_size_per_gpu": shape.micro_batch,
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": v.stage,
            "stage3_param_persistence_threshold": 0,  # every parameter in a unit: the 3P formula
            "reduce_bucket_size": 25_000_000 // FP32,
        },
        "expert_parallel_size": v.ep,
        "desync_check": False,
        "collective_timeout_s": 600.0,
    }


def build(v: Variant, shape: Shape):
    model = build_model(shape)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return shardtrain.initialize(model, config=engine_config(v, shape), optimizer=opt)


def batch(shape: Shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, shape.vocab, (shape.micro_batch, shape.seq), generator=g)


def train_step(engine, ids: torch.Tensor) -> torch.Tensor:
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return loss.detach()


def settle(engine) -> None:
    """Wait for what a step left in flight (ZeRO-1/2's all-gathers after the step)."""
    wait = getattr(getattr(engine, "_optimizer", None), "wait_gathers", None)
    if wait is not None:
        wait()


def probe(variants: list[Variant], shape: Shape) -> dict[str, str]:
    """The variants ``initialize`` refuses, with its message (the same verdict on every rank: the config check runs
    before any collective of the engine). Only the expert-parallel variants are tried (an ``E`` the world or the
    experts do not take); the others are built, and a failure there is the bench's."""
    refused = {}
    for v in variants:
        if v.ep == 1:
            continue
        try:
            engine = build(v, shape)
        except ConfigError as err:
            refused[v.name] = str(err)
            continue
        engine.close()
        del engine
        gc.collect()
    return refused


def timing_body(variants: list[Variant], steps: int, warmup: int, run: int, shape: Shape) -> dict:
    rank = dist.get_rank()
    refused = probe(variants, shape)
    live = [v for v in variants if v.name not in refused]
    engines = {v.name: build(v, shape) for v in live}
    times: dict[str, list[float]] = {v.name: [] for v in live}
    sent: dict[str, dict[str, float]] = {}
    losses: dict[str, list[float]] = {v.name: [] for v in live}
    for it in range(warmup + steps):
        k = it % len(live)
        for v in live[k:] + live[:k]:  # rotate so no variant always runs first
            engine = engines[v.name]
            engine.comm_stats(reset=True)
            dist.barrier()
            start = time.perf_counter()
            for j in range(run):
                loss = train_step(engine, batch(shape, seed=1000 * it + 10 * j + rank))
            settle(engine)
            span = torch.tensor([(time.perf_counter() - start) / run], dtype=torch.float64)
            dist.all_reduce(span, op=dist.ReduceOp.MAX)
            if it >= warmup:
                times[v.name].append(float(span))
                losses[v.name].append(float(loss))
            if it == warmup:  # a step after the warm-up: the bytes of every step from here are these
                per_kind: dict[str, float] = {}
                for group, stats in engine.comm_stats(by_group=True).items():
                    for kind, c in stats.items():
                        key = f"{group}:{kind}"
                        per_kind[key] = per_kind.get(key, 0) + c["sent"] / run
                sent[v.name] = per_kind
    for engine in engines.values():
        engine.close()
    return {"times": times, "sent": sent, "refused": refused, "losses": losses}


def memory_body(variants: list[Variant], steps: int, shape: Shape) -> dict:
    """Each variant's model state and its last step's peak of torch's CPU allocator, measured as
    tests/estimate/test_estimate.py measures them."""
    from shardtrain.estimate import PeakMeter

    rank = dist.get_rank()
    meter = PeakMeter()
    out = {}
    try:
        for v in variants:
            gc.collect()
            with meter.window(f"before:{v.name}", scan=True):
                pass
            engine = build(v, shape)
            for step in range(steps):
                with meter.window(v.name, scan=True) if step == steps - 1 else nullcontext():
                    train_step(engine, batch(shape, seed=100 * step + rank))
                    settle(engine)
            out[v.name] = {"state": engine.state_bytes()}
            engine.close()
            del engine
    finally:
        meter.stop()
    for name in out:
        live = meter.live[name] - meter.live[f"before:{name}"]
        out[name]["peak"] = meter.rise(name) + live
    return out


def estimate(v: Variant, shape: Shape, world: int):
    from shardtrain.estimate import Candidate, estimate_memory

    layout = Candidate(world, stage=v.stage, ep=v.ep, micro_batch=shape.micro_batch, seq_len=shape.seq)
    return estimate_memory(lambda: build_model(shape), engine_config(v, shape), layout=layout, device_type="cpu")


def formulas(v: Variant, shape: Shape, world: int, counts: dict[str, int]) -> dict[str, float]:
    """Bytes per rank and step by what moves them (see the module docstring)."""
    ring = (world - 1) / world
    total = counts["dense"] + counts["expert"]
    if v.ep == 1:
        if v.stage == 3:
            backward = total - counts["root"] - counts["last_block"]
            return {"all_gather": (total + backward) * FP32 * ring, "reduce_scatter": total * FP32 * ring}
        if v.stage == 0:
            return {"all_reduce": 2 * total * FP32 * ring}
        return {"all_gather": total * FP32 * ring, "reduce_scatter": total * FP32 * ring}
    edp = world // v.ep
    f = (v.ep - 1) / v.ep
    dense = counts["dense"] * FP32 * ring
    expert = counts["expert"] / v.ep * FP32 * (edp - 1) / edp
    rows = f * shape.tokens * shape.top_k
    exchange = shape.layers * (4 * rows * shape.hidden * FP32 + rows * 8 + 8 * (v.ep - 1))
    if v.stage == 0:
        return {"all_reduce": 2 * (dense + expert), "all_to_all": exchange}
    if v.stage == 3:  # gathered again in backward: all but the root and the last block (no experts in the root)
        dense_back = counts["dense"] - counts["root"] - (counts["last_block"] - counts["last_experts"])
        expert_back = (counts["expert"] - counts["last_experts"]) / v.ep
        gathers = dense + dense_back * FP32 * ring + expert + expert_back * FP32 * (edp - 1) / edp
        return {"all_gather": gathers, "reduce_scatter": dense + expert, "all_to_all": exchange}
    return {"all_gather": dense + expert, "reduce_scatter": dense + expert, "all_to_all": exchange}


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--variants", default="zero3,zero2,ep2,ep4,ep4:z3", help="comma-separated; zero3 among them")
    parser.add_argument("--steps", type=int, default=6, help="timed iterations")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--run", type=int, default=2, help="consecutive steps of a variant per timed sample")
    parser.add_argument("--mem-steps", type=int, default=3)
    parser.add_argument("--no-memory", action="store_true", help="skip the memory runs and the estimates")
    args = parser.parse_args()
    variants = [parse_variant(t) for t in args.variants.split(",")]
    if "zero3" not in [v.name for v in variants]:
        raise SystemExit("--variants must include zero3 (the reference)")
    shape = Shape()
    counts = parameter_counts(shape)
    world = args.world
    print(
        f"# bench_moe: random Mixtral, {(counts['dense'] + counts['expert']) / 1e6:.2f}M parameters "
        f"({counts['dense'] / 1e6:.2f}M dense, {counts['expert'] / 1e6:.2f}M in {shape.experts} experts x "
        f"{shape.layers} layers, top-{shape.top_k}), hidden {shape.hidden}, vocab {shape.vocab}; fp32 AdamW, "
        f"world {world} (gloo, 1 thread/rank), micro-batch {shape.micro_batch}x{shape.seq} per rank; "
        f"{args.steps} samples of {args.run} consecutive steps per variant, interleaved"
    )
    print(f"# machine: {platform.machine()}, {torch.get_num_threads()} cores, torch {torch.__version__}")
    print(f"# command: python {' '.join(sys.argv)}")
    per_rank = run_distributed(
        timing_body, world, variants, args.steps, args.warmup, args.run, shape, timeout=3600, threads=1
    )
    result = per_rank[0]
    for name, why in result["refused"].items():
        print(f"\n{name}: refused by initialize: {why}")
    live = [v for v in variants if v.name not in result["refused"]]
    times = result["times"]
    ref_time = statistics.median(times["zero3"])
    totals = {v.name: [sum(r["sent"][v.name].values()) for r in per_rank] for v in live}
    ref_bytes = statistics.mean(totals["zero3"])
    print(
        f"\n{'variant':9} {'stage':>5} {'ep':>3} {'median step':>11} {'ratio':>6} {'paired [q1, q3]':>23}"
        f" {'MiB sent/rank (max)':>20} {'ratio':>6} {'formula':>8}"
    )
    for v in live:
        med = statistics.median(times[v.name])
        q1, q2, q3 = _quartiles([a / b for a, b in zip(times[v.name], times["zero3"])])
        mean, most = statistics.mean(totals[v.name]), max(totals[v.name])
        expected = sum(formulas(v, shape, world, counts).values())
        print(
            f"{v.name:9} {v.stage:5d} {v.ep:3d} {med * 1000:9.0f}ms {med / ref_time:5.3f}x {q2:6.3f}x"
            f" [{q1:.3f}, {q3:.3f}] {_mib(mean):>11} ({_mib(most)}) {mean / ref_bytes:5.3f}x {_mib(expected):>8}"
        )
    print("\nbytes per rank and step by group:collective, mean over ranks (formula), MiB:")
    for v in live:
        keys = sorted({k for r in per_rank for k in r["sent"][v.name]})
        expected = formulas(v, shape, world, counts)
        by_kind: dict[str, float] = {}
        parts = []
        for key in keys:
            mean = statistics.mean(r["sent"][v.name].get(key, 0.0) for r in per_rank)
            by_kind[key.split(":")[1]] = by_kind.get(key.split(":")[1], 0.0) + mean
            parts.append(f"{key} {_mib(mean)}")
        checks = ", ".join(f"{k} {_mib(by_kind.get(k, 0.0))} ({_mib(e)})" for k, e in expected.items())
        print(f"  {v.name:9} {', '.join(parts)}\n  {'':9} against the formulas: {checks}")
        if v.ep > 1:  # the share of routed rows that left the rank, read back from the exchange's bytes
            rows = shape.layers * shape.tokens * shape.top_k * (4 * shape.hidden * FP32 + 8)
            f = (by_kind.get("all_to_all", 0.0) - shape.layers * 8 * (v.ep - 1)) / rows
            print(f"  {'':9} routed rows sent to another rank: f = {f:.3f} (balanced routing: {(v.ep - 1) / v.ep:.3f})")
    print(
        "\nloss of the last timed step (rank 0): "
        + ", ".join(f"{v.name} {result['losses'][v.name][-1]:.4f}" for v in live)
    )
    if args.no_memory:
        return
    measured = run_distributed(memory_body, world, live, args.mem_steps, shape, timeout=3600, threads=1)[0]
    print(f"\nmemory per rank (rank 0), measured after {args.mem_steps} steps vs shardtrain estimate (--device cpu):")
    header = f"{'variant':9} {'state measured':>15} {'estimated':>10} {'peak measured':>14} {'estimated':>10}"
    print(f"{header} {'error':>7}")
    for v in live:
        est = estimate(v, shape, world)
        state, peak = sum(measured[v.name]["state"].values()), measured[v.name]["peak"]
        exact = "=" if est.model_state() == measured[v.name]["state"] else "!="
        print(
            f"{v.name:9} {_mib(state):>11} MiB {exact:>2}{_mib(sum(est.model_state().values())):>8}"
            f" {_mib(peak):>10} MiB {_mib(est.memory_peak):>10} {(est.memory_peak - peak) / peak * 100:+6.1f}%"
        )


if __name__ == "__main__":
    main()
