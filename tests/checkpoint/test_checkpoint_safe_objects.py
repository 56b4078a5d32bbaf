"""Opening a checkpoint never runs code from it.

New checkpoints store their objects as JSON with tensors in safetensors (no pickle); objects that cannot be stored
that way are refused at save time. Checkpoints of format version 1 (objects pickled) still load, through an
unpickler that admits only what version 1 wrote; a crafted one is refused by name by ``inspect``, ``load_checkpoint``
and consolidation, and its payload never runs.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import shutil
import subprocess
import sys
import zlib
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
import torch.distributed as dist
import torch.storage

from shardtrain.checkpoint import FlatSlice, SavePiece, open_checkpoint, save
from shardtrain.checkpoint.consolidate import consolidate
from shardtrain.checkpoint.objects import load_v1_pickle
from shardtrain.errors import CheckpointError, UnsafePickleError
from shardtrain.testing import run_distributed

from helpers.checkpoint import V1_FIXTURE, v1_client_state, v1_engine

SYSTEM = f"{os.system.__module__}.system"  # how pickle names os.system ('posix.system' on Linux)


class _RunsCommand:
    """Unpickling this runs ``touch marker`` in a shell (what a crafted checkpoint would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _StorageRunsCommand:
    """A "tensor storage" whose ``torch.save`` bytes hold the command: the route plain pickling of tensors opens."""

    def __init__(self, marker: Path) -> None:
        buf = io.BytesIO()
        torch.save(_RunsCommand(marker), buf)
        self.data = buf.getvalue()

    def __reduce__(self):
        return (torch.storage._load_from_bytes, (self.data,))


class _Opaque:
    """A user object with no plain-data form."""


def _same(a, b) -> bool:
    """Equal values of the same types, recursively (nan equals nan, tensors and arrays compared with dtype)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, (float, np.floating)):
        return (math.isnan(a) and math.isnan(b)) or (a == b and (not isinstance(a, np.generic) or a.dtype == b.dtype))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return len(a) == len(b) and all(_same(ka, kb) and _same(a[ka], b[kb]) for ka, kb in zip(a, b))
    return a == b


def _rich_objects() -> dict:
    return {
        "plain": {"lr": 0.1, "names": ["a", "b"], "flag": True, "none": None},
        "client_state": {
            "betas": (0.9, 0.999),
            "non_finite": [float("inf"), float("-inf"), float("nan")],
            3: "an int key",
            (1, "x"): "a tuple key",
            "$type": "a key the encoding itself uses",
            "blob": b"\x00\xffbytes",
            "ema": torch.linspace(0, 1, 5, dtype=torch.bfloat16).reshape(5, 1),
            "view": torch.arange(10.0)[::3],  # not contiguous
            "mask": torch.tensor([True, False]),
            "uint32": np.arange(6, dtype=np.uint32).reshape(2, 3),
            "scalar": np.float32(2.5),
            "nested": [{"deep": (torch.tensor(7, dtype=torch.int64), np.array([1.5]))}],
        },
    }


def _save(tmp_path: Path, **objects) -> Path:
    piece = SavePiece("x", (2,), FlatSlice(0, 2), torch.ones(2))
    save(tmp_path, "t", None, [piece], **objects)
    return tmp_path / "t"


def test_new_checkpoints_hold_no_pickle_and_objects_round_trip(tmp_path):
    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": __import__("random").getstate()}
    ckpt = _save(tmp_path, global_objects=_rich_objects(), rank_objects={"rng": rng})
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == ["manifest.json", "objects.safetensors", "rank00000.objects.safetensors", "rank00000.safetensors"]
    for p in ckpt.iterdir():  # no file is a pickle: each parses as JSON or as safetensors, which a pickle never does
        if p.suffix == ".json":
            json.loads(p.read_text())
        else:
            safetensors.torch.load_file(p)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["version"] == 2
    assert manifest["objects"]["plain"]["encoding"] == "json"
    assert manifest["objects"]["client_state"]["encoding"] == "tagged"
    assert manifest["rank_objects"]["0"]["rng"]["encoding"] == "tagged"
    reader = open_checkpoint(ckpt)
    assert _same(reader.objects, _rich_objects()), reader.objects
    got = reader.rank_objects(0)["rng"]
    assert _same(got, rng)
    np.random.set_state(got["numpy"])  # each library takes its state back
    torch.set_rng_state(got["torch"])
    assert open_checkpoint(ckpt).verify() == []


def test_subclasses_come_back_as_their_base_type(tmp_path):
    ckpt = _save(tmp_path, global_objects={"o": OrderedDict(b=1, a=(2,)), "p": torch.nn.Parameter(torch.ones(2))})
    objects = open_checkpoint(ckpt).objects
    assert type(objects["o"]) is dict and list(objects["o"].items()) == [("b", 1), ("a", (2,))]
    assert type(objects["p"]) is torch.Tensor and torch.equal(objects["p"], torch.ones(2))


@pytest.mark.parametrize(
    "value, where, what",
    [
        ({"cb": _Opaque()}, "client_state['cb']", "_Opaque"),
        ({"seen": {1, 2}}, "client_state['seen']", "builtins.set"),
        ({"fn": [len]}, "client_state['fn'][0]", "builtin_function_or_method"),
        ({_Opaque(): 1}, "client_state", "dict key of type _Opaque"),
        ({"obj": np.array([None, 1], dtype=object)}, "client_state['obj']", "dtype object"),
        ({"z": torch.ones(2, dtype=torch.complex64)}, "client_state['z']", "complex tensor"),
    ],
)
def test_unsupported_objects_are_refused_at_save(tmp_path, value, where, what):
    with pytest.raises(CheckpointError) as info:
        _save(tmp_path, global_objects={"client_state": value})
    message = str(info.value)
    assert f"{where}: " in message and what in message and "nothing was published" in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no checkpoint, no temporary directory, no 'latest'


# -- format version 1 -----------------------------------------------------------------------------------------------


def _crafted_v1(tmp_path: Path, file: str = "objects.pkl", payload: object = None) -> tuple[Path, Path]:
    """A copy of the version-1 fixture (saved by the engine at world 2) whose ``file`` is replaced by a pickle that
    runs ``touch marker``, its size and checksum updated in the manifest. Returns (save dir, marker)."""
    root = tmp_path / "crafted"
    shutil.copytree(V1_FIXTURE, root)
    marker = tmp_path / "MARKER"
    ckpt = root / "v1"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    records = manifest["objects"] if file == "objects.pkl" else manifest["rank_objects"][str(int(file[4:9]))]
    keys = [k for k, r in records.items() if r.get("file") == file]  # the payload under every key the file held
    data = pickle.dumps({k: payload or _RunsCommand(marker) for k in keys})
    (ckpt / file).write_bytes(data)
    manifest["files"][file].update(size=len(data), checksum=f"crc32:{zlib.crc32(data):08x}")
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    return root, marker


def test_the_crafted_payload_runs_under_plain_pickle(tmp_path):
    """The control: what the other tests refuse does run a shell command when unpickled as version 1 did."""
    root, marker = _crafted_v1(tmp_path)
    pickle.loads((root / "v1" / "objects.pkl").read_bytes())
    assert marker.exists()


def _inspect(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "shardtrain", "checkpoint", "inspect", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_inspect_refuses_a_crafted_checkpoint_and_shows_a_version_1_one(tmp_path):
    proc = _inspect(str(V1_FIXTURE), "--verify")
    assert proc.returncode == 0, proc.stderr
    assert "format version 1" in proc.stdout and "verify: all files and checksums OK" in proc.stdout
    root, marker = _crafted_v1(tmp_path)
    proc = _inspect(str(root), "--verify")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert f"{root / 'v1' / 'objects.pkl'}: refused to unpickle {SYSTEM!r}" in proc.stderr, proc.stderr
    assert not marker.exists()


def test_verify_and_consolidate_refuse_a_crafted_checkpoint(tmp_path):
    root, marker = _crafted_v1(tmp_path)
    problems = open_checkpoint(root).verify()
    assert len(problems) == 1 and f"refused to unpickle {SYSTEM!r}" in problems[0], problems
    with pytest.raises(UnsafePickleError, match=f"objects.pkl: refused to unpickle {SYSTEM!r}"):
        consolidate(open_checkpoint(root), tmp_path / "out", progress=False)
    assert not marker.exists()


@pytest.mark.parametrize("file", ["objects.pkl", "rank00001.objects.pkl"])
def test_a_tensor_storage_cannot_smuggle_a_payload(tmp_path, file):
    """A pickled tensor carries its storage as ``torch.save`` bytes: those are read with weights_only=True."""
    marker = tmp_path / "MARKER"
    root, _ = _crafted_v1(tmp_path, file, _StorageRunsCommand(marker))
    data = (root / "v1" / file).read_bytes()
    with pytest.raises(UnsafePickleError, match=f"weights_only=True.*GLOBAL {SYSTEM}"):
        load_v1_pickle(data, file)
    reader = open_checkpoint(root)
    with pytest.raises(UnsafePickleError, match=f"{file}: a pickled tensor's storage"):
        reader.objects if file == "objects.pkl" else reader.rank_objects(1)
    assert not marker.exists()


def _params(engine) -> dict[str, torch.Tensor]:
    """This rank's parameters (whole on every rank at ZeRO-2)."""
    return {k: p.detach().clone() for k, p in engine.module.named_parameters()}


def _load_v1_and_crafted(tmp: str) -> dict:
    """Every rank: load the pristine fixture into an engine of another seed, then three crafted copies."""
    tmp_path = Path(tmp)
    rank = dist.get_rank()
    engine = v1_engine(1)
    before = _params(engine)
    client = engine.load_checkpoint(V1_FIXTURE)
    reader = open_checkpoint(V1_FIXTURE)
    out = {
        "client": client,
        "step": engine.global_step,
        "loaded": _params(engine),
        "saved": {k: reader.read(f"model/{k}") for k in before},
        "rng": torch.equal(torch.get_rng_state(), reader.rank_objects(rank)["rng"]["torch"]),
        "changed": any(not torch.equal(before[k], v) for k, v in _params(engine).items()),
        "refusals": {},
    }
    x = torch.randn(2, 3)
    engine.backward(engine(x).square().mean())  # training goes on from the loaded state
    engine.step()
    for file in ("objects.pkl", "rank00001.objects.pkl"):
        crafted = tmp_path / file
        if rank == 0:
            _crafted_v1(crafted, file)
        dist.barrier()
        fresh = v1_engine(2)
        before = _params(fresh)
        try:
            fresh.load_checkpoint(crafted / "crafted")
            message = "no error"
        except CheckpointError as err:
            message = str(err)
        out["refusals"][file] = {
            "message": message,
            "marker": (crafted / "MARKER").exists(),
            "untouched": all(torch.equal(before[k], v) for k, v in _params(fresh).items()),
        }
    return out


def test_load_checkpoint_reads_version_1_and_refuses_a_crafted_one(tmp_path):
    results = run_distributed(_load_v1_and_crafted, 2, str(tmp_path))
    for rank, out in enumerate(results):
        assert _same(out["client"], v1_client_state()), out["client"]
        assert out["step"] == 2 and out["rng"] and out["changed"]
        for k, v in out["saved"].items():
            assert torch.equal(out["loaded"][k], v), k
        for file, failing in (("objects.pkl", [0, 1]), ("rank00001.objects.pkl", [1])):
            refusal = out["refusals"][file]
            assert not refusal["marker"], (rank, file)
            if rank in failing:  # refused before its engine was touched (another rank may have loaded its part)
                assert refusal["untouched"], (rank, file)
            message = refusal["message"]
            for r in failing:
                assert f"rank {r} failed to load checkpoint" in message, (rank, message)
            assert message.count("failed to load") == len(failing), message
            assert f"{file}: refused to unpickle {SYSTEM!r}" in message, message
