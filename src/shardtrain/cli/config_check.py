"""``shardtrain config check FILE... [--world-size N]``: can shardtrain use these DeepSpeed configs?

For each file: ``ok``, or every problem with its key path; then the keys without effect (accepted without effect,
or supported but doing nothing in the combination the file gives: see
:data:`shardtrain.config.deepspeed_keys.NO_EFFECT_WHEN`) and the ``"auto"`` values ``initialize`` will resolve (and from
what). ``--world-size N`` also checks the layout at N ranks as ``initialize`` would (``tensor_parallel.size``,
``sequence_parallel_size``, ``mics_shard_size``, ``zero_hpz_partition_size``) and the batch sizes against the
data-parallel size it gives, N / (tp x sp). ``--device cuda|cpu`` also says what ``initialize`` would refuse on
devices of that type (e.g. ``offload_param`` on CUDA) and which offload keys would do nothing there. Exit status: 0
when every file is usable, 2 otherwise (bad input, as every ``shardtrain`` command).
"""

from __future__ import annotations

import argparse

from shardtrain.config.plan import ineffective_offload_keys, refuse_fp8_on_device, refuse_on_device, resolve_plan
from shardtrain.config.sections import inspect_config, resolve_batch_sizes
from shardtrain.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="config_command", required=True)
    check = sub.add_parser("check", help="report, per file, what shardtrain does with each DeepSpeed key")
    check.add_argument("files", nargs="+", metavar="FILE", help="DeepSpeed config files (.json, .yaml)")
    check.add_argument(
        "--world-size", type=int, help="also check the layout and the batch sizes at N ranks (dp = N / (tp x sp))"
    )
    check.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        help="also check what initialize refuses, and which offload keys do nothing, on devices of this type",
    )
    check.add_argument("--quiet", "-q", action="store_true", help="print only the verdict and the problems")
    check.set_defaults(func=check_files)


def check_file(path: str, world_size: int | None = None, device: str | None = None) -> tuple[bool, list[str]]:
    """(usable, report lines) for one file: the config's own problems, then the plan ``initialize`` would build
    from it (:func:`~shardtrain.config.plan.resolve_plan`) at ``world_size`` ranks on ``device``."""
    report = inspect_config(path)
    problems, no_effect = list(report.problems), list(report.no_effect)
    if report.config is not None and device is not None:
        try:
            refuse_on_device(report.config, device)
            refuse_fp8_on_device(report.config, device)
        except ConfigError as err:
            problems.append(f"{err} (device {device}: initialize refuses it)")
        no_effect += [f"{note} (device {device})" for note in ineffective_offload_keys(report.config, device)]
    if report.config is not None and world_size is not None:
        cfg = report.config
        batch_keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
        try:
            dp = resolve_plan(cfg, world_size).dims.dp
            if not any(k in report.autos for k in batch_keys):  # "auto" batch sizes are derived to fit
                resolve_batch_sizes(cfg, dp)
        except ConfigError as err:
            problems.append(f"{err} (world size {world_size})")
    lines = [f"{path}: ok" if not problems else f"{path}: {len(problems)} problem(s)"]
    lines += [f"  error  {p}" for p in problems]
    lines += [f"  warning  {w}" for w in report.warnings]
    lines += [f"  no effect  {n}" for n in no_effect]
    lines += [f'  "auto"  {key}: resolved at initialize from {source}' for key, source in report.autos.items()]
    return not problems, lines


def check_files(args: argparse.Namespace) -> int:
    if args.world_size is not None and args.world_size < 1:
        print("shardtrain config check: --world-size must be at least 1")
        return 2
    all_ok = True
    for path in args.files:
        ok, lines = check_file(path, args.world_size, args.device)
        all_ok &= ok
        if args.quiet:
            lines = [line for line in lines if not line.startswith(("  no effect", '  "auto"'))]
        print("\n".join(lines))
    return 0 if all_ok else 2
