"""Hybrid sharding (MiCS) and ZeRO++ hpZ: the bytes that cross group boundaries per step, measured against the
formulas and against plain ZeRO at the same world size.

    python bench/bench_hybrid.py [--world 4] [--shard 2] [--stages 1,2,3] [--steps 3] [--gas 1,2] [--layers 4]

The world is read as ``world / shard`` nodes of ``shard`` adjacent ranks (groups of ``mics_shard_size`` ranks are
meant to be nodes). A collective's bytes cross a node boundary when its group spans more than one node: with plain
ZeRO every collective is over all data-parallel ranks, so all of them do; with hybrid sharding the shard group's
gathers and reduce-scatters stay inside a node and only the replicate group's gradient all-reduce and the small
exchanges over every data-parallel rank (gradient norm, launch order) leave it. Bytes are ``engine.comm_stats(
by_group=True)``'s, in the bus-bandwidth convention of :mod:`shardtrain.distributed.communicator` (what one rank sends
in a ring), per rank and optimizer step after a warm-up step; ``stage3_gather_check`` is off so that the counts are
parameter and gradient traffic only.

Formulas, per rank and optimizer step, from the layout's padded bucket sizes (``B``: a bucket's bytes, ``N`` the
data-parallel size, ``S`` the shard group, ``R = N/S`` replicas, ``k`` micro-steps per step):

* all-gather within the group: stages 1-2 ``sum B (S-1)/S`` after the step; stage 3 ``sum B (S-1)/S`` per forward
  and again per backward for every unit but the root and the last block ([Note: kept after forward]), ``k`` times;
* reduce-scatter within the group: ``sum B (S-1)/S``, at the boundary (stage 1) or every micro-step (stages 2-3);
* across the replicas (hybrid only): ``2 sum (B/S) (R-1)/R`` once per step, whatever ``k``;
* gradient norm: an all-reduce of two fp32 values over every data-parallel rank (stages 2-3), of one within the
  group at stage 1.

Plain ZeRO is the same with ``S = N`` and no replicas. At stage 3 the run adds ZeRO++ hpZ with
``zero_hpz_partition_size`` = ``--shard`` (``H``): everything as plain ZeRO-3 over all ``N`` ranks (so it crosses the
nodes), except the backward gathers of the units released after forward, which move ``sum B (H-1)/H`` within the
node from the secondary shards ([Note: secondary shards] in ``src/shardtrain/zero/hpz.py``); the most
secondary-shard bytes a rank held at once after the warm-up step is printed beside the state (the released units'
bytes over ``H``). The step time is printed too, for scale only: on one machine's loopback a "node boundary" costs
nothing, so the time says nothing about a real network.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

import shardtrain
from shardtrain.models.gpt import GPT, GPTConfig, num_parameters
from shardtrain.testing import run_distributed

FP32 = 4


def _model(layers: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=2048, seq_len=64, d_model=128, n_layer=layers, n_head=4))


def _ring(nbytes: int, n: int, factor: int = 1) -> int:
    """One collective's bytes in the convention of shardtrain.distributed.communicator (rounded down as the
    Communicator does)."""
    return factor * nbytes * (n - 1) // n


def formulas(engine, stage: int, gas: int) -> dict[str, int]:
    """Bytes per rank and optimizer step by group, from the layout (see the module docstring)."""
    topo, layout = engine.topology, engine.layout
    s, r, n, h = topo.shard_size, topo.replicas, topo.dp, topo.hpz_size
    trainable = layout.trainable_buckets
    shard: dict[str, int] = {}
    hpz = 0
    if stage == 3:
        units = layout.unit_buckets  # backward order: the last block first, the root last; both stay gathered
        kept = {id(units[0][1]), id(units[-1][1])}
        forward = sum(_ring(b.padded_numel * FP32, s) for _, _, bs in units for b in bs)
        released = [b.padded_numel * FP32 for _, m, bs in units if id(m) not in kept for b in bs]
        if h > 1:  # hpZ: the backward gathers move within the hpZ group, from the secondary shards
            shard["all_gather"] = gas * forward
            hpz = gas * sum(_ring(nbytes, h) for nbytes in released)
        else:
            shard["all_gather"] = gas * (forward + sum(_ring(nbytes, s) for nbytes in released))
    else:
        shard["all_gather"] = sum(_ring(b.padded_numel * FP32, s) for b in trainable)
    reductions = 1 if stage == 1 else gas
    shard["reduce_scatter"] = reductions * sum(_ring(b.padded_numel * FP32, s) for b in trainable)
    out = {"shard": sum(shard.values())}
    norm = _ring(2 * FP32, n, 2) if stage >= 2 else _ring(FP32, s, 2)
    if r > 1:
        out["replicate"] = sum(_ring(b.shard_numel * FP32, r, 2) for b in trainable)
        out["dp"] = norm if stage >= 2 else 0  # stage 1: the norm stays in the group
        if stage == 1:
            out["shard"] += norm
    else:
        out["shard"] += norm
    if hpz:
        out["hpz"] = hpz
    return out


def _bytes(stats: dict) -> int:
    return sum(v["bytes"] for v in stats.values())


def _body(world: int, shard: int, stages: list[int], gases: list[int], steps: int, layers: int) -> list[dict]:
    rows = []
    for stage in stages:
        for gas in gases:
            # (mics_shard_size, zero_hpz_partition_size): plain, MiCS, and at stage 3 hpZ
            for size, hpz in [(-1, 1), (shard, 1)] + ([(-1, shard)] if stage == 3 else []):
                model = _model(layers)
                config = {
                    "train_micro_batch_size_per_gpu": 2,
                    "gradient_accumulation_steps": gas,
                    "gradient_clipping": 1.0,
                    "steps_per_print": 10**6,
                    "zero_optimization": {
                        "stage": stage,
                        "mics_shard_size": size,
                        "zero_hpz_partition_size": hpz,
                        "stage3_param_persistence_threshold": 0,
                        "stage3_gather_check": False,
                        "reduce_bucket_size": 2_000_000,
                    },
                }
                engine = shardtrain.initialize(model, config=config, optimizer=torch.optim.AdamW)
                g = torch.Generator().manual_seed(engine.topology.dp_rank)
                per_step, times = [], []
                for step in range(steps + 1):  # the first step warms up (it records the unit order)
                    dist.barrier()
                    started = time.perf_counter()
                    for _ in range(gas):
                        x = torch.randint(0, 2048, (2, 64), generator=g)
                        engine.backward(engine(x, torch.roll(x, -1, dims=1)))
                        engine.step()
                    elapsed = torch.tensor([time.perf_counter() - started])
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                    stats = engine.comm_stats(reset=True, by_group=True)
                    if engine._runtime.hpz is not None and not step:  # the warm-up releases the last unit too
                        engine._runtime.hpz.max_held_bytes = 0
                    if step:
                        per_step.append({group: _bytes(s) for group, s in stats.items()})
                        times.append(float(elapsed))
                measured = per_step[-1]
                assert all(p == measured for p in per_step), f"bytes differ between steps: {per_step}"
                rows.append(
                    {
                        "stage": stage,
                        "gas": gas,
                        "shard": engine.topology.shard_size,
                        "replicas": engine.topology.replicas,
                        "hpz": engine.topology.hpz_size,
                        "secondary": engine._runtime.hpz.max_held_bytes if engine._runtime.hpz is not None else 0,
                        "measured": measured,
                        "formula": formulas(engine, stage, gas),
                        "step_s": statistics.median(times),
                        "params": num_parameters(model),
                        "state": engine.state_bytes(),
                    }
                )
                engine.close()
    return rows


def crossing(row: dict) -> int:
    """Bytes of the groups that span more than one node (see the module docstring): everything but the shard groups of
    hybrid sharding and the hpZ groups."""
    spans = {"replicate", "dp"} if row["replicas"] > 1 else {"shard"}
    return sum(v for k, v in row["measured"].items() if k in spans)


def inside(row: dict) -> int:
    """Bytes of the groups that stay in a node."""
    return sum(v for k, v in row["measured"].items() if k == "hpz" or (k == "shard" and row["replicas"] > 1))


def _name(row: dict) -> str:
    if row["replicas"] > 1:
        return f"{row['replicas']} x shard {row['shard']}"
    return f"hpZ {row['hpz']}" if row["hpz"] > 1 else "plain ZeRO"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--shard", type=int, default=2)
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--gas", default="1,2")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args()
    stages = [int(s) for s in a.stages.split(",")]
    gases = [int(g) for g in a.gas.split(",")]
    results = run_distributed(_body, a.world, a.world, a.shard, stages, gases, a.steps, a.layers, timeout=1800)
    rank0 = results[0]
    print(f"# {' '.join(sys.argv)}")
    print(f"# {platform.node()}, {platform.processor() or platform.machine()}, torch {torch.__version__}, gloo")
    print(
        f"# GPT {rank0[0]['params'] / 1e6:.2f}M parameters, world {a.world} read as {a.world // a.shard} nodes of "
        f"{a.shard}; bytes per rank and optimizer step (bus convention)"
    )
    print(
        "| stage | micro-steps | layout | in-node bytes | cross-node bytes | cross-node vs plain | state bytes/rank | "
        "hpZ secondary bytes (max) | step s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    mismatches = []
    for stage in stages:
        for gas in gases:
            rows = [r for r in rank0 if (r["stage"], r["gas"]) == (stage, gas)]
            plain = next(r for r in rows if _name(r) == "plain ZeRO")
            for row in rows:
                for rank in range(a.world):  # every rank measures its own; all must match their formulas
                    mine = next(
                        r for r in results[rank] if (r["stage"], r["gas"], _name(r)) == (stage, gas, _name(row))
                    )
                    if mine["measured"] != mine["formula"]:
                        mismatches.append((rank, stage, gas, _name(mine), mine["measured"], mine["formula"]))
                ratio = crossing(row) / crossing(plain)
                state = sum(row["state"].values())
                secondary = f"{row['secondary']:,}" if row["hpz"] > 1 else "-"
                print(
                    f"| {stage} | {gas} | {_name(row)} | {inside(row):,} | {crossing(row):,} | {ratio:.3f}x | "
                    f"{state:,} | {secondary} | {row['step_s']:.3f} |"
                )
    if mismatches:
        for m in mismatches:
            print(f"MISMATCH rank {m[0]} stage {m[1]} gas {m[2]} {m[3]}: measured {m[4]} formula {m[5]}")
        raise SystemExit(1)
    print("# every rank's measured bytes equal the formulas, per group")


if __name__ == "__main__":
    main()
