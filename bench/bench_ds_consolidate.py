"""Consolidating and loading a real DeepSpeed checkpoint: shardtrain vs DeepSpeed's own ``zero_to_fp32``.

Writes one ZeRO checkpoint with DeepSpeed (CPU accelerator, gloo, 2 ranks, fp32, AdamW) of a model of ``--params``
parameters in ``--layers`` equal linear layers, then, each in a fresh process:

* ``zero_to_fp32``: ``convert_zero_checkpoint_to_fp32_state_dict(..., safe_serialization=True)``;
* ``shardtrain``: ``shardtrain checkpoint consolidate`` (``open_checkpoint`` + ``consolidate``);
* ``load_share``: what one rank of a 4-rank shardtrain job reads when it loads the checkpoint (a quarter of every
  tensor's masters and moments), through the same reader.

Reported per run, after the imports: wall time, the growth of peak resident memory (``ru_maxrss``, which counts
pages of memory-mapped files read) and of anonymous memory (``RssAnon`` sampled every 2 ms: what cannot be dropped
under memory pressure), with the ratios shardtrain / zero_to_fp32. Run::

    DS_ACCELERATOR=cpu PYTHONPATH=src python bench/bench_ds_consolidate.py --params 50e6
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _write_checkpoint(root: str, params: int, layers: int) -> None:
    import contextlib
    import io

    import deepspeed
    import torch
    from torch import nn

    width = int((params / layers) ** 0.5)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
    }
    with contextlib.redirect_stdout(io.StringIO()):
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    loss = engine(torch.randn(2, width)).square().mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(root)


_CHILD = r"""
import json, os, resource, sys, threading, time
peak = [0]
def anon(field="RssAnon:"):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0
stop = False
def sample():
    while not stop:
        peak[0] = max(peak[0], anon())
        time.sleep(0.002)
what, ckpt, out = sys.argv[1:4]
# imports first: the figures are the work's, not torch's or DeepSpeed's import
import contextlib, io
import torch
from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
from shardtrain.checkpoint.consolidate import consolidate
from shardtrain.checkpoint.reader import open_checkpoint
base, base_rss = anon(), anon("VmRSS:")
threading.Thread(target=sample, daemon=True).start()
t0 = time.perf_counter()
if what == "zero_to_fp32":
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        convert_zero_checkpoint_to_fp32_state_dict(ckpt, out, safe_serialization=True, max_shard_size=None)
elif what == "shardtrain":
    consolidate(open_checkpoint(ckpt), out, progress=False)
else:  # one rank's share of a 4-rank load
    r = open_checkpoint(ckpt)
    kept = []
    for name, e in r.manifest.tensors.items():
        n = e.numel
        per = -(-n // 4)
        kept.append(r.read(name, (min(n, per), min(n, 2 * per))))
    share = sum(t.numel() * t.element_size() for t in kept)
    largest = max(e.nbytes for e in r.manifest.tensors.values())
    print(json.dumps({"share": share, "largest": largest}), file=sys.stderr)
elapsed = time.perf_counter() - t0
stop = True
print(json.dumps({"seconds": elapsed, "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_rss,
                  "anon_peak": peak[0] - base}))
"""


def _measure(what: str, ckpt: str, out: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, what, ckpt, out], capture_output=True, text=True, env=env, check=False
    )
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    extra = [line for line in proc.stderr.splitlines() if line.startswith("{")]
    if extra:
        result.update(json.loads(extra[-1]))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, default=50e6)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument(
        "--keep", help="directory for the checkpoint, reused when it holds one (default: a temporary one)"
    )
    args = parser.parse_args()
    from shardtrain.testing import run_distributed

    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or str(Path(tmp) / "ds")
        t0 = time.perf_counter()
        if not (Path(root) / "latest").is_file():
            run_distributed(_write_checkpoint, 2, root, int(args.params), args.layers, timeout=1200)
        size = sum(f.stat().st_size for f in Path(root).rglob("*.pt"))
        print(
            f"DeepSpeed checkpoint: {args.params:.3g} parameters, {size / 1e6:.0f} MB of .pt files, written in "
            f"{time.perf_counter() - t0:.1f}s; model fp32 {args.params * 4 / 1e6:.0f} MB"
        )
        runs = {}
        for what in ("zero_to_fp32", "shardtrain", "load_share"):
            runs[what] = _measure(what, root, str(Path(tmp) / what))
            r = runs[what]
            print(
                f"{what:>13}: {r['seconds']:7.2f} s   peak RSS growth {r['maxrss'] / 1e6:6.0f} MB   "
                f"peak anonymous growth {r['anon_peak'] / 1e6:6.0f} MB"
            )
        z, s, load = runs["zero_to_fp32"], runs["shardtrain"], runs["load_share"]
        print(
            f"ratios shardtrain / zero_to_fp32: time {s['seconds'] / z['seconds']:.2f}x, peak RSS "
            f"{s['maxrss'] / z['maxrss']:.2f}x, peak anonymous {s['anon_peak'] / max(1, z['anon_peak']):.2f}x"
        )
        print(
            f"one rank's load at world 4: read {load['share'] / 1e6:.0f} MB (its share), largest tensor "
            f"{load['largest'] / 1e6:.0f} MB, peak anonymous growth {load['anon_peak'] / 1e6:.0f} MB"
        )


if __name__ == "__main__":
    main()
