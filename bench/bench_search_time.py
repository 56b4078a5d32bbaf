"""The planner's ``--budget`` search at 8 and 1,024 GPUs: its wall time, the layouts it weighs and the fake runs it
makes (what bounds the time; tests/estimate/test_estimate_time.py checks the counts, never the clock)::

    PYTHONPATH=src python bench/bench_search_time.py [--nodes 1,128]

The model is the tests' tiny GPT (``tests/estimate/test_estimate_time.py:tiny_gpt``) on H100 SXM nodes of 8 GPUs,
the search in one process (``--jobs 1``). Note the machine's load (``uptime``) beside the times: it is shared.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def search(nodes: int) -> dict[str, float]:
    from shardtrain.cli import main as cli_main
    from shardtrain.estimate import planner

    counts = {"layouts": 0, "memory_runs": 0, "time_runs": 0}
    real_runs, real_work, real_prepare = planner.measure_runs, planner.measure_work, planner._prepare

    def runs(keyed, workers=1):  # type: ignore[no-untyped-def]
        counts["memory_runs"] += len(keyed)
        yield from real_runs(keyed, workers)

    def work(**kwargs):  # type: ignore[no-untyped-def]
        counts["time_runs"] += 1
        return real_work(**kwargs)

    def prepare(*args, **kwargs):  # type: ignore[no-untyped-def]
        counts["layouts"] += 1
        return real_prepare(*args, **kwargs)

    planner.measure_runs, planner.measure_work, planner._prepare = runs, work, prepare
    try:
        import test_estimate_time

        argv = ["estimate", "test_estimate_time:tiny_gpt", "--seq-len", str(test_estimate_time.SEQ), "--budget",
                "80GiB", "--gpu", "H100-SXM", "--nodes", str(nodes), "--jobs", "1"]  # fmt: skip
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            assert cli_main(argv) == 0
        return {"seconds": time.perf_counter() - start, **counts}
    finally:
        planner.measure_runs, planner.measure_work, planner._prepare = real_runs, real_work, real_prepare


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="1,128", help="comma-separated node counts (8 GPUs a node)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests" / "estimate"))
    sys.path.insert(0, str(ROOT / "tests"))
    print(f"load before: {os.getloadavg()[0]:.1f}")
    print("| GPUs | search time (s) | layouts weighed | memory fake runs | time fake runs |")
    print("|---:|---:|---:|---:|---:|")
    for nodes in (int(n) for n in args.nodes.split(",")):
        r = search(nodes)
        print(f"| {8 * nodes:,} | {r['seconds']:.1f} | {r['layouts']} | {r['memory_runs']} | {r['time_runs']} |",
              flush=True)  # fmt: skip
    print(f"load after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
