"""The one-GPU validation (issue 33): plain PyTorch against the engine, variant by variant, at world 1.

    python bench/gpu_validate.py                       # a ~1.3B GPT, bf16, sequence 2048, on this rank's GPU
    python bench/gpu_validate.py --variants plain,stage2,stage3 --steps 5
    python bench/gpu_validate.py --tiny                # a tiny GPT on the CPU
    python bench/gpu_validate.py --tiny --in-process   # the same, every variant in one process (the test suite's)
    python bench/gpu_validate.py --json results.json   # the table as JSON too
    python bench/gpu_validate.py --shape llama3-8b --variants stage3:inductor,stage3:inductor:fp8   # fp8's goal

Variants (``--variants``, comma-separated; default all):
* ``plain``: plain PyTorch, the reference. fp32 parameters, bf16 autocast, fused AdamW, clipping at 1.0.
  Nothing from shardtrain.
* ``stage0`` to ``stage3``: the engine at that ZeRO stage, bf16, the same AdamW and clipping.
* ``stage3:inductor``: graph mode at stage 3 with ``graph.compiler`` ``inductor``. The capture and compile are in
  the warm-up steps, whose time is printed apart.
* ``stage3:host``: stage 3 with the model built on the host, without ``zero.Init``: ``initialize`` lays it out on
  the device unit by unit ([Note: stage 3 from the host]); its ``init peak`` is the shards plus one unit, not the
  model.
* ``stage2:offload``, ``stage3:offload``: the optimizer's state and step in host memory (``offload_optimizer``
  ``cpu``, pinned on CUDA).
* ``stage3:offload-param``, ``stage3:offload-param-nvme``: ZeRO-Infinity, the parameters' unit shards in pinned host
  memory (or every unit in swap files under the temporary directory), each copied to the GPU on a side stream before
  its gather ([Note: parameter uploads]), beside ``stage3:offload``'s optimizer offload (parameter offload alone is
  refused on CUDA). On the CPU ``cpu`` has no effect (the shards are in host memory already); ``nvme`` runs.
* ``stage2:offload:zenflow``: stall-free offload (DeepSpeed's ZenFlow example section: ``topk_ratio`` 0.1,
  ``update_interval`` 4, ``overlap_step``): the top tenth of each weight's columns and their Adam state on the GPU
  every step, the rest accumulated and stepped on the host in a thread ([Note: ZenFlow on the device]); its losses
  part from ``plain``'s by the rule's staleness, within the tolerance over these few steps.
* ``stage2:offload-partial``: DeepSpeed's partial offload (``offload_optimizer.ratio`` 0.25, sub-groups of 50M
  elements): the first quarter of the state is stepped on the host, the rest on the GPU. On the CPU the ratio has no
  effect (everything is in host memory already), so there it runs as ``stage2:offload``.
* ``stage2:fp16``, ``stage3:fp16``: fp16 with dynamic loss scaling instead of bf16; the fused AdamW skips an
  overflowing step in its kernel, so the overflow never has to be read during the step.
* ``stage3:selective``, ``stage3:full``, ``stage3:full-cpu``: activation checkpointing by policy
  (``activation_checkpointing.policy``: matmul outputs kept, the rest recomputed; or whole blocks recomputed, their
  inputs in pinned host memory with ``-cpu``): the peak against ``stage3``'s, and the recompute's time.
* ``stage3:fp8``, ``stage3:inductor:fp8``: ``stage3`` and ``stage3:inductor`` with the ``fp8`` section (torchao's
  float8 matmuls, tensorwise; the eager one gathers the converted weights in float8): docs/fp8.md. Emulated on the
  CPU, where the variant checks that it runs and stays within the loss tolerance, not its speed.
* ``stage2:nccl``, ``stage3:nccl``: every collective issued although the group has one rank
  (``SHARDTRAIN_FORCE_COLLECTIVES=1``, [Note: a group of one]). On a GPU this runs NCCL's streams, the waits and the
  buffer frees after them. On the CPU the group is gloo's.

Shapes (``--shape``): ``gpt-1.3b`` (default: 24 layers, d_model 2048, 16 heads, vocab 32000, sequence 2048,
micro-batch 4) and ``llama3-8b``, a layer stack of Llama-3-8B's dimensions (d_model 4096, 32 heads, vocab 128256,
sequence 8192, micro-batch 1; 4 layers), where fp8's goal is measured (``stage3:inductor:fp8`` at most 0.80x
``stage3:inductor``, docs/fp8.md). It is the project's GPT, not Llama: its MLP is 4 x 4096 with GELU where Llama's is
SwiGLU of 14336 (1.3x the MLP's FLOPs), and its attention has no grouped keys and values. ``--layers``, ``--d-model``,
``--seq`` and ``--micro-batch`` override a shape's values.

Each variant runs in a process of its own (its memory, process group, compiled graphs and peak counters; a crash
costs that variant only). Every variant starts from the same initial weights (seeded), trains on the same batches,
and runs ``--warmup`` steps, then one counted step, then ``--steps`` timed steps. The counted step counts host
synchronizations:
* on CUDA, the operations ``torch.cuda.set_sync_debug_mode`` reports, plus calls to ``synchronize``;
* on the CPU, the operations that would synchronize on a GPU (``aten._local_scalar_dense``, behind ``.item()`` and
  ``bool()``; ``nonzero``; ``equal``), seen by a dispatch mode.
Each is named by its operation and the line that asked for it ([Note: counting host synchronizations] in
:mod:`shardtrain.testing.syncs`).

Each variant prints:
* its step time, and the ratio of that time to ``plain``'s; tokens per second (micro-batch x sequence per step);
* host syncs per step;
* CPU seconds per wall second over the timed steps (``getrusage``: every thread of the process);
* peak allocated and reserved GPU memory, against ``shardtrain estimate``'s device peak for that layout (``/ est``:
  peak allocated over the estimate; ``!`` beside it when they are more than 10% apart), and the peak allocated by the
  end of ``initialize`` (``init peak``);
* TFLOP/s and MFU. Model FLOPs per step are counted once with ``torch.utils.flop_counter`` on ``plain``'s forward
  and backward. The device's peak is known for common GPUs, or given with ``--peak-tflops``.

Each engine variant's losses are compared with ``plain``'s (``--loss-rtol``: bf16 compute against bf16 autocast),
and with ``stage0``'s (``--engine-rtol``). On a mismatch the script exits with status 1, naming the variant and the
step. ``plain`` is timed first and last; the printed drift between the two is the noise the ratios carry. ``--no-plain``
runs no ``plain`` (a model whose fp32 weights and Adam state do not fit the device, such as ``--shape llama3-8b
--layers 32``): no ratios to it and no FLOPs, the step times and tokens/s only.
docs/benchmarks-gpu.md has the device commands and the results. ``bench/longest_seq.py`` runs these variants at the
longest sequence each fits (issue 51's activation goals).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

import shardtrain
from shardtrain.distributed.communicator import FORCE_ENV
from shardtrain.distributed.mesh import pick_device
from shardtrain.engine.monitor import known_peak_tflops
from shardtrain.estimate import estimate_memory, fmt_bytes
from shardtrain.models.gpt import GPT, GPTConfig, num_parameters
from shardtrain.testing.syncs import count_host_syncs

VARIANTS = (
    "plain",
    "stage0",
    "stage1",
    "stage2",
    "stage3",
    "stage3:inductor",
    "stage3:host",
    "stage2:offload",
    "stage2:offload:zenflow",
    "stage2:offload-partial",
    "stage3:offload",
    "stage3:offload-param",
    "stage3:offload-param-nvme",
    "stage2:nccl",
    "stage3:nccl",
    "stage2:fp16",
    "stage3:fp16",
    "stage3:selective",
    "stage3:full",
    "stage3:full-cpu",
    "stage3:fp8",
    "stage3:inductor:fp8",
)
LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 3e-4, (0.9, 0.95), 1e-8, 0.1, 1.0
PARTIAL_RATIO = 0.25  # ``stage2:offload-partial``: the fraction of the optimizer's elements stepped on the host
PARTIAL_SUB_GROUP = 50_000_000  # elements per sub-group: fine enough for the ratio to split the 1.3B model's state


@dataclass
class Result:
    variant: str
    step_s: float
    warmup_s: float
    syncs_per_step: float | None
    cpu_per_wall: float
    peak_allocated: int | None
    peak_reserved: int | None
    init_peak_allocated: int | None
    estimate: int | None
    losses: list[float] = field(default_factory=list)
    sync_sites: dict[str, int] = field(default_factory=dict)  # where the counted step synchronized: file:line -> n
    tokens_per_s: float | None = None  # micro-batch x sequence over the step time


SHAPES: dict[str, dict[str, int]] = {
    "gpt-1.3b": {"vocab": 32000, "layers": 24, "d_model": 2048, "seq": 2048, "micro_batch": 4},
    # Llama-3-8B's hidden size, heads (head dim 128), vocabulary and sequence; a few layers of the project's GPT
    "llama3-8b": {"vocab": 128256, "layers": 4, "d_model": 4096, "seq": 8192, "micro_batch": 1},
}


def shape(args: argparse.Namespace) -> tuple[GPTConfig, int]:
    if args.tiny:
        return GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_layer=2, n_head=4), 2
    dims = SHAPES[args.shape]
    given = {k: getattr(args, k) for k in ("layers", "d_model", "seq", "micro_batch") if getattr(args, k) is not None}
    dims = {**dims, **given}
    cfg = GPTConfig(
        vocab_size=dims["vocab"],
        seq_len=dims["seq"],
        d_model=dims["d_model"],
        n_layer=dims["layers"],
        n_head=dims["d_model"] // 128,
    )
    return cfg, dims["micro_batch"]


def batches(cfg: GPTConfig, micro_batch: int, n: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(n):
        x = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len), generator=g)
        out.append((x.to(device), torch.roll(x, -1, dims=1).to(device)))
    return out


def build(cfg: GPTConfig, device: torch.device) -> GPT:
    torch.manual_seed(0)
    with device:
        return GPT(cfg)


def engine_config(variant: str, micro_batch: int, device: torch.device) -> dict[str, Any]:
    stage = int(variant.split(":")[0].removeprefix("stage"))
    zero: dict[str, Any] = {"stage": stage}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "bf16": {"enabled": True},
        "steps_per_print": 10**9,
        "zero_optimization": zero,
    }
    if ":offload" in variant:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
    if ":offload-param" in variant:  # ZeRO-Infinity: the unit shards in host memory or files, uploaded per gather
        nvme = variant.endswith("-nvme")
        zero["offload_param"] = {"device": "nvme" if nvme else "cpu"}
        if nvme:
            zero["offload_param"].update(nvme_path=tempfile.gettempdir(), max_in_cpu=0)
    if variant.endswith(":zenflow"):  # stall-free offload: DeepSpeed's example section (docs/offload.md#zenflow)
        zero["zenflow"] = {"topk_ratio": 0.1, "update_interval": 4, "overlap_step": True}
    if variant.endswith(":offload-partial"):  # DeepSpeed's partial offload: a quarter of the state on the host
        zero["offload_optimizer"]["ratio"] = PARTIAL_RATIO
        zero["sub_group_size"] = PARTIAL_SUB_GROUP
    if ":inductor" in variant:
        config["graph"] = {"enabled": True, "compiler": "inductor", "dynamic_shapes": False}
    if variant.endswith(":fp8"):  # docs/fp8.md; emulated where there are no float8 matmuls (the CPU)
        config["fp8"] = {"enabled": True, "emulate": device.type != "cuda"}
    if variant.endswith(":fp16"):  # dynamic loss scaling; the fused AdamW skips an overflow in its kernel
        del config["bf16"]
        config["fp16"] = {"enabled": True, "initial_scale_power": 16}
    if variant.endswith(":selective"):  # docs/activation-checkpointing.md
        config["activation_checkpointing"] = {"policy": "selective"}
    if ":full" in variant:
        config["activation_checkpointing"] = {"policy": "full", "cpu_checkpointing": variant.endswith("-cpu")}
    return config


def adamw(params: Any) -> torch.optim.Optimizer:
    """Fused on the CPU too: the unfused step reads each parameter's step count on the host (``.item()``), which
    would hide the engine's own host synchronizations in the CPU count."""
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True)


