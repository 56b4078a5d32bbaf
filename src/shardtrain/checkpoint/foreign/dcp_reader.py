"""Read a torch.distributed.checkpoint (DCP) directory through the interface of
:class:`~shardtrain.checkpoint.reader.CheckpointReader`, so that the engine loads it into any layout by the same
path as its own checkpoints ([Note: DCP checkpoints] in ``dcp_format.py`` says what maps to what).

A read asks DCP's own ``FileSystemReader`` for the chunks that share elements with the slice wanted, and of each
only the rows (along its first dimension) that hold them: torch loads a chunk's bytes with
``torch.load(weights_only=True)`` and narrows it, and a small ``LoadPlanner`` of ours hands each narrowed piece to
the same segment copier as ``reader.py`` (the element map comes from run tables: a chunk is a box, a box is runs).
Memory: the result, one chunk, the run tables. Nothing here holds a file open between calls.
"""

from __future__ import annotations

import io
import math
import pickle
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from shardtrain.checkpoint.foreign.dcp_format import DcpContents, DcpTensorEntry, interpret, load_metadata
from shardtrain.checkpoint.format import FlatSlice, Slice, check_coverage, slice_destination
from shardtrain.checkpoint.resume_needs import optimizer_state_problems
from shardtrain.checkpoint.runs import RunTable, SegmentCopier, intersect
from shardtrain.errors import CheckpointError

# the names engine/checkpointing.py reads (it imports this package, so they are spelled here, not imported)
PARAM_GROUPS_KEY, STATE_KINDS_KEY = "optimizer/param_groups", "optimizer/state_kinds"
ELEMENTWISE, SCALAR = "elementwise", "scalar"


