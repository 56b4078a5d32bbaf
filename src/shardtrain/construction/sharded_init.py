"""Sharded construction: build a model so that no rank ever holds it whole.

    with shardtrain.zero.Init():
        model = MyModel(config)            # parameters are sharded as each module is built
    engine = shardtrain.initialize(model, config={"zero_optimization": {"stage": 3}}, ...)

[Note: sharded construction]
While the context is active every ``nn.Module`` class's ``__init__`` is wrapped: when a constructor returns, each
parameter it registered is flattened, padded to the data-parallel size and cut to this rank's chunk (a one-parameter
unit, :mod:`shardtrain.zero.units`). Every rank runs the same constructor with the same seed, so the chunks are of
identical tensors. A later touch of a built parameter (a parent's ``apply(_init_weights)``,
``weight.data.normal_()``) gathers it (one all-gather; every rank touches it at the same point), and it stays whole
until the next construction event (another module done, another parameter touched, the context exits). So values
equal a normal build's with the same seed, and a rank holds at most its chunks plus one module's parameters plus one
touched parameter (peak RSS on glibc may exceed this: docs/sharded-construction.md, "Memory, measured").
``initialize`` then lays the parameters out into units one unit at a time. Parameters are created on the device
shardtrain would pick (the local rank's CUDA device, else CPU). Module classes defined inside the context are not
wrapped: define models before entering it.

[Note: deferred construction]
With tensor parallelism a parameter must end up as this rank's block of a split tensor, known only once the model is
whole (plans match module *names*). So ``Init(config)`` with ``tensor_parallel.size`` > 1 (or ``Init(deferred=True)``)
builds no parameter: factories run on ``meta`` and a dispatch mode records, per meta storage, the initialization
applied (an :class:`InitRecipe`: ``normal_``, ``uniform_``, ``fill_``/``zero_``, element-wise in-place ops with scalar
arguments such as ``trunc_normal_``'s). Tensors computed by other ops (``arange``, rotary frequencies) stay real.
``initialize`` splits the meta model and :func:`materialize_deferred` makes each parameter directly as this rank's
chunk of its block, each element computed from its position in the *whole* tensor (``global_flat_index``) alone: no
rank allocates more than its chunk, and values do not depend on the layout. Random steps hash ``(seed, name, k, i)``,
since torch's generators cannot produce a slice of a stream alone: the numbers are the same in one process or at any
(dp, tp), but *not* those of ``torch.manual_seed`` + a normal build (docs/sharded-construction.md, "Initial values").
``seed`` is ``Init(seed=...)``, else ``torch.initial_seed()`` at entry. A model built on ``meta`` without ``Init``
has no recipes: ``initialize`` records them by calling each module's ``reset_parameters()`` (as FSDP2 and torchtitan
do); a parameter still without one starts at zero (with a warning) and is expected to be loaded. What cannot be
replayed on a chunk (``orthogonal_``, a write through a partial view, a copy from another tensor, a buffer computed on
``meta``) is refused by name.

[Note: experts under sharded construction]
Under expert parallelism (``expert_parallel_size: E``) a rank keeps rows ``[ep_rank * n/E, (ep_rank + 1) * n/E)`` of
each fused experts weight ``[n, ...]``, chunked over the expert-data-parallel group (the ``dp / E`` ranks holding the
same experts, [Note: expert buckets] in :mod:`shardtrain.zero.layout`). Deferred (``Init(config)`` with
``expert_parallel_size`` > 1, ``Init(deferred=True)``, or a model built on ``meta``): ``initialize`` cuts the meta
rows and :func:`materialize_deferred` computes each element of this rank's chunk from its position in the whole
tensor (rows a dim-0 block over ``E``: ``TPPlacement(0, 1, whole)``), so no rank allocates another rank's experts and
values match a one-process deferred build at any (dp, ep). Sharded as built (``Init()``, ``Init(config,
deferred=False)``): values are a normal build's, chunked over the world; ``initialize`` gathers each expert weight
once (one whole weight at a time, as construction did), keeps its rows and chunks them over the expert-data-parallel
group. Either way the layout then gathers each unit's expert weights over that group. Rank 0's model is not broadcast
first (unlike a model built in memory): the chunks are of one tensor or computed from positions, so every rank's rows
are rows of the same model.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import math
import sys
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from shardtrain.config.sections import Config, load_config
from shardtrain.distributed.communicator import Communicator
from shardtrain.distributed.mesh import ensure_process_group, pick_device
from shardtrain.distributed.placement import TPPlacement, global_flat_index
from shardtrain.errors import ConfigError
from shardtrain.zero.guarded import ShardedParameter, guard, guard_of, unguard
from shardtrain.zero.layout import Bucket, ParamSlot, _fragment, build_buckets
from shardtrain.zero.units import Unit, UnitState

log = logging.getLogger(__name__)


class ConstructionRuntime:
    """Gathers and re-shards one-parameter units while a model is being built (see the module note)."""

    in_forward = False

    def hooks_for_op(self) -> None:  # nothing autograd saves during construction is a unit's to mark
        return None

    def __init__(self, comm: Communicator, device: torch.device | None = None) -> None:
        self.comm = comm
        self.device = device if device is not None else pick_device()
        self._open: list[Unit] = []
        # units sharded over another group than ``comm`` (expert weights: their expert-data-parallel group)
        self._groups: weakref.WeakKeyDictionary[Unit, Communicator] = weakref.WeakKeyDictionary()

    def _group(self, unit: Unit) -> Communicator:
        return self._groups.get(unit, self.comm)

    def shard(self, name: str, p: nn.Parameter, comm: Communicator | None = None) -> None:
        """Make ``p`` a one-parameter unit holding this rank's chunk over ``comm`` (default the runtime's)."""
        comm = comm if comm is not None else self.comm
        (bucket,) = build_buckets([[(name, p)]], comm.size, comm.rank, own_shard=True)
        bucket.gather_after_step = False
        unit = Unit(-1, name, module=None, buckets=[bucket], runtime=self)
        if comm is not self.comm:
            self._groups[unit] = comm
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
            storage = b.flat_param.untyped_storage()
            storage.resize_(b.padded_numel * b.flat_param.element_size())
            if b.flat_param.numel() != b.padded_numel:  # a deferred parameter's first gather: shape the buffer
                self._point_into(b, storage)
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(b.flat_param):
                self._group(unit).all_gather(b.flat_param, b.shard, what=f"parameter {unit.name!r} during construction")
        unit.state = UnitState.GATHERED
        self._open.append(unit)

    def shard_deferred(
        self,
        name: str,
        p: nn.Parameter,
        values: Callable[[int, int], torch.Tensor],
        comm: Communicator | None = None,
    ) -> None:
        """Make ``p`` (a meta parameter) a one-parameter unit holding only this rank's chunk over ``comm`` (default
        the runtime's), whose elements ``[a, b)`` of the flattened parameter ``values(a, b)`` computes ([Note:
        deferred construction]). The full buffer gets storage only when the parameter is gathered."""
        comm = comm if comm is not None else self.comm
        dp, rank = comm.size, comm.rank
        n, dtype, device = p.numel(), p.dtype, self.device
        padded = -(-n // dp) * dp
        lo, hi = rank * (padded // dp), (rank + 1) * (padded // dp)
        shard = torch.zeros(padded // dp, dtype=dtype, device=device)
        a, b = min(lo, n), min(hi, n)
        if b > a:
            shard[: b - a] = values(a, b)
        slot = ParamSlot(name=name, param=p, offset=0, numel=n)
        flat = torch.empty(0, dtype=dtype, device=device)  # shaped to `padded` by its first gather
        bucket = Bucket(-1, dtype, [slot], n, padded, dp, rank, flat_param=flat, shard=shard)
        bucket.requires_grad, bucket.gather_after_step = p.requires_grad, False
        bucket.fragments = [_fragment(slot, lo, hi)]
        _leave_meta(p, torch.zeros((), dtype=dtype, device=device).expand(p.shape))
        unit = Unit(-1, name, module=None, buckets=[bucket], runtime=self)
        if comm is not self.comm:
            self._groups[unit] = comm
        guard(p, name, unit)
        unit.state = UnitState.SHARDED

    @staticmethod
    def _point_into(b: Bucket, storage: torch.UntypedStorage) -> None:
        b.flat_param.set_(storage, 0, (b.padded_numel,), (1,))
        with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():  # layout work on a guarded parameter
            for s in b.slots:
                s.param.data = b.flat_param[s.offset : s.offset + s.numel].view(s.param.shape)

    def materialize(self, p: ShardedParameter) -> None:
        """Turn a parameter built under Init back into an ordinary whole Parameter."""
        self.touch(p)
        full = p.detach().clone()
        self._open.remove(guard_of(p).unit)
        unguard(p)
        p.data = full

    def keep_rows(self, name: str, p: ShardedParameter, first: int, count: int, comm: Communicator) -> None:
        """Keep rows ``[first, first + count)`` (dim 0) of ``p``, sharded over ``comm``: ``p`` is gathered whole
        once, its rows copied out, and it becomes a one-parameter unit of those rows over ``comm`` ([Note: experts
        under sharded construction])."""
        self.touch(p)
        unit = guard_of(p).unit
        with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():  # layout work on a guarded parameter
            rows = p.detach()[first : first + count].clone()
        self._open.remove(unit)
        self._release(unit)  # the whole tensor's storage goes before the rows are sharded
        unguard(p)
        p.data = rows
        self.shard(name, p, comm)

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


def expert_rows_cut(comm: Communicator) -> Callable[[str, nn.Parameter, int, int], None]:
    """How expert parallelism keeps rows ``[first, first + count)`` of an expert weight ``p``: one built under
    :class:`Init` is gathered once and its rows sharded over ``comm`` (the expert-data-parallel group); one on
    ``meta`` or in memory is sliced ([Note: experts under sharded construction])."""

    def cut(name: str, p: nn.Parameter, first: int, count: int) -> None:
        if is_under_construction(p):
            construction_runtime(p).keep_rows(name, p, first, count, comm)
        else:
            p.data = p.detach()[first : first + count].clone()

    return cut


def _module_classes() -> list[type[nn.Module]]:
    seen, stack = [], [nn.Module]
    while stack:
        cls = stack.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.append(sub)
                stack.append(sub)
    return [nn.Module, *seen]


# -- deferred construction ([Note: deferred construction]) -------------------------------------------------

aten = torch.ops.aten
# factories whose values are a constant or a distribution: made on meta, their recipe written down
# (("fill_arg", i): the value is argument i)
_META_FACTORIES = {
    aten.empty.memory_format: None,
    aten.empty_strided.default: None,
    aten.zeros.default: ("fill", 0.0),
    aten.ones.default: ("fill", 1.0),
    aten.full.default: ("fill_arg", 1),
    aten.rand.default: ("uniform", 0.0, 1.0),
    aten.randn.default: ("normal", 0.0, 1.0),
}
# the same from another tensor's shape: a new recipe when that tensor (so the result) is on meta
_LIKE_FACTORIES = {
    aten.empty_like.default: None,
    aten.zeros_like.default: ("fill", 0.0),
    aten.ones_like.default: ("fill", 1.0),
    aten.full_like.default: ("fill_arg", 1),
    aten.rand_like.default: ("uniform", 0.0, 1.0),
    aten.randn_like.default: ("normal", 0.0, 1.0),
    aten.new_empty.default: None,
    aten.new_empty_strided.default: None,
    aten.new_zeros.default: ("fill", 0.0),
    aten.new_ones.default: ("fill", 1.0),
    aten.new_full.default: ("fill_arg", 2),
}
# copies of a whole tensor (``module.to(dtype)``, ``clone``): the copy has the source's recipe (computed in float64,
# cast once to the copy's dtype)
_COPIES = frozenset([aten._to_copy.default, aten.clone.default])
# in-place element-wise ops that may follow an initialization (trunc_normal_, scaling) with scalar arguments
_ELEMENTWISE = frozenset(
    [
        "mul_",
        "add_",
        "sub_",
        "div_",
        "erfinv_",
        "clamp_",
        "clamp_min_",
        "clamp_max_",
        "neg_",
        "exp_",
        "log_",
        "sqrt_",
        "abs_",
        "tanh_",
        "sigmoid_",
        "pow_",
    ]
)


@dataclass
class InitRecipe:
    """How one meta tensor was initialized: the steps replayed on each rank's chunk, or why they cannot be."""

    seed: int
    steps: list[tuple] = field(default_factory=list)  # ("fill", v) | ("uniform", a, b, k) | ("normal", m, s, k)
    # | ("op", OpOverload, scalar args, kwargs)
    broken: str | None = None
    randoms: int = 0

    def add_random(self, kind: str, *params: float) -> None:
        self.steps.append((kind, *(float(x) for x in params), self.randoms))
        self.randoms += 1


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _whole(t: torch.Tensor) -> bool:
    return t.numel() * t.element_size() == t.untyped_storage().nbytes()


