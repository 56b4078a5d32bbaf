"""Process topology: who we are, which device and backend we use, and the data- and tensor-parallel groups.

A :class:`Topology` is built once by :func:`init_topology` and passed explicitly to everything that
communicates. There are no process-group globals in shardtrain.

Three ways to start are supported:

* the user already called ``torch.distributed.init_process_group``: we use that group's ranks and store, and create
  the engine's own groups with ``collective_timeout_s`` where the user's timeout differs (see [Note: the engine's
  groups]);
* launched by ``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` set): we initialize from the env, over a store
  of this attempt's own when torchrun shares its store with the workers (see [Note: restarts under torchrun]);
* a plain ``python train.py``: we initialize a one-process group on a free local port, so the same code
  path runs everywhere.

[Note: the engine's groups]
Every engine collective runs on a group of its own topology (world, ``dp``, ``tp``) created with
``collective_timeout_s``: ``new_group`` otherwise gives 30 minutes, whatever the default group's timeout. The default
group serves the world axis only when its timeout is the configured one (always when shardtrain created it); else a
new group over the same ranks does, so a stuck peer still fails the engine after ``collective_timeout_s``. On gloo a
default group made by the user or a launcher is never used: ``close()`` frees the engine's groups, joining their
gloo threads ([Note: what the engine starts and who joins it] in :mod:`shardtrain.engine.shutdown`), and others hold
the default group (``deepspeed.comm`` keeps it in its ``barrier`` defaults).

Each axis also has a host-side group (``host_world_group``, ``host_dp_group``, ``host_tp_group``) for the agreement
checks (desync, unit order, tensor-parallel batch): CPU tensors over gloo, so a check never waits for queued CUDA
kernels. They are the main groups where the backend already takes CPU tensors, else gloo groups over the same ranks,
made once in :func:`make_groups`.

[Note: choosing the device]
The config's ``device`` (``"cpu"``/``"cuda"``) chooses, else ``SHARDTRAIN_DEVICE`` (as DeepSpeed's ``DS_ACCELERATOR``),
else CUDA when this process sees a device. A CUDA rank takes device ``LOCAL_RANK``, or the only one it sees (SLURM's
``--gpus-per-task=1``); more ranks on a node than devices is an error before any collective, and two ranks on one
device are named at ``init_topology`` (host names and device UUIDs exchanged), not by NCCL's first collective. The
device is made current whoever created the group, and a group shardtrain creates is bound to it (``device_id``) so
NCCL's communicator is made eagerly on the right device. CPU picks gloo, CUDA NCCL; CUDA with a user's gloo group is
refused by name.

[Note: restarts under torchrun]
Since PyTorch 2.4 torchrun's rendezvous shares its TCP store with the workers (``TORCHELASTIC_USE_AGENT_STORE``) and
keeps it across restarts, so a restarted worker may read the previous attempt's address before its peer overwrites it
(gloo: ``connectFullMesh failed ... Connection refused``; NCCL: a stale unique id; pytorch/pytorch#135712). A key
prefix from ``TORCHELASTIC_RESTART_COUNT`` fails: the agents of a multi-node job need not agree on it (#108158). So
under a shared store rank 0 starts its own TCP store per attempt (as without one, rank 0 hosts it, so the failure survey
names it when silent) and publishes ``<host> <port> <token>`` under :data:`_ATTEMPT_STORE_KEY` (host: its address on the
route to the agent's store; token: random, also in its store); the others use it only if it holds the same token, else
read the key again (a stale key names a dead port or another store).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import socket
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shardtrain.distributed import failure
from shardtrain.distributed.store_calls import BoundedStore, StoreSilentError
from shardtrain.distributed.watchdog import backend_margin_s
from shardtrain.errors import LayoutError, ShardtrainError
from shardtrain.plan.dims import ParallelDims

_ATTEMPT_STORE_KEY = "shardtrain/attempt_store"
"""In torchrun's shared store: ``<port> <token>`` of this attempt's store, hosted by rank 0 (see [Note: restarts
under torchrun])."""
_TOKEN_KEY = "shardtrain/attempt_token"
_PROBE_S = 2.0
"""How long a rank tries to connect to the port a key names before reading the key again: a dead attempt's port
refuses at once, a live store accepts at once."""


DEVICE_ENV = "SHARDTRAIN_DEVICE"
"""The environment variable that chooses the device when the config does not (as DeepSpeed's ``DS_ACCELERATOR``)."""
DEVICES = ("cpu", "cuda")
"""The device settings; unset, CUDA when this process sees a CUDA device, else the CPU."""


def pick_device(setting: str | None = None) -> torch.device:
    """This rank's device (see [Note: choosing the device]): ``setting`` is the config's ``device``; unset, it
    defers to :data:`DEVICE_ENV`, then to whether CUDA is available."""
    source = "the config's device"
    if setting is None and os.environ.get(DEVICE_ENV):
        setting, source = os.environ[DEVICE_ENV], DEVICE_ENV
    if setting is not None and setting not in DEVICES:
        raise ShardtrainError(f"{source} is {setting!r}; choose one of {', '.join(map(repr, DEVICES))}")
    if setting == "cpu" or (setting is None and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise LayoutError(
            f"{source} is 'cuda' but this process sees no CUDA device (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda}); set it to 'cpu' or 'auto'"
        )
    return torch.device("cuda", local_device_index())


def local_device_index() -> int:
    """The CUDA device of this local rank: ``LOCAL_RANK`` among the devices this process sees, or the only one it
    sees (a launcher that gives each process its own device, as SLURM's ``--gpus-per-task=1``)."""
    count = torch.cuda.device_count()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(local_rank + 1)))
    if count == 1 or local_world <= count:
        return 0 if count == 1 else local_rank
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    raise LayoutError(
        f"this node runs {local_world} ranks (LOCAL_WORLD_SIZE) but each process sees {count} CUDA devices"
        + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
        + f": one rank per device, so start at most {count} processes per node (torchrun --nproc-per-node "
        f"{count}), or set {DEVICE_ENV}=cpu to train on the CPU"
    )