def box_runs(shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> RunTable:
    """The runs ([Note: runs] in ``runs.py``) of an n-D box of a tensor of ``shape``: the box's elements in its own
    row-major order. Trailing dimensions the box spans whole merge into its runs, so a row block is one run."""
    if any(s == 0 for s in sizes):
        return RunTable.of([], [], [])
    if not shape:
        return RunTable.of([0], [0], [1])
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    k = len(shape) - 1
    while k > 0 and offsets[k] == 0 and sizes[k] == shape[k]:
        k -= 1
    run = sizes[k] * strides[k]
    starts = torch.tensor([offsets[k] * strides[k]], dtype=torch.int64)
    for d in range(k - 1, -1, -1):  # outer dimensions, innermost first: row-major order of the box
        steps = (offsets[d] + torch.arange(sizes[d], dtype=torch.int64)) * strides[d]
        starts = (steps[:, None] + starts[None, :]).reshape(-1)
    return RunTable(starts, torch.arange(starts.numel(), dtype=torch.int64) * run, torch.full_like(starts, run))


class _Planner(LoadPlanner):
    """The receiving end of ``FileSystemReader.read_data``: a buffer per requested piece, handed to its sink once
    filled; values (non-tensor entries) through ``torch.load(weights_only=True)``. The planning methods are unused:
    the plan is built by :class:`DcpReader` for one rank, without collectives."""

    def __init__(self, dtypes: dict[MetadataIndex, torch.dtype], sinks: dict[MetadataIndex, Callable]) -> None:
        self.dtypes, self.sinks = dtypes, sinks
        self.values: dict[str, Any] = {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        raise NotImplementedError

    def create_local_plan(self) -> LoadPlan:
        raise NotImplementedError

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        raise NotImplementedError

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        raise NotImplementedError

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        try:
            self.values[key] = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:  # torch's allow-list refused a global
            named = next((ln.strip() for ln in str(err).splitlines() if "GLOBAL" in ln or "Unsupported" in ln), "")
            raise CheckpointError(
                f"entry {key!r} holds what torch.load(weights_only=True) refuses ({named}); only plain data, "
                "tensors and containers of them are read from a DCP checkpoint (nothing from it was run)"
            ) from None

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return torch.empty(read_item.lengths, dtype=self.dtypes[read_item.storage_index])

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        self.sinks.pop(read_item.storage_index)(tensor.reshape(-1))


class DcpReader:
    """Reads the tensors and objects of one DCP checkpoint directory (see the module docstring)."""

    format_name = "torch DCP (FSDP2, torchtitan)"  # for `shardtrain checkpoint inspect`

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.verify_reads = False  # DCP stores no checksums
        self._md: Metadata = load_metadata(self.path)
        self.contents: DcpContents = interpret(self.path, self._md)
        self.manifest = self.contents.manifest
        self._covered: set[str] = set()
        self._objects: dict[str, Any] | None = None
        self._storage = FileSystemReader(self.path)
        self._storage.set_up_storage_reader(self._md, is_coordinator=True)

    # -- tensors ----------------------------------------------------------------------------------
    def entry(self, name: str) -> DcpTensorEntry:
        return self.manifest.resolve(name)

    def read(
        self, name: str, flat_range: tuple[int, int] | None = None, *, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """As :meth:`CheckpointReader.read`: tensor ``name`` whole, or elements ``[a, b)`` of it flattened."""
        return self._read(self.manifest.resolve(name), flat_range, dtype)

    def read_slice(self, name: str, slice: Slice, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        """As :meth:`CheckpointReader.read_slice`: the part ``slice`` of tensor ``name``, from the chunks holding it."""
        return self._read_slice(self.manifest.resolve(name), slice, dtype)

    def _read(self, entry: DcpTensorEntry, flat_range: tuple[int, int] | None, dtype: torch.dtype | None):
        a, b = (0, entry.numel) if flat_range is None else flat_range
        if not (0 <= a <= b <= entry.numel):
            raise CheckpointError(f"tensor {entry.name!r}: range [{a}, {b}) is outside its {entry.numel} elements")
        out = self._read_slice(entry, FlatSlice(a, b - a), dtype)
        return out.reshape(entry.global_shape) if flat_range is None else out

    def _read_slice(self, entry: DcpTensorEntry, slice: Slice, dtype: torch.dtype | None) -> torch.Tensor:
        shape = entry.global_shape
        out = slice_destination(entry, slice, dtype)
        target = slice.run_table(shape)
        if target.count == 0:
            return out
        tables = [box_runs(shape, offsets, sizes) for offsets, sizes in entry.chunks]
        if entry.key not in self._covered:  # the chunks must tile the tensor, or elements would be left unset
            try:
                check_coverage(entry.key, shape, [_TableSlice(t) for t in tables])
            except CheckpointError as err:
                raise CheckpointError(f"{self.path}: {err}; the DCP metadata is damaged") from None
            self._covered.add(entry.key)
        flat = out.view(-1)
        items, dtypes, sinks = [], {}, {}
        for i, ((offsets, sizes), table) in enumerate(zip(entry.chunks, tables)):
            segments = intersect(target, table)
            if segments.count == 0:
                continue
            first = int(segments.piece_start[0])
            last = int(segments.piece_start[-1] + segments.length[-1])
            row = math.prod(sizes[1:])  # only the rows (first dimension) of the chunk holding what is wanted
            r0, r1 = (first // row, -(-last // row)) if sizes else (0, 0)
            index = MetadataIndex(entry.key, offsets, i)
            items.append(
                ReadItem(
                    type=LoadItemType.TENSOR,
                    dest_index=index,
                    dest_offsets=torch.Size([0] * len(sizes)),
                    storage_index=index,
                    storage_offsets=torch.Size([r0] + [0] * (len(sizes) - 1)) if sizes else torch.Size([]),
                    lengths=torch.Size([r1 - r0, *sizes[1:]]) if sizes else torch.Size([]),
                )
            )
            dtypes[index] = entry.torch_dtype
            copier = SegmentCopier(flat, segments)
            sinks[index] = lambda t, copier=copier, start=r0 * row: copier(start, t)
        self._read_items(items, _Planner(dtypes, sinks), f"tensor {entry.key!r}")
        return out

    def _read_items(self, items: list[ReadItem], planner: _Planner, what: str) -> None:
        missing = [it.storage_index for it in items if it.storage_index not in self._storage.storage_data]
        if missing:
            raise CheckpointError(
                f"{self.path}: the DCP metadata lists {what} but not where its data is ({missing[0]}); the "
                "checkpoint is incomplete"
            )
        try:
            self._storage.read_data(LoadPlan(items), planner).wait()
        except CheckpointError as err:
            raise CheckpointError(f"{self.path}: {err}") from None
        except FileNotFoundError as err:
            raise CheckpointError(f"{self.path}: a data file is missing (needed for {what}): {err.filename}") from None
        except Exception as err:  # a truncated or damaged file: torch.load's or the copy's error
            raise CheckpointError(
                f"{self.path}: cannot read {what} ({type(err).__name__}: {err}); the file is damaged"
            ) from None

    def _read_values(self, keys: list[str]) -> dict[str, Any]:
        """The non-tensor entries ``keys`` (pickled by ``torch.save``), through ``torch.load(weights_only=True)``."""
        planner = _Planner({}, {})
        items = []
        for key in keys:
            index = MetadataIndex(key)
            zero = torch.Size([0])
            items.append(ReadItem(LoadItemType.BYTE_IO, index, zero, index, zero, zero))
        if items:
            self._read_items(items, planner, ", ".join(map(repr, keys[:3])) + (" ..." if len(keys) > 3 else ""))
        return planner.values

    def _value_of(self, entries: list[tuple[tuple, str]]) -> Any:
        """The object the entries ``(path below it, key)`` were flattened from, tensors read whole."""
        tensor_keys = {k for _, k in entries if k in self.contents.tensors_by_key}
        values = self._read_values([k for _, k in entries if k not in tensor_keys])
        for k in tensor_keys:
            values[k] = self._read(self.contents.tensors_by_key[k], None, None)
        return _nest([(p, values[k]) for p, k in entries])

    # -- objects ----------------------------------------------------------------------------------
    @property
    def objects(self) -> dict[str, Any]:
        """The objects the engine's load reads: param groups and state kinds (when the checkpoint has an optimizer),
        counters, the scheduler state and the client state."""
        if self._objects is None:
            self._objects = self._build_objects()
        return self._objects

    def rank_objects(self, rank: int) -> dict[str, Any]:
        """A DCP checkpoint has no per-rank objects (no RNG states)."""
        return {}

    def _build_objects(self) -> dict[str, Any]:
        c = self.contents
        objects: dict[str, Any] = ObjectsWithoutOptimizer(
            f"torch DCP checkpoint {self.path} holds no optimizer state (no 'optimizer' entry with param groups, as "
            "get_optimizer_state_dict returns them); load it with load_optimizer_states=False (or consolidate it "
            "without --optimizer)"
        )
        groups = self._param_groups()
        if groups is not None:
            objects[PARAM_GROUPS_KEY] = groups
            objects[STATE_KINDS_KEY] = self._state_kinds()
        if c.scheduler:
            scheduler = self._value_of(c.scheduler)
            if isinstance(scheduler, dict) and set(scheduler) == {"last_epoch"}:
                # torchtitan saves only this; as a torch LRScheduler state, as torchtitan's own load restores it (a
                # LambdaLR's state must name its lambdas: None keeps the ones the script built)
                last = scheduler["last_epoch"]
                scheduler = {"last_epoch": last, "_step_count": last + 1, "lr_lambdas": []}
            objects["engine/scheduler"] = scheduler
        notes = list(c.not_carried)
        step = None
        if c.train_state:
            train_state = self._value_of(c.train_state)
            if isinstance(train_state, dict):
                step = train_state.get("step")
                notes += [f"train_state {k!r}" for k in train_state if k != "step"]
        if step is None:  # the optimizer's step count is the number of optimizer steps taken
            steps = sorted(n for n in self.manifest.tensors if n.startswith("optim/") and n.endswith("/step"))
            if steps and self.manifest.tensors[steps[0]].numel == 1:
                step = self.read(steps[0])
        if step is not None:
            objects["engine/counters"] = {"global_step": int(torch.as_tensor(step).reshape(()).item())}
        objects["client_state"] = self._value_of(c.client) if c.client else {}
        notes.append("RNG states (a DCP checkpoint holds none; each rank keeps its own)")
        warnings.warn(f"torch DCP checkpoint {self.path}: not carried over: {'; '.join(notes)}", stacklevel=3)
        return objects

    def _param_groups(self) -> list[dict] | None:
        c = self.contents
        if c.groups_nested:
            groups = self._value_of([(p, k) for p, k in c.groups_nested])
            if not isinstance(groups, list) or not all(
                isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
            ):
                raise CheckpointError(
                    f"{self.path}: 'optimizer.param_groups' is not a list of groups each listing its 'params'; the "
                    "checkpoint was not saved from get_optimizer_state_dict"
                )
            return [{k: v for k, v in g.items() if k != "param_names"} for g in groups]
        if not c.groups_flat:
            return None
        # flattened (torchtitan): one saved group per distinct set of hyperparameters, in order of appearance
        keys = [k for hypers in c.groups_flat.values() for k in hypers.values()]
        values = self._read_values(keys)
        by_hypers: dict[str, dict] = {}
        for name, hypers in c.groups_flat.items():
            group = {h: values[k] for h, k in sorted(hypers.items())}
            by_hypers.setdefault(repr(_frozen(group)), {**group, "params": []})["params"].append(name)
        return list(by_hypers.values())

    def _state_kinds(self) -> dict[str, str]:
        """Scalar (``step``, a 0-dim state of a parameter with elements) or element-wise, for each state key whose
        entries agree."""
        kinds: dict[str, set[str]] = {}
        for name, entry in self.manifest.tensors.items():
            if not name.startswith("optim/"):
                continue
            param, _, key = name.removeprefix("optim/").rpartition("/")
            model = self.manifest.tensors.get(f"model/{param}")
            scalar = entry.global_shape == () and (key == "step" or (model is not None and model.global_shape != ()))
            kinds.setdefault(key, set()).add(SCALAR if scalar else ELEMENTWISE)
        return {k: next(iter(v)) for k, v in sorted(kinds.items()) if len(v) == 1}

    # -- full check -------------------------------------------------------------------------------
    def verify(self, progress: Callable[[int], None] | None = None) -> list[str]:
        """Read every chunk and value once, and check that the optimizer state holds what a resume needs
        (``resume_needs.py``); one message per problem (empty: all good)."""
        problems = []
        for entry in self.contents.tensors_by_key.values():
            try:
                self._read(entry, None, None)
            except CheckpointError as err:
                problems.append(str(err))
            if progress is not None:
                progress(entry.nbytes)
        values = [k for k in self._md.state_dict_metadata if k not in self.contents.tensors_by_key]
        for key in values:
            try:
                self._read_values([key])
            except CheckpointError as err:
                problems.append(str(err))
        try:
            problems += optimizer_state_problems(self.manifest, self.objects)
        except CheckpointError as err:
            problems.append(str(err))
        return problems


class ObjectsWithoutOptimizer(dict):
    """A foreign checkpoint's objects dict; asking for the param groups of one without optimizer state raises
    ``why`` (the DCP and Megatron readers say each their reason)."""

    def __init__(self, why: str) -> None:
        super().__init__()
        self._why = why

    def get(self, key: str, default: Any = None) -> Any:
        if key == PARAM_GROUPS_KEY and key not in self:
            raise CheckpointError(self._why)
        return super().get(key, default)


class _TableSlice:
    """A chunk's run table where ``check_coverage`` expects a slice."""

    def __init__(self, table: RunTable) -> None:
        self.table = table

    def run_table(self, shape: tuple[int, ...]) -> RunTable:
        return self.table

    def __str__(self) -> str:
        return f"chunk at element {int(self.table.global_start[0]) if self.table.count else 0}"


def _frozen(value: Any) -> Any:
    """A comparable stand-in for a hyperparameter value (tensors by their values)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.reshape(-1).tolist()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    return value


def _nest(items: list[tuple[tuple, Any]]) -> Any:
    """The nested object that DCP flattened into ``items`` (path, value): dicts, and lists where the keys are the
    indices 0..n-1 (DCP flattens a list of containers by index)."""
    if len(items) == 1 and items[0][0] == ():
        return items[0][1]
    root: dict = {}
    for path, value in items:
        node = root
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return _lists(root)


def _lists(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    node = {k: _lists(v) for k, v in node.items()}
    if node and all(isinstance(k, int) for k in node) and sorted(node) == list(range(len(node))):
        return [node[i] for i in range(len(node))]
    return node
