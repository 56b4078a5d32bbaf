"""``deepspeed.comm``: DeepSpeed's communication API, which is ``torch.distributed`` with DeepSpeed's signatures.

DeepSpeed's functions take ``torch.distributed``'s arguments plus its profiling ones (``prof``, ``log_name``,
``debug``), which only feed DeepSpeed's communication logger; here they are accepted and have no effect (the
engine's own traffic is in ``engine.comm_stats()``). Every call goes to the default process group unless a
``group`` is given, as in DeepSpeed. A name this module does not provide raises
:class:`~shardtrain.compat.deepspeed.unsupported.NotProvidedError` naming it.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from shardtrain.compat.deepspeed.unsupported import not_provided
from shardtrain.distributed.mesh import backend_for, ensure_process_group, pick_device

ReduceOp = dist.ReduceOp


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: datetime.timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """``deepspeed.init_distributed`` and ``deepspeed.comm.init_distributed`` (one function). Join the default
    process group from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``), unless one exists. ``dist_backend``: DeepSpeed's names (``nccl``, ``gloo``) or None for the
    device's (NCCL on CUDA, gloo on the CPU)."""
    if dist.is_initialized():
        return
    if dist_init_required is False:
        raise ValueError("init_distributed(dist_init_required=False) but no process group exists: create one first")
    if (
        init_method is not None
        or rank != -1
        or world_size != -1
        or (dist_backend not in (None, backend_for(pick_device())))
    ):
        # an explicit rendezvous: torch's own call, with DeepSpeed's arguments
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        kwargs: dict[str, Any] = {"backend": dist_backend or backend_for(pick_device()), "init_method": init_method}
        if rank != -1 or world_size != -1:
            kwargs.update(rank=rank, world_size=world_size)
        if timeout is not None:
            kwargs["timeout"] = timeout
        dist.init_process_group(**kwargs)
        return
    ensure_process_group(timeout.total_seconds() if timeout is not None else 1800.0)


def is_initialized() -> bool:
    return dist.is_initialized()


def is_available() -> bool:
    return dist.is_available()


def get_rank(group: Any = None) -> int:
    return dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """This process's rank on its node (``LOCAL_RANK``, 0 without a launcher), as DeepSpeed reads it."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    return dist.get_global_rank(group if group is not None else dist.group.WORLD, group_rank)


def get_world_group() -> Any:
    return dist.group.WORLD


def new_group(ranks: list[int] | None = None, **kwargs: Any) -> Any:
    return dist.new_group(ranks, **kwargs)


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None, **profiling: Any) -> Any:
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def all_reduce(
    tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False, **profiling: Any
) -> Any:
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False, **profiling: Any) -> Any:
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_gather(
    tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False, **profiling: Any
) -> Any:
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(
    output_tensor: torch.Tensor, tensor: torch.Tensor, group: Any = None, async_op: bool = False, **profiling: Any
) -> Any:
    return dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    **profiling: Any,
) -> Any:
    return dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def reduce(
    tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False, **profiling: Any
) -> Any:
    return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int = 0,
    group: Any = None,
    async_op: bool = False,
    **profiling: Any,
) -> Any:
    return dist.gather(tensor, gather_list, dst, group=group, async_op=async_op)


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    dist.all_gather_object(object_list, obj, group=group)


def broadcast_object_list(object_list: list[Any], src: int, group: Any = None, device: Any = None) -> None:
    dist.broadcast_object_list(object_list, src, group=group, device=device)


def destroy_process_group(group: Any = None) -> None:
    dist.destroy_process_group(group)


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(f"module 'deepspeed.comm' has no attribute {name!r}")
    raise not_provided(f"deepspeed.comm.{name}", f"use torch.distributed.{name}")
