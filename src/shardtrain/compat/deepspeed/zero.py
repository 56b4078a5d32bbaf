"""``deepspeed.zero``: ``Init`` (sharded construction) and ``GatheredParameters``, over shardtrain's own.

[Note: GatheredParameters without an engine argument]
DeepSpeed's ``GatheredParameters(params)`` is given parameters only; the engine that shards them is found here:
a parameter still under ``zero.Init`` construction belongs to its construction runtime; one of a model passed to
``shardtrain.deepspeed.initialize`` belongs to that engine, whose ``gathered()`` does the work (at every stage:
with ``modifier_rank`` it broadcasts that rank's values into every rank's shard and into the optimizer's fp32 masters,
so the change survives the next step). Other parameters are plain tensors, which DeepSpeed also leaves alone.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from shardtrain.compat.deepspeed.unsupported import not_provided
from shardtrain.construction.sharded_init import Init as _ShardedInit
from shardtrain.construction.sharded_init import construction_runtime, is_under_construction
from shardtrain.engine.engine import Engine
from shardtrain.zero.guarded import guard_of

_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()
"""Engines built by ``shardtrain.deepspeed.initialize`` (see [Note: GatheredParameters without an engine
argument])."""


def register_engine(engine: Engine) -> None:
    _ENGINES.add(engine)


class DeepSpeedInit:
    """``deepspeed.zero.Init``: build a model with its parameters sharded over the ranks as they are created.

    ``enabled=False`` builds it normally. ``config_dict_or_path`` / ``config`` goes to shardtrain's ``zero.Init``:
    its timeout, and with ``tensor_parallel.size`` > 1 or ``expert_parallel_size`` > 1 a deferred build whose
    parameters are materialized as each rank's fragment of its block (or of its experts' rows) after the split
    (docs/sharded-construction.md). Remote devices, quantized weights
    and other groups are refused by name."""

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        zero_param_parallel_group: Any = None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        sequence_data_parallel_group: Any = None,
        param_swapper: Any = None,
    ) -> None:
        refused = {
            "module": module is not None,
            "data_parallel_group": data_parallel_group is not None,
            "remote_device": remote_device not in (None, "none", "cpu") and enabled,
            "dtype": dtype is not None,
            "mpu": mpu is not None,
            "zero_param_parallel_group": zero_param_parallel_group is not None,
            "zero_quantized_weights": bool(zero_quantized_weights),
            "zero_quantized_nontrainable_weights": bool(zero_quantized_nontrainable_weights),
            "sequence_data_parallel_group": sequence_data_parallel_group is not None,
            "param_swapper": param_swapper is not None,
        }
        for name, given in refused.items():
            if given:
                raise not_provided(
                    f"deepspeed.zero.Init({name}=...)",
                    "build the model under zero.Init() without it (it shards over every rank, in the dtype the "
                    "model's code gives), then pass the model to initialize()",
                )
        if config_dict_or_path is not None and config is not None:
            raise ValueError("deepspeed.zero.Init: pass config_dict_or_path or config, not both")
        source = config_dict_or_path if config_dict_or_path is not None else config
        # remote_device "cpu" asks for the shards in host memory: on CPU they are, on CUDA it is refused by
        # initialize's offload checks like offload_param; shardtrain creates them on the device it trains on
        self.enabled = enabled
        self._inner = _ShardedInit(source) if enabled else None

    def __enter__(self) -> DeepSpeedInit:
        if self._inner is not None:
            self._inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._inner is not None:
            self._inner.__exit__(*exc)


Init = DeepSpeedInit
"""The name scripts write (``deepspeed.zero.Init``); the class is named apart from :class:`shardtrain.zero.Init`."""


def _as_list(params: nn.Parameter | Iterable[nn.Parameter]) -> list[nn.Parameter]:
    if isinstance(params, torch.Tensor):
        return [params]
    if isinstance(params, nn.Module):
        raise TypeError("deepspeed.zero.GatheredParameters expects parameters, got a module: pass module.parameters()")
    return [p for p in params if p is not None]


def _owner(params: list[nn.Parameter]) -> Engine | None:
    owners = set()
    for engine in list(_ENGINES):
        mine = {id(p) for p in engine.module.parameters()}
        hits = [p for p in params if id(p) in mine]
        if hits and len(hits) != len(params):
            raise ValueError(
                "deepspeed.zero.GatheredParameters: some of the parameters given belong to an engine and some do "
                "not; gather each model's parameters in a block of their own"
            )
        if hits:
            owners.add(engine)
    if len(owners) > 1:
        raise ValueError(
            "deepspeed.zero.GatheredParameters: the parameters given belong to several engines; gather each "
            "engine's parameters in a block of their own"
        )
    return owners.pop() if owners else None


def engine_of(param: nn.Parameter) -> Engine | None:
    """The engine built by ``shardtrain.deepspeed.initialize`` whose model holds ``param``; None if none does."""
    return _owner([param])


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """``deepspeed.zero.register_external_parameter``: accepted, nothing to do. DeepSpeed needs it for a parameter
    that one module's forward uses but another module owns; here a stage-3 parameter used outside its unit is
    gathered on demand (its guard, :mod:`shardtrain.zero.guarded`), and every parameter is whole at stages 0-2."""
    if not isinstance(parameter, torch.Tensor):
        raise TypeError(f"register_external_parameter: expected a parameter, got {type(parameter).__name__}")


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """``deepspeed.zero.unregister_external_parameter``: accepted, nothing to do (see register_external_parameter)."""


class GatheredParameters:
    """``deepspeed.zero.GatheredParameters(params, modifier_rank=None)``: inside the block every rank holds the full
    ``params``; with ``modifier_rank=r`` the values rank ``r`` leaves there at the end reach every rank's shard.
    Collective: every rank enters the block. See [Note: GatheredParameters without an engine argument]."""

    def __init__(
        self,
        params: nn.Parameter | Iterable[nn.Parameter],
        modifier_rank: int | None = None,
        fwd_module: nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        if fwd_module is not None:
            raise not_provided(
                "deepspeed.zero.GatheredParameters(fwd_module=...)",
                "a parameter used outside its module is gathered on demand during forward: leave fwd_module out",
            )
        self.params = _as_list(params) if enabled else []
        self.modifier_rank = modifier_rank
        self._stack = ExitStack()
        self._building: list[tuple[nn.Parameter, str, Any]] = []

    def __enter__(self) -> GatheredParameters:
        if not self.params:
            return self
        building = [p for p in self.params if is_under_construction(p)]
        if building and len(building) != len(self.params):
            raise ValueError(
                "deepspeed.zero.GatheredParameters: some parameters are still being built under zero.Init and some "
                "are not; gather them in separate blocks"
            )
        if building:
            # whole while the block runs: each is made an ordinary parameter, and sharded again at the end
            for p in building:
                name, runtime = guard_of(p).name, construction_runtime(p)
                runtime.materialize(p)
                self._building.append((p, name, runtime))
            return self
        engine = _owner(self.params)
        if engine is not None:
            self._stack.enter_context(engine.gathered(self.params, modifier_rank=self.modifier_rank))
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._building:
            self._stack.__exit__(*exc)
            return
        if exc[0] is None and self.modifier_rank is not None:
            with torch.no_grad():
                for p, name, runtime in self._building:
                    if not 0 <= self.modifier_rank < runtime.comm.size:
                        raise ValueError(
                            f"deepspeed.zero.GatheredParameters: modifier_rank {self.modifier_rank} is not a rank of "
                            f"this job (0..{runtime.comm.size - 1})"
                        )
                    runtime.comm.broadcast(p.data, self.modifier_rank, what=f"{name!r} changed in GatheredParameters")
        for p, name, runtime in self._building:
            runtime.shard(name, p)


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(f"module 'shardtrain.deepspeed.zero' has no attribute {name!r}")
    raise not_provided(
        f"deepspeed.zero.{name}",
        "shardtrain.deepspeed.zero provides Init, GatheredParameters and register_external_parameter",
    )
