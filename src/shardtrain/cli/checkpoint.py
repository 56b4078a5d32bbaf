"""``shardtrain checkpoint inspect DIR [--verify]`` and ``shardtrain checkpoint consolidate DIR OUT [...]``.

``DIR`` is a save directory (the checkpoint ``latest`` names, or ``--tag``) or one checkpoint directory, of
shardtrain or of DeepSpeed (``save_checkpoint``'s directories are read as they are, see ``deepspeed_reader.py``).
Exit status: 0 on success, 1 when ``--verify`` found damage, 2 for bad input (missing or unreadable checkpoint, a
malformed manifest or header, a file that is not a regular file inside the checkpoint, an output that cannot be
written), with one line naming the file and what is wrong.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

from tqdm import tqdm

from shardtrain.checkpoint.format import BlockFlatSlice, BlockSlice, FlatSlice, TensorEntry
from shardtrain.errors import CheckpointError, ShardtrainError, UnsafePickleError


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def describe_layout(entry: TensorEntry) -> str:
    """How a tensor's pieces split it, e.g. ``tp: dim 0, 2 blocks, stride 3 | zero: 4 fragments per block``."""
    flats = [p.slice for p in entry.pieces if isinstance(p.slice, FlatSlice)]
    if len(flats) == len(entry.pieces) == 1:
        return "whole"
    parts = [f"zero: {len(flats)} fragments"] if flats else []
    # per tensor-parallel split (dim, count, stride): the number of pieces of each block (1 = stored whole)
    splits: dict[tuple[int, int, int], Counter] = {}
    for p in entry.pieces:
        block = p.slice.block if isinstance(p.slice, BlockFlatSlice) else p.slice
        if isinstance(block, BlockSlice):
            splits.setdefault((block.dim, block.count, block.stride), Counter())[block.index] += 1
    for (dim, count, stride), per_block in splits.items():
        text = f"tp: dim {dim}, {count} blocks" + (f", stride {stride}" if stride > 1 else "")
        if len(per_block) < count:
            text += f" ({len(per_block)} stored this way)"
        low, high = min(per_block.values()), max(per_block.values())
        if high > 1:
            text += f" | zero: {low if low == high else f'{low}-{high}'} fragments per block"
        parts.append(text)
    return "; ".join(parts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="checkpoint_command", required=True)
    ins = sub.add_parser("inspect", help="print topology, step, objects and tensors; --verify checks every checksum")
    ins.add_argument("dir", help="save directory (uses 'latest') or checkpoint directory")
    ins.add_argument("--tag", help="checkpoint tag inside DIR (default: the one 'latest' names)")
    ins.add_argument("--verify", action="store_true", help="read every piece and compare its checksum")
    ins.set_defaults(func=_bad_input_is_2(inspect))
    con = sub.add_parser("consolidate", help="write Hugging Face-style safetensors (and optionally optimizer state)")
    con.add_argument("dir", help="save directory (uses 'latest') or checkpoint directory")
    con.add_argument("out", help="output directory")
    con.add_argument("--tag", help="checkpoint tag inside DIR (default: the one 'latest' names)")
    con.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="convert floating-point tensors")
    con.add_argument("--max-shard-size", default="2GB", help="largest output file, e.g. 2GB, 500MB (default 2GB)")
    con.add_argument("--optimizer", action="store_true", help="also write optimizer.pt (a torch optimizer state dict)")
    con.add_argument(
        "--merge-adapters",
        action="store_true",
        help="peft run: fold the adapters into the base weights (the default for a peft run)",
    )
    con.add_argument(
        "--adapters-only",
        action="store_true",
        help="peft run: write only the adapters, as PeftModel.save_pretrained does",
    )
    con.add_argument("--no-progress", action="store_true", help="no progress bar")
    con.set_defaults(func=_bad_input_is_2(consolidate_cmd))


def _bad_input_is_2(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``command``, with shardtrain's named errors and OS errors (which name their path) as one line and exit
    status 2: the documented code for bad input, never a traceback with 1 (CI reads 1 as "damage found")."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except (ShardtrainError, OSError) as err:
            # one line: characters from a damaged file (a newline, a carriage return) are shown escaped
            text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(err))
            print(f"shardtrain checkpoint: error: {text}", file=sys.stderr)
            return 2

    return run


