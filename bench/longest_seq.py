"""The longest sequence each variant trains at on one device (issue 51's activation goals), at a fixed micro-batch.

    python bench/longest_seq.py --shape llama3-8b --seq 4096 --variants stage3,stage3:selective,stage3:full-cpu
    python bench/longest_seq.py --tiny --seq 64 --memory-limit-mib 4 --in-process   # the test suite's

For each variant (``bench/gpu_validate.py``'s: the same model, configs and batches) the search probes training
steps (forward, backward, step) at growing sequence lengths: it doubles from ``--seq`` until a probe does not fit,
then bisects between the last length that fit and the first that did not, to ``--resolution`` tokens
([Note: the longest-sequence search]). A probe that runs out of memory (``torch.OutOfMemoryError``, caught in the
probe's process) is reported as "does not fit"; a crash or a ``--probe-timeout`` ends that variant's search, with
the reason, and never the whole run. Each probe runs in a fresh process (its allocator's state and peak counters its
own), or in this one with ``--in-process``.

On the CPU there is no device memory to run out of, so ``--memory-limit-mib`` stands in for it: the probe measures
the peak of its steps' live tensor storages (``shardtrain.testing.live_bytes.LiveBytes``, a dispatch mode) and raises
the same ``torch.OutOfMemoryError`` when it is over the limit. On CUDA the limit, when given, is checked against
``torch.cuda.max_memory_allocated`` the same way (a smaller card simulated on a bigger one).

It prints, and writes to ``--json``, each variant's longest length, its step time, tokens/s and peak memory, its
ratios against ``stage3`` (no checkpointing), and issue 51's goals as met / not met: ``stage3:selective`` at least
2x ``stage3``'s length with a step at most 1.25x ``stage3``'s (the step at ``stage3``'s longest length, the same
memory), ``stage3:full-cpu`` at least 4x ``stage3``'s length.

Note: the project's GPT learns its position table (``seq_len x d_model``), so the model grows with the sequence
(at d_model 4096, 16 KiB of bf16 weights per token, 64 KiB with fp32 masters and Adam); every variant carries it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shardtrain.testing.live_bytes import LiveBytes


def _gpu_validate() -> Any:
    """``bench/gpu_validate.py``, the variants' source (bench/ is not a package)."""
    if "gpu_validate" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_validate", Path(__file__).with_name("gpu_validate.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules["gpu_validate"]


gv = _gpu_validate()

# issue 51's goals, against ``stage3`` (no checkpointing)
BASE = "stage3"
GOALS = {"stage3:selective": (2.0, 1.25), "stage3:full-cpu": (4.0, None)}  # length at least, step at most


@dataclasses.dataclass
class Probe:
    seq: int
    fits: bool
    reason: str = ""  # why it does not fit: "out of memory", or what ended the search
    step_s: float | None = None
    peak_bytes: int | None = None

    @property
    def conclusive(self) -> bool:
        """Fits, or ran out of memory: a crash or a timeout says nothing about the memory."""
        return self.fits or self.reason == "out of memory"


# [Note: the longest-sequence search]
# Doubling from the start finds a length that fits (``lo``) and one that does not (``hi``), then bisection halves
# the gap, keeping every probed length a multiple of the resolution above ``lo``, until the gap is one resolution:
# ``lo`` is then the longest length that fits, to the resolution, provided that whether a length fits is monotone
# in the length (a longer sequence needs at least the memory of a shorter one). ``--max-seq`` caps the doubling
# (a CPU without a limit never runs out). A probe that neither fits nor runs out of memory (a crash, a timeout)
# ends the search at the last length that fit, with that probe's reason beside it: the length is then a lower
# bound, not the boundary.
def longest_fitting(
    probe: Callable[[int], Probe], start: int, resolution: int, max_seq: int | None = None
) -> tuple[Probe | None, Probe | None, list[Probe]]:
    """The longest probe that fits, the shortest that does not (None when none failed below ``max_seq``), and every
    probe in order; see [Note: the longest-sequence search]."""
    if start <= 0 or resolution <= 0 or start % resolution:
        raise ValueError(f"the start ({start}) must be a positive multiple of the resolution ({resolution})")
    probes: list[Probe] = []

    def run(seq: int) -> Probe:
        probes.append(probe(seq))
        return probes[-1]

    first = run(start)
    if not first.fits:
        return None, first, probes
    lo, hi = first, None
    while max_seq is None or lo.seq * 2 <= max_seq:
        got = run(lo.seq * 2)
        if not got.fits:
            hi = got
            break
        lo = got
    if hi is None or not hi.conclusive:
        return lo, hi, probes
    while hi.seq - lo.seq > resolution:
        mid = lo.seq + (hi.seq - lo.seq) // (2 * resolution) * resolution
        got = run(mid)
        if got.fits:
            lo = got
        elif got.conclusive:
            hi = got
        else:
            return lo, got, probes
    return lo, hi, probes