def _written(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func`` writes in place (``self`` of ``x_``, ``out=``)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if isinstance(value, torch.Tensor):
            out.append(value)
    return out


# torch.nn.init functions that return at once for a meta tensor (they would silently leave the previous values)
_SKIP_META = ("orthogonal_", "dirac_", "sparse_", "trunc_normal_")


class _Recorder(TorchDispatchMode):
    """Runs construction with parameter-sized factories on ``meta`` and writes down each meta storage's init.

    The ``torch.nn.init`` functions that do nothing on meta tensors are replaced while it is active (also in
    ``transformers.initialization``'s table of them): ``trunc_normal_`` is recorded as a step of its own, the
    others mark the tensor as impossible to make chunk by chunk."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.seed = seed
        self.recipes: dict[int, InitRecipe] = {}
        self._restore: list[tuple[dict, str, Callable]] = []

    def __enter__(self) -> _Recorder:
        tables = [vars(torch.nn.init)]
        hf = sys.modules.get("transformers.initialization")
        if hf is not None and isinstance(getattr(hf, "TORCH_INIT_FUNCTIONS", None), dict):
            tables.append(hf.TORCH_INIT_FUNCTIONS)
        for table in tables:
            for name in _SKIP_META:
                if callable(table.get(name)):
                    self._restore.append((table, name, table[name]))
                    table[name] = self._on_meta(name, table[name])
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        for table, name, original in reversed(self._restore):
            table[name] = original
        self._restore.clear()
        return super().__exit__(*exc)

    def _on_meta(self, name: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def init(tensor, *args, **kwargs):
            if not isinstance(tensor, torch.Tensor) or not tensor.is_meta:
                return original(tensor, *args, **kwargs)
            recipe = self.recipes.setdefault(_storage_key(tensor), InitRecipe(self.seed))
            if name == "trunc_normal_" and _whole(tensor) and tensor.is_contiguous():
                bound = inspect.signature(original).bind(tensor, *args, **kwargs)
                bound.apply_defaults()
                a = bound.arguments
                recipe.add_random("trunc_normal", a["mean"], a["std"], a["a"], a["b"])
            elif recipe.broken is None:
                recipe.broken = f"nn.init.{name} has no chunk-wise form"
            return tensor

        return init

    def recipe_of(self, t: torch.Tensor) -> InitRecipe | None:
        return self.recipes.get(_storage_key(t))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _META_FACTORIES:
            out = func(*args, **{**kwargs, "device": torch.device("meta")})
            return self._fresh(out, _META_FACTORIES[func], args)
        for t in _written(func, args, kwargs):
            if t.is_meta:
                self._record_write(func, t, args, kwargs)
        out = func(*args, **kwargs)
        if func in _LIKE_FACTORIES and isinstance(out, torch.Tensor) and out.is_meta:
            return self._fresh(out, _LIKE_FACTORIES[func], args)
        source = args[0] if args and isinstance(args[0], torch.Tensor) and args[0].is_meta else None
        if func in _COPIES and source is not None and _whole(source) and isinstance(out, torch.Tensor):
            recipe = self.recipe_of(source)  # a dtype cast or copy of a whole tensor: the same values
            if recipe is not None:
                self.recipes[_storage_key(out)] = replace(recipe, steps=list(recipe.steps))
                return out
        aliasing = any(r.alias_info is not None for r in func._schema.returns)
        if not aliasing and not func._schema.is_mutable:
            for o in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(o, torch.Tensor) and o.is_meta:
                    self.recipes[_storage_key(o)] = InitRecipe(self.seed, broken=f"computed by {func}")
        return out

    def _fresh(self, out: torch.Tensor, step: tuple | None, args: tuple) -> torch.Tensor:
        recipe = self.recipes[_storage_key(out)] = InitRecipe(self.seed)  # a new storage: a new recipe
        if step is not None and step[0] == "fill_arg":
            step = ("fill", args[step[1]])
        if step is not None and step[0] == "fill" and isinstance(step[1], (bool, int, float)):
            recipe.steps.append(("fill", float(step[1])))
        elif step is not None and step[0] == "fill":
            recipe.broken = f"filled with {type(step[1]).__name__} {step[1]!r}"
        elif step is not None:
            recipe.add_random(*step)
        return out

    def _record_write(self, func, t: torch.Tensor, args: tuple, kwargs: dict) -> None:
        recipe = self.recipes.setdefault(_storage_key(t), InitRecipe(self.seed))
        if recipe.broken is not None:
            return
        name = func._schema.name.removeprefix("aten::")
        extra = [a for a in args[1:] if not isinstance(a, torch.Generator)]
        scalars = all(a is None or isinstance(a, (bool, int, float)) for a in (*extra, *kwargs.values()))
        if not _whole(t):
            recipe.broken = f"{func} writes part of it (through a view)"
        elif name == "zero_":
            recipe.steps.append(("fill", 0.0))
        elif name == "fill_" and len(args) > 1 and isinstance(args[1], (bool, int, float)):
            recipe.steps.append(("fill", float(args[1])))
        elif name == "fill_" and len(args) > 1 and not args[1].is_meta and args[1].numel() == 1:
            recipe.steps.append(("fill", float(args[1].item())))
        elif name in ("uniform_", "normal_") and t.is_contiguous():
            schema_defaults = (0.0, 1.0)
            a = args[1] if len(args) > 1 else kwargs.get("from", kwargs.get("mean", schema_defaults[0]))
            b = args[2] if len(args) > 2 else kwargs.get("to", kwargs.get("std", schema_defaults[1]))
            recipe.add_random("uniform" if name == "uniform_" else "normal", a, b)
        elif name in _ELEMENTWISE and scalars:
            recipe.steps.append(("op", func, tuple(extra), {k: v for k, v in kwargs.items() if k != "generator"}))
        else:
            recipe.broken = f"{func} cannot be replayed on a chunk"


_RECIPES: WeakIdKeyDictionary = WeakIdKeyDictionary()  # meta parameter or buffer -> InitRecipe


def is_deferred(model: nn.Module) -> bool:
    """Whether ``model`` has parameters on the ``meta`` device (built by ``Init(deferred)`` or on ``meta``)."""
    return any(p.is_meta for p in model.parameters())


# splitmix64 constants, as signed 64-bit integers (torch's int64 arithmetic wraps)
_GOLDEN, _MIX1, _MIX2 = (c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))
_CHUNK = 1 << 16  # elements computed at once: bounds the int64/float64 temporaries (~3 MB)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    return (x >> k) & ((1 << (64 - k)) - 1)  # logical shift of an int64


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def _key(seed: int, name: str, k: int, part: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{k}/{part}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2  # 62 bits: an int64 constant


def _uniform(seed: int, name: str, k: int, part: int, index: torch.Tensor) -> torch.Tensor:
    """float64 in [0, 1) for each global element index: 53 bits of the hash of (seed, name, k, index)."""
    return _shr(_mix(_mix(index ^ _key(seed, name, k, part))), 11).double() * 2.0**-53


def _replay(recipe: InitRecipe, name: str, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values of the elements at global flat ``index`` after the recipe's steps."""
    values = torch.zeros(index.shape, dtype=torch.float64 if dtype.is_floating_point else dtype, device=index.device)
    for step in recipe.steps:
        if step[0] == "fill":
            values.fill_(step[1])
        elif step[0] == "uniform":
            _, a, b, k = step
            values = a + (b - a) * _uniform(recipe.seed, name, k, 0, index)
        elif step[0] == "normal":
            _, mean, std, k = step
            u1 = 1.0 - _uniform(recipe.seed, name, k, 0, index)  # (0, 1]: log is finite
            u2 = _uniform(recipe.seed, name, k, 1, index)
            values = mean + std * torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)
        elif step[0] == "trunc_normal":  # by inverting the normal CDF over [a, b]
            _, mean, std, a, b, k = step
            lo, hi = (0.5 * (1.0 + math.erf((x - mean) / (std * math.sqrt(2.0)))) for x in (a, b))
            u = lo + (hi - lo) * _uniform(recipe.seed, name, k, 0, index)
            values = (mean + std * math.sqrt(2.0) * torch.erfinv(2.0 * u - 1.0)).clamp_(a, b)
        else:
            _, func, args, kwargs = step
            func(values, *args, **kwargs)
    return values.to(dtype)