def shared_devices(records: list[tuple[str, str]]) -> dict[tuple[str, str], list[int]]:
    """``(host, device uuid)`` of every rank -> the ranks on that device, where more than one rank is."""
    ranks: dict[tuple[str, str], list[int]] = {}
    for rank, record in enumerate(records):
        ranks.setdefault(record, []).append(rank)
    return {record: rs for record, rs in ranks.items() if len(rs) > 1}


def _check_one_rank_per_device(device: torch.device, host_group: dist.ProcessGroup) -> None:
    """Two ranks on one GPU fail inside NCCL's first collective with its own words; name them here instead."""
    if device.type != "cuda" or dist.get_world_size() == 1:
        return
    mine = (socket.gethostname(), str(torch.cuda.get_device_properties(device).uuid))
    records: list = [None] * dist.get_world_size()
    dist.all_gather_object(records, mine, group=host_group)
    shared = shared_devices([tuple(r) for r in records])
    if shared:
        (host, uuid_), ranks = next(iter(shared.items()))
        raise LayoutError(
            f"ranks {ranks} run on one CUDA device ({uuid_} on {host}): NCCL needs one device per rank; give each "
            "process its own device (CUDA_VISIBLE_DEVICES, or torchrun's LOCAL_RANK with --nproc-per-node at most "
            "the node's devices)"
        )


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def exchanges_on_host(backend: str) -> bool:
    """Whether a group of ``backend`` (``dist.get_backend``'s string) exchanges CPU tensors: gloo, or a per-device
    backend such as ``"cpu:gloo,cuda:nccl"``. Such a group is its own host-side group ([Note: the engine's
    groups])."""
    return "gloo" in backend


def ensure_process_group(timeout_s: float, device: torch.device | None = None) -> bool:
    """Initialize the default process group if nobody has; returns True when this call created it. ``device``
    (default :func:`pick_device`'s) chooses the backend; a CUDA device is bound to the group (``device_id``)."""
    if dist.is_initialized():
        return False
    device = device if device is not None else pick_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=backend_timeout_s(timeout_s, device))
    # device_id: NCCL's communicator is created now, on this rank's device, not lazily on whichever is current
    kwargs: dict = {"backend": backend_for(device), "timeout": timeout}
    if device.type == "cuda":
        kwargs["device_id"] = device
    if _single_process_run():
        # No launcher: a group of one whose store lives in this process. Nothing goes into os.environ, so a process
        # this one starts later (a launcher, a test's workers) does not inherit a taken MASTER_PORT.
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):  # see [Note: restarts under torchrun]
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = attempt_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank, world, timeout)
        dist.init_process_group(store=store, rank=rank, world_size=world, **kwargs)
    else:
        dist.init_process_group(**kwargs)
    global _own_default
    world = dist.group.WORLD
    _own_default = weakref.ref(world) if world is not None else None  # None: a stand-in init made no group
    atexit.register(_destroy_own_process_group)
    return True


_own_default: weakref.ref | None = None
"""The default group :func:`ensure_process_group` created, weakly (None: not shardtrain's)."""


def _default_is_own() -> bool:
    return _own_default is not None and _own_default() is dist.group.WORLD


def backend_timeout_s(timeout_s: float, device: torch.device) -> float:
    """The timeout a group that shardtrain creates gives its backend: ``collective_timeout_s``, plus a margin on a
    device backend, whose own watchdog is then the backstop behind shardtrain's ([Note: failures under NCCL] in
    :mod:`shardtrain.distributed.watchdog`)."""
    return timeout_s + backend_margin_s(timeout_s) if device.type == "cuda" else timeout_s


