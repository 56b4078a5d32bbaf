"""Fuzzed checkpoints: a small checkpoint holding every slice kind (tensor-parallel blocks, ZeRO fragments, fragments of
blocks, a scalar, an object file), damaged by generated operations (manifest and safetensors-header values replaced
or deleted, hostile piece paths, permuted shapes, flipped bytes, truncation, FIFOs, directories, symlink loops and
symlinks out in place of files), then opened, verified, read and consolidated by the library and by ``shardtrain
checkpoint inspect --verify|consolidate``.

The property: every outcome is the right answer (each tensor read, and each consolidated one, equals the undamaged
checkpoint's) or a ``CheckpointError`` naming the checkpoint (exit status 2 from the command, 1 for damage
``--verify`` found); never another exception (a traceback), a read that blocks (each example runs under an alarm),
a file opened outside the checkpoint directory (an audit hook records every ``open``), or exit 0 from ``--verify`` on
a checkpoint that a read then finds damaged.

Examples are derandomized (the same every run); the default run is bounded, ``-m soak`` runs many more.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from shardtrain.checkpoint import BlockFlatSlice, BlockSlice, FlatSlice, SavePiece, open_checkpoint, save
from shardtrain.checkpoint.consolidate import consolidate
from shardtrain.cli import main as cli_main
from shardtrain.errors import CheckpointError

from helpers.reliability import walk_and_set

TAG = "t"
FILES = ("manifest.json", "rank00000.safetensors", "objects.safetensors")
FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)


def _pieces() -> list[SavePiece]:
    g = torch.Generator().manual_seed(0)
    a, c = torch.randn(4, 6, generator=g), torch.randn(6, 4, generator=g)
    b, b_avg = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    pieces = []
    for i in range(2):  # row blocks, and the same for the state
        pieces.append(SavePiece("model/a", (4, 6), BlockSlice(0, i, 2), a[2 * i : 2 * i + 2]))
        pieces.append(SavePiece("optim/a/exp_avg", (4, 6), BlockSlice(0, i, 2), 2 * a[2 * i : 2 * i + 2]))
    for start, length in ((0, 5), (5, 7)):  # ZeRO fragments
        pieces.append(SavePiece("model/b", (3, 4), FlatSlice(start, length), b.reshape(-1)[start : start + length]))
        state = b_avg.reshape(-1)[start : start + length]
        pieces.append(SavePiece("optim/b/exp_avg", (3, 4), FlatSlice(start, length), state))
    pieces.append(SavePiece("optim/b/step", (), FlatSlice(0, 1), torch.tensor([3.0])))
    for i in range(2):  # column blocks of c (6, 4), each in two fragments
        block = c[:, 2 * i : 2 * i + 2].reshape(-1)
        for start, length in ((0, 5), (5, 7)):
            where = BlockFlatSlice(BlockSlice(1, i, 2), start, length)
            pieces.append(SavePiece("model/c", (6, 4), where, block[start : start + length]))
            pieces.append(SavePiece("optim/c/exp_avg", (6, 4), where, -block[start : start + length]))
    d = torch.randn(5, 2, generator=g)  # a buffer: stored whole, no optimizer state
    pieces.append(SavePiece("model/d", (5, 2), FlatSlice(0, 10), d.reshape(-1)))
    return pieces


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The undamaged checkpoint, what it reads as, and what it consolidates to."""
    root = tmp_path_factory.mktemp("pristine")
    save(
        root,
        TAG,
        None,
        _pieces(),
        global_objects={
            "step": 3,
            "optimizer/state_kinds": {"exp_avg": "elementwise", "step": "scalar"},
            "client_state": {"ema": torch.arange(3.0)},  # a tensor: an object file
        },
    )
    reader = open_checkpoint(root)
    tensors = {name: reader.read(name) for name in reader.manifest.tensors}
    consolidate(reader, root / "out", progress=False)
    return root, tensors, load_file(root / "out" / "model.safetensors")


