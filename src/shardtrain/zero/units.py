"""ZeRO-3 units: which modules are gathered and released together, and each unit's state.

[Note: unit lifecycle]
A *unit* is a module whose parameters are gathered and released together: by default every block of a repeated
``nn.ModuleList``/``nn.Sequential`` stack, plus a root unit with the rest. Each unit owns one flat bucket per dtype
(see [Note: bucket layout]); its ``shard`` is the only permanent copy, and the full buffer's storage is resized to 0
while the unit is ``SHARDED``.

* forward: the pre-forward hook gathers the unit (or waits for its prefetch) and prefetches the next unit(s) of the
  order recorded on the first step; the post-forward hook releases it;
* backward: see [Note: gathering for backward];
* parameters stay views of the full buffer for life: release frees the storage in place and gather refills it, so
  tensors autograd saved in forward see the values again (the version counter is kept: the values are the same);
* frozen parameters are sharded too, in buckets of their own, gathered with the unit and never reduced.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from shardtrain.distributed.communicator import Handle
from shardtrain.errors import ConfigError
from shardtrain.zero.layout import Bucket


class UnitState(enum.Enum):
    SHARDED = "sharded"  # only this rank's shard exists; the full buffer's storage is freed
    GATHERING = "gathering"  # an all-gather into the full buffer is in flight (prefetch)
    GATHERED = "gathered"  # full parameters are readable


class UnitOwner(Protocol):
    """What a unit's sharded parameters ask of the runtime that gathers and releases it: ``EagerRuntime``, or
    ``zero.Init``'s ``ConstructionRuntime`` while the model is being built (see [Note: guarded parameters] in
    :mod:`shardtrain.zero.guarded`)."""

    def touch(self, p: nn.Parameter) -> None:
        """``p``'s data is about to be used by an operation: gather its unit, or refuse."""

    def hooks_for_op(self) -> Any:
        """Saved-tensor hooks to push around that operation, or None."""


@dataclass(eq=False)
class Unit:
    index: int
    name: str
    module: nn.Module
    buckets: list[Bucket]
    runtime: UnitOwner = field(repr=False)
    state: UnitState = UnitState.GATHERED
    pending: list[Handle] = field(default_factory=list)
    check: tuple[torch.Tensor, Handle] | None = None  # the unit-id exchange of the gather in flight
    why: str = ""  # what the gather in flight is for (error messages)
    grads_pending: int = 0  # trainable parameters still waiting for their gradient this backward
    saved: int = 0  # tensors aliasing its storage that autograd saved and has not unpacked yet
    last_unpack: object = None  # the autograd node that last unpacked one of them
    needed_in_backward: bool = False  # gathered for this backward already (order recorded)
    prefetches: int = 0  # how often it was gathered ahead of use (tests and benchmarks read it)
    gathers: int = 0  # all-gathers issued for it (tests read it)
    float8_only: bool = False  # gathered for its matmuls: its float8 buckets hold float8 weights only

    @property
    def numel(self) -> int:
        return sum(b.padded_numel for b in self.buckets)

    @property
    def trainable(self) -> int:
        return sum(len(b.slots) for b in self.buckets if b.requires_grad)


def find_unit_modules(root: nn.Module, unit_classes: Sequence[str] | None) -> list[tuple[str, nn.Module]]:
    """Modules to make units of, outermost first, never one inside another."""
    chosen: list[tuple[str, nn.Module]] = []

    def inside_chosen(name: str) -> bool:
        return any(name == c or name.startswith(c + ".") for c, _ in chosen)

    if unit_classes:
        found = set()
        for name, m in root.named_modules():
            if m is not root and type(m).__name__ in unit_classes and not inside_chosen(name):
                chosen.append((name, m))
                found.add(type(m).__name__)
        missing = sorted(set(unit_classes) - found)
        if missing:
            raise ConfigError(
                f"zero_optimization.stage3_unit_classes: no module of class {', '.join(map(repr, missing))} in "
                f"the model; classes present: {', '.join(sorted({type(m).__name__ for m in root.modules()}))}"
            )
        return chosen
    for name, m in root.named_modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and not inside_chosen(name):
            children = list(m.named_children())
            kinds = {type(c) for _, c in children}
            if len(children) >= 2 and len(kinds) == 1 and any(True for _ in children[0][1].parameters()):
                chosen.extend((f"{name}.{n}" if name else n, c) for n, c in children)
    return chosen


def assign_parameters(
    root: nn.Module, unit_modules: list[tuple[str, nn.Module]]
) -> list[list[tuple[str, nn.Parameter]]]:
    """Parameters (trainable and frozen) of each unit module, then the root's (last); a shared parameter goes
    to the unit whose module registers it first in ``named_modules()`` order."""
    owner_of = {id(m): i for i, (_, m) in enumerate(unit_modules)}
    groups: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(len(unit_modules) + 1)]
    seen: set[int] = set()
    prefix_unit: dict[str, int] = {}
    for name, m in root.named_modules(remove_duplicate=False):
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        unit = owner_of.get(id(m), prefix_unit.get(parent, len(unit_modules)) if name else len(unit_modules))
        prefix_unit[name] = unit
        for pname, p in m.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                groups[unit].append((f"{name}.{pname}" if name else pname, p))
    return groups
