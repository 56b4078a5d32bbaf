"""Collective, crash-safe checkpoint save: every rank writes its pieces in parallel, rank 0 publishes.

Protocol (every rank calls :func:`save` with the same ``save_dir`` and ``tag``; ``docs/checkpoint-format.md`` has
the full argument):

1. rank 0 validates the tag, claims the directory for this job ([Note: one job per save directory] in
   ``owner.py``; another job's directory is refused here, untouched), finishes a publish a crash interrupted
   (``latest.recover``), refuses an existing tag unless ``overwrite`` or it may be replaced (:func:`_replaceable`),
   removes leftovers of crashed saves (``.tmp-*``, ``.trash-*``) and creates ``.tmp-<tag>``;
2. one ``all_gather_object`` shares the piece descriptors (and rank 0's outcome of step 1); every rank then computes
   the same plan: which rank stores each replicated piece (the lowest that holds it), whether shapes and dtypes
   agree, whether the pieces cover every tensor exactly once;
3. every rank writes ``rank<r>.safetensors`` (its planned pieces; CRC-32 computed during the fsync) and
   ``rank<r>.objects.safetensors`` (the tensors and arrays its per-rank objects hold, if any: [Note: checkpoint
   objects]), rank 0 also ``objects.safetensors`` for the global objects; each file is fsynced; a second gather
   shares sizes and checksums, and every rank checks that replicas agree;
4. rank 0 writes ``manifest.json`` (fsync) and fsyncs the directory; writes ``latest.tmp`` naming the tag, fsyncs it
   and ``save_dir`` (the save is committed); renames the directory to ``<tag>`` (an existing one aside first),
   renames ``latest.tmp`` over ``latest`` and fsyncs ``save_dir`` ([Note: the publish journal] in ``latest.py``);
5. a third gather returns rank 0's outcome, so that every rank returns (or raises) only once the checkpoint is
   complete.

A failure on any rank in steps 1-4 (any exception, not only I/O errors) is carried in the next gather, so that every
rank raises the same :class:`CheckpointError`, naming the failing ranks and causes, instead of hanging in a
collective; the temporary directory is removed and nothing is published.

Steps 1-2 are :func:`prepare` and steps 3-5 :func:`commit`; an asynchronous save runs the commit in a background
thread ([Note: asynchronous checkpoints] in ``async_save.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from shardtrain.checkpoint.durable import crash_point, fsync_path, naming, write_object_file
from shardtrain.checkpoint.format import (
    FORMAT_VERSION,
    LATEST_NAME,
    MANIFEST_NAME,
    FileEntry,
    FlatSlice,
    Manifest,
    ObjectRecord,
    Slice,
    crc32_of,
    dtype_name,
)
from shardtrain.checkpoint.latest import (
    JOURNAL_NAME,
    TMP_PREFIX,
    TRASH_PREFIX,
    PublishError,
    complete_checkpoint_problem,
    finish_publish,
    read_latest,
    recover,
    write_journal,
)
from shardtrain.checkpoint.objects import TaggedEncoder, encode_tensor_file
from shardtrain.checkpoint.owner import SaveDirInUseError, SaveDirOwner
from shardtrain.checkpoint.plan import piece_keys, plan_pieces, rank_file, tensor_entries
from shardtrain.checkpoint.safetensors_io import GLOBAL_SHAPES_KEY, write_streaming
from shardtrain.distributed.communicator import Communicator
from shardtrain.errors import CheckpointError

log = logging.getLogger("shardtrain")

_TAG_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.=-]*")


@dataclass(frozen=True)
class SavePiece:
    """What one rank holds of a logical tensor: ``tensor`` is the part ``slice`` of a tensor of ``global_shape``.

    The logical dtype is ``tensor.dtype``. A piece held by several ranks with the same slice (a replicated
    parameter) is stored once, by the lowest of those ranks; the replicas must have identical bytes.
    """

    name: str
    global_shape: tuple[int, ...]
    slice: Slice
    tensor: torch.Tensor

    def __post_init__(self) -> None:
        shape = tuple(int(s) for s in self.global_shape)
        object.__setattr__(self, "global_shape", shape)
        try:
            self.slice.validate(shape)
        except CheckpointError as err:
            raise CheckpointError(f"tensor {self.name!r}: {err}") from None
        want = self.slice.piece_shape(shape)
        if isinstance(self.slice, FlatSlice):  # any shape with the right element count; stored flattened
            if self.tensor.numel() != self.slice.length:
                raise CheckpointError(
                    f"tensor {self.name!r}: piece has {self.tensor.numel()} elements but {self.slice} holds "
                    f"{self.slice.length}"
                )
        elif tuple(self.tensor.shape) != want:
            raise CheckpointError(
                f"tensor {self.name!r}: piece has shape {tuple(self.tensor.shape)} but {self.slice} of a tensor of "
                f"shape {shape} has shape {want}"
            )
        dtype_name(self.tensor.dtype)


@dataclass(frozen=True)
class SaveResult:
    path: Path
    manifest: Manifest
    bytes_written: int  # by this rank
    seconds: float


def check_tag(tag: str) -> None:
    if not isinstance(tag, str) or not _TAG_RE.fullmatch(tag) or tag in (LATEST_NAME, MANIFEST_NAME, JOURNAL_NAME):
        raise CheckpointError(
            f"checkpoint tag {tag!r} is not allowed: use letters, digits, '_', '.', '=', '-', not starting with "
            f"'.' or '-', and not {LATEST_NAME!r} or {JOURNAL_NAME!r}"
        )


_OUR_FILE_RE = re.compile(r"manifest\.json|objects\.(safetensors|pkl)|rank\d{5}(\.objects)?\.(safetensors|pkl)")


def _replaceable(final: Path, same_save: dict[str, Any] | None) -> str | None:
    """Whether the existing checkpoint directory ``final`` may be replaced by this save (None) or why not.

    [Note: saving a tag that exists]
    A save never silently destroys a checkpoint, but a restarted job must be able to save again. Replaced, always
    through a complete new copy first ([Note: the publish journal]): ``final`` when it is complete and holds the
    global objects ``same_save`` (the engine passes its step counters and its torchrun run id: the same save, done
    again by a restart of the job that resumed from an earlier checkpoint, as DeepSpeed and torch DCP overwrite a
    step's directory; another job's checkpoint is not replaced, [Note: one job per save directory]); or when it is
    incomplete (no manifest, or one that does not parse or whose files are missing) and holds nothing but the files
    a checkpoint of ours holds, so that it could never load. Refused: a complete checkpoint of another step (a tag
    the user reuses: the message says how to replace it), and a directory with other files (not ours, e.g.
    DeepSpeed's)."""
    if final.is_symlink() or not final.is_dir():
        return "and is not a checkpoint directory"
    problem = complete_checkpoint_problem(final)
    if problem is None:
        if same_save is not None:
            text = (final / MANIFEST_NAME).read_text(encoding="utf-8")
            objects = Manifest.from_json(text, str(final / MANIFEST_NAME)).objects
            held = {k: objects[k].value if k in objects and objects[k].encoding == "json" else None for k in same_save}
            if held == same_save:
                return None
            if "engine/run_id" in same_save and {**held, "engine/run_id": None} == {**same_save, "engine/run_id": None}:
                return (
                    f" (saved at the same point of training by another job, torchrun run id {held['engine/run_id']}; "
                    f"this job's is {same_save['engine/run_id']}: only a restart of the job that saved it replaces it)"
                )
            return f" (a complete checkpoint of another point of training: {held}, this save is at {same_save})"
        return ""
    others = sorted(p.name for p in final.iterdir() if not (_OUR_FILE_RE.fullmatch(p.name) and p.is_file()))
    if others:
        return f" and is not a shardtrain checkpoint (it holds {', '.join(others[:5])})"
    return None


def _prepare(
    save_dir: Path,
    tag: str,
    overwrite: bool,
    same_save: dict[str, Any] | None = None,
    owner: SaveDirOwner | None = None,
) -> str | None:
    """Rank 0, step 1. Returns an error message instead of raising (it travels to the other ranks), except
    :class:`SaveDirInUseError`: another job's directory, where nothing may be touched (not even ``.tmp-<tag>``)."""
    try:
        check_tag(tag)
        save_dir.mkdir(parents=True, exist_ok=True)
        if owner is not None:
            owner.claim(save_dir)  # before anything in the directory is read or changed
        for line in recover(save_dir):
            log.warning("checkpoint directory %s: %s", save_dir, line)
        final = save_dir / tag
        if os.path.lexists(final) and not overwrite:
            why = _replaceable(final, same_save)
            if why is not None:
                return (
                    f"checkpoint {final} already exists{why}; choose another tag, delete it, "
                    "or pass overwrite=True to replace it"
                )
            kind = "incomplete" if complete_checkpoint_problem(final) else "saved at the same step by an earlier run"
            log.warning("checkpoint %s exists (%s): it is replaced once the new one is complete", final, kind)
        for leftover in save_dir.iterdir():  # after recover(): what is left was never committed
            if leftover.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
                if leftover.is_dir() and not leftover.is_symlink():
                    shutil.rmtree(leftover, ignore_errors=True)
                else:
                    leftover.unlink()
        tmp = save_dir / (TMP_PREFIX + tag)
        tmp.mkdir()  # no fsync of save_dir needed: nothing relies on .tmp-<tag> surviving a crash
    except SaveDirInUseError:
        raise
    except CheckpointError as err:
        return str(err)
    except Exception as err:  # OSError, or anything else: it must reach the other ranks (no hang)
        return f"cannot prepare {save_dir} for checkpoint {tag!r}: {_describe(err)}"
    crash_point("tmp_created")
    return None


def object_file(rank: int | None) -> str:
    """The file holding the tensors of the global objects (``None``) or of rank ``rank``'s objects."""
    return "objects.safetensors" if rank is None else f"rank{rank:05d}.objects.safetensors"


def _encode_objects(objects: dict[str, Any], file: str) -> tuple[dict[str, ObjectRecord], bytes | None]:
    """Inline JSON where the value survives a JSON round trip unchanged, a tagged tree otherwise, with the tensors
    it holds in ``file`` ([Note: checkpoint objects]). Returns the records and the file's bytes (None: no tensors).
    An object holding something else is refused here, before anything is written."""
    records: dict[str, ObjectRecord] = {}
    encoder = TaggedEncoder()
    for key, value in objects.items():
        try:
            inline = json.loads(json.dumps(value, allow_nan=False)) == value
        except (TypeError, ValueError):
            inline = False
        if inline:  # the JSON copy: the caller may change ``value`` before the manifest is written
            records[key] = ObjectRecord(key, "json", json.loads(json.dumps(value, allow_nan=False)))
        else:
            before = len(encoder.tensors)
            tree = encoder.encode(key, value)
            records[key] = ObjectRecord(key, "tagged", tree, file if len(encoder.tensors) > before else None)
    if not encoder.tensors:
        return records, None
    try:
        return records, encode_tensor_file(encoder.tensors)
    except Exception as err:  # a tensor safetensors cannot hold (dtype)
        keys = ", ".join(sorted({k for k, r in records.items() if r.file is not None}))
        raise CheckpointError(f"the tensors of objects {keys} cannot be stored: {_describe(err)}") from None


def _write_rank_files(
    tmp: Path, rank: int, pieces: list[SavePiece], mine: list[tuple[SavePiece, str]], object_data: bytes | None
) -> tuple[list[FileEntry], dict[tuple, str], int]:
    """Step 3 on one rank: its tensor file (checksummed during its fsync) and its per-rank object file, fsynced.

    Returns the file entries, the checksum of every piece this rank holds (stored by it or, for a replica stored by
    a lower rank, computed for the comparison), and the bytes written."""
    files: list[FileEntry] = []
    checksums: dict[tuple, str] = {}
    written = 0
    if mine:
        path = tmp / rank_file(rank)
        tensors = [_stored(p) for p, _ in mine]
        specs = [(key, t.dtype, tuple(t.shape)) for (_, key), t in zip(mine, tensors)]
        with naming(path):
            shapes = json.dumps({key: list(p.global_shape) for p, key in mine}, separators=(",", ":"))
            metadata = {"format": "pt", GLOBAL_SHAPES_KEY: shapes}  # see GLOBAL_SHAPES_KEY: flat pieces' shapes
            write_streaming(path, specs, tensors.__getitem__, metadata, via_partial=False, fsync=False)
        crash_point("tensor_file_torn", path)
        crash_point("tensor_file_written")
        # The checksums are computed while the kernel writes the file back: fsync waits on the disk, crc32 on the
        # CPU, and both release the GIL. A plain thread, not an executor: a background save may still be writing
        # when the interpreter exits, and executors refuse new work once its shutdown has begun.
        fsync_error: list[BaseException] = []
        synced = threading.Thread(target=_fsync_into, args=(path, fsync_error), name="shardtrain checkpoint fsync")
        synced.start()
        try:
            checksums = {(p.name, p.slice): crc32_of(t) for (p, _), t in zip(mine, tensors)}
        finally:
            synced.join()
        if fsync_error:
            raise fsync_error[0]
        del tensors
        size = path.stat().st_size
        files.append(FileEntry(path.name, rank, size))
        written += size
    for p in pieces:
        if (p.name, p.slice) not in checksums:
            checksums[(p.name, p.slice)] = crc32_of(p.tensor)
    if object_data is not None:
        files.append(write_object_file(tmp / object_file(rank), rank, object_data))
        written += files[-1].size
    return files, checksums, written


def _fsync_into(path: Path, errors: list[BaseException]) -> None:
    try:
        fsync_path(path)
    except BaseException as err:  # raised by the writing thread
        errors.append(err)


def _stored(p: SavePiece) -> torch.Tensor:
    t = p.tensor.detach()
    return (t.reshape(-1) if isinstance(p.slice, FlatSlice) else t).contiguous()


def _publish(save_dir: Path, tag: str, manifest: Manifest) -> None:
    """Step 4 on rank 0."""
    tmp = save_dir / (TMP_PREFIX + tag)
    path = tmp / MANIFEST_NAME
    with naming(path), open(path, "w") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    crash_point("manifest_torn", path)
    crash_point("manifest_written")
    fsync_path(tmp)
    crash_point("tmp_synced")
    missing = [name for name in (MANIFEST_NAME, *manifest.files) if not (tmp / name).is_file()]
    if missing:  # [Note: publish what exists] in latest.py
        what = f"{tmp} is gone" if not tmp.is_dir() else f"{tmp} lacks {', '.join(missing[:3])}"
        raise PublishError(
            f"checkpoint {save_dir / tag} vanished before it was published ({what}: deleted, or removed by another "
            f"job saving into {save_dir}); nothing was published"
        )
    write_journal(save_dir, tag)  # committed: a crash from here on is finished by the next load or save
    finish_publish(save_dir, tag)  # an existing <tag> is replaced only now: the new copy is complete and durable


def _latest_state(save_dir: Path, tag: str) -> str:
    """After a failed publish: whether the new checkpoint is in place and what ``latest`` names."""
    try:
        latest = read_latest(save_dir)
    except CheckpointError:
        latest = None
    if latest == tag:
        return f"{LATEST_NAME!r} names it"
    if (save_dir / JOURNAL_NAME).exists():
        return f"{save_dir / JOURNAL_NAME} commits it: the next load or save of {save_dir} publishes it"
    state = f"{save_dir / tag} is complete but " if (save_dir / tag / MANIFEST_NAME).is_file() else ""
    return state + (f"{LATEST_NAME!r} still names {latest!r}" if latest else f"there is no {LATEST_NAME!r}")


def _describe(err: BaseException) -> str:
    return str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}"


