"""Sharded construction: build a model so that no rank ever holds it whole.

    with shardtrain.zero.Init():
        model = MyModel(config)            # parameters are sharded as each module is built
    engine = shardtrain.initialize(model, config={"zero_optimization": {"stage": 3}}, ...)

[Note: sharded construction]
While the context is active, the ``__init__`` of every ``nn.Module`` class is wrapped: when a module's
constructor returns, each parameter it registered is flattened, padded to the data-parallel size, and only
this rank's chunk is kept (a one-parameter unit, see :mod:`shardtrain.zero.units`). Every rank runs the
same constructor code with the same seed, so the chunks are chunks of identical tensors.

Construction code often touches parameters after they were built (a parent's ``apply(_init_weights)``,
``weight.data.normal_()``). Such a touch gathers that parameter (one all-gather: every rank touches it at
the same point); it stays whole until the next construction event (another module finished, another
parameter touched, the context exits), when its chunk is taken back. Values therefore equal those of a
normal build with the same seed, and a rank holds at most its chunks plus one module's parameters plus one
touched parameter. ``initialize`` then lays the parameters out into units one unit at a time.

Measured peak RSS may exceed that bound on glibc: its dynamic mmap threshold keeps freed blocks in the heap
(``MALLOC_MMAP_THRESHOLD_=65536`` or jemalloc make RSS follow what is allocated; see the tests).

Parameters are created on the device shardtrain would pick (the CUDA device of the local rank, else CPU).
Module classes defined inside the context are not wrapped: define models before entering it.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from shardtrain.comm import Communicator
from shardtrain.mesh import ensure_process_group, pick_device
from shardtrain.zero.guarded import ShardedParameter, guard, guard_of, unguard
from shardtrain.zero.layout import build_buckets
from shardtrain.zero.units import Unit, UnitState


class ConstructionRuntime:
    """Gathers and re-shards one-parameter units while a model is being built (see the module note)."""

    in_forward = False

    def hooks_for_op(self) -> None:  # nothing autograd saves during construction is a unit's to mark
        return None

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self._open: list[Unit] = []

    def shard(self, name: str, p: nn.Parameter) -> None:
        (bucket,) = build_buckets([[(name, p)]], self.comm.size, self.comm.rank, own_shard=True)
        bucket.gather_after_step = False
        unit = Unit(-1, name, module=None, buckets=[bucket], runtime=self)
        guard(p, name, unit)
        self._release(unit)

    def _release(self, unit: Unit) -> None:
        for b in unit.buckets:
            b.flat_param.untyped_storage().resize_(0)
        unit.state = UnitState.SHARDED

    def settle(self) -> None:
        """Take back the chunks of touched parameters (their values may have changed) and free them."""
        for unit in self._open:
            for b in unit.buckets:
                lo, hi = b.shard_range
                b.shard.copy_(b.flat_param[lo:hi])
            self._release(unit)
        self._open.clear()

    def touch(self, p: ShardedParameter) -> None:
        unit = guard_of(p).unit
        if unit in self._open:
            return
        self.settle()
        for b in unit.buckets:
            b.flat_param.untyped_storage().resize_(b.padded_numel * b.flat_param.element_size())
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(b.flat_param):
                self.comm.all_gather(b.flat_param, b.shard, what=f"parameter {unit.name!r} during construction")
        unit.state = UnitState.GATHERED
        self._open.append(unit)

    def materialize(self, p: ShardedParameter) -> None:
        """Turn a parameter built under Init back into an ordinary whole Parameter."""
        self.touch(p)
        full = p.detach().clone()
        self._open.remove(guard_of(p).unit)
        unguard(p)
        p.data = full

    def post_init(self, module: nn.Module) -> None:
        self.settle()
        for name, p in list(module._parameters.items()):
            if p is not None and not isinstance(p, ShardedParameter):
                self.shard(f"{type(module).__name__}.{name}", p)


def is_under_construction(p: nn.Parameter) -> bool:
    return isinstance(p, ShardedParameter) and isinstance(guard_of(p).unit.runtime, ConstructionRuntime)


def construction_runtime(p: nn.Parameter) -> ConstructionRuntime:
    """The runtime that built ``p`` under :class:`Init` (``p`` must be under construction)."""
    return guard_of(p).unit.runtime


def _module_classes() -> list[type[nn.Module]]:
    seen, stack = [], [nn.Module]
    while stack:
        cls = stack.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.append(sub)
                stack.append(sub)
    return [nn.Module, *seen]


class Init:
    """Context manager for sharded construction; see [Note: sharded construction]."""

    def __init__(self, timeout_s: float = 1800.0) -> None:
        self.timeout_s = timeout_s
        self._patched: list[tuple[type, object]] = []
        self._device_ctx: torch.device | None = None

    def __enter__(self) -> Init:
        ensure_process_group(self.timeout_s)
        self.runtime = ConstructionRuntime(Communicator(dist.group.WORLD, self.timeout_s))
        for cls in _module_classes()[1:]:  # nn.Module.__init__ itself registers no parameter
            if "__init__" in cls.__dict__:
                original = cls.__dict__["__init__"]
                cls.__init__ = self._wrap(original)
                self._patched.append((cls, original))
        self._device_ctx = pick_device()
        self._device_ctx.__enter__()
        return self

    def _wrap(self, original):
        runtime = self.runtime

        @functools.wraps(original)
        def init(module, *args, **kwargs):
            original(module, *args, **kwargs)
            runtime.post_init(module)  # base-class constructors finish first; already sharded ones are skipped

        return init

    def __exit__(self, *exc) -> None:
        assert self._device_ctx is not None
        self._device_ctx.__exit__(*exc)
        for cls, original in reversed(self._patched):
            cls.__init__ = original
        self._patched.clear()
        self.runtime.settle()