class Plain:
    """The reference: a training step as a PyTorch user writes it."""

    def __init__(self, cfg: GPTConfig, device: torch.device) -> None:
        self.model = build(cfg, device)
        self.opt = adamw(self.model.parameters())
        self.device = device

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = self.model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


class OnEngine:
    def __init__(
        self, variant: str, cfg: GPTConfig, micro_batch: int, device: torch.device, extra: dict | None = None
    ) -> None:
        config = {**engine_config(variant, micro_batch, device), **(extra or {})}  # extra: top-level keys added
        forced = variant.endswith(":nccl")
        if forced:  # read when the engine's communicators are made
            os.environ[FORCE_ENV] = "1"
        try:
            model = build(cfg, torch.device("cpu") if variant.endswith(":host") else device)
            self.engine = shardtrain.initialize(model, config=config, optimizer=adamw)
        finally:
            os.environ.pop(FORCE_ENV, None)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.engine(x, y)
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()


def count_syncs(
    step: Any, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device, graph: bool
) -> tuple[int | None, dict[str, int]]:
    """Host synchronizations in one call of ``step`` (None: not countable here, a graph on the CPU), and where each
    was asked for (the operation and the innermost frame outside torch and this file), see [Note: counting host
    synchronizations] in :mod:`shardtrain.testing.syncs`."""
    if device.type != "cuda" and graph:  # a dispatch mode around compiled code would run it differently
        step(*batch)
        return None, {}
    with count_host_syncs(device, skip=(__file__,)) as count:
        step(*batch)
    return count.total, dict(count.sites)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_variant(
    variant: str, cfg: GPTConfig, micro_batch: int, device: torch.device, args: argparse.Namespace, data: list
) -> Result:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    runner: Plain | OnEngine = Plain(cfg, device) if variant == "plain" else OnEngine(variant, cfg, micro_batch, device)
    init_peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    losses: list[torch.Tensor] = []

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        losses.append(runner.step(x, y))

    it = iter(data)
    started = time.perf_counter()
    for _ in range(args.warmup):
        step(*next(it))
    sync(device)
    warmup_s = time.perf_counter() - started
    syncs, sync_sites = count_syncs(step, next(it), device, graph=":inductor" in variant)
    sync(device)
    cpu0, wall0 = cpu_seconds(), time.perf_counter()
    for _ in range(args.steps):
        step(*next(it))
    sync(device)
    wall = time.perf_counter() - wall0
    cpu = cpu_seconds() - cpu0
    estimate = None
    if variant != "plain":
        est = estimate_memory(
            lambda: GPT(cfg),
            engine_config(variant, micro_batch, device),
            world_size=1,
            seq_len=cfg.seq_len,
            device_type=device.type,
        )
        estimate = est.peak["device"]
    result = Result(
        variant=variant,
        step_s=wall / args.steps,
        warmup_s=warmup_s,
        syncs_per_step=syncs,
        sync_sites=sync_sites,
        cpu_per_wall=cpu / wall,
        peak_allocated=torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
        peak_reserved=torch.cuda.max_memory_reserved() if device.type == "cuda" else None,
        init_peak_allocated=init_peak,
        estimate=estimate,
        losses=[float(v) for v in losses],  # read once, after the timing
        tokens_per_s=micro_batch * cfg.seq_len * args.steps / wall,
    )
    return result