def _raise_failures(
    errors: list[str | None],
    step: str,
    save_dir: Path,
    tag: str,
    rank: int,
    error_type: type[CheckpointError] = CheckpointError,
) -> None:
    """Raise ``error_type`` on every rank when any rank failed; rank 0 first removes the unpublished temporary
    directory (every rank is past its writes: this runs after a gather)."""
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if not failed:
        return
    if rank == 0:
        shutil.rmtree(save_dir / (TMP_PREFIX + tag), ignore_errors=True)
    unchanged = "; nothing was published ('latest' is unchanged)" if step != "publishing" else ""
    raise error_type(
        "; ".join(f"rank {r} failed to save checkpoint {save_dir / tag} ({step}): {e}" for r, e in failed) + unchanged
    )


def _to_host(pieces: list[SavePiece], copy: bool = False) -> list[SavePiece]:
    """Pieces of device tensors copied to host memory (pinned, asynchronous from CUDA, one synchronization), so
    that the files and checksums are computed from host memory. ``copy``: host tensors are copied too (a
    snapshot: training may change the originals as soon as this returns)."""
    out, cuda = [], False
    for p in pieces:
        t = p.tensor.detach()
        if t.device.type == "cpu":
            out.append(replace(p, tensor=t.clone()) if copy else p)
            continue
        if t.is_cuda:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            cuda = True
        else:
            host = t.to("cpu")
        out.append(replace(p, tensor=host))
    if cuda:
        torch.cuda.synchronize()
    return out