# -- what is generated ------------------------------------------------------------------------------------------
HOSTILE_NAMES = [
    "../rank00000.safetensors",
    "../../outside/secret.safetensors",
    "/etc/passwd",
    "./rank00000.safetensors",
    "a/../rank00000.safetensors",
    "",
    "rank00000.safetensors\x00",
    "objects.safetensors",
    "rank00000.safetensors",
    "manifest.json",
    "missing.safetensors",
]
_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 40),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=6),
    st.sampled_from(HOSTILE_NAMES),
    st.sampled_from(["F32", "F16", "I64", "float32", "int64", "bool", "flat", "block", "block_flat"]),
)
values = st.recursive(
    _leaves,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
walks = st.lists(st.integers(0, 40), min_size=1, max_size=7)
operations = st.one_of(
    st.tuples(st.just("manifest"), walks, st.booleans(), values),
    st.tuples(st.just("header"), walks, st.booleans(), values, st.booleans()),  # last: record the new size
    st.tuples(st.just("permute"), st.integers(0, 10)),
    st.tuples(st.just("rename"), st.sampled_from(FILES[1:]), st.sampled_from(HOSTILE_NAMES)),
    st.tuples(st.just("flip"), st.sampled_from(FILES), st.integers(0, 1 << 16), st.integers(0, 7)),
    st.tuples(st.just("truncate"), st.sampled_from(FILES), st.integers(0, 1 << 16)),
    st.tuples(st.just("append"), st.sampled_from(FILES[1:]), st.binary(min_size=1, max_size=16)),
    st.tuples(
        st.just("replace"),
        st.sampled_from(FILES),
        st.sampled_from(["fifo", "directory", "symlink loop", "symlink out", "missing", "deep json"]),
    ),
)
examples_of = st.lists(operations, min_size=1, max_size=3)


# -- applying it ------------------------------------------------------------------------------------------------
def _split_header(raw: bytes) -> tuple[Any, bytes] | None:
    try:
        (n,) = struct.unpack("<Q", raw[:8])
        return json.loads(raw[8 : 8 + n]), raw[8 + n :]
    except (struct.error, ValueError, RecursionError):
        return None


def _materialize(ckpt: Path, outside: Path, ops: list) -> None:
    files = {name: (ckpt / name).read_bytes() for name in FILES}
    special: dict[str, str] = {}
    for op in ops:
        kind, *args = op
        manifest = _split_manifest(files.get("manifest.json"))
        if kind == "manifest" and manifest is not None:
            files["manifest.json"] = json.dumps(walk_and_set(manifest, *args)).encode()
        elif kind == "header" and "rank00000.safetensors" in files:
            walk, delete, value, record_size = args
            parsed = _split_header(files["rank00000.safetensors"])
            if parsed is None:
                continue
            text = json.dumps(walk_and_set(parsed[0], walk, delete, value)).encode()
            text += b" " * (-len(text) % 8)
            files["rank00000.safetensors"] = struct.pack("<Q", len(text)) + text + parsed[1]
            if record_size and isinstance(manifest, dict):
                with contextlib.suppress(KeyError, TypeError):
                    manifest["files"]["rank00000.safetensors"]["size"] = len(files["rank00000.safetensors"])
                    files["manifest.json"] = json.dumps(manifest).encode()
        elif kind == "permute" and isinstance(manifest, dict):
            with contextlib.suppress(KeyError, TypeError, AttributeError, IndexError):
                entries = sorted(manifest["tensors"].items())
                name, entry = entries[args[0] % len(entries)]
                entry["shape"] = entry["shape"][::-1]
                files["manifest.json"] = json.dumps(manifest).encode()
        elif kind == "rename" and isinstance(manifest, dict):  # a file's name, everywhere the manifest uses it
            old, new = args
            text = files["manifest.json"].decode("utf-8", "replace")
            files["manifest.json"] = text.replace(json.dumps(old), json.dumps(new)).encode()
        elif kind == "flip" and args[0] in files and files[args[0]]:
            name, pos, bit = args
            data = bytearray(files[name])
            data[pos % len(data)] ^= 1 << bit
            files[name] = bytes(data)
        elif kind == "truncate" and args[0] in files:
            files[args[0]] = files[args[0]][: args[1] % (len(files[args[0]]) + 1)]
        elif kind == "append" and args[0] in files:
            files[args[0]] += args[1]
        elif kind == "replace":
            special[args[0]] = args[1]
            files.pop(args[0], None)
    for name, data in files.items():
        (ckpt / name).write_bytes(data)
    for name, what in special.items():
        path = ckpt / name
        path.unlink(missing_ok=True)
        if what == "fifo":
            os.mkfifo(path)
        elif what == "directory":
            path.mkdir()
        elif what == "symlink loop":
            path.symlink_to(name)
        elif what == "symlink out":  # the intact file, but outside the directory
            shutil.copy(outside / "pristine" / name, outside / name)
            path.symlink_to(outside / name)
        elif what == "deep json":
            path.write_bytes(b"[" * 100_000 + b"]" * 100_000)


def _split_manifest(raw: bytes | None) -> Any:
    try:
        return json.loads(raw) if raw is not None else None
    except (ValueError, RecursionError):
        return None


# -- watching it ------------------------------------------------------------------------------------------------
class _Watch:
    """Every path ``open``ed while a case runs (an audit hook: it cannot be removed, so it records only when on)."""

    on = False
    opened: list[str] = []  # noqa: RUF012  # one process-wide record

    @classmethod
    def install(cls) -> None:
        if not getattr(sys, "_shardtrain_fuzz_watch", False):
            sys.addaudithook(cls._hook)
            sys._shardtrain_fuzz_watch = True  # type: ignore[attr-defined]

    @classmethod
    def _hook(cls, event: str, args: tuple) -> None:
        if cls.on and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            cls.opened.append(os.fsdecode(args[0]))


@contextlib.contextmanager
def _alarm(seconds: float):
    def expired(signum, frame):
        raise AssertionError(f"still running after {seconds} s: a read blocked or did not end")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _named(err: CheckpointError, root: Path) -> None:
    assert str(root) in str(err), f"the error names no file of the checkpoint: {err}"


# Tensors stored in 1-D pieces (ZeRO fragments, fragments of blocks, a buffer stored whole) are no exception: the
# writer records each piece's global shape in its file (safetensors_io.GLOBAL_SHAPES_KEY), so a manifest whose shape
# was permuted is contradicted by the files like any other.
ONE_D_PIECES: set[str] = set()


def _check_answer(name: str, got: torch.Tensor, want: torch.Tensor, verified: bool | None) -> None:
    if name in ONE_D_PIECES and got.shape != want.shape and got.numel() == want.numel():
        got, want = got.reshape(-1).sort().values, want.reshape(-1).sort().values  # the saved elements, moved
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), (
        f"{name} read as {got.dtype} {tuple(got.shape)}, saved as {want.dtype} {tuple(want.shape)} "
        f"(verify {'passed' if verified else 'found problems'})"
    )