def flops_per_step(cfg: GPTConfig, micro_batch: int, device: torch.device) -> int:
    plain = Plain(cfg, device)
    (x, y) = batches(cfg, micro_batch, 1, device)[0]
    with FlopCounterMode(display=False) as counter:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = plain.model(x, y)
        loss.backward()
    del plain
    return counter.get_total_flops()


def write_json(
    path: str, info: dict[str, Any], results: dict[str, Result], last: Result | None, problems: list
) -> None:
    body = {
        **info,
        "torch": torch.__version__,
        "plain_drift": last.step_s / results["plain"].step_s if last is not None and "plain" in results else None,
        "results": [asdict(r) for r in results.values()],
        "problems": problems,
    }
    Path(path).write_text(json.dumps(body, indent=1))


def against_estimate(r: Result) -> str:
    """Peak allocated over the estimate, ``!`` beside it when they are more than 10% apart; ``-``: not measured."""
    if not r.peak_allocated or not r.estimate:
        return "-"
    ratio = r.peak_allocated / r.estimate
    return f"{ratio:.2f}{'!' if abs(ratio - 1) > 0.10 else ''}"


def peak_tflops(name: str, given: float | None) -> float | None:
    """The dense bf16 peak of the device called ``name`` (``"CPU"``: none), as the monitor's MFU takes it."""
    return given if given is not None else known_peak_tflops(name)


