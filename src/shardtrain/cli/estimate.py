"""``shardtrain estimate``: one layout's memory per rank, or the layouts that fit a budget (``--budget``)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, replace

from shardtrain.config.sections import PIPELINE_SCHEDULES
from shardtrain.errors import ShardtrainError
from shardtrain.estimate.activation_budget import fitting_checkpointing, predicted_peak
from shardtrain.estimate.cluster import GPUS, Cluster, builtin_cluster, read_cluster
from shardtrain.estimate.planner import (
    MemoryEstimate,
    describe_blocks,
    estimate_memory,
    fitting_layouts,
    fmt_bytes,
    layout_from_config,
    parse_bytes,
    read_config,
    why_slower,
    with_global_batch,
)
from shardtrain.estimate.timing import TP_STYLES

EPILOG = """examples:
  shardtrain estimate meta-llama/config.json --world 8 --stage 3 --dtype bf16 --micro-batch 1 --seq-len 4096
  shardtrain estimate ./my_model_dir --config ds_config.json --world 16 --checkpointing
  shardtrain estimate mypkg.models:build --world 4 --budget 16GiB --seq-len 1024
  shardtrain estimate ./mixtral_dir --world 8 --stage 2 --ep 4 --dtype bf16 --seq-len 4096
  shardtrain estimate ./llama_dir --world 8 --stage 3 --sp 8 --dtype bf16 --seq-len 32768
  shardtrain estimate ./llama_dir --budget 80GiB --worlds 8 --sp 4 --seq-len 16384
  shardtrain estimate ./llama_dir --world 64 --stage 3 --dtype bf16 --time --gpu H100-SXM --gpus-per-node 8
  shardtrain estimate ./llama_dir --budget 80GiB --gpu H200 --gpus-per-node 8 --nodes 128 --dtype bf16
  shardtrain estimate mypkg.models:build --world 4 --time --cluster profile.json   (from shardtrain calibrate)
  shardtrain estimate ./llama_dir --world 16 --pp 4 --schedule Interleaved1F1B --stages-per-rank 2 --ac selective \
      --fp8 --compile --global-batch 256 --dtype bf16 --time --gpu H100-SXM --gpus-per-node 8 --nodes 2

