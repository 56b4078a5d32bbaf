"""``shardtrain compare RUN_A RUN_B``: find the first step and activation where two runs' statistics part ways.

Prints the first step with a difference above tolerance, the first such record in execution order at that step
(forward before backward), the largest differences at that step and one line per step. ``--out DIR`` also writes
``DIR/report.html``, a single self-contained file with the plots embedded. Exit status: 0 when nothing diverged,
1 when something did, 2 for bad input (so it can gate CI). Difference and tolerance are defined in
:mod:`shardtrain.debug.records`.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from shardtrain.debug.records import CompareError, Comparison, RecordDiff, compare_runs, describe_key, load_run

DEFAULT_RTOL = 1e-4
DEFAULT_ATOL = 0.0


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_a", help="output_dir of a StatisticsSubscriber (holding rank_<r>/step_<n>.jsonl)")
    parser.add_argument("run_b", help="the run to compare with RUN_A")
    parser.add_argument("--out", metavar="DIR", help="write DIR/report.html with embedded plots")
    parser.add_argument("--rtol", type=_tolerance, default=DEFAULT_RTOL, help=f"relative tolerance ({DEFAULT_RTOL:g})")
    parser.add_argument("--atol", type=_tolerance, default=DEFAULT_ATOL, help=f"absolute tolerance ({DEFAULT_ATOL:g})")
    parser.add_argument("--top", type=_count, default=10, help="differences listed at the first step (10)")


def run(args: argparse.Namespace) -> int:
    try:
        comparison = compare_runs(load_run(args.run_a), load_run(args.run_b), args.rtol, args.atol)
    except CompareError as err:
        print(f"shardtrain compare: error: {err}", file=sys.stderr)
        return 2
    text = format_report(comparison, args.run_a, args.run_b, args.top)
    print(text)
    if args.out:
        from shardtrain.debug.report_html import write_html  # matplotlib is imported only when asked for

        try:
            path = write_html(comparison, Path(args.out), args.run_a, args.run_b, text)
        except OSError as err:  # --out names a file, or a place we may not write
            print(f"shardtrain compare: error: cannot write the HTML report: {err}", file=sys.stderr)
            return 2
        print(f"report written to {path}")
    return 1 if comparison.first_step is not None else 0


def format_report(c: Comparison, run_a: str, run_b: str, top: int = 10) -> str:
    lines = [f"A: {run_a}", f"B: {run_b}", f"tolerance: rtol={c.rtol:g} atol={c.atol:g}"]
    aligned = sum(d.a is not None and d.b is not None for d in c.diffs)
    lines.append(f"records compared: {aligned} over {len(c.per_step())} step(s)")
    for label, steps in (("A", c.steps_only_in_a), ("B", c.steps_only_in_b)):
        if steps:
            lines.append(f"steps only in {label} (not compared): {_ranges(steps)}")
    for d in c.missing[:top]:
        where = "A" if d.a is not None else "B"
        lines.append(f"only in {where}: step {d.step} {describe_key(d.key)}")
    if len(c.missing) > top:
        lines.append(f"... {len(c.missing) - top} more records present in only one run")
    for (da, db), n in c.dtype_mismatches.items():
        lines.append(f"dtype differs in {n} record(s): {da} in A, {db} in B (statistics are compared anyway)")
    if c.shape_mismatches:
        lines.append(f"shape differs in {c.shape_mismatches} record(s)")
    first = c.first_divergence()
    lines.append("")
    if first is None:
        lines.append("no divergence: every statistic is within tolerance")
    else:
        lines.append(f"FIRST DIVERGENCE at step {first.step}")
        lines.append(f"first diverging activation (execution order): {describe_key(first.key)}")
        lines.append(f"  {_explain(first)}")
        lines.append("")
        lines.append(f"largest differences at step {first.step}:")
        ranked = sorted((d for d in c.at_step(first.step) if d.above), key=lambda d: -d.worst.rel)
        lines.append(f"  {'rel diff':>9}  {'stat':<7} {'A':>13} {'B':>13}  activation")
        for d in ranked[:top]:
            w = d.worst
            lines.append(f"  {_num(w.rel):>9}  {w.stat:<7} {_num(w.a):>13} {_num(w.b):>13}  {describe_key(d.key)}")
    lines.append("")
    lines.append("largest relative difference per step:")
    for step, d in c.per_step().items():
        above = sum(x.above for x in c.at_step(step))
        verdict = f"DIVERGED ({above} record(s) above tolerance)" if above else "ok"
        where = f"{d.worst.stat} of {describe_key(d.key)}" if d.worst.rel > 0 else "(identical)"
        lines.append(f"  step {step:>5}  {_num(d.worst.rel):>9}  {verdict:<40} {where}")
    return "\n".join(lines)


def _explain(d: RecordDiff) -> str:
    above = [s for s in d.stats if s.above]
    return "; ".join(f"{s.stat} {_num(s.a)} vs {_num(s.b)} (rel {_num(s.rel)})" for s in above)


def _num(x: object) -> str:
    if isinstance(x, bool) or x is None:
        return str(x)
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        return f"{x:.4g}" if x != 0 else "0"
    return str(x)


def _ranges(steps: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    spans = [[steps[0], steps[0]]]
    for step in steps[1:]:
        if step == spans[-1][1] + 1:
            spans[-1][1] = step
        else:
            spans.append([step, step])
    return ", ".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in spans)
