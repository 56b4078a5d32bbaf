"""``shardtrain compare RUN_A RUN_B``: placeholder until the debugging issue lands."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_a")
    parser.add_argument("run_b")


def run(args: argparse.Namespace) -> int:
    raise SystemExit("shardtrain compare is not available yet")