MODEL is a Hugging Face config.json (or a directory holding one; no weights are read) or a factory
'package.module:function' returning an nn.Module (the module may define estimate_batch(micro_batch, seq_len) ->
(args, kwargs) and tp_plan). Values from --config (a DeepSpeed-style JSON/YAML file) are used where no option
overrides them. Numbers are per rank, for rank 0 (the one holding the most optimizer state). The model is built on
fake tensors: nothing is allocated, and activations are measured by running one micro-batch's forward and backward on
them. See docs/estimate.md for what is counted.
"""


AC_CHOICES = ("none", "selective", "full")
AC_CHECKPOINTING: dict[str, bool | str] = {"none": False, "selective": "selective", "full": True}
"""``--ac`` as :attr:`~shardtrain.estimate.planner.Candidate.checkpointing`."""
SEARCHED_MICRO_BATCHES = (1, 2, 4, 8)
"""Micro-batch sizes a ``--budget`` search with a cluster tries when ``--micro-batch`` is not given."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Memory per rank (parameters, gradients, optimizer state, gathered units, buffers, activations; device, "
        "host and nvme) of training a model in one layout, or with --budget the layouts that fit."
    )
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("model", help="Hugging Face config.json or model directory, or 'package.module:function'")
    parser.add_argument("--config", help="DeepSpeed-style config file (JSON or YAML) the layout starts from")
    parser.add_argument("--world", type=int, help="number of ranks (default 1; with --budget see --worlds)")
    parser.add_argument("--stage", type=int, choices=(0, 1, 2, 3), help="ZeRO stage")
    parser.add_argument("--tp", type=int, help="tensor-parallel size")
    parser.add_argument(
        "--mics-shard-size",
        type=int,
        help="hybrid sharding: shard within groups of this many data-parallel ranks, replicate across groups",
    )
    parser.add_argument(
        "--ep",
        type=int,
        help="expert-parallel size (expert_parallel_size, DeepSpeed's ep_size): each rank holds num_experts / ep "
        "experts of every MoE layer; with --budget every size that fits the model is tried",
    )
    parser.add_argument(
        "--sp",
        type=int,
        help="sequence-parallel size (sequence_parallel_size, Ulysses): each rank holds 1/sp of every sequence; "
        "with --budget every size from 1 to this one that the world and the model's heads allow is tried "
        "(without it, only the config's, else 1)",
    )
    parser.add_argument("--offload-optimizer", choices=("none", "cpu", "nvme"), help="where optimizer state lives")
    parser.add_argument("--offload-param", choices=("none", "cpu", "nvme"), help="stage 3: where parameter shards live")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="compute dtype (bf16/fp16: mixed precision)")
    parser.add_argument("--micro-batch", type=int, help="sequences per rank and micro-step")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    parser.add_argument(
        "--checkpointing", action="store_true", help="activation checkpointing of every block (--ac full)"
    )
    parser.add_argument(
        "--ac",
        choices=AC_CHOICES,
        help="activation checkpointing of every block: none, selective (matmul and attention outputs kept) or full; "
        "with --budget and a cluster, all three are searched unless given",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile: the time model fuses element-wise operators (docs/estimate.md, 'Time'); memory unchanged",
    )
    parser.add_argument("--fp8", action="store_true", help="FP8 training: converted linears' matmuls at the fp8 peak")
    parser.add_argument(
        "--schedule",
        help=f"with --pp: the pipeline schedule (the pipeline section's names: {', '.join(PIPELINE_SCHEDULES)})",
    )
    parser.add_argument(
        "--tp-style",
        choices=TP_STYLES,
        help="how the tensor parallelism runs, for the time: shardtrain's (default), or another stack's sequence "
        "parallelism, with its TP communication overlapped behind the matmuls or not (docs/planner.md)",
    )
    parser.add_argument(
        "--stages-per-rank", type=int, help="with --pp: stages per pipeline rank (Interleaved1F1B, LoopedBFS: 2+)"
    )
    parser.add_argument(
        "--global-batch",
        type=int,
        help="sequences per optimizer step: micro-batch x accumulation x dp must equal it (the accumulation steps "
        "follow); with --budget, layouts that cannot make it up are left out",
    )
    parser.add_argument(
        "--optimizer",
        choices=("adamw", "adam", "sgd", "muon-adamw", "lamb"),
        help="default: the config's, else AdamW; for an optimizer passed to initialize: muon-adamw "
        "(shardtrain.optim.muon.MuonWithAdamW, planned with DeepSpeed's Muon selection), lamb (shardtrain.optim.lamb)",
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="plan for accelerators (default; cpu offload moves state to the host) or a CPU-only machine",
    )
    parser.add_argument("--budget", help="device memory per rank (e.g. 16GiB, 80GB): list the layouts that fit")
    parser.add_argument(
        "--memory-limit",
        help="without --budget: device memory per rank the layout must fit (default with --gpu: the GPU's); when it "
        "does not, the cheapest activation checkpointing setting that makes it fit is printed (--json: 'fit')",
    )
    parser.add_argument(
        "--worlds",
        default=None,
        help="with --budget: world sizes to try, comma-separated (default: --world, else 1,2,4,8)",
    )
    parser.add_argument("--no-offload", action="store_true", help="with --budget: leave offload layouts out")
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="with --budget: processes the fake runs are spread over (default: the CPUs this process may use)",
    )
    parser.add_argument(
        "--state-only",
        action="store_true",
        help="model state only (parameters, gradients, optimizer): no fake forward/backward, as DeepSpeed's estimator",
    )
    parser.add_argument(
        "--pp",
        type=int,
        help="pipeline-parallel size (pipeline_parallel_size): each rank holds its stages' layers; with --budget "
        "every size from 1 to this one that divides the world is tried; micro-batches are the config's "
        "gradient_accumulation_steps, the schedule its pipeline.schedule",
    )
    parser.add_argument(
        "--pp-rank", type=int, help="with --pp: the pipeline rank reported (default 0, the first stage's)"
    )
    parser.add_argument(
        "--cp",
        type=int,
        help="context-parallel size (context_parallel_size, ring attention): each rank holds 1/cp of every sequence",
    )
    parser.add_argument(
        "--time",
        action="store_true",
        help="also predict the step time, tokens/s per GPU, MFU and exposed communication on the cluster "
        "(--cluster or --gpu; docs/estimate.md, 'Time')",
    )
    parser.add_argument("--cluster", help="cluster profile (JSON: gpu, gpus_per_node, overrides; shardtrain calibrate)")
    parser.add_argument("--gpu", choices=sorted(GPUS), help="a built-in GPU for the time model")
    parser.add_argument("--gpus-per-node", type=int, help="with --gpu: GPUs per node (default 8)")
    parser.add_argument("--nodes", type=int, help="with --gpu: nodes (default 1); the world is gpus-per-node x nodes")
    parser.add_argument("--top", type=int, default=5, help="with --budget and a cluster: the fastest layouts shown")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def _overrides(args: argparse.Namespace) -> dict:
    pairs = {
        "stage": args.stage,
        "tp": args.tp,
        "shard_size": args.mics_shard_size,
        "ep": args.ep,
        "sp": args.sp,
        "pp": args.pp,
        "pp_rank": args.pp_rank,
        "cp": args.cp,
        "offload_optimizer": args.offload_optimizer,
        "offload_param": args.offload_param,
        "dtype": args.dtype,
        "micro_batch": args.micro_batch,
        "checkpointing": AC_CHECKPOINTING[args.ac] if args.ac else None,
        "fp8": True if args.fp8 else None,
        "compile": True if args.compile else None,
        "schedule": args.schedule,
        "stages_per_rank": args.stages_per_rank,
        "tp_style": args.tp_style,
    }
    return {k: v for k, v in pairs.items() if v is not None}