def _run_case(root: Path, ckpt_dir: Path, out: Path, tensors: dict, model: dict) -> None:
    """The library's and the command's outcomes on the checkpoint in ``root``; asserts the property."""
    verified = None
    try:
        reader = open_checkpoint(root)
    except CheckpointError as err:
        _named(err, root)
        reader = None
    if reader is not None:
        problems = reader.verify()
        verified = not problems
        for name, want in tensors.items():
            try:
                got = reader.read(name)
            except CheckpointError as err:
                _named(err, root)
                assert not verified or name not in reader.manifest._names, f"verify passed, read failed: {err}"
                continue
            _check_answer(name, got, want, verified)
        try:
            written = consolidate(reader, out / "lib", progress=False)
        except CheckpointError as err:
            _named(err, root)
        else:
            got = load_file(next(p for p in written if p.name == "model.safetensors"))
            for name, t in got.items():
                _check_answer(f"model/{name}", t, model[name], verified)
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = cli_main(["checkpoint", "inspect", "--verify", str(root)])
    assert code in (0, 1, 2)
    assert code != 0 or verified, "inspect --verify exited 0 on a checkpoint the library finds damaged"
    stderr = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = cli_main(["checkpoint", "consolidate", "--no-progress", str(root), str(out / "cli")])
    if code == 0:
        got = load_file(out / "cli" / "model.safetensors")
        for name, t in got.items():
            _check_answer(f"model/{name}", t, model[name], verified)
    else:
        assert code == 2 and len(stderr.getvalue().strip().splitlines()) == 1, stderr.getvalue()


def _fuzz(reference, tmp_path, examples: int) -> None:
    pristine, tensors, model = reference
    _Watch.install()
    outside = tmp_path / "outside"
    shutil.copytree(pristine / TAG, outside / "pristine")
    (outside / "secret.safetensors").write_bytes((pristine / TAG / "rank00000.safetensors").read_bytes())
    root = tmp_path / "case"

    @settings(FUZZ, max_examples=examples)
    @given(examples_of)
    def case(ops):
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(tmp_path / "out", ignore_errors=True)
        shutil.copytree(pristine, root, ignore=shutil.ignore_patterns("out"), copy_function=shutil.copy)
        _materialize(root / TAG, outside, ops)
        _Watch.opened.clear()
        _Watch.on = True
        try:
            with _alarm(20):
                _run_case(root, root / TAG, tmp_path / "out", tensors, model)
        finally:
            _Watch.on = False
        inside = (os.path.realpath(root / TAG), os.path.realpath(tmp_path / "out"), os.path.realpath(root / "latest"))
        for path in _Watch.opened:
            real = os.path.realpath(path)
            # the library's own modules may be imported lazily; everything else opened must be in the checkpoint
            if real.startswith(os.path.realpath(tmp_path)) or real.startswith("/etc"):
                assert real.startswith(inside), f"opened {path} ({real}), outside the checkpoint"

    case()


@pytest.mark.parametrize("examples", [pytest.param(60, id="60"), pytest.param(3000, marks=pytest.mark.soak, id="3000")])
def test_damaged_checkpoints_give_named_errors_or_the_right_answer(reference, tmp_path, examples):
    _fuzz(reference, tmp_path, examples)