def chunk_values(
    recipe: InitRecipe, name: str, placement: Any, tp_rank: int, tp: int, a: int, b: int, dtype, device
) -> torch.Tensor:
    """Elements ``[a, b)`` of this rank's (flattened) tensor-parallel block of ``name``, by the recipe."""
    out = torch.empty(b - a, dtype=dtype, device=device)
    for lo in range(a, b, _CHUNK):
        hi = min(b, lo + _CHUNK)
        local = torch.arange(lo, hi, dtype=torch.int64, device=device)
        out[lo - a : hi - a] = _replay(recipe, name, global_flat_index(placement, tp_rank, tp, local), dtype)
    return out


def _distinct(module: nn.Module, buffers: bool) -> list[tuple[str, torch.Tensor]]:
    """(first name, tensor) for each distinct parameter (or buffer) of ``module``."""
    seen: dict[int, tuple[str, torch.Tensor]] = {}
    items = module.named_buffers(remove_duplicate=False) if buffers else module.named_parameters(remove_duplicate=False)
    for name, t in items:
        seen.setdefault(id(t), (name, t))
    return list(seen.values())


def record_initialization(module: nn.Module) -> None:
    """Recipes for the meta parameters of ``module`` that have none (built on ``meta`` without ``Init``): each
    module's own ``reset_parameters()``, recorded on the whole (not yet split) model; seed ``torch.initial_seed()``.
    ``initialize`` calls it before the tensor-parallel split replaces the modules."""
    recorder = _Recorder(torch.initial_seed())
    with recorder, torch.no_grad():
        for m in module.modules():
            own = [p for p in m.parameters(recurse=False) if p.is_meta and p not in _RECIPES]
            if own and callable(getattr(m, "reset_parameters", None)):
                m.reset_parameters()
    for _, t in (*_distinct(module, False), *_distinct(module, True)):
        if t.is_meta and t not in _RECIPES and (recipe := recorder.recipe_of(t)) is not None:
            _RECIPES[t] = recipe