def _check_speed_flags(args: argparse.Namespace, raw: dict) -> None:
    """Refuse the speed settings that contradict each other, by name. The pipeline's size is ``--pp`` or, without
    it, the config's ``pipeline_parallel_size``: ``--schedule`` applies wherever either sets one."""
    config_pp = raw.get("pipeline_parallel_size")
    pp = args.pp or (config_pp if isinstance(config_pp, int) else 1)
    if args.ac is not None and args.ac != "full" and args.checkpointing:
        raise ShardtrainError(f"--checkpointing is --ac full; it contradicts --ac {args.ac}: give one")
    if args.schedule is not None:
        known = {name.lower(): name for name in PIPELINE_SCHEDULES}
        if args.schedule.lower() not in known:
            raise ShardtrainError(
                f"--schedule {args.schedule!r} is not built; use one of {', '.join(PIPELINE_SCHEDULES)}"
            )
        args.schedule = known[args.schedule.lower()]
        if pp < 2:
            raise ShardtrainError("--schedule names a pipeline schedule: give --pp 2 or more with it")
    if args.stages_per_rank is not None and pp < 2:
        raise ShardtrainError("--stages-per-rank is a pipeline setting: give --pp 2 or more with it")


def _as_json(est: MemoryEstimate) -> dict:
    return {
        "model": est.model,
        "parameters": est.parameters,
        "layout": asdict(est.layout),
        "rows": [asdict(r) for r in est.rows],
        "peak": est.peak,
        "sent_per_step": est.traffic,
        "pipeline_bubble": est.bubble,
        **(est.time.as_dict() if est.time is not None else {}),
    }


def _cluster(args: argparse.Namespace) -> Cluster | None:
    """The cluster the time model runs on: ``--cluster FILE``, or ``--gpu`` with its node shape; None without
    either (and without ``--time``)."""
    if args.cluster and args.gpu:
        raise ShardtrainError("give --cluster FILE or --gpu NAME, not both")
    if args.cluster:
        cluster = read_cluster(args.cluster)
    elif args.gpu:
        cluster = builtin_cluster(args.gpu, args.gpus_per_node or 8, args.nodes or 1)
    elif args.time:
        raise ShardtrainError("--time needs a cluster: --cluster FILE (shardtrain calibrate writes one) or --gpu NAME")
    else:
        return None
    return cluster