def probe_once(args: argparse.Namespace, variant: str, seq: int) -> Probe:
    """``args.warmup`` + ``args.steps`` training steps of ``variant`` at ``seq`` in this process; out of memory
    (the device's, or over ``--memory-limit-mib``) is a probe that does not fit."""
    device = gv.pick_device()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    limit = None if args.memory_limit_mib is None else args.memory_limit_mib * 2**20
    shape_args = argparse.Namespace(**{**vars(args), "seq": seq})
    cfg, micro_batch = gv.shape(shape_args)
    cfg = dataclasses.replace(cfg, seq_len=seq)  # the tiny shape has no --seq of its own
    tracker = LiveBytes() if not cuda else None
    runner = None
    try:
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        data = gv.batches(cfg, micro_batch, args.warmup + args.steps, device)
        extra = {"tiled_logits_loss": True} if args.tiled_logits_loss else None
        runner = gv.Plain(cfg, device) if variant == "plain" else gv.OnEngine(variant, cfg, micro_batch, device, extra)

        def peak() -> int:
            return torch.cuda.max_memory_allocated() if cuda else tracker.peak

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            with tracker if tracker is not None else contextlib.nullcontext():
                runner.step(x, y)
            if limit is not None and peak() > limit:  # the simulated card: the same error as the real one's
                raise torch.OutOfMemoryError(f"peak {peak()} bytes over the limit of {limit}")

        for x, y in data[: args.warmup]:
            step(x, y)
        gv.sync(device)
        started = time.perf_counter()
        for x, y in data[args.warmup :]:
            step(x, y)
        gv.sync(device)
        return Probe(seq, True, step_s=(time.perf_counter() - started) / args.steps, peak_bytes=peak())
    except torch.OutOfMemoryError:
        return Probe(seq, False, "out of memory")
    finally:
        runner = None  # its memory goes before the next probe
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def probe_in_child(argv: list[str], args: argparse.Namespace, variant: str, seq: int) -> Probe:
    """:func:`probe_once` in a fresh process (``--in-process``: in this one): a crash or a timeout is a probe that
    does not fit, with its reason, and ends that variant's search only."""
    if args.in_process:
        return probe_once(args, variant, seq)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "probe.json")
        command = [sys.executable, __file__, *argv, "--probe", f"{variant}@{seq}", "--result", out]
        try:
            done = subprocess.run(command, timeout=args.probe_timeout)
        except subprocess.TimeoutExpired:
            return Probe(seq, False, f"timed out after {args.probe_timeout} s")
        if done.returncode != 0 or not os.path.exists(out):
            return Probe(seq, False, f"failed (exit {done.returncode}); its output is above")
        return Probe(**json.loads(Path(out).read_text()))