@dataclass
class PreparedSave:
    """A save after its snapshot (steps 1-2 done): everything steps 3-5 need, in memory that training no longer
    touches, so that they may run in a background thread ([Note: asynchronous checkpoints] in ``async_save.py``)."""

    save_dir: Path
    tag: str
    rank: int
    size: int
    pieces: list[SavePiece]  # host copies
    mine: list[tuple[SavePiece, str]]  # the pieces this rank stores, with their keys in its file
    tensors: Any  # plan_pieces' outcome, the same on every rank
    holders: Any
    keys: Any
    records: dict[str, ObjectRecord]
    global_records: dict[str, ObjectRecord]
    object_data: bytes | None
    global_data: bytes | None
    started: float


def prepare(
    save_dir: str | os.PathLike,
    tag: str,
    comm: Communicator | None,
    pieces: list[SavePiece],
    *,
    rank_objects: dict[str, Any] | None = None,
    global_objects: dict[str, Any] | None = None,
    aliases: dict[str, str] | None = None,
    overwrite: bool = False,
    same_save: dict[str, Any] | None = None,
    failure: str | None = None,
    snapshot: bool = False,
    owner: SaveDirOwner | None = None,
) -> PreparedSave:
    """Steps 1-2 of :func:`save` (collective over ``comm``): prepare the directory, copy the pieces to host memory,
    encode the objects, agree on the plan. ``snapshot``: copy host tensors too (not only device ones), so that
    training may change them once this returns; the objects are always encoded here, into bytes and fresh JSON.
    ``owner``: the job's claims, which rank 0 extends to ``save_dir`` ([Note: one job per save directory]); it must
    hold the directory until the commit is over (None: the caller holds it, or nobody guards it)."""
    t0 = time.perf_counter()
    crash_point("start")
    save_dir = Path(save_dir)
    rank, size = (comm.rank, comm.size) if comm is not None else (0, 1)

    def gather(obj: Any, what: str) -> list[Any]:
        return comm.all_gather_object(obj, what=what) if comm is not None else [obj]

    prep_error = refusal = None
    if rank == 0:
        try:
            prep_error = _prepare(save_dir, tag, overwrite, same_save, owner)
        except SaveDirInUseError as err:
            refusal = str(err)
    local_error, descs = failure, []
    if local_error is None:
        try:
            pieces = _to_host(pieces, copy=snapshot)
            descs = [(p.name, p.global_shape, dtype_name(p.tensor.dtype), p.slice) for p in pieces]
            if len({(d[0], d[3]) for d in descs}) < len(descs):
                local_error = "the same part of a tensor is passed twice"
        except Exception as err:
            local_error = f"staging its pieces: {_describe(err)}"
    records: dict[str, ObjectRecord] = {}
    global_records: dict[str, ObjectRecord] = {}
    object_data = global_data = None
    if local_error is None:  # an object that cannot be stored is refused before anything is written
        try:
            records, object_data = _encode_objects(rank_objects or {}, object_file(rank))
            if rank == 0:
                global_records, global_data = _encode_objects(global_objects or {}, object_file(None))
        except Exception as err:
            local_error = f"encoding its objects: {_describe(err)}"
    gathered = gather((descs, prep_error or local_error, aliases or {}, refusal), "checkpoint piece descriptors")
    if gathered[0][3] is not None:  # another job's directory: every rank raises, nothing is removed
        raise SaveDirInUseError(gathered[0][3])
    _raise_failures([g[1] for g in gathered], "preparing", save_dir, tag, rank)
    try:
        # every rank's aliases: under pipeline parallelism a tied head's name is known to the last stage only
        tensors, holders = plan_pieces([g[0] for g in gathered], {k: v for g in gathered for k, v in g[2].items()})
    except CheckpointError:  # computed from the same gathered data on every rank: every rank raises it
        if rank == 0:
            shutil.rmtree(save_dir / (TMP_PREFIX + tag), ignore_errors=True)
        raise
    keys = piece_keys(holders)
    mine = [(p, keys[(p.name, p.slice)]) for p in pieces if holders[(p.name, p.slice)][0] == rank]
    return PreparedSave(
        save_dir,
        tag,
        rank,
        size,
        pieces,
        mine,
        tensors,
        holders,
        keys,
        records,
        global_records,
        object_data,
        global_data,
        t0,
    )