def _usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ShardtrainError as err:
        print(f"shardtrain estimate: {err}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    raw = read_config(args.config)
    names = ("world", "micro_batch", "tp", "mics_shard_size", "ep", "sp", "pp", "cp", "seq_len", "jobs")
    for name in (*names, "gpus_per_node", "nodes", "top", "global_batch", "stages_per_rank"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ShardtrainError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    _check_speed_flags(args, raw)
    cluster = _cluster(args)
    world = args.world or (cluster.world if cluster is not None and (args.gpu or args.cluster) else None)
    if args.budget is None:
        layout = replace(layout_from_config(raw, world or 1, args.seq_len, args.checkpointing), **_overrides(args))
        if args.global_batch is not None:
            layout = with_global_batch(layout, args.global_batch)
        est = estimate_memory(
            args.model,
            raw,
            layout=layout,
            optimizer=args.optimizer,
            device_type=args.device,
            activations=not args.state_only,
            progress=None,  # a bar on stderr, on a terminal only
            cluster=cluster,
        )
        limit = _memory_limit(args, cluster, raw)
        fit = _fit(args, raw, layout, est, limit) if limit is not None and not args.state_only else None
        if args.json:
            print(json.dumps({**_as_json(est), **({"fit": fit} if fit is not None else {})}, indent=1))
        else:
            print(est.format())
            if fit is not None:
                print(_fit_text(fit, layout.seq_len))
        return 0
    if args.memory_limit is not None:
        raise ShardtrainError("--memory-limit checks one layout; --budget searches layouts: give one of them")
    budget = parse_bytes(args.budget)
    if args.worlds:
        try:
            worlds = [int(w) for w in args.worlds.split(",")]
        except ValueError:
            raise ShardtrainError(
                f"--worlds {args.worlds!r}: give world sizes separated by commas, e.g. 1,2,4,8"
            ) from None
    else:
        worlds = [world] if world else [1, 2, 4, 8]
    # with a cluster the search ranks by speed, and micro-batch and checkpointing change speed: search them too
    searched = cluster is not None
    sizes = SEARCHED_MICRO_BATCHES if searched and args.micro_batch is None else None
    acs = list(AC_CHECKPOINTING.values()) if searched and args.ac is None and not args.checkpointing else None
    fits = fitting_layouts(
        args.model,
        budget,
        raw,
        worlds=worlds,
        seq_len=args.seq_len,
        checkpointing=args.checkpointing,
        optimizer=args.optimizer,
        device_type=args.device,
        offload=not args.no_offload,
        activations=not args.state_only,
        progress=None,
        workers=args.jobs or _usable_cpus(),
        cluster=cluster,
        micro_batch_sizes=sizes,
        checkpointings=acs,
        global_batch=args.global_batch,
        **{k: v for k, v in _overrides(args).items() if k in SEARCH_OVERRIDES},
    )
    if args.json:
        print(json.dumps([_as_json(e) for e in fits], indent=1))
        return 0 if fits else 1
    if not fits:
        print(f"no layout with world sizes {worlds} fits {fmt_bytes(budget)} of device memory per rank")
        return 1
    if cluster is not None:
        _print_ranked(fits, budget, args.top)
        return 0
    print(f"layouts that fit {fmt_bytes(budget)} of device memory per rank, fewest ranks first, then least memory:")
    print(f"  {'device':>11} {'host':>11} {'nvme':>11}  layout")
    for e in fits:
        sizes = " ".join(f"{fmt_bytes(e.peak[where]):>11}" for where in ("device", "host", "nvme"))
        print(f"  {sizes}  {e.layout.describe()}")
    return 0


def _memory_limit(args: argparse.Namespace, cluster: Cluster | None, raw: dict) -> int | None:
    """``--memory-limit``, else the config's ``memory_budget_gib`` (``policy: "budget"``: the choice ``initialize``
    would make), else with ``--gpu`` the GPU's memory; None: no limit to check."""
    if args.memory_limit is not None:
        return parse_bytes(args.memory_limit)
    ac = raw.get("activation_checkpointing") or {}
    if ac.get("policy") == "budget" and isinstance(ac.get("memory_budget_gib"), (int, float)):
        return int(ac["memory_budget_gib"] * 2**30)
    if args.gpu and cluster is not None:
        return int(cluster.gpu.hbm_gib * 2**30)
    return None


def _fit(args: argparse.Namespace, raw: dict, layout, est: MemoryEstimate, limit: int) -> dict:
    """Whether the layout fits ``limit``, and when it does not the cheapest activation setting that does
    ([Note: checkpointing by budget] in estimate/activation_budget.py); None in ``setting``: none does."""
    peak = predicted_peak(est)
    out: dict = {"limit": limit, "peak": peak, "fits": peak <= limit}
    if peak > limit:
        choice = fitting_checkpointing(
            args.model, raw, layout, limit, device_type=args.device, optimizer=args.optimizer
        )
        out["setting"] = choice.as_dict() if choice is not None else None
        if choice is not None:
            out["setting"]["config"] = _section_of(choice.as_dict(), limit, layout.seq_len)
    return out


def _section_of(setting: dict, limit: int, seq_len: int) -> dict:
    """The ``activation_checkpointing`` section that asks for ``setting``."""
    policy = setting["setting"].split(",")[0]
    section: dict = {"policy": policy}
    if policy == "budget":
        # up to the next 1e-6 GiB (about 1 KiB): a budget rounded down might not fit the rung chosen here
        section.update(memory_budget_gib=math.ceil(limit / 2**30 * 1e6) / 1e6, budget_seq_len=seq_len)
    if setting["cpu_checkpointing"]:
        section["cpu_checkpointing"] = True
    return section


def _fit_text(fit: dict, seq_len: int) -> str:
    head = f"memory limit {fmt_bytes(fit['limit'])} per rank: the predicted peak {fmt_bytes(fit['peak'])} "
    if fit["fits"]:
        return head + "fits"
    setting = fit["setting"]
    if setting is None:
        return head + (
            "does not fit, and no activation checkpointing setting makes it fit (every block full, inputs in host "
            "memory included): shard more, or shorten the sequence or the micro-batch"
        )
    blocks = describe_blocks(tuple(setting["per_block"]))
    host = f", host {fmt_bytes(setting['host_bytes'])} of block inputs" if setting["cpu_checkpointing"] else ""
    return (
        head + f"does not fit; the cheapest activation setting that fits: {setting['setting']} ({blocks}): predicted "
        f'peak {fmt_bytes(setting["peak"])}{host}\n  "activation_checkpointing": {json.dumps(setting["config"])}'
    )


SEARCH_OVERRIDES = ("dtype", "micro_batch", "sp", "pp", "cp", "checkpointing", "fp8", "compile", "schedule")
SEARCH_OVERRIDES += ("stages_per_rank", "tp_style")
"""The options a ``--budget`` search keeps fixed for every layout it tries."""


def _print_ranked(fits: list[MemoryEstimate], budget: int, top: int) -> None:
    """The fastest ``top`` layouts that fit, each after the first with what makes it slower."""
    print(
        f"{len(fits)} layouts fit {fmt_bytes(budget)} of device memory per rank; the fastest {min(top, len(fits))} "
        "by predicted tokens/s per GPU:"
    )
    best = fits[0].time
    assert best is not None
    for i, e in enumerate(fits[:top]):
        t = e.time
        assert t is not None
        print(
            f"  {i + 1}. {t.tokens_per_s_per_gpu:>12,.0f} tokens/s/GPU  step {t.step_time_s * 1e3:9.2f} ms  "
            f"MFU {t.mfu:6.1%}  device {fmt_bytes(e.peak['device']):>11}  {e.layout.describe()}"
        )
        if i:
            print(
                f"       slower than 1. by {1 - t.tokens_per_s_per_gpu / best.tokens_per_s_per_gpu:.0%}: "
                f"{why_slower(best, t)}"
            )