def _single_process_run() -> bool:
    """Whether no launcher set the rendezvous variables (``RANK`` and ``WORLD_SIZE``): a plain ``python script.py``.
    Only one of them set is a launch that lost the other, refused by name rather than guessed."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None and world is None:
        return True
    if rank is None or world is None:
        missing, present = ("RANK", f"WORLD_SIZE={world}") if rank is None else ("WORLD_SIZE", f"RANK={rank}")
        raise LayoutError(
            f"the environment sets {present} but not {missing}: a launcher sets both (torchrun does), a single "
            f"process sets neither; set {missing} or unset the other"
        )
    return False


def attempt_store(addr: str, port: int, rank: int, world: int, timeout: datetime.timedelta) -> dist.Store:
    """A store of this attempt only, found through the shared store at ``addr:port`` (see [Note: restarts under
    torchrun]). Every call on a store ends within ``timeout`` ([Note: every wait on the store is bounded] in
    :mod:`shardtrain.distributed.store_calls`): a stopped agent is named, not waited for."""
    # torch's own timeout ends a wait for a key not yet written; ours, a second later, a host that does not answer
    limit = timeout.total_seconds() + 1.0
    shared = BoundedStore(dist.TCPStore(addr, port, world, is_master=False, timeout=timeout), limit)
    if rank == 0:
        own = dist.TCPStore(addr, 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        token = uuid.uuid4().hex
        own.set(_TOKEN_KEY, token)
        # rank 0 need not run on the agent store's node (multi-node): publish the address it is reached at, the
        # local end of a connection to that store (the interface the other nodes' traffic to it takes too)
        with socket.create_connection((addr, port), timeout=_PROBE_S) as probe_socket:
            host = probe_socket.getsockname()[0]
        _published(shared, rank, f"{host} {own.port} {token}")
        return own
    deadline = time.monotonic() + timeout.total_seconds()
    probe = datetime.timedelta(seconds=_PROBE_S)
    while True:
        host, own_port, token = _published(shared, rank).split()
        # a dead attempt's port refuses: asked with a plain socket first, since a store client that cannot connect
        # logs a C++ traceback at every retry
        if _listening(host, int(own_port)):
            with contextlib.suppress(RuntimeError, StoreSilentError):  # not a store, gone or silent: read the key again
                own = dist.TCPStore(host, int(own_port), world, is_master=False, timeout=probe, wait_for_workers=False)
                asked = BoundedStore(own, _PROBE_S)
                if asked.check([_TOKEN_KEY]) and asked.get(_TOKEN_KEY).decode() == token:
                    own.set_timeout(timeout)
                    return own
        if time.monotonic() > deadline:
            raise ShardtrainError(
                f"rank {rank}: rank 0's store for this attempt could not be reached within {timeout.total_seconds():g}"
                f" s: torchrun's store at {addr}:{port} names {host}:{own_port}, which does not answer with the "
                "token rank 0 wrote. Is rank 0 running? (see [Note: restarts under torchrun] in shardtrain/mesh.py)"
            )
        time.sleep(0.05)


def _published(shared: BoundedStore, rank: int, value: str | None = None) -> str:
    """Write (rank 0) or read this attempt's store address in torchrun's store; a silent agent is named."""
    try:
        if value is not None:
            shared.set(_ATTEMPT_STORE_KEY, value)
            return value
        return shared.get(_ATTEMPT_STORE_KEY).decode()
    except StoreSilentError as err:
        raise ShardtrainError(
            f"rank {rank}: torchrun's store, through which this attempt's store is found, does not answer: {err} "
            "(see [Note: restarts under torchrun] in shardtrain/distributed/mesh.py)"
        ) from None


def _listening(addr: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((addr, port), timeout=_PROBE_S):
        return True
    return False


def _destroy_own_process_group() -> None:
    """Destroy the process group this module created, while the interpreter is still whole.

    A gloo group left to the interpreter's finalization may still own work objects holding tensors; freeing them
    then takes the GIL of a half-torn-down interpreter and the process dies with SIGABRT ("terminate called without
    an active exception") after the script has finished, which torchrun reports as a failed job. Destroying a gloo
    group is local (no collective). After a collective failed the group is left alone: the process is failing anyway,
    and NCCL's teardown of a group whose peers are gone may wait for them."""
    if failure.any_failed():
        return
    with contextlib.suppress(Exception):  # already destroyed by the user
        if dist.is_initialized():
            dist.destroy_process_group()


def destroy_own_groups(topology: Topology) -> None:
    """Destroy the groups ``topology`` created (``Topology.own_groups``), newest first; local, not collective. Left
    alone after a collective failed, as :func:`_destroy_own_process_group` leaves the default group."""
    if failure.any_failed() or not dist.is_initialized():
        return
    for group in reversed(topology.own_groups):
        with contextlib.suppress(Exception):  # already destroyed (by the user, or with the default group)
            dist.destroy_process_group(group)


def release_groups(topology: Topology) -> None:
    """Drop ``topology``'s references to its process groups (its axes, their host twins, ``own_groups`` and the
    device mesh's registry), once :func:`destroy_own_groups` has run: with no reference left a group is freed, and
    its gloo worker threads joined, while the interpreter is whole (see [Note: what the engine starts and who joins
    it] in :mod:`shardtrain.engine.shutdown`). The topology's groups read None afterwards. Left alone after a
    collective failed: freeing a group waits for the work its threads still run."""
    if failure.any_failed():
        return
    gone = Groups(world=None, dp=None, tp=None)  # type: ignore[arg-type]
    object.__setattr__(topology, "groups", gone)
    object.__setattr__(topology, "host_groups", gone)
    object.__setattr__(topology, "own_groups", ())
    registry = getattr(topology.mesh, "_pg_registry", None)
    if isinstance(registry, dict):
        registry.clear()


@dataclass(frozen=True)
class Groups:
    """This rank's group on each axis of the topology."""

    world: dist.ProcessGroup
    dp: dist.ProcessGroup
    tp: dist.ProcessGroup
    shard: dist.ProcessGroup | None = None
    """Hybrid sharding: the ``S`` ranks this rank shards state with (None: ZeRO shards over the whole ``dp`` axis)."""
    replicate: dist.ProcessGroup | None = None
    """Hybrid sharding: the ranks holding the same shard in the other groups (None without hybrid sharding)."""
    sp: dist.ProcessGroup | None = None
    """Sequence parallelism: the ``sp`` adjacent ranks that share one sequence (None without it)."""
    dp_sp: dist.ProcessGroup | None = None
    """Sequence or context parallelism: the ``dp * cp * sp`` ranks ZeRO shards over (None without either; see [Note:
    the sequence axis], [Note: the context axis])."""
    cp: dist.ProcessGroup | None = None
    """Context parallelism: the ``cp`` ranks that hold one sequence's load-balanced chunks (None without it; see
    [Note: the context axis])."""
    seq: dist.ProcessGroup | None = None
    """Context with sequence parallelism: the ``cp * sp`` ranks sharing one sequence (None unless both; see [Note:
    the context axis])."""
    ep: dist.ProcessGroup | None = None
    """Expert parallelism: the ``E`` adjacent data-parallel ranks holding different experts (None without it; see
    [Note: the expert axis])."""
    edp: dist.ProcessGroup | None = None
    """Expert parallelism: the ``dp / E`` ranks holding the same experts, which their gradients are reduced over
    (None without expert parallelism)."""
    pp: dist.ProcessGroup | None = None
    """Pipeline parallelism: the ``pp`` ranks holding the same place in each stage, which send each other activations
    (None without it; see [Note: the pipeline axis])."""
    pp_ends: dist.ProcessGroup | None = None
    """Pipeline parallelism at ``pp > 2``: the first and the last stage's ranks at one place, which sum the gradients
    of the weights tied across them (at ``pp`` 2 the ``pp`` group itself; see [Note: weights tied across stages] in
    :mod:`shardtrain.pipeline_parallel.cut`)."""
    stage: dist.ProcessGroup | None = None
    """Pipeline with tensor parallelism: the ``world / pp`` ranks holding this rank's stage, which broadcast the
    model, agree on it and sum the tensor-parallel norm (None otherwise: there the ``dp`` group serves)."""
    hpz: dist.ProcessGroup | None = None
    """ZeRO++ hpZ: the ``H`` adjacent data-parallel ranks that re-gather units for backward from their secondary
    shards (None without hpZ; see [Note: secondary shards] in :mod:`shardtrain.zero.hpz`)."""


def make_groups(
    rank: int,
    world: int,
    tp: int,
    backend: str,
    world_group: dist.ProcessGroup,
    new_group: Callable[[list[int], str | None], dist.ProcessGroup],
    shard_size: int | None = None,
    sp: int = 1,
    hpz_size: int = 1,
    ep: int = 1,
    pp: int = 1,
    cp: int = 1,
) -> tuple[Groups, Groups]:
    """The engine's groups and their host-side twins (see [Note: the engine's groups]).

    ``world_group``: the group over every rank with the configured timeout; ``new_group(ranks, backend)`` creates
    one (``backend`` None: the default group's). Every rank calls ``new_group`` for every group, in the same order
    (group creation is collective). ``shard_size``: hybrid sharding's group size ``S`` (see [Note: the hybrid
    mesh]); None or the whole data-parallel size: no shard and replicate groups. ``sp``: the sequence-parallel
    size (see [Note: the sequence axis]). ``hpz_size``: ZeRO++ hpZ's group size ``H`` (1 or the whole axis: no hpZ
    group). ``ep``: the expert-parallel size (see [Note: the expert axis]; with or without tensor parallelism and
    hybrid sharding's groups, cut from the ``dp * sp`` ranks of [Note: experts under sequence parallelism] when
    ``sp > 1``, at each tp rank, [Note: experts under tensor and sequence parallelism]). ``pp``: the pipeline size;
    every other axis is cut within each stage's ``world / pp`` ranks ([Note: the pipeline axis]). ``cp``: the
    context-parallel size ([Note: the context axis]). Returns ``(main, host)``."""
    stage_world = world // pp
    seq = cp * sp  # the ranks sharing one sequence
    dp = stage_world // (tp * seq)
    # rank = (dp_rank * seq + seq_rank) * tp + tp_rank = zero_rank * tp + tp_rank, seq_rank = cp_rank * sp + sp_rank,
    # zero_rank = dp_rank * seq + seq_rank: the index among the dp * cp * sp ranks holding the same tensor-parallel
    # block, over which ZeRO shards
    zero = dp * seq
    partitions = {
        "dp": [[(d * seq + s) * tp + t for d in range(dp)] for s in range(seq) for t in range(tp)],  # same seq, tp
        "tp": [[i * tp + t for t in range(tp)] for i in range(zero)],  # tp adjacent ranks
    }
    if sp > 1:
        partitions["sp"] = [[(g * sp + s) * tp + t for s in range(sp)] for g in range(dp * cp) for t in range(tp)]
    if cp > 1:  # see [Note: the context axis]: the cp ranks with one dp rank, sp rank and tp rank
        partitions["cp"] = [
            [((d * cp + c) * sp + s) * tp + t for c in range(cp)]
            for d in range(dp)
            for s in range(sp)
            for t in range(tp)
        ]
    if cp > 1 and sp > 1:  # the cp * sp ranks of one sequence: the loss and the batch check span them
        partitions["seq"] = [[(d * seq + i) * tp + t for i in range(seq)] for d in range(dp) for t in range(tp)]
    if seq > 1:
        partitions["dp_sp"] = [[i * tp + t for i in range(zero)] for t in range(tp)]  # ZeRO's ranks: same tp block
    if shard_size is not None and shard_size != zero:
        s, replicas = shard_size, zero // shard_size
        partitions["shard"] = [
            [((r * s) + i) * tp + t for i in range(s)] for r in range(replicas) for t in range(tp)
        ]  # S adjacent ranks of ZeRO's axis in one replica, same tp block
        partitions["replicate"] = [
            [((r * s) + i) * tp + t for r in range(replicas)] for i in range(s) for t in range(tp)
        ]  # the same shard index in every replica
    if 1 < hpz_size < zero:  # H adjacent ranks of ZeRO's axis, same tp block: one node when H * tp GPUs fit in it
        partitions["hpz"] = [
            [((g * hpz_size) + i) * tp + t for i in range(hpz_size)] for g in range(zero // hpz_size) for t in range(tp)
        ]
    if ep > 1:  # see [Note: the expert axis]: zero_rank = edp_rank * ep + ep_rank, cut at each tp rank
        groups = range(zero // ep)
        partitions["ep"] = [[(g * ep + e) * tp + t for e in range(ep)] for g in groups for t in range(tp)]
        partitions["edp"] = [[(g * ep + e) * tp + t for g in groups] for e in range(ep) for t in range(tp)]
    if pp > 1:  # see [Note: the pipeline axis]: the same groups in every stage, and the stages' ranks at one place
        partitions = {
            axis: [[s * stage_world + r for r in ranks] for s in range(pp) for ranks in partition]
            for axis, partition in partitions.items()
        }
        partitions["pp"] = [[s * stage_world + r for s in range(pp)] for r in range(stage_world)]
        if pp > 2:
            partitions["pp_ends"] = [[r, (pp - 1) * stage_world + r] for r in range(stage_world)]
        if tp > 1:  # what the world group serves without pipelining: one stage's ranks hold one model
            partitions["stage"] = [[s * stage_world + r for r in range(stage_world)] for s in range(pp)]
    return _groups_of(partitions, rank, world, backend, world_group, new_group)


def _groups_of(
    partitions: dict[str, list[list[int]]],
    rank: int,
    world: int,
    backend: str,
    world_group: dist.ProcessGroup,
    new_group: Callable[[list[int], str | None], dist.ProcessGroup],
) -> tuple[Groups, Groups]:
    def groups(whole: dist.ProcessGroup, backend: str | None) -> Groups:
        mine = {}
        for axis, partition in partitions.items():
            for ranks in partition:
                group = whole if len(ranks) == world else new_group(ranks, backend)
                if rank in ranks:
                    mine[axis] = group
        return Groups(world=whole, **mine)

    main = groups(world_group, None)
    if exchanges_on_host(backend):
        return main, main
    return main, groups(new_group(list(range(world)), "gloo"), "gloo")


def _timeout_s(group: dist.ProcessGroup, device: torch.device) -> float | None:
    """The timeout ``group`` was created with, when its backend says."""
    with contextlib.suppress(Exception):
        return group._get_backend(device).options._timeout.total_seconds()
    return None


@dataclass(frozen=True)
class Topology:
    """The parallel layout of this job, validated once: a 2-D ``(dp, tp)`` device mesh, or with hybrid sharding a
    3-D ``(replicate, shard, tp)`` one (see [Note: the hybrid mesh]), or with sequence parallelism a 3-D ``(dp, sp,
    tp)`` one, hybrid sharding's groups then beside it (see [Note: the sequence axis]).

    Tensor-parallel groups are ``tp`` adjacent ranks (``rank = dp_rank * tp + tp_rank``), so that on a
    multi-GPU node a layer's all-reduces stay inside the node; ZeRO shards over the ``dp`` axis only (over its
    ``shard`` part with hybrid sharding), i.e. across the tensor-parallel groups, between ranks holding the same
    tensor-parallel block.

    [Note: the hybrid mesh]
    With ``zero_optimization.mics_shard_size: S``, ``dp = replicas * S`` and ``dp_rank = replica_rank * S +
    shard_rank``: a shard group is ``S`` adjacent data-parallel ranks (``S * tp`` adjacent global ranks, one node when
    they fit), and a rank's replicate group is the ranks with its shard index (and tp rank) in every other replica. ZeRO
    shards all state over ``shard``; ``replicate`` holds copies. ``dp`` and ``dp_rank`` stay the axis along which
    batches differ, so scripts and batch-size arithmetic don't change. The ``dp`` group remains for what must reach
    every data-parallel rank: the initial broadcast, the gradient norm, ``gathered`` with a ``modifier_rank``.

    [Note: the sequence axis]
    With ``sequence_parallel_size: P`` (Ulysses, docs/sequence-parallel.md) the mesh is ``(dp, sp, tp)``: ``world = dp *
    sp * tp`` and ``rank = (dp_rank * sp + sp_rank) * tp + tp_rank``, so one sequence's ``P`` ranks are adjacent
    (all-to-alls inside a node). Batches differ along ``dp`` only: an sp group gets the same batch and each rank keeps
    its slice of the sequence. ZeRO shards over the ``dp * sp`` ranks holding the same tensor-parallel block
    (DeepSpeed's "sequence data parallel" group): each holds a full gradient for its tokens, so the reduction averages
    over all of them ([Note: the loss over a sequence-parallel group] in ``shardtrain.sequence_parallel.inputs``).
    ``zero_rank = dp_rank * sp + sp_rank`` indexes that axis and ``zero_group`` is it (the initial broadcast and
    deferred construction must reach it). With tensor parallelism an sp group holds the same heads ([Note: Ulysses under
    tensor parallelism]). Hybrid sharding cuts ``dp * sp`` as it cuts ``dp`` (``S`` must divide ``dp * sp``; shard
    groups of ``S`` adjacent ``zero_rank`` s); the gradient is still averaged over all ``dp * sp`` ranks.

    [Note: the context axis]
    With ``context_parallel_size: C`` (ring attention, docs/context-parallel.md) the sequence is shared by ``C * sp``
    ranks: ``rank = ((dp_rank * C + cp_rank) * sp + sp_rank) * tp + tp_rank``, so Ulysses' ``sp`` ranks stay adjacent
    (heads over sp) and the ``C`` ranks of a cp group hold chunks of one sequence; the mesh is ``(dp, cp, sp, tp)``
    (``(dp, cp, tp)`` without Ulysses). The ``C * sp`` ranks of one sequence are the ``seq`` group (the loss, the
    batch check); the sp ranks of a cp rank split its two chunks, and Ulysses' all-to-all gathers them back for
    ``h / sp`` heads before the ring over cp. Batches differ along ``dp`` only. Every one of the ``dp * C * sp``
    ranks computes a gradient of all parameters from its tokens, so ZeRO shards and averages over all of them ([Note:
    the loss over a sequence-parallel group] in ``shardtrain.sequence_parallel.inputs`` holds for any split);
    ``zero_rank = dp_rank * C * sp + cp_rank * sp + sp_rank``. No parameter is split by cp. Hybrid sharding and
    (without Ulysses) hpZ cut that axis as they cut ``dp`` alone: groups of adjacent ``zero_rank`` s, one sequence's
    ranks first.

    [Note: the expert axis]
    With ``expert_parallel_size: E`` (docs/expert-parallel.md) the data-parallel axis is cut as DeepSpeed-MoE cuts it:
    ``dp_rank = edp_rank * E + ep_rank``. An expert group is ``E`` adjacent data-parallel ranks (inside a node when
    ``E`` GPUs fit), each holding ``num_experts / E`` whole experts of every MoE layer; the expert-data-parallel group
    is the ``dp / E`` ranks with the same ``ep_rank``, which hold the same experts and reduce their gradients together.
    Batches still differ along all of ``dp`` and dense parameters are reduced over it; the mesh is ``(edp, ep, tp)``, or
    the hybrid or sequence-parallel one with the expert groups beside it. Hybrid sharding shards and replicates the
    dense state only: expert buckets stay sharded over the expert-data-parallel group, which holds their only copies.
    With tensor parallelism the rank stays ``dp_rank * T + tp_rank`` and the expert groups are cut at each tp rank; the
    ``T`` ranks of a tp group hold the same experts, whole ([Note: experts beside tensor parallelism] in
    :mod:`shardtrain.expert_parallel.dispatch`). With sequence parallelism see [Note: experts under sequence
    parallelism] and [Note: experts under tensor and sequence parallelism].

    [Note: experts under sequence parallelism]
    With ``sequence_parallel_size: P`` as well, the expert groups are cut from ZeRO's ``dp * P`` axis, not from ``dp``:
    ``zero_rank = edp_rank * E + ep_rank``. A MoE layer works on a rank's own tokens (only attention crosses the
    sequence-parallel group), so any ``E`` ranks of that axis can exchange tokens: ``E`` need only divide ``dp * P``
    (groups cut from ``dp`` alone would stop at ``dp``, from the sp group alone at ``P``), and how a group straddles sp
    groups changes who exchanges tokens, not what any rank computes. The expert-data-parallel group is the ``dp * P /
    E`` ranks with the same ``ep_rank``. Gradients need nothing new: a rank's expert gradient sums its expert group's
    contributions ([Note: the loss over a sequence-parallel group] in ``shardtrain.sequence_parallel.inputs``), so their
    average over the expert-data-parallel group divided by ``E`` ([Note: expert buckets] in ``zero/layout.py``) is the
    sum over all ``dp * P`` ranks divided by ``dp * P``. Hybrid sharding leaves the expert buckets as it does without
    sequence parallelism.

    [Note: experts under tensor and sequence parallelism]
    With ``tensor_parallel.size: T`` as well, rank = ``zero_rank * T + tp_rank`` (``zero_rank = dp_rank * P +
    sp_rank``), and the expert groups of [Note: experts under sequence parallelism] are cut at each tp rank as in [Note:
    the expert axis]: ``(g * E + e) * T + t`` for the ``e`` of an expert group, the ``g`` of an expert-data-parallel
    one. Each tp rank sends only its share of its tokens (``ceil(N / (P * T))`` of a slice's ``N / P``, [Note: experts
    beside tensor parallelism] in :mod:`shardtrain.expert_parallel.dispatch`). That is right because the tp ranks of one
    ``(dp, sp)`` position hold the same tokens at every MoE layer: they get the same rows (checked at the first step),
    keep the same slice (``sp_rank = (rank // T) % P``), and their sp groups share a tp rank ([Note: Ulysses under
    tensor parallelism]), so activations between layers stay whole on every tp rank (no Megatron-style sequence split)
    and so does the routing (replicated router; load-balancing loss per [Note: the router's loss under Ulysses] in
    ``shardtrain.sequence_parallel.router_loss``). The tp ranks' expert gradients sum to the slice's, so the reduction
    is the one above. ``E`` must divide ``dp * P``; ``T`` and ``P`` need only what they need without experts.

    [Note: the pipeline axis]
    With ``pipeline_parallel_size: P`` the mesh is ``(pp, dp, tp)`` and ``rank = pp_rank * (world / P) + r``: each
    stage is held by ``world / P`` adjacent ranks, and ``r``, the rank within the stage, is laid out as a whole job
    without pipelining would be (``dp_rank = r // tp``), so every axis above is cut inside one stage and ZeRO shards a
    stage's parameters over that stage's data-parallel ranks only. A rank's pipeline group is the ``P`` ranks with its
    ``r``: they hold the same rows (``dp_rank``) of every micro-batch, and the schedule sends activations between
    them. torch's pipelining library numbers stages along that group (stage ``i`` on ``pp_rank i % P``, then ``i + P``
    with several stages per rank). With experts the expert and expert-data-parallel groups of [Note: the expert axis]
    are cut from a stage's data-parallel ranks, beside the mesh: a stage's ranks exchange tokens of its MoE layers,
    all in the order of the one schedule every rank of the stage runs.
    """

    rank: int
    world_size: int
    dp: int
    device: torch.device
    backend: str
    mesh: DeviceMesh
    timeout_s: float
    groups: Groups
    host_groups: Groups
    tp: int = 1
    replicas: int = 1
    """Hybrid sharding: copies of the sharded state (``dp // mics_shard_size``); 1 without it."""
    sp: int = 1
    """Sequence parallelism: ranks sharing one sequence (``sequence_parallel_size``); 1 without it."""
    cp: int = 1
    """Context parallelism: ranks sharing one sequence in load-balanced chunks (``context_parallel_size``; [Note: the
    context axis]); 1 without it."""
    hpz_size: int = 1
    """ZeRO++ hpZ: ranks of a secondary-shard group (``zero_hpz_partition_size``); 1 without hpZ."""
    ep: int = 1
    """The expert-parallel size ``E`` (see [Note: the expert axis]); 1 without expert parallelism."""
    pp: int = 1
    """The pipeline-parallel size ``P`` (see [Note: the pipeline axis]); 1 without pipeline parallelism."""
    own_groups: tuple[dist.ProcessGroup, ...] = ()
    """The groups :func:`init_topology` created for this topology (``new_group``), in creation order: what
    :func:`destroy_own_groups` destroys. Never the default group, which its creator destroys (see [Note: what the
    engine starts and who joins it] in :mod:`shardtrain.engine.shutdown`)."""

    @property
    def pp_rank(self) -> int:
        """Which pipeline stage this rank holds (the first of its stages with several per rank)."""
        return self.rank // self.stage_world

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """The ``pp`` ranks holding the other stages of this rank's rows (None without pipeline parallelism)."""
        return self.groups.pp

    @property
    def pp_ends_group(self) -> dist.ProcessGroup | None:
        """This rank's first and last stage ranks (the ``pp`` group at ``pp`` 2; None without pipeline
        parallelism): where the gradients of weights tied across the two are summed."""
        return self.groups.pp if self.pp == 2 else self.groups.pp_ends

    @property
    def stage_world(self) -> int:
        """The ranks holding one pipeline stage (``world_size / pp``; every rank without pipeline parallelism)."""
        return self.world_size // self.pp

    @property
    def _stage_rank(self) -> int:
        """This rank's index among its stage's ranks: what every axis but ``pp`` is cut from."""
        return self.rank % self.stage_world

    @property
    def hpz_group(self) -> dist.ProcessGroup | None:
        """ZeRO++ hpZ's group of ``hpz_size`` adjacent data-parallel ranks; None without hpZ."""
        return self.groups.hpz

    @property
    def ep_rank(self) -> int:
        """This rank's index in its expert group: it holds experts ``[ep_rank * n/E, (ep_rank + 1) * n/E)``
        (``zero_rank % E``: ``dp_rank % E`` without sequence parallelism)."""
        return self.zero_rank % self.ep

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        """The ``E`` ranks holding different experts, which exchange tokens (None without expert parallelism)."""
        return self.groups.ep

    @property
    def edp_group(self) -> dist.ProcessGroup | None:
        """The ``dp / E`` ranks holding the same experts (None without expert parallelism)."""
        return self.groups.edp

    @property
    def hybrid(self) -> bool:
        return self.replicas > 1

    @property
    def zero_group(self) -> dist.ProcessGroup:
        """Every rank holding this rank's tensor-parallel block and training on other tokens, the axis ZeRO shards
        over (``zero_rank`` is the index on it): the ``dp`` axis, times the ``sp`` axis under sequence parallelism
        (what the initial broadcast, the deferred construction and, with hybrid sharding, the gradient norm must
        reach; see [Note: the sequence axis])."""
        return self.groups.dp_sp if self.groups.dp_sp is not None else self.groups.dp

    @property
    def dp_rank(self) -> int:
        """This rank's index along the axis batches differ on (``replica_rank * shard_size + shard_rank``)."""
        return self._stage_rank // (self.tp * self.sp * self.cp)

    @property
    def zero_rank(self) -> int:
        """This rank's index among the ``dp * sp`` ranks holding its tensor-parallel block (``dp_rank * sp +
        sp_rank``; ``dp_rank`` without sequence parallelism): the axis ZeRO shards over, hybrid sharding's
        ``replica_rank * shard_size + shard_rank``."""
        return self._stage_rank // self.tp

    @property
    def sp_rank(self) -> int:
        """This rank's index in its sequence-parallel group: which slice of the sequence it holds."""
        return (self._stage_rank // self.tp) % self.sp

    @property
    def sp_group(self) -> dist.ProcessGroup | None:
        """None without sequence parallelism."""
        return self.groups.sp

    @property
    def cp_rank(self) -> int:
        """This rank's index in its context-parallel group: which two chunks of the sequence it holds ([Note: the
        context axis])."""
        return (self._stage_rank // (self.tp * self.sp)) % self.cp

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        """None without context parallelism."""
        return self.groups.cp

    @property
    def seq_group(self) -> dist.ProcessGroup | None:
        """Every rank sharing this rank's sequence: the cp group, the sp group, or with both the ``cp * sp`` ranks
        of [Note: the context axis]; None without either."""
        if self.groups.seq is not None:
            return self.groups.seq
        return self.groups.cp if self.groups.cp is not None else self.groups.sp

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("tp")

    @property
    def tp_rank(self) -> int:
        return self.mesh.get_local_rank("tp")

    @property
    def shard_size(self) -> int:
        """Ranks ZeRO shards state over: ``mics_shard_size``, or the whole data-parallel size (times the
        sequence-parallel size, see [Note: the sequence axis])."""
        return self.dp * self.cp * self.sp // self.replicas

    @property
    def shard_rank(self) -> int:
        return (self._stage_rank // self.tp) % self.shard_size

    @property
    def replica_rank(self) -> int:
        return (self._stage_rank // self.tp) // self.shard_size

    @property
    def shard_group(self) -> dist.ProcessGroup:
        if self.groups.shard is not None:
            return self.groups.shard
        return self.zero_group  # dp, times sp under sequence parallelism (see [Note: the sequence axis])

    @property
    def replicate_group(self) -> dist.ProcessGroup | None:
        """None without hybrid sharding."""
        return self.groups.replicate

    @property
    def host_shard_group(self) -> dist.ProcessGroup:
        if self.host_groups.shard is not None:
            return self.host_groups.shard
        return self.host_dp_group

    @property
    def world_group(self) -> dist.ProcessGroup:
        return self.groups.world

    @property
    def model_group(self) -> dist.ProcessGroup:
        """The ranks holding one whole model (or, under pipeline parallelism, one stage of it): the world group
        without pipelining, this rank's stage's ranks with it."""
        return self.groups.stage if self.groups.stage is not None else self.groups.world

    @property
    def host_world_group(self) -> dist.ProcessGroup:
        """Every rank, exchanging CPU tensors (see [Note: the engine's groups])."""
        return self.host_groups.world

    @property
    def host_dp_group(self) -> dist.ProcessGroup:
        return self.host_groups.dp_sp if self.host_groups.dp_sp is not None else self.host_groups.dp

    @property
    def host_tp_group(self) -> dist.ProcessGroup:
        return self.host_groups.tp


def _pipeline_sequence_mesh(groups: Groups, device_type: str, world: int, dims: ParallelDims) -> DeviceMesh:
    """The mesh of pipeline parallelism with the sequence split in each stage: ``(pp, dp, cp, sp, tp)``, the axes of
    size 1 left out, each stage's ranks laid out as a whole job without pipelining ([Note: the pipeline axis])."""
    axes = [("pp", dims.pp, groups.pp), ("dp", dims.dp, groups.dp), ("cp", dims.cp, groups.cp)]
    axes += [("sp", dims.sp, groups.sp), ("tp", dims.tp, groups.tp)]
    kept = [(name, size, group) for name, size, group in axes if size > 1 or name in ("dp", "tp")]
    ranks = torch.arange(world).view(*(size for _, size, _ in kept))
    return DeviceMesh.from_group(
        [g for _, _, g in kept], device_type, mesh=ranks, mesh_dim_names=tuple(name for name, _, _ in kept)
    )


def join_world(timeout_s: float = 1800.0, device: str | None = None) -> int:
    """Make (or adopt) the default process group on this rank's device (``device``: the config's, see
    :func:`pick_device`) and return the number of processes: what the plan's dimensions are resolved at."""
    ensure_process_group(timeout_s, pick_device(device))
    return dist.get_world_size()


def init_topology(dims: ParallelDims, timeout_s: float = 1800.0, device: str | None = None) -> Topology:
    """The device mesh and the engine's groups for ``dims`` (validated when they were made: every refusal of a size
    is :class:`~shardtrain.plan.dims.ParallelDims`'): ``(dp, tp)``, ``(replicate, shard, tp)`` with hybrid sharding
    ([Note: the hybrid mesh]), ``(dp, sp, tp)`` with sequence parallelism ([Note: the sequence axis]), ``(edp, ep,
    tp)`` with expert parallelism ([Note: the expert axis]), ``(pp, dp, tp)`` with pipeline parallelism ([Note: the
    pipeline axis]). Makes or adopts the default process group first."""
    dev = pick_device(device)
    created = ensure_process_group(timeout_s, dev)
    world = dist.get_world_size()
    if dims.world != world:
        raise LayoutError(f"the layout was planned for {dims.world} processes, but this job has {world}")
    tp, sp, dp, ep, shard = dims.tp, dims.sp, dims.dp, dims.ep, dims.shard
    cp = dims.cp
    # hpZ is not built with sequence parallelism (dims.hpz is 1 then); with context parallelism its groups are
    # adjacent ranks of ZeRO's dp * cp axis
    axes = {"sp": sp, "hpz_size": dims.hpz}
    if cp > 1:
        axes["cp"] = cp
    if dims.pp > 1:
        axes["pp"] = dims.pp
    device, backend, groups, host_groups, own = _make_mesh_groups(
        dev, world, tp, timeout_s, created, shard_size=shard, ep=ep, **axes
    )
    if dims.pp > 1 and cp * sp > 1:
        mesh = _pipeline_sequence_mesh(groups, device.type, world, dims)
    elif dims.pp > 1:  # the plan refuses pp beside hybrid sharding: (pp, dp, tp), the expert groups beside it
        ranks = torch.arange(world).view(dims.pp, dp, tp)
        mesh = DeviceMesh.from_group(
            [groups.pp, groups.dp, groups.tp], device.type, mesh=ranks, mesh_dim_names=("pp", "dp", "tp")
        )
    elif cp > 1 and sp > 1:  # hybrid sharding's and the expert groups beside it, cut from the dp * cp * sp axis
        ranks = torch.arange(world).view(dp, cp, sp, tp)
        mesh = DeviceMesh.from_group(
            [groups.dp, groups.cp, groups.sp, groups.tp],
            device.type,
            mesh=ranks,
            mesh_dim_names=("dp", "cp", "sp", "tp"),
        )
    elif cp > 1:  # hybrid sharding's, hpZ's and the expert groups beside it, cut from the dp * cp axis
        ranks = torch.arange(world).view(dp, cp, tp)
        mesh = DeviceMesh.from_group(
            [groups.dp, groups.cp, groups.tp], device.type, mesh=ranks, mesh_dim_names=("dp", "cp", "tp")
        )
    elif sp > 1:
        ranks = torch.arange(world).view(dp, sp, tp)
        mesh = DeviceMesh.from_group(
            [groups.dp, groups.sp, groups.tp], device.type, mesh=ranks, mesh_dim_names=("dp", "sp", "tp")
        )
    elif dims.replicas > 1:  # see [Note: the hybrid mesh]
        ranks = torch.arange(world).view(dims.replicas, shard, tp)
        mesh_axes = [groups.replicate, groups.shard, groups.tp]
        mesh = DeviceMesh.from_group(mesh_axes, device.type, mesh=ranks, mesh_dim_names=("replicate", "shard", "tp"))
    elif ep > 1:  # see [Note: the expert axis]: (edp, ep) cut the dp axis at each tp rank
        ranks = torch.arange(world).view(dp // ep, ep, tp)
        mesh = DeviceMesh.from_group(
            [groups.edp, groups.ep, groups.tp], device.type, mesh=ranks, mesh_dim_names=("edp", "ep", "tp")
        )
    else:
        ranks = torch.arange(world).view(dp, tp)
        mesh = DeviceMesh.from_group([groups.dp, groups.tp], device.type, mesh=ranks, mesh_dim_names=("dp", "tp"))
    return Topology(
        rank=dist.get_rank(),
        world_size=world,
        dp=dp,
        device=device,
        backend=backend,
        mesh=mesh,
        timeout_s=timeout_s,
        groups=groups,
        host_groups=host_groups,
        tp=tp,
        replicas=dims.replicas,
        sp=sp,
        cp=cp,
        hpz_size=dims.hpz,
        ep=ep,
        pp=dims.pp,
        own_groups=own,
    )


def _make_mesh_groups(
    device: torch.device, world: int, tp: int, timeout_s: float, created: bool, **axes: int
) -> tuple[torch.device, str, Groups, Groups, tuple[dist.ProcessGroup, ...]]:
    """The device, the backend, the mesh's groups and their host twins (``axes``: ``make_groups``' hybrid
    ``shard_size`` or sequence-parallel ``sp``), every group with the collective timeout, and the groups created
    here (``Topology.own_groups``)."""
    backend = str(dist.get_backend())
    if device.type == "cuda" and "nccl" not in backend:
        # A user-created gloo group with CUDA tensors would fail deep inside the first collective.
        raise LayoutError(
            f"the process group uses {backend!r} but this rank's device is {device} (without the config's device "
            f"or {DEVICE_ENV}, CUDA when it is available); initialize the group with 'nccl', or set the "
            f'config\'s "device": "cpu" or {DEVICE_ENV}=cpu to train on the CPU'
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)  # whoever created the group: object collectives and barriers use the current
    timeout = datetime.timedelta(seconds=backend_timeout_s(timeout_s, device))

    made: list[dist.ProcessGroup] = []

    def new_group(ranks: list[int], backend: str | None) -> dist.ProcessGroup:
        # the host twins (gloo) block the host, so their own timeout is the configured one
        own = datetime.timedelta(seconds=timeout_s) if backend == "gloo" else timeout
        group = dist.new_group(ranks, timeout=own, backend=backend)
        if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:  # a group this rank is in
            made.append(group)
        return group

    whole = dist.group.WORLD
    # the user's group, with another timeout (theirs equal to collective_timeout_s, without the margin, will do), or
    # a gloo one: the engine frees its gloo groups at close(), which a group others still hold cannot be
    if not (created or _default_is_own()) and (
        device.type != "cuda" or _timeout_s(whole, device) not in (timeout_s, timeout.total_seconds())
    ):
        whole = new_group(list(range(world)), None)
    groups, host_groups = make_groups(dist.get_rank(), world, tp, backend, whole, new_group, **axes)
    _check_one_rank_per_device(device, host_groups.world)
    return device, backend, groups, host_groups, tuple(made)