def commit(prepared: PreparedSave, comm: Communicator | None) -> SaveResult:
    """Steps 3-5 of :func:`save`: write and fsync this rank's files, agree, publish. Collective over ``comm``, which
    must hold the same ranks in the same order as the one :func:`prepare` ran over (it may be another group: a
    background commit uses the checkpoint group of [Note: asynchronous checkpoints])."""
    s = prepared
    save_dir, tag, rank = s.save_dir, s.tag, s.rank

    def gather(obj: Any, what: str) -> list[Any]:
        return comm.all_gather_object(obj, what=what) if comm is not None else [obj]

    tmp = save_dir / (TMP_PREFIX + tag)
    write_error: str | None = None
    files: list[FileEntry] = []
    checksums: dict[tuple, str] = {}
    written = 0
    try:
        files, checksums, written = _write_rank_files(tmp, rank, s.pieces, s.mine, s.object_data)
        if s.global_data is not None:
            files.append(write_object_file(tmp / object_file(None), 0, s.global_data))
            written += files[-1].size
        crash_point("objects_written")
    except Exception as err:  # I/O, a bug: every rank must hear of it
        write_error = f"writing into {tmp}: {_describe(err)}"
    crash_point("files_synced")
    parts = gather((files, s.records, s.global_records, write_error, checksums), "checkpoint file list")
    _raise_failures([p[3] for p in parts], "writing files", save_dir, tag, rank)
    try:
        manifest = Manifest(
            version=FORMAT_VERSION,
            tag=tag,
            world_size=s.size,
            tensors=tensor_entries(s.tensors, s.holders, s.keys, [p[4] for p in parts]),
            files={f.name: f for p in parts for f in p[0]},
            objects=parts[0][2],
            rank_objects={r: p[1] for r, p in enumerate(parts) if p[1]},
        )
    except CheckpointError:  # the same on every rank (e.g. diverged replicas)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_error: str | None = None
    vanished = False  # the checkpoint was gone before it was published: a PublishError on every rank
    if rank == 0:
        try:
            _publish(save_dir, tag, manifest)
        except Exception as err:
            vanished = isinstance(err, PublishError)
            # committed or not, leave a state the message describes: finish or drop the journal now
            with contextlib.suppress(Exception):
                recover(save_dir)
            publish_error = f"{_describe(err)}; {_latest_state(save_dir, tag)}"
        crash_point("done")
    publish_error, vanished = gather((publish_error, vanished), "checkpoint published")[0]
    error_type = PublishError if vanished else CheckpointError
    _raise_failures([publish_error], "publishing", save_dir, tag, rank, error_type)
    return SaveResult(save_dir / tag, manifest, written, time.perf_counter() - s.started)


