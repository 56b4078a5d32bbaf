"""``shardtrain calibrate``: measure this machine and write the profile ``shardtrain estimate --cluster`` reads."""

from __future__ import annotations

import argparse
import json
import sys

from shardtrain.errors import ShardtrainError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Measure this machine (matmul rate by shape, attention, memory bandwidth, per-operator host time, gloo "
        "all-reduce latency, bandwidth and overlap at --world ranks) and write a cluster profile for "
        "shardtrain estimate --cluster (src/shardtrain/estimate/calibrate.py says how each is measured)."
    )
    parser.add_argument("--out", required=True, help="the profile file to write (JSON)")
    parser.add_argument("--world", type=int, default=2, help="ranks the collectives are measured at (default 2)")
    parser.add_argument("--threads", type=int, help="torch threads per process (default: torch's)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shardtrain.estimate.calibrate import calibrate, write_profile
    from shardtrain.estimate.cluster import cluster_from_dict

    try:
        if args.world < 1:
            raise ShardtrainError(f"--world must be at least 1, got {args.world}")
        profile = calibrate(args.world, args.threads)
        cluster_from_dict(profile, "the measured profile")  # what --cluster will read: refused here, not later
    except ShardtrainError as err:
        print(f"shardtrain calibrate: {err}", file=sys.stderr)
        return 2
    write_profile(profile, args.out)
    print(json.dumps(profile, indent=1))
    return 0
