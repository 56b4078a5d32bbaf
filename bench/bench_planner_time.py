"""The time model against this machine: predicted vs measured step time of layouts of the project's GPT, a tiny Hugging
Face Llama and a tiny Mixtral at worlds 1-4 on gloo.

    PYTHONPATH=src python bench/bench_planner_time.py [--steps 8] [--repeats 3] [--only gpt,llama,mixtral]
        [--markdown FILE]
    PYTHONPATH=src python bench/bench_planner_time.py --h200

``--h200`` predicts the GPU validation's H200 runs (docs/benchmarks-gpu.md) from the shipped H200 profile instead.

For each world it first runs ``shardtrain calibrate``'s measurements at that world (every rank at once, one torch
thread each, as the training runs), and predicts each layout's step from that profile
(``estimate_memory(..., device_type="cpu", cluster=profile)``); then it trains the layout with the engine
(``shardtrain.initialize``, AdamW, clipping 1.0, one torch thread per rank) and takes the median over ranks of each
rank's median step wall time after two warm-up steps. With ``--repeats R`` (3) each world is calibrated R times and
each layout trained R times, round after round, and the medians taken: on this shared machine one run of a layout
lands anywhere within +-15% of another. It prints the table, the median absolute error (goal: 20%),
and per model whether the layout predicted fastest (tokens/s per GPU) is measured within 10% of the measured fastest.
The machine's load average is printed before and after: the CPUs are shared, and a profile made under one load
predicts that load.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

VOCAB, SEQ, MICRO = 1024, 128, 4


def gpt() -> torch.nn.Module:
    from shardtrain.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=128, n_layer=4, n_head=4))


def llama() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, tie_word_embeddings=False, attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def mixtral() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=SEQ,
        tie_word_embeddings=False, attn_implementation="sdpa", output_router_logits=False,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(cfg)


MODELS = {"gpt": gpt, "llama": llama, "mixtral": mixtral}


def zero(stage: int, **extra: object) -> dict:
    return {"zero_optimization": {"stage": stage, **extra}}


# (model, world, config extras, label)
LAYOUTS = [
    ("gpt", 1, zero(0), "stage 0"),
    ("gpt", 2, zero(0), "stage 0"),
    ("gpt", 2, zero(1), "stage 1"),
    ("gpt", 2, zero(2), "stage 2"),
    ("gpt", 2, zero(3), "stage 3"),
    ("gpt", 2, zero(1, offload_optimizer={"device": "cpu"}), "stage 1, optimizer offload"),
    ("gpt", 2, {**zero(2), "sequence_parallel_size": 2}, "sp 2, stage 2"),
    ("gpt", 3, zero(2), "stage 2"),
    ("gpt", 3, zero(3), "stage 3"),
    ("gpt", 4, zero(2), "stage 2"),
    ("gpt", 4, zero(3, mics_shard_size=2), "stage 3, hybrid shard 2 x 2"),
    ("llama", 1, zero(0), "stage 0"),
    ("llama", 2, {**zero(1), "tensor_parallel": {"size": 2}}, "tp 2, stage 1"),
    ("llama", 2, zero(3), "stage 3"),
    ("llama", 4, {**zero(2), "tensor_parallel": {"size": 2}}, "tp 2 x dp 2, stage 2"),
    ("mixtral", 2, {**zero(2), "expert_parallel_size": 2}, "ep 2, stage 2"),
]


def config_of(extra: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0, **extra}


def train(model_name: str, extra: dict, steps: int) -> float:
    """On every rank: the median wall time of ``steps`` training steps after two warm-up steps."""
    import torch.distributed as dist

    import shardtrain

    model = MODELS[model_name]()
    engine = shardtrain.initialize(
        model, config=config_of(extra), optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4)
    )
    dp_rank = engine.topology.dp_rank if hasattr(engine, "topology") else dist.get_rank()
    g = torch.Generator().manual_seed(dp_rank)
    times = []
    for i in range(steps + 2):
        ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
        start = time.perf_counter()
        out = engine(ids, ids) if model_name == "gpt" else engine(input_ids=ids, labels=ids)
        engine.backward(out if model_name == "gpt" else out.loss)
        engine.step()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


# docs/benchmarks-gpu.md, NVIDIA H200, world 1, the 1.3B GPT (24 layers, d_model 2048, vocab 32000), micro-batch
# 4 x 2048, bf16: ms per step measured (first session, 2026-11-27; offload: call 4 of the second, overlapped copies)
H200_MEASURED = {(0, "none"): 144.5, (1, "none"): 148.8, (2, "none"): 147.5, (3, "none"): 149.6, (2, "cpu"): 772.0}


def big_gpt() -> torch.nn.Module:
    from shardtrain.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=32000, seq_len=2048, d_model=2048, n_layer=24, n_head=16))


def h200_check() -> str:
    """The shipped H200 profile's predictions of the GPU validation's runs (no GPU needed: the planner's fake run)."""
    from shardtrain.estimate import estimate_memory
    from shardtrain.estimate.cluster import builtin_cluster

    cluster = builtin_cluster("H200", gpus_per_node=1)
    lines = ["| H200 variant | predicted ms | measured ms | predicted / measured |", "|---|---:|---:|---:|"]
    for (stage, offload), measured in H200_MEASURED.items():
        est = estimate_memory(
            big_gpt, {"bf16": {"enabled": True}}, world_size=1, stage=stage, offload_optimizer=offload,
            seq_len=2048, micro_batch=4, device_type="cuda", cluster=cluster,
        )  # fmt: skip
        assert est.time is not None
        predicted = est.time.step_time_s * 1e3
        name = f"stage{stage}" + (":offload" if offload != "none" else "")
        lines.append(f"| {name} | {predicted:.1f} | {measured:.1f} | {predicted / measured:.2f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--repeats", type=int, default=3, help="calibrations per world and trainings per layout, interleaved; medians"
    )
    parser.add_argument("--h200", action="store_true", help="only the shipped H200 profile against the GPU validation")
    parser.add_argument("--only", default="gpt,llama,mixtral")
    parser.add_argument("--markdown", help="also write the table to this file")
    args = parser.parse_args()
    if args.h200:
        print(h200_check())
        return 0

    from shardtrain.estimate import estimate_memory
    from shardtrain.estimate.calibrate import calibrate, median_profile
    from shardtrain.estimate.cluster import cluster_from_dict
    from shardtrain.testing import run_distributed

    models = args.only.split(",")
    layouts = [lay for lay in LAYOUTS if lay[0] in models]
    load_before = os.getloadavg()
    print(f"# bench_planner_time: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    print(f"# load average before: {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}")
    measured_profiles: dict[int, list[dict]] = {}
    for _ in range(args.repeats):
        for world in sorted({lay[1] for lay in layouts}):
            measured_profiles.setdefault(world, []).append(calibrate(world, threads=1))
    profiles = {}
    for world, runs in measured_profiles.items():
        profiles[world] = cluster_from_dict(median_profile(runs), f"calibrate at world {world}")
        gpu, eff = profiles[world].gpu, profiles[world].efficiencies
        skews = ", ".join(f"{r.get('sync_skew', 0.0):.2f}" for r in runs)
        print(
            f"# calibrate world {world} (median of {len(runs)}): fp32 {gpu.fp32_tflops * 1e3:.1f}"
            f" GFLOP/s, memory {gpu.hbm_tb_s * 1e3:.1f} GB/s, op {eff.op_overhead_us:.1f} us, "
            f"all-reduce {gpu.intra_node_gb_s:.2f} GB/s, latency {eff.latency_us:.0f} us, "
            f"overlap {eff.overlap:.2f}, sync skew {eff.sync_skew:.2f} ({skews}), "
            f"optimizer {eff.optimizer_us_per_tensor:.0f} us a tensor"
        )
    per_layout: dict[int, list[float]] = {}
    for _ in range(args.repeats):  # round after round, so that a minute of load falls on every layout alike
        for index, (model_name, world, extra, _label) in enumerate(layouts):
            try:
                per_rank = run_distributed(train, world, model_name, extra, args.steps, threads=1, timeout=600)
                # the median over ranks: on a shared CPU each rank gets its own share of the cores
                per_layout.setdefault(index, []).append(statistics.median(per_rank))
            except Exception as err:  # a layout that fails is reported, the others still measured
                per_layout[index] = []
                print(f"FAILED {model_name} world {world}: {type(err).__name__}: {str(err)[:200]}", flush=True)
    rows = []
    failed = []
    for index, (model_name, world, extra, label) in enumerate(layouts):
        try:
            est = estimate_memory(
                MODELS[model_name], config_of(extra), world_size=world, seq_len=SEQ, device_type="cpu",
                cluster=profiles[world],
            )  # fmt: skip
            assert est.time is not None
            if not per_layout.get(index):
                raise RuntimeError("its training failed (above)")
            measured = statistics.median(per_layout[index])
        except Exception as err:
            failed.append(f"{model_name} world {world} {label}: {type(err).__name__}: {str(err)[:200]}")
            print(f"FAILED {failed[-1]}", flush=True)
            continue
        predicted = est.time.step_time_s
        tokens = est.layout.dp * MICRO * SEQ / world
        rows.append((model_name, world, label, predicted, measured, tokens / predicted, tokens / measured))
        print(
            f"{model_name:8} world {world} {label:32} predicted {predicted * 1e3:8.1f} ms  measured "
            f"{measured * 1e3:8.1f} ms  error {predicted / measured - 1:+.0%}  (runs "
            f"{', '.join(f'{t * 1e3:.1f}' for t in per_layout[index])} ms)",
            flush=True,
        )
    errors = [abs(p / m - 1) for *_, p, m, _, _ in rows]
    lines = [
        "| model | world | layout | predicted ms | measured ms | predicted / measured |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for model_name, world, label, p, m, _, _ in rows:
        lines.append(f"| {model_name} | {world} | {label} | {p * 1e3:.1f} | {m * 1e3:.1f} | {p / m:.2f} |")
    lines.append("")
    lines.append(f"median absolute error: {statistics.median(errors):.0%} (goal 20%); largest {max(errors):.0%}")
    for model_name in models:
        group = [r for r in rows if r[0] == model_name]
        if len(group) < 2:
            continue
        best_predicted = max(group, key=lambda r: r[5])
        best_measured = max(group, key=lambda r: r[6])
        ratio = best_predicted[6] / best_measured[6]
        lines.append(
            f"{model_name}: predicted fastest (tokens/s per GPU) world {best_predicted[1]} {best_predicted[2]}, "
            f"measured at {ratio:.0%} of the measured fastest (world {best_measured[1]} {best_measured[2]}): "
            f"{'within' if ratio >= 0.9 else 'NOT within'} 10%"
        )
    lines += [f"failed: {f}" for f in failed]
    load_after = os.getloadavg()
    lines.append(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1-minute)")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
