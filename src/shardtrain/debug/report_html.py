"""The HTML report of ``shardtrain compare --out DIR``: one file, plots embedded as base64 PNG (matplotlib, Agg).

Three figures: the largest relative difference per step; a heat map of activations (rows, in execution order)
by step; and both runs' values over the steps for the first diverging activations. Nothing is loaded from the
network, so the file opens in a browser from disk.
"""

from __future__ import annotations

import base64
import html
import io
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display; must precede pyplot
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from shardtrain.debug.records import Comparison, Key, RecordDiff, describe_key

FLOOR = 1e-12  # zero differences are drawn at this height on log scales
MAX_ROWS = 60  # activations in the heat map (the most different ones)
MAX_CURVES = 4  # first diverging activations whose values are plotted


def write_html(c: Comparison, out_dir: Path, run_a: str, run_b: str, summary: str) -> Path:
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"--out {str(out_dir)!r} exists and is not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = [
        ("Largest relative difference per step", _per_step_figure(c)),
        ("Relative difference by activation and step", _heatmap_figure(c)),
        ("First diverging activations in both runs", _curves_figure(c)),
    ]
    body = [
        f"<h1>shardtrain compare</h1><p>A: <code>{html.escape(run_a)}</code><br>B: "
        f"<code>{html.escape(run_b)}</code></p>",
        f"<pre>{html.escape(summary)}</pre>",
    ]
    for title, fig in figures:
        if fig is None:
            continue
        body.append(f"<h2>{html.escape(title)}</h2>")
        body.append(f'<img alt="{html.escape(title)}" src="data:image/png;base64,{_png_base64(fig)}">')
    page = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>shardtrain compare</title>'
        "<style>body{font-family:sans-serif;margin:2em;max-width:1200px}pre{background:#f4f4f4;padding:1em;"
        "overflow-x:auto}img{max-width:100%}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
    path = out_dir / "report.html"
    path.write_text(page, encoding="utf-8")
    return path


def _png_base64(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _shown(rel: float) -> float:
    return max(rel, FLOOR) if math.isfinite(rel) else 1e3  # a missing record is drawn far above any tolerance


def _per_step_figure(c: Comparison) -> Figure:
    per_step = c.per_step()
    steps = list(per_step)
    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.semilogy(steps, [_shown(d.worst.rel) for d in per_step.values()], marker="o", label="largest difference")
    ax.axhline(max(c.rtol, FLOOR), color="gray", linestyle="--", label=f"rtol {c.rtol:g}")
    if c.first_step is not None:
        ax.axvline(c.first_step, color="red", alpha=0.5, label=f"first divergence (step {c.first_step})")
    ax.set_xlabel("step")
    ax.set_ylabel("relative difference")
    ax.legend(loc="best", fontsize="small")
    return fig


def _row_key(key: Key) -> Key:
    return (key[0], -1, *key[2:])  # one row per activation, whatever the step


def _heatmap_figure(c: Comparison) -> Figure | None:
    steps = list(c.per_step())
    if not steps:
        return None
    rows: dict[Key, dict[int, float]] = {}
    order: dict[Key, tuple] = {}
    for d in c.diffs:
        row = _row_key(d.key)
        rows.setdefault(row, {})[d.step] = d.worst.rel
        order.setdefault(row, (d.key[2] != "forward", d.seq, d.key[0]))  # forward rows first, execution order
    keep = sorted(rows, key=lambda r: -max(rows[r].values()))[:MAX_ROWS]
    keep.sort(key=lambda r: order[r])
    grid = np.full((len(keep), len(steps)), np.nan)
    for i, row in enumerate(keep):
        for j, step in enumerate(steps):
            if step in rows[row]:
                grid[i, j] = math.log10(_shown(rows[row][step]))
    fig, ax = plt.subplots(figsize=(9, 1.5 + 0.22 * len(keep)))
    image = ax.imshow(grid, aspect="auto", cmap="magma", interpolation="nearest", vmin=math.log10(FLOOR), vmax=0)
    ax.set_yticks(range(len(keep)), [describe_key(r) for r in keep], fontsize=7)
    ax.set_xticks(range(len(steps)), [str(s) for s in steps], fontsize=7)
    ax.set_xlabel("step")
    fig.colorbar(image, ax=ax, label="log10 relative difference")
    return fig


def _curves_figure(c: Comparison) -> Figure | None:
    first_step = c.first_step
    if first_step is None:
        return None
    leaders: list[RecordDiff] = sorted((d for d in c.at_step(first_step) if d.above), key=RecordDiff.order)
    leaders = [d for d in leaders if d.a is not None and d.b is not None][:MAX_CURVES]
    if not leaders:
        return None
    by_row: dict[Key, list[RecordDiff]] = {}
    for d in c.diffs:
        by_row.setdefault(_row_key(d.key), []).append(d)
    # top row: the statistic in both runs; bottom row: its relative difference, which the top row can hide
    fig, axes = plt.subplots(2, len(leaders), figsize=(4 * len(leaders), 5.5), squeeze=False, sharex="col")
    for col, leader in enumerate(leaders):
        top, bottom = axes[0][col], axes[1][col]
        stat = leader.worst.stat
        series = [d for d in by_row[_row_key(leader.key)] if d.a is not None and d.b is not None]
        xs = [d.step for d in series]
        top.plot(xs, [_value(d.a.data.get(stat)) for d in series], marker="o", label="A")
        top.plot(xs, [_value(d.b.data.get(stat)) for d in series], marker="x", linestyle="--", label="B")
        top.set_title(f"{stat} of {describe_key(leader.key)}", fontsize=8)
        top.legend(fontsize="small")
        rel = [next((s.rel for s in d.stats if s.stat == stat), 0.0) for d in series]
        bottom.semilogy(xs, [_shown(r) for r in rel], marker="o", color="tab:red")
        bottom.axhline(max(c.rtol, FLOOR), color="gray", linestyle="--")
        bottom.set_ylabel("relative difference", fontsize=8)
        bottom.set_xlabel("step")
        for ax in (top, bottom):
            ax.axvline(first_step, color="red", alpha=0.4)
    fig.tight_layout()
    return fig


def _value(x: object) -> float:
    return float(x) if isinstance(x, (int, float)) else math.nan