@dataclass(frozen=True)
class ExpertRows:
    """Expert parallelism's cut of the expert weights, for :func:`materialize_deferred`: each is rows
    ``[ep_rank * n/ep, (ep_rank + 1) * n/ep)`` of the whole ``[n, ...]`` tensor, chunked over ``comm`` ([Note:
    experts under sharded construction])."""

    ids: frozenset[int]  # the expert weights (ids of their Parameter objects), already cut to this rank's rows
    comm: Communicator  # the expert-data-parallel group: the ranks holding the same experts
    ep_rank: int
    ep: int


def materialize_deferred(
    module: nn.Module,
    placements: Mapping[str, Any] | None,
    comm: Communicator,
    tp_rank: int,
    tp: int,
    device: torch.device,
    experts: ExpertRows | None = None,
) -> None:
    """Give every meta parameter of ``module`` its data-parallel chunk (over ``comm``) of this rank's
    tensor-parallel block, and every meta buffer its values ([Note: deferred construction]). ``experts``: under
    expert parallelism, the expert weights get their chunk over the expert-data-parallel group of this rank's
    experts' rows ([Note: experts under sharded construction]).

    Called by ``initialize`` after ``parallelize`` (which cut meta blocks) and the expert split (which cut meta
    rows); the parameters become construction units that the layout gathers one unit at a time, as after ``Init``
    without tensor parallelism."""
    placements = placements or {}
    problems, unset = [], []
    for name, t in [*_distinct(module, False), *_distinct(module, True)]:
        recipe = _RECIPES.get(t) if t.is_meta else None
        if t.is_meta and recipe is not None and recipe.broken is not None:
            problems.append(f"{name} ({recipe.broken})")
        elif t.is_meta and recipe is None and not isinstance(t, nn.Parameter):
            problems.append(f"{name} (a buffer built on meta without shardtrain.zero.Init)")
        elif t.is_meta and recipe is None:
            unset.append(name)
    if problems:
        raise ConfigError(
            f"{type(module).__name__} was built on the meta device and these tensors' values cannot be made as "
            f"chunks: {'; '.join(problems)}. Initialize them with normal_/uniform_/fill_-style in-place ops on the "
            "whole tensor, or keep them real (buffers: build the model under shardtrain.zero.Init(config), "
            "which leaves tensors computed by other ops real), or build the model without meta/deferred "
            "construction."
        )
    if unset:
        log.warning(
            "%s: parameters built on meta with no recorded initialization start at zero (load weights into "
            "them, e.g. engine.load_full_state_dict): %s",
            type(module).__name__,
            ", ".join(unset),
        )
    for name, buf in _distinct(module, True):
        if buf.is_meta:
            values = chunk_values(_RECIPES[buf], name, None, 0, 1, 0, buf.numel(), buf.dtype, device)
            _replace_buffer(module, buf, values.view(buf.shape))
    runtime = ConstructionRuntime(comm, device)
    for name, p in _distinct(module, False):
        if not p.is_meta:
            continue
        recipe = _RECIPES.pop(p, None) or InitRecipe(0)  # none: zeros (warned above)
        placement, rank, size, over = placements.get(name), tp_rank, tp, None
        if experts is not None and id(p) in experts.ids:  # this rank's experts: a block of rows of the whole tensor
            whole = (p.shape[0] * experts.ep, *p.shape[1:])
            placement, rank, size, over = TPPlacement(0, 1, whole), experts.ep_rank, experts.ep, experts.comm

        def values(a, b, recipe=recipe, name=name, placement=placement, rank=rank, size=size, dtype=p.dtype):
            return chunk_values(recipe, name, placement, rank, size, a, b, dtype, device)

        runtime.shard_deferred(name, p, values, over)


