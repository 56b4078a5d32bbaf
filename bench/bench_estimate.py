"""``shardtrain estimate`` on Llama-3-8B's shape: one layout, and a budget search over every layout of 8 ranks, timed
on this tree and on a reference checkout (the code before a speed-up), each in its own interpreter.

    python bench/bench_estimate.py [--base ../wt-est-base] [--layers 32] [--budget 80GiB] [--dtype fp32]
                                   [--jobs 1,2] [--skip-base-search] [--sp 8]

The model is a ``LlamaConfig`` with Llama-3-8B's sizes (hidden 4096, 32 layers, 32 heads, 8 key/value heads,
intermediate 14336, vocabulary 128256), written to a temporary directory and read as ``shardtrain estimate`` reads a
``config.json``: no weights exist anywhere. One layout: world 8, ZeRO-3, bf16, micro-batch 1 x 2048 tokens. The
search: ``fitting_layouts(..., worlds=(8,))``, what ``shardtrain estimate CONFIG --budget 80GiB --worlds 8`` runs
(tensor-parallel sizes 1, 2, 4, 8, stages 0-3, optimizer offload none/cpu/nvme; with ``--sp P`` also every
sequence-parallel size up to ``P``, as ``--sp P`` does for the command: a tree without it cannot run that search).
Each timing includes building the fake models, not the interpreter's start or imports. The search runs once per
``--jobs`` value on this tree (``workers``: processes its fake runs are spread over; a tree without the argument
runs in one process), with wall and CPU seconds (this process and its workers). Every run must give the same answer:
the script compares each layout's rows (component, place, bytes) and fake-run peaks with the reference's and says
whether they agree.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import dataclasses, inspect, json, os, sys, time
from shardtrain.estimate import Candidate, estimate_memory, fitting_layouts, parse_bytes
path, what, budget, dtype, jobs, sp = sys.argv[1:7]
import transformers  # imported before the clock starts, as the CLI has by then
def cpu():
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system
t, c = time.perf_counter(), cpu()
if what == "one":
    ests = [estimate_memory(path, layout=Candidate(8, stage=3, dtype="bf16", seq_len=2048))]
else:
    kw = {"workers": int(jobs)} if "workers" in inspect.signature(fitting_layouts).parameters else {}
    kw.update({"sp": int(sp)} if int(sp) > 1 else {})
    ests = fitting_layouts(path, parse_bytes(budget), worlds=(8,), dtype=dtype, **kw)
seconds, cpu_seconds = time.perf_counter() - t, cpu() - c
answer = [[e.layout.describe(), [dataclasses.astuple(r) for r in e.rows], dataclasses.astuple(e.compute), e.peak]
          for e in ests]
print(json.dumps({"seconds": seconds, "cpu": cpu_seconds, "answer": answer}))
"""


def timed(src: Path, config_dir: str, what: str, budget: str, dtype: str, jobs: int = 1, sp: int = 1) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, config_dir, what, budget, dtype, str(jobs), str(sp)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default=str(ROOT.parent / "wt-est-base"), help="checkout of the reference code")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--budget", default="80GiB")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="the search's compute dtype")
    parser.add_argument("--skip-base-search", action="store_true", help="the reference search takes minutes")
    parser.add_argument("--jobs", default="1,2", help="worker counts the search runs with on this tree")
    parser.add_argument("--sp", type=int, default=1, help="the search also tries sequence-parallel sizes up to this")
    args = parser.parse_args()
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=args.layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
    )
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"python {platform.python_version()}, {sys.executable}")
    base = Path(args.base) / "src"
    jobs = [int(j) for j in args.jobs.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        cfg.save_pretrained(tmp)
        runs = [("one", "one layout (world 8, stage 3, bf16)", [("before", base, 1), ("after", ROOT / "src", 1)])]
        search = [("before", base, 1)] if not args.skip_base_search and args.sp == 1 else []
        search += [(f"after, {j} worker(s)", ROOT / "src", j) for j in jobs]
        searched = f"budget search {args.budget}, world 8, {args.dtype}"
        runs.append(("search", searched + (f", sp up to {args.sp}" if args.sp > 1 else ""), search))
        for what, label, trees in runs:
            results = {}
            for tree, src, j in trees:
                sp = args.sp if what == "search" else 1
                results[tree] = r = timed(src, tmp, what, args.budget, args.dtype, j, sp)
                print(
                    f"{label}: {tree}: {r['seconds']:.1f} s wall, {r['cpu']:.1f} s CPU, {len(r['answer'])} layout(s), "
                    f"load average {os.getloadavg()[0]:.1f}"
                )
            first = next(iter(results))
            for tree, r in results.items():
                if tree != first:
                    same = r["answer"] == results[first]["answer"]
                    ratio = results[first]["seconds"] / r["seconds"]
                    print(f"{label}: {first} / {tree} = {ratio:.2f}x wall; the same answer: {same}")


if __name__ == "__main__":
    main()