def inspect(args: argparse.Namespace) -> int:
    from shardtrain.checkpoint.reader import open_checkpoint

    try:
        reader = open_checkpoint(args.dir, args.tag)
    except CheckpointError as err:
        print(f"shardtrain checkpoint: error: {err}", file=sys.stderr)
        return 2
    m = reader.manifest
    foreign = getattr(reader, "format_name", None)  # DeepSpeed and DCP directories have no format version of ours
    print(f"checkpoint {reader.path} ({foreign or f'format version {m.version}'})")
    if not hasattr(m, "files"):  # a DCP checkpoint: tensors as boxes of chunks, no files or objects of ours
        return _inspect_chunked(reader, args.verify)
    print(f"tag: {m.tag}   saved by {m.world_size} rank(s)   files: {len(m.files)}")
    try:
        objects = reader.objects
    except UnsafePickleError as err:  # a tampered or foreign file: refused, not shown as mere damage
        print(f"shardtrain checkpoint: error: {err}", file=sys.stderr)
        return 2
    except CheckpointError as err:
        objects = {}
        print(f"objects: unreadable ({err})")
    for key in ("step", "topology"):
        if key in objects:
            print(f"{key}: {objects[key]}")
    topology = objects.get("engine/topology") or {}
    if topology.get("format") == "deepspeed":  # read through DeepSpeedReader (see deepspeed_reader.py)
        print(
            f"written by DeepSpeed {topology.get('ds_version')}: ZeRO stage {topology.get('zero_stage')}, "
            f"{topology.get('dp')} data-parallel rank(s)"
            + (f", {topology['pp']} pipeline stage(s) (layer files)" if topology.get("pp", 1) > 1 else "")
            + f"; counters {objects.get('engine/counters')}"
        )
    print(f"global objects: {', '.join(sorted(m.objects)) or '-'}")
    per_rank = sorted({k for objs in m.rank_objects.values() for k in objs})
    print(f"per-rank objects: {', '.join(per_rank) or '-'}")
    total = sum(e.nbytes for e in m.tensors.values())
    print(f"tensors: {len(m.tensors)}, {_human(total)}")
    width = max(len(n) for n in m.tensors) if m.tensors else 4
    for name, e in m.tensors.items():
        alias = f"  (also {', '.join(e.aliases)})" if e.aliases else ""
        shape = "x".join(map(str, e.global_shape)) or "scalar"
        pieces = f"{len(e.pieces)} piece(s)"
        layout = describe_layout(e)
        print(f"  {name:<{width}}  {e.dtype:<9} {shape:<16} {_human(e.nbytes):>10}  {pieces:<11} {layout}{alias}")
    if not args.verify:
        return 0
    if foreign:
        return _verify(reader, total, "every file opened and every piece found (DeepSpeed's files carry no checksums)")
    return _verify(reader, total, "all files and checksums OK")


def _verify(reader: Any, total: int, ok: str) -> int:
    """``inspect --verify``: read everything with a progress bar; 1 and every problem, or 0 and ``ok``."""
    with tqdm(total=total, unit="B", unit_scale=True, desc="verify", file=sys.stderr) as bar:
        problems = reader.verify(bar.update)
    if problems:
        print(f"verify: {len(problems)} problem(s)")
        for p in problems:
            print(f"  {p}")
        return 1
    print(f"verify: {ok}")
    return 0


def _inspect_chunked(reader: Any, verify: bool) -> int:
    """``inspect`` of a torch DCP directory: each tensor with the chunks (boxes of the global tensor) it is in."""
    m = reader.manifest
    print(f"tag: {m.tag}   saved by {m.world_size} rank(s)")
    objects = reader.objects
    print(f"objects: {', '.join(sorted(objects)) or '-'}")
    total = sum(e.nbytes for e in m.tensors.values())
    print(f"tensors: {len(m.tensors)}, {_human(total)}")
    width = max(len(n) for n in m.tensors) if m.tensors else 4
    for name, e in m.tensors.items():
        shape = "x".join(map(str, e.global_shape)) or "scalar"
        alias = f"  (also {', '.join(e.aliases)})" if e.aliases else ""
        print(f"  {name:<{width}}  {e.dtype:<9} {shape:<16} {_human(e.nbytes):>10}  {len(e.chunks)} chunk(s){alias}")
    if not verify:
        return 0
    return _verify(reader, total, "every tensor read whole (DCP files carry no checksums)")


def consolidate_cmd(args: argparse.Namespace) -> int:
    from shardtrain.checkpoint.consolidate import DTYPE_CHOICES, consolidate, parse_size
    from shardtrain.checkpoint.reader import open_checkpoint

    try:
        reader = open_checkpoint(args.dir, args.tag)
        files = consolidate(
            reader,
            args.out,
            dtype=DTYPE_CHOICES[args.dtype] if args.dtype else None,
            max_shard_size=parse_size(args.max_shard_size),
            optimizer=args.optimizer,
            progress=not args.no_progress,
            merge_adapters=args.merge_adapters,
            adapters_only=args.adapters_only,
        )
    except CheckpointError as err:
        print(f"shardtrain checkpoint: error: {err}", file=sys.stderr)
        return 2
    for f in files:
        print(f)
    return 0
