"""The ``shardtrain`` command (also ``python -m shardtrain``): one module per subcommand (:mod:`.checkpoint`,
:mod:`.config_check`, :mod:`.estimate`, :mod:`.calibrate`, :mod:`.demo`; ``compare`` is
:mod:`shardtrain.debug.compare`'s); this module only dispatches.
"""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from torch.distributed.run import main as torchrun

    torchrun(["--standalone", f"--nproc_per_node={args.nproc}", "-m", "shardtrain.cli.demo", *args.demo_args])
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardtrain", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train a small GPT with ZeRO stage 2 on local processes")
    demo.add_argument("--nproc", type=int, default=2, help="number of processes (default 2)")
    demo.add_argument("demo_args", nargs=argparse.REMAINDER, help="arguments passed to the demo script")
    demo.set_defaults(func=_demo)

    from shardtrain.debug import compare

    cmp = sub.add_parser("compare", help="compare two runs' statistics and point at the first divergence")
    compare.add_arguments(cmp)
    cmp.set_defaults(func=compare.run)

    from shardtrain.cli import checkpoint as checkpoint_cli

    ckpt = sub.add_parser("checkpoint", help="inspect, verify or consolidate a checkpoint")
    checkpoint_cli.add_arguments(ckpt)

    from shardtrain.cli import config_check

    cfg = sub.add_parser("config", help="check DeepSpeed config files: what is supported, ignored or refused")
    config_check.add_arguments(cfg)

    from shardtrain.cli import estimate as estimate_cli

    est = sub.add_parser("estimate", help="memory per rank for a model and layout, or the layouts that fit a budget")
    estimate_cli.add_arguments(est)

    from shardtrain.cli import calibrate as calibrate_cli

    cal = sub.add_parser("calibrate", help="measure this machine and write a cluster profile for estimate --cluster")
    calibrate_cli.add_arguments(cal)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