def summarize(found: dict[str, dict[str, Any]], micro_batch: int) -> tuple[list[str], dict[str, Any]]:
    """The printed lines and the JSON's ratios and goals: each variant against ``stage3``'s longest length, and its
    step against ``stage3``'s at that length (the same memory)."""
    lines, goals = [], {}
    base = found.get(BASE, {}).get("longest")
    header = f"{'variant':<20} {'longest':>8} {'x stage3':>9} {'ms/step':>9} {'tokens/s':>10} {'peak MiB':>10}  note"
    lines.append(header)
    for variant, f in found.items():
        best = f["longest"]
        ratio = best["seq"] / base["seq"] if best and base else None
        f["length_ratio"] = ratio
        note = f["limit"]
        if best is None:
            lines.append(f"{variant:<20} {'-':>8} {'-':>9} {'-':>9} {'-':>10} {'-':>10}  {note}")
            continue
        tokens_per_s = micro_batch * best["seq"] / best["step_s"]
        f["tokens_per_s"] = tokens_per_s
        peak = "-" if best["peak_bytes"] is None else f"{best['peak_bytes'] / 2**20:.1f}"
        lines.append(
            f"{variant:<20} {best['seq']:>8} {'-' if ratio is None else f'{ratio:.2f}':>9} "
            f"{best['step_s'] * 1e3:>9.1f} {tokens_per_s:>10.0f} {peak:>10}  {note}"
        )
    for variant, (length_goal, step_goal) in GOALS.items():
        f = found.get(variant)
        if f is None or base is None or f["length_ratio"] is None:
            continue
        met = f["length_ratio"] >= length_goal
        text = f"{variant}: {f['length_ratio']:.2f}x stage3's length (goal >= {length_goal}x)"
        step_ratio = None
        at_base = f.get("at_base")
        if step_goal is not None and at_base is not None and at_base["fits"]:
            step_ratio = at_base["step_s"] / base["step_s"]
            met = met and step_ratio <= step_goal
            text += f", step {step_ratio:.2f}x stage3's at {base['seq']} (goal <= {step_goal}x)"
        elif step_goal is not None:
            met = False
            text += ", its step at stage3's length not measured"
        goals[variant] = {"length_ratio": f["length_ratio"], "step_ratio": step_ratio, "met": met}
        lines.append(f"{text}: {'met' if met else 'NOT met'}")
    return lines, goals


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="stage3,stage3:selective,stage3:full-cpu")
    p.add_argument("--tiny", action="store_true", help="a tiny GPT on the CPU (the test suite's run)")
    p.add_argument("--shape", default="llama3-8b", choices=sorted(gv.SHAPES))
    p.add_argument("--layers", type=int, default=None, help="default: the shape's")
    p.add_argument("--d-model", type=int, default=None, help="default: the shape's")
    p.add_argument("--micro-batch", type=int, default=None, help="default: the shape's")
    p.add_argument("--seq", type=int, default=4096, help="the search's first length")
    p.add_argument("--resolution", type=int, default=256, help="bisect to this many tokens")
    p.add_argument("--max-seq", type=int, default=None, help="double no further than this")
    p.add_argument("--memory-limit-mib", type=float, default=None, help="a simulated device memory (the CPU's)")
    p.add_argument(
        "--tiled-logits-loss",
        action="store_true",
        help="the engine's tiled loss (ALST's): the whole logits never exist, so the layers, not the head, set the "
        "length",
    )
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--probe-timeout", type=float, default=None, help="seconds; a probe past it ends the search")
    p.add_argument("--json", default=None, help="write the results here too, after each variant")
    p.add_argument("--in-process", action="store_true", help="every probe in this process (the test suite's)")
    p.add_argument("--probe", default=None, help=argparse.SUPPRESS)  # a child's variant@seq
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in gv.VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {', '.join(gv.VARIANTS)}")
    if args.seq % args.resolution:
        p.error(f"--seq {args.seq} must be a multiple of --resolution {args.resolution}")
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(key, None)  # world 1 of its own
    if args.tiny:
        os.environ.setdefault("SHARDTRAIN_DEVICE", "cpu")
    if args.probe:
        variant, seq = args.probe.rsplit("@", 1)
        Path(args.result).write_text(json.dumps(dataclasses.asdict(probe_once(args, variant, int(seq)))))
        return 0
    micro_batch = gv.shape(args)[1]
    found: dict[str, dict[str, Any]] = {}
    for variant in [BASE] + [v for v in variants if v != BASE] if BASE in variants else variants:
        lo, hi, probes = longest_fitting(
            lambda seq, v=variant: probe_in_child(argv, args, v, seq), args.seq, args.resolution, args.max_seq
        )
        limit = "out of memory above" if hi is not None and hi.conclusive else "capped by --max-seq"
        if hi is not None and not hi.conclusive:
            limit = f"a lower bound: {hi.reason} at {hi.seq}"
        if lo is None:
            limit = f"does not fit at {args.seq}: {hi.reason}"
        found[variant] = {
            "longest": None if lo is None else dataclasses.asdict(lo),
            "first_too_long": None if hi is None else dataclasses.asdict(hi),
            "limit": limit,
            "probes": [dataclasses.asdict(q) for q in probes],
        }
        base = found.get(BASE, {}).get("longest")
        if variant in GOALS and GOALS[variant][1] is not None and base is not None:  # its step at the same memory
            same = next((q for q in probes if q.seq == base["seq"]), None) or probe_in_child(
                argv, args, variant, base["seq"]
            )
            found[variant]["at_base"] = dataclasses.asdict(same)
        print(f"  {variant}: longest {None if lo is None else lo.seq} ({limit}), {len(probes)} probes", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"micro_batch": micro_batch, "variants": found}, indent=1))
    lines, goals = summarize(found, micro_batch)
    where = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.tiny else "CPU"
    print(f"{where}, torch {torch.__version__}; micro-batch {micro_batch}; resolution {args.resolution} tokens")
    print("\n".join(lines))
    if args.json:
        body = {"device": where, "micro_batch": micro_batch, "resolution": args.resolution, "variants": found}
        Path(args.json).write_text(json.dumps({**body, "goals": goals}, indent=1))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