def check_losses(results: dict[str, Result], args: argparse.Namespace) -> list[str]:
    """Each mismatch, named: an engine variant against plain PyTorch, and against stage 0."""
    problems = []
    for name, r in results.items():
        refs = [("plain", args.loss_rtol)] + ([("stage0", args.engine_rtol)] if name not in ("plain", "stage0") else [])
        for ref, rtol in refs:
            if name == ref or ref not in results:
                continue
            for step, (a, b) in enumerate(zip(r.losses, results[ref].losses)):
                if not abs(a - b) <= rtol * abs(b):
                    problems.append(f"{name}: loss {a:.5f} at step {step}, {ref} {b:.5f} (rtol {rtol:g})")
                    break
    return problems


def child(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    """One variant in this process: its :class:`Result`, the device's name and, for ``plain``, the FLOPs per step."""
    device = pick_device()  # SHARDTRAIN_DEVICE, then CUDA when available; world 1: LOCAL_RANK 0
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg, micro_batch = shape(args)
    flops = flops_per_step(cfg, micro_batch, device) if variant == "plain" else None
    data = batches(cfg, micro_batch, args.warmup + 1 + args.steps, device)
    result = run_variant(variant, cfg, micro_batch, device, args, data)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return {"result": asdict(result), "flops": flops, "device": where}


def spawn(argv: list[str], variant: str, args: argparse.Namespace) -> tuple[Result | None, dict[str, Any], str]:
    """``variant`` in a fresh process: its memory, process group, compiled graphs and peak counters are its own,
    and a crash costs that variant only (``--in-process``: in this one, for the tiny model)."""
    if args.in_process:
        got = child(args, variant)
        return Result(**got.pop("result")), got, ""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        done = subprocess.run([sys.executable, __file__, *argv, "--only", variant, "--result", out])
        if done.returncode != 0 or not os.path.exists(out):
            return None, {}, f"{variant}: the run failed (exit {done.returncode}); its output is above"
        got = json.loads(Path(out).read_text())
    return Result(**got.pop("result")), got, ""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--tiny", action="store_true", help="a tiny GPT on the CPU (the test suite's run)")
    p.add_argument("--shape", default="gpt-1.3b", choices=sorted(SHAPES), help="the model's dimensions (above)")
    p.add_argument("--layers", type=int, default=None, help="default: the shape's")
    p.add_argument("--d-model", type=int, default=None, help="default: the shape's")
    p.add_argument("--seq", type=int, default=None, help="default: the shape's")
    p.add_argument("--micro-batch", type=int, default=None, help="default: the shape's")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak (default: known GPUs)")
    p.add_argument("--loss-rtol", type=float, default=3e-2, help="engine against plain (bf16 against autocast)")
    p.add_argument("--engine-rtol", type=float, default=1e-2, help="engine variants against stage0")
    p.add_argument("--json", default=None, help="write the results here too, after each variant")
    p.add_argument("--in-process", action="store_true", help="every variant in this process (the test suite's)")
    p.add_argument(
        "--no-plain",
        action="store_true",
        help="run no plain PyTorch reference (a model whose fp32 weights and Adam state do not fit the device): "
        "no ratios to plain, no FLOPs",
    )
    p.add_argument("--only", default=None, help=argparse.SUPPRESS)  # a child's variant
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)  # where a child writes its result
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(key, None)  # world 1 of its own, also when started from a distributed job's environment
    if args.tiny:
        os.environ.setdefault("SHARDTRAIN_DEVICE", "cpu")
        args.warmup, args.steps = min(args.warmup, 2), min(args.steps, 3)
    if args.only:
        Path(args.result).write_text(json.dumps(child(args, args.only)))
        return 0
    cfg, micro_batch = shape(args)
    order = ["plain"] + [v for v in variants if v != "plain"] + ["plain"]  # plain again at the end: the drift
    if args.no_plain:
        order = [v for v in variants if v != "plain"]
    results: dict[str, Result] = {}
    failures: list[str] = []
    info: dict[str, Any] = {}
    last: Result | None = None
    for k, v in enumerate(order):
        result, got, failed = spawn(argv, v, args)
        if failed:
            failures.append(failed)
            if v == "plain" and k == 0 and not args.no_plain:
                break  # nothing to compare with
            continue
        if k == len(order) - 1 and not args.no_plain:
            last = result
        else:
            results[v] = result
            info.update({key: value for key, value in got.items() if value is not None})
        print(f"  {v}: {result.step_s * 1e3:.1f} ms/step", flush=True)
        if args.json:
            write_json(args.json, info, results, last, failures)
    if "plain" not in results and not (args.no_plain and results):
        print("\n".join(failures), file=sys.stderr)
        return 1
    flops, where = info.get("flops"), info["device"]
    peak = peak_tflops(where, args.peak_tflops)
    print(
        f"{where}, torch {torch.__version__}; GPT {num_parameters(build(cfg, torch.device('meta'))) / 1e6:,.1f}M "
        f"parameters, {cfg.n_layer} layers, d_model {cfg.d_model}, micro-batch {micro_batch} x sequence "
        f"{cfg.seq_len}; {'-' if flops is None else f'{flops / 1e12:.2f}'} TFLOP per step; {args.warmup} warm-up + "
        f"1 counted + {args.steps} timed"
    )
    base = results["plain"].step_s if "plain" in results else None
    if last is not None:
        print(f"plain again at the end: {last.step_s / base:.3f}x the first plain run (the noise in the ratios)")
    head = (
        f"{'variant':<22} {'ms/step':>9} {'x plain':>8} {'tokens/s':>9} {'warm-up s':>9} {'syncs':>6} {'cpu/wall':>8} "
        f"{'peak alloc':>11} {'reserved':>11} {'estimate':>11} {'/ est':>6} {'init peak':>11} {'TFLOP/s':>8} {'MFU':>6}"
    )
    print(head)
    for v, r in results.items():
        tflops = None if flops is None else flops / r.step_s / 1e12
        print(
            f"{v:<22} {r.step_s * 1e3:>9.1f} {'-' if base is None else f'{r.step_s / base:.3f}':>8} "
            f"{r.tokens_per_s:>9.0f} {r.warmup_s:>9.1f} "
            f"{'-' if r.syncs_per_step is None else r.syncs_per_step:>6} {r.cpu_per_wall:>8.2f} "
            f"{fmt_bytes(r.peak_allocated) if r.peak_allocated is not None else '-':>11} "
            f"{fmt_bytes(r.peak_reserved) if r.peak_reserved is not None else '-':>11} "
            f"{fmt_bytes(r.estimate) if r.estimate is not None else '-':>11} {against_estimate(r):>6} "
            f"{fmt_bytes(r.init_peak_allocated) if r.init_peak_allocated is not None else '-':>11} "
            f"{'-' if tflops is None else f'{tflops:.2f}':>8} {f'{tflops / peak:.1%}' if peak and tflops else '-':>6}"
        )
    for fp8, bf16 in (("stage3:inductor:fp8", "stage3:inductor"), ("stage3:fp8", "stage3")):
        if fp8 in results and bf16 in results:  # fp8's goal: at most 0.80x on the llama3-8b shape (docs/fp8.md)
            print(f"{fp8} / {bf16}: {results[fp8].step_s / results[bf16].step_s:.3f}x the step")
    for v, r in results.items():
        for site, n in sorted(r.sync_sites.items()):
            print(f"  {v} synchronizes at {site} (x{n})")
    problems = check_losses(results, args) + failures
    if args.json:
        write_json(args.json, {**info, "peak_tflops": peak}, results, last, problems)
    for problem in problems:
        print(f"LOSS MISMATCH: {problem}", file=sys.stderr)
    print("losses: every variant within tolerance" if not problems else f"{len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
