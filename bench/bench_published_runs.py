"""The planner against published training runs: predict every row of ``bench/published_runs.json`` from the shipped GPU
profile and the model's shape, and print the table of docs/planner.md.

    PYTHONPATH=src python bench/bench_published_runs.py [--only ID,ID] [--markdown FILE] [--json FILE]

Each row is predicted as it was published: the model built on fake tensors from its config (a Hugging Face
``LlamaForCausalLM`` for the Llama rows, the project's GPT, GELU MLP of 4 x hidden, for the GPT rows), the row's
layout (data-parallel sharding as a ZeRO stage, tp, pp, cp, the pipeline schedule and virtual stages), its
micro-batch and global batch (the micro-batches per step follow), bf16 or fp8, torch.compile, activation
checkpointing, on a cluster of the row's GPU with 8 GPUs a node. Nothing is fitted to a row: the profile is
:data:`~shardtrain.estimate.cluster.GPU_EFFICIENCIES`, overridden only by the hardware the source
states (torchtitan's H100s: 2.4 TB/s HBM2e, a lower peak). The error of a row is ``predicted / published - 1`` on the
metric the source publishes (tokens/s per GPU; model TFLOP/s per GPU where only MFU is given).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

RUNS = Path(__file__).with_name("published_runs.json")
GPUS_PER_NODE = 8
CLUSTER_OVERRIDES = {"torchtitan-2412": {"hbm_tb_s": 2.4, "hbm_gib": 96.0, "bf16_tflops": 912.0, "fp8_tflops": 1825.0}}
"""What a source states of its hardware that differs from the built-in profile (the rest is the profile's):
torchtitan's H100s have 2.4 TB/s HBM2e and a peak between the SXM's and the NVL's (its ``peak`` note in the data
file: the midpoint)."""


def load_runs(path: Path = RUNS) -> dict[str, Any]:
    return json.loads(path.read_text())


def build_model(spec: dict[str, Any], seq_len: int) -> Any:
    """The row's model (called under the planner's fake tensors: no weights are allocated)."""
    cfg = spec["config"]
    if spec["family"] == "llama":
        import transformers

        config = transformers.LlamaConfig(
            **cfg, max_position_embeddings=seq_len, tie_word_embeddings=False, attn_implementation="sdpa"
        )
        return transformers.LlamaForCausalLM(config)
    from shardtrain.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(seq_len=seq_len, **cfg))


def model_source(spec: dict[str, Any], seq_len: int) -> Any:
    from shardtrain.estimate.source import ModelSource
    from shardtrain.tensor_parallel import GPT_TP_PLAN

    gpt = spec["family"] == "gpt"
    return ModelSource(lambda: build_model(spec, seq_len), name=spec.get("name", "published"),
                       hf=not gpt, tp_plan=GPT_TP_PLAN if gpt else None)  # fmt: skip


@dataclass(frozen=True)
class Prediction:
    run_id: str
    metric: str
    published: float
    predicted: float
    tokens_per_s_per_gpu: float
    mfu: float
    step_time_s: float
    parts: dict[str, float]

    @property
    def ratio(self) -> float:
        return self.predicted / self.published


def fused(run: dict[str, Any], sources: dict[str, Any]) -> bool:
    """Whether the row ran fused kernels: torch.compile, or a stack whose source says it fuses (Transformer
    Engine's), both charged by the time model's fusion rule ([Note: what compile changes] in ``estimate/timing.py``)."""
    return run["compile"] or "fused_kernels" in sources[run["source"]]


def layout_of(run: dict[str, Any], sources: dict[str, Any]) -> Any:
    from shardtrain.estimate import Candidate

    checkpointing = {"none": False, "full": True, "selective": "selective"}[run["ac"]]
    fp8 = run["precision"] == "fp8"
    layout = Candidate(
        run["gpus"], stage=run["stage"], tp=run["tp"], pp=run["pp"], cp=run["cp"],
        schedule=run.get("schedule", "1F1B"), stages_per_rank=run.get("vp", 1), fp8=fp8, dtype="bf16",
        micro_batch=run["micro_batch"], seq_len=run["seq_len"], checkpointing=checkpointing,
        compile=fused(run, sources), tp_style=run.get("tp_style", "shardtrain"),
    )  # fmt: skip
    from shardtrain.estimate.planner import with_global_batch

    return with_global_batch(layout, run["global_batch"])


def cluster_of(run: dict[str, Any]) -> Any:
    from shardtrain.estimate.cluster import cluster_from_dict

    nodes = max(run["gpus"] // GPUS_PER_NODE, 1)
    spec = {"gpu": run.get("gpu", "H100-SXM"), "gpus_per_node": GPUS_PER_NODE, "nodes": nodes}
    return cluster_from_dict({**spec, **CLUSTER_OVERRIDES.get(run["source"], {})})


def predict(run: dict[str, Any], data: dict[str, Any]) -> Prediction:
    """One row's prediction (the planner's ``estimate_memory`` with ``cluster=``); ``data``: the whole file."""
    from shardtrain.estimate import estimate_memory

    cluster = cluster_of(run)
    source, layout = model_source(data["models"][run["model"]], run["seq_len"]), layout_of(run, data["sources"])
    if layout.fp8 and (layout.pp > 1 or layout.cp > 1):
        t = _fp8_not_built(source, layout, cluster)
    else:
        t = estimate_memory(source, layout=layout, cluster=cluster).time
    published = run["published"]
    if "tokens_per_s_per_gpu" in published:
        metric, value, predicted = "tokens/s per GPU", published["tokens_per_s_per_gpu"], t.tokens_per_s_per_gpu
    else:
        peak = cluster.peak_tflops("bf16", run["precision"] == "fp8")
        metric, value, predicted = "model TFLOP/s per GPU", published["model_tflops_per_gpu"], t.mfu * peak
    return Prediction(run["id"], metric, value, predicted, t.tokens_per_s_per_gpu, t.mfu, t.step_time_s, t.parts)


def _fp8_not_built(source: Any, layout: Any, cluster: Any) -> Any:
    """The step of an fp8 layout the engine does not build yet (fp8 with pipeline or context parallelism, refused by
    ``config/plan.py``): the same layout in bf16 (its plan, state and fake run), timed with the converted linears'
    matmuls at the fp8 peak ([Note: fp8 matmuls] in ``estimate/timing.py``). Which linears convert depends only on
    the model and its tensor-parallel split, so it is read from the layout with ``pp = cp = 1`` (which fp8 builds)."""
    from shardtrain.estimate.planner import _estimate, _prepare, time_prepared

    cache: dict = {"fast": True}
    bf16 = replace(layout, fp8=False)
    est = _estimate(source, {}, bf16, None, "cuda", None, cache)
    prep = _prepare(source, {}, bf16, None, "cuda", None, cache)
    probe_layout = replace(layout, pp=1, cp=1, stages_per_rank=1, schedule="1F1B", micro_batches=1)
    probe = _prepare(source, {}, probe_layout, None, "cuda", None, cache)
    prep = replace(prep, layout=replace(prep.layout, fp8=True), float8_linears=probe.float8_linears)
    return time_prepared(prep, est, cluster, cache)


def summary(predictions: list[Prediction]) -> dict[str, float]:
    """Median and largest absolute error (``|predicted / published - 1|``), and the largest factor either way."""
    errors = [abs(p.ratio - 1) for p in predictions]
    factors = [max(p.ratio, 1 / p.ratio) for p in predictions]
    return {"median": statistics.median(errors), "largest": max(errors), "largest_factor": max(factors)}


def predicted_runs(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows the planner predicts (a row whose layout the engine does not build says why under not_predicted)."""
    return [r for r in data["runs"] if "not_predicted" not in r]