def _leave_meta(p: nn.Parameter, data: torch.Tensor) -> None:
    """Give the meta parameter ``p`` real ``data``, keeping the object (optimizers, tied modules hold it).

    ``p.data = data`` cannot change a tensor's device type, so the contents of ``p`` are swapped with those of a
    new parameter (``torch.utils.swap_tensors``, as ``nn.Module.to_empty`` does under
    ``swap_module_params_on_conversion``); the Python attributes set on ``p`` are carried over. Hooks on it
    would not be, so they are refused (the tensor-parallel gradient check registers its hooks after this)."""
    if p._backward_hooks or p._post_accumulate_grad_hooks:
        raise ConfigError(
            "a parameter of a model built on meta has gradient hooks registered before initialize(); register "
            "them after initialize() (shardtrain replaces the meta storage of every parameter)"
        )
    attributes = dict(p.__dict__)
    real = nn.Parameter(data, requires_grad=p.requires_grad)
    torch.utils.swap_tensors(p, real)
    p.__dict__.update(attributes)


def _replace_buffer(module: nn.Module, old: torch.Tensor, new: torch.Tensor) -> None:
    for m in module.modules():
        for key, b in m._buffers.items():
            if b is old:
                m._buffers[key] = new


class Init:
    """Context manager for sharded construction.

    ``Init()`` shards each parameter over the world as it is built ([Note: sharded construction]).
    ``Init(config)`` with ``tensor_parallel.size`` > 1 or ``expert_parallel_size`` > 1 (the config ``initialize``
    gets: a dict, a path or a :class:`~shardtrain.config.sections.Config`, as DeepSpeed's
    ``zero.Init(config_dict_or_path=...)``), or ``Init(deferred=True)``, builds the parameters on ``meta`` and
    writes down their initialization; ``initialize`` (with the tensor-parallel plan) then makes each rank's chunk of
    its block, and of its experts' rows, directly ([Note: deferred construction], [Note: experts under sharded
    construction])::

        with shardtrain.zero.Init(config):
            model = MyModel(model_config)
        engine = shardtrain.initialize(model, config, lambda params: torch.optim.AdamW(params), tp_plan=plan)

    ``config_dict_or_path``: DeepSpeed's name for ``config``. ``seed``: of deferred initialization (default
    ``torch.initial_seed()`` on entry). ``timeout_s``: of the construction collectives (default the config's
    ``collective_timeout_s``)."""

    def __init__(
        self,
        config: Config | Mapping[str, Any] | str | Path | None = None,
        *,
        deferred: bool | None = None,
        seed: int | None = None,
        timeout_s: float | None = None,
        config_dict_or_path: Mapping[str, Any] | str | Path | None = None,
    ) -> None:
        if config is not None and config_dict_or_path is not None:
            raise ConfigError("zero.Init: give config or config_dict_or_path (DeepSpeed's name for it), not both")
        cfg = load_config(config if config is not None else config_dict_or_path)
        split = cfg.tensor_parallel.degree > 1 or cfg.expert_parallel_size > 1  # each rank makes its blocks only
        self.deferred = split if deferred is None else deferred
        if not self.deferred and cfg.tensor_parallel.degree > 1:
            raise ConfigError(
                "zero.Init(deferred=False) with tensor_parallel.size > 1: a parameter sharded as it is built "
                "cannot be cut into tensor-parallel blocks afterwards; leave deferred unset"
            )
        self.timeout_s = timeout_s if timeout_s is not None else cfg.collective_timeout_s
        self.device = cfg.device
        self.seed = seed
        self._patched: list[tuple[type, object]] = []
        self._device_ctx: torch.device | None = None
        self._recorder: _Recorder | None = None
        self._handles: list = []
        self._built: list[weakref.ref] = []

    def __enter__(self) -> Init:
        self._device_ctx = pick_device(self.device)
        if self.deferred:
            self._enter_deferred()
        else:
            ensure_process_group(self.timeout_s, self._device_ctx)
            self.runtime = ConstructionRuntime(Communicator(dist.group.WORLD, self.timeout_s), self._device_ctx)
            for cls in _module_classes()[1:]:  # nn.Module.__init__ itself registers no parameter
                if "__init__" in cls.__dict__:
                    original = cls.__dict__["__init__"]
                    cls.__init__ = self._wrap(original)
                    self._patched.append((cls, original))
        self._device_ctx.__enter__()
        return self

    def _enter_deferred(self) -> None:
        """No communication: the model may be built before the process group exists (as in torchtitan)."""
        self._recorder = _Recorder(self.seed if self.seed is not None else torch.initial_seed())
        self._recorder.__enter__()

        def built(_module, _name, t):
            if t is not None and t.is_meta:
                self._built.append(weakref.ref(t))

        registration = torch.nn.modules.module
        self._handles = [
            registration.register_module_parameter_registration_hook(built),
            registration.register_module_buffer_registration_hook(built),
        ]

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
        if self.deferred:
            assert self._recorder is not None
            self._recorder.__exit__(*exc)
            for handle in self._handles:
                handle.remove()
            for ref in self._built:  # recipes are read once construction is over: later steps are in them
                t = ref()
                if t is not None and t.is_meta and (recipe := self._recorder.recipe_of(t)) is not None:
                    _RECIPES[t] = recipe
            self._built.clear()
            return
        for cls, original in reversed(self._patched):
            cls.__init__ = original
        self._patched.clear()
        self.runtime.settle()
