"""Process topology: who we are, which device and backend we use, and the data- and tensor-parallel groups.

A :class:`Topology` is built once by :func:`init_topology` and passed explicitly to everything that
communicates. There are no process-group globals in shardtrain.

Three ways to start are supported:

* the user already called ``torch.distributed.init_process_group``: we use that group as it is;
* launched by ``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` set): we initialize from the env;
* a plain ``python train.py``: we initialize a one-process group on a free local port, so the same code
  path runs everywhere.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardtrain import comm_failure
from shardtrain.errors import LayoutError


def pick_device() -> torch.device:
    """CUDA device of this local rank when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_process_group(timeout_s: float) -> bool:
    """Initialize the default process group if nobody has; returns True when this call created it."""
    if dist.is_initialized():
        return False
    device = pick_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        # A plain single-process run: no launcher set the rendezvous variables.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
    dist.init_process_group(backend=backend_for(device), timeout=datetime.timedelta(seconds=timeout_s))
    atexit.register(_destroy_own_process_group)
    return True


def _destroy_own_process_group() -> None:
    """Destroy the process group this module created, while the interpreter is still whole.

    A gloo group left to the interpreter's finalization may still own work objects holding tensors; freeing them
    then takes the GIL of a half-torn-down interpreter and the process dies with SIGABRT ("terminate called without
    an active exception") after the script has finished, which torchrun reports as a failed job. Destroying a gloo
    group is local (no collective). After a collective failed the group is left alone: the process is failing anyway,
    and NCCL's teardown of a group whose peers are gone may wait for them."""
    if comm_failure.any_failed():
        return
    with contextlib.suppress(Exception):  # already destroyed by the user
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass(frozen=True)
class Topology:
    """The parallel layout of this job, validated once: a 2-D ``(dp, tp)`` device mesh.

    Tensor-parallel groups are ``tp`` adjacent ranks (``rank = dp_rank * tp + tp_rank``), so that on a
    multi-GPU node a layer's all-reduces stay inside the node; ZeRO shards over the ``dp`` axis only, i.e.
    across the tensor-parallel groups, between ranks holding the same tensor-parallel block.
    """

    rank: int
    world_size: int
    dp: int
    device: torch.device
    backend: str
    mesh: DeviceMesh
    timeout_s: float
    tp: int = 1

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("dp")

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp")

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("tp")

    @property
    def tp_rank(self) -> int:
        return self.mesh.get_local_rank("tp")

    @property
    def world_group(self) -> dist.ProcessGroup:
        return dist.group.WORLD


def init_topology(tp: int = 1, timeout_s: float = 1800.0) -> Topology:
    """Create (or adopt) the process group and the ``(dp, tp)`` device mesh, and check the layout is possible."""
    ensure_process_group(timeout_s)
    world = dist.get_world_size()
    if tp < 1 or world % tp:
        raise LayoutError(
            f"tensor_parallel.size {tp} does not divide the {world} processes of this job: the data-parallel size "
            f"is world / tensor_parallel.size, so choose one of {[d for d in range(1, world + 1) if world % d == 0]}"
        )
    dp = world // tp
    device = pick_device()
    backend = str(dist.get_backend())
    if device.type == "cuda" and "nccl" not in backend:
        # A user-created gloo group with CUDA tensors would fail deep inside the first collective.
        raise LayoutError(f"the process group uses {backend!r} but tensors live on CUDA; initialize it with 'nccl'.")
    mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    return Topology(
        rank=dist.get_rank(),
        world_size=world,
        dp=dp,
        device=device,
        backend=backend,
        mesh=mesh,
        timeout_s=timeout_s,
        tp=tp,
    )