def describe(run: dict[str, Any], sources: dict[str, Any]) -> str:
    axes = [f"{name} {run[name]}" for name in ("tp", "pp", "cp") if run[name] > 1]
    dp = run["gpus"] // (run["tp"] * run["pp"] * run["cp"])
    zero = {3: "FSDP", 1: "ZeRO-1"}.get(run["stage"], f"ZeRO-{run['stage']}")
    parts = [f"{zero} {dp}", *axes]
    if run.get("vp", 1) > 1:
        parts.append(f"vp {run['vp']}")
    extras = [run["precision"]]
    style = run.get("tp_style", "shardtrain")
    if run["tp"] > 1 and style != "shardtrain":  # [Note: how a stack runs its TP] in estimate/timing.py
        extras.append("SP, TP comm overlapped" if style == "sequence-parallel-overlap" else "SP")
    if fused(run, sources):
        extras.append("compile" if run["compile"] else "fused kernels")
    if run["ac"] != "none":
        extras.append(f"AC {run['ac']}")
    return f"{', '.join(parts)}; {', '.join(extras)}"


def markdown(data: dict[str, Any], predictions: dict[str, Prediction]) -> str:
    lines = [
        "| set | row | model | GPUs | seq x micro x global | layout | metric | published | predicted "
        "| predicted / published |",
        "|---|---|---|---:|---|---|---|---:|---:|---:|",
    ]  # fmt: skip
    for run in data["runs"]:
        p = predictions.get(run["id"])
        if p is None:
            continue
        fmt = "{:,.0f}" if p.metric.startswith("tokens") else "{:,.1f}"
        lines.append(
            f"| {'held out' if run['held_out'] else 'shown'} | {run['id']} | {run['model']} | {run['gpus']:,} | "
            f"{run['seq_len']} x {run['micro_batch']} x {run['global_batch']} | {describe(run, data['sources'])} | "
            f"{p.metric} | "
            f"{fmt.format(p.published)} | {fmt.format(p.predicted)} | {p.ratio:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated row ids")
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--json", type=Path, help="write each row's prediction (what tests compare with)")
    args = parser.parse_args(argv)
    data = load_runs()
    only = set(filter(None, args.only.split(",")))
    predictions: dict[str, Prediction] = {}
    for run in predicted_runs(data):
        if only and run["id"] not in only:
            continue
        start = time.perf_counter()
        p = predict(run, data)
        predictions[run["id"]] = p
        print(f"{run['id']}: {p.metric} published {p.published:,.1f} predicted {p.predicted:,.1f} "
              f"({p.ratio:.2f}x) in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)  # fmt: skip
    table = markdown(data, predictions)
    print(table)
    held = {r["id"] for r in data["runs"] if r["held_out"]}
    for name, chosen in (("all", predictions), ("shown", {k: v for k, v in predictions.items() if k not in held}),
                         ("held out", {k: v for k, v in predictions.items() if k in held})):  # fmt: skip
        if chosen:
            s = summary(list(chosen.values()))
            print(f"{name}: {len(chosen)} rows, median |error| {s['median']:.1%}, largest {s['largest']:.1%} "
                  f"(x{s['largest_factor']:.2f})")  # fmt: skip
    if args.markdown:
        args.markdown.write_text(table + "\n")
    if args.json:
        args.json.write_text(json.dumps({k: v.predicted for k, v in predictions.items()}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