def save(
    save_dir: str | os.PathLike,
    tag: str,
    comm: Communicator | None,
    pieces: list[SavePiece],
    *,
    rank_objects: dict[str, Any] | None = None,
    global_objects: dict[str, Any] | None = None,
    aliases: dict[str, str] | None = None,
    overwrite: bool = False,
    same_save: dict[str, Any] | None = None,
    failure: str | None = None,
    owner: SaveDirOwner | None = None,
) -> SaveResult:
    """Save one checkpoint ``save_dir/tag`` collectively; every rank of ``comm`` calls this (``None``: one process).

    ``pieces``: this rank's parts of logical tensors. ``rank_objects``: this rank's small objects (RNG states);
    ``global_objects``: objects shared by all ranks (only rank 0's are written). Objects may hold the types of
    [Note: checkpoint objects] (plain data, tensors, numpy arrays); anything else fails the save before any file
    is written. ``aliases``: ``{alias: name}`` extra names of a tensor (tied weights), given on rank 0. An existing
    tag is refused unless ``overwrite``, or it is incomplete, or it holds the global objects ``same_save`` (inline
    JSON values, e.g. step counters: the same save done again by a restarted run; [Note: saving a tag that
    exists]); it is replaced only once the new checkpoint is complete and committed. Returns when the checkpoint
    is complete and ``latest`` names it. Pieces may live on any device; they are copied to host memory first (this
    rank's pieces are held there until its file is written).

    ``failure``: this rank could not prepare its part (e.g. collecting its pieces raised); the save is abandoned
    on every rank with this message at the first gather. Any exception a rank meets during the save is carried the
    same way, so every rank raises one :class:`CheckpointError` naming the failing ranks and causes, and nothing is
    published.

    ``owner``: the job's claims on save directories, held on after the save ([Note: one job per save directory]);
    by default the directory is claimed for this save only. Another job's directory raises
    :class:`SaveDirInUseError` on every rank, and nothing in it is touched.

    It is :func:`prepare` then :func:`commit` on the calling thread; ``async_save.py`` runs the commit in the
    background.
    """
    temporary = owner is None
    owner = SaveDirOwner() if temporary else owner
    try:
        prepared = prepare(
            save_dir,
            tag,
            comm,
            pieces,
            rank_objects=rank_objects,
            global_objects=global_objects,
            aliases=aliases,
            overwrite=overwrite,
            same_save=same_save,
            failure=failure,
            owner=owner,
        )
        return commit(prepared, comm)
    finally:
        if temporary:
            owner.release()
