"""``shardtrain estimate`` on Llama-3-8B's shape: one layout, and a budget search over every layout of 8 ranks, timed
on this tree and on a reference checkout (the code before the speed-up), each in its own interpreter.

    python bench/bench_estimate.py [--base ../wt-est-base] [--layers 32] [--budget 80GiB] [--dtype fp32]
                                   [--skip-base-search]

The model is a ``LlamaConfig`` with Llama-3-8B's sizes (hidden 4096, 32 layers, 32 heads, 8 key/value heads,
intermediate 14336, vocabulary 128256), written to a temporary directory and read as ``shardtrain estimate`` reads a
``config.json``: no weights exist anywhere. One layout: world 8, ZeRO-3, bf16, micro-batch 1 x 2048 tokens. The
search: ``fitting_layouts(..., worlds=(8,))``, what ``shardtrain estimate CONFIG --budget 80GiB --worlds 8`` runs
(tensor-parallel sizes 1, 2, 4, 8, stages 0-3, optimizer offload none/cpu/nvme). Each timing includes building the
fake models, not the interpreter's start or imports. Both trees must give the same bytes: the script compares the
peaks it prints and says whether they agree.
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
import json, sys, time
from shardtrain.estimate import Layout, estimate_memory, fitting_layouts, parse_bytes
path, what, budget, dtype = sys.argv[1:5]
import transformers  # imported before the clock starts, as the CLI has by then
t = time.perf_counter()
if what == "one":
    est = estimate_memory(path, layout=Layout(8, stage=3, dtype="bf16", seq_len=2048))
    peaks = {est.layout.describe(): est.peak}
else:
    fits = fitting_layouts(path, parse_bytes(budget), worlds=(8,), dtype=dtype)
    peaks = {e.layout.describe(): e.peak for e in fits}
print(json.dumps({"seconds": time.perf_counter() - t, "peaks": peaks}))
"""


def timed(src: Path, config_dir: str, what: str, budget: str, dtype: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, config_dir, what, budget, dtype],
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
    trees = {"after": ROOT / "src", "before": Path(args.base) / "src"}
    with tempfile.TemporaryDirectory() as tmp:
        cfg.save_pretrained(tmp)
        for what, label in (("one", "one layout (world 8, stage 3, bf16)"), ("search", "budget search, world 8")):
            results = {}
            for tree, src in trees.items():
                if tree == "before" and what == "search" and args.skip_base_search:
                    continue
                results[tree] = timed(src, tmp, what, args.budget, args.dtype)
                print(f"{label}: {tree}: {results[tree]['seconds']:.1f} s, {len(results[tree]['peaks'])} layout(s)")
            if len(results) == 2:
                same = results["before"]["peaks"] == results["after"]["peaks"]
                ratio = results["before"]["seconds"] / results["after"]["seconds"]
                print(f"{label}: before / after = {ratio:.1f}x; same bytes: {same}")


if __name__ == "__main__":
    main()
