"""Which layer files of a DeepSpeed ``PipelineEngine`` checkpoint belong to which stage, and under which names.

[Note: DeepSpeed pipeline checkpoints]
A ``PipelineEngine`` (DeepSpeed 0.19, ZeRO 0 or 1) saves its weights per layer, not per rank:
``layer_<i>-model_states.pt`` is ``forward_funcs[i].state_dict()`` (keys relative to the layer; functions have no
file), written by each stage's first data-parallel rank. ``mp_rank_<s>_model_states.pt`` is stage ``s``'s
model-states file with ``module: None``; the stage's optimizer is in it (ZeRO 0) or in
``zero_pp_rank_<d>_mp_rank_<s>_optim_states.pt`` (ZeRO 1, with the names in ``param_shapes``). The module's names
are DeepSpeed's: layer ``i``'s key ``k`` is ``<i>.<k>`` (so a ``nn.Sequential`` of the same layers, and the shim's
``PipelineModule`` at any number of stages, have the same names) and a ``TiedLayerSpec``'s is
``tied_modules.<key>.<k>``. Each stage is read as a model-states file whose ``module`` is the union of its layer
files, its parameters disjoint from the other stages' (not tensor-parallel shards of them). Which layers a stage
holds: its ``param_shapes`` names (ZeRO 1), or its optimizer's parameter count filled by the layer files in order
(ZeRO 0, which saves no names). A tied module's file names the module only at ZeRO 1 (``param_shapes``): at
ZeRO 0 a tie is refused by name, as is a layer file that is missing.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardtrain.errors import CheckpointError

LAYER_FILE = re.compile(r"^layer_(\d+)-model_states\.pt$")
TIED_PREFIX = "tied_modules."


def layer_files(d: Path) -> dict[int, str]:
    """Layer index -> its file, for the layer files in checkpoint directory ``d``."""
    return {int(m.group(1)): p.name for p in d.glob("layer_*-model_states.pt") if (m := LAYER_FILE.match(p.name))}


def _stage_names(main: dict) -> list[str] | None:
    shapes = main.get("param_shapes")
    return [n for group in shapes for n in group] if isinstance(shapes, list) else None


def _optimizer_count(main: dict) -> int | None:
    opt = main.get("optimizer")
    if not isinstance(opt, dict):
        return None
    inner = opt.get("optimizer_state_dict", opt)
    return sum(len(g["params"]) for g in inner.get("param_groups", ()))


def pipeline_modules(
    d: Path, stage_files: list[str], open_file: Callable[[str], dict[str, Any]]
) -> list[dict[str, Any]] | None:
    """Each stage's ``module`` as DeepSpeed would have saved it without pipelines (names as in
    [Note: DeepSpeed pipeline checkpoints]), or None when ``d`` is not a pipeline checkpoint."""
    mains = [open_file(f) for f in stage_files]
    if mains[0].get("module") is not None:
        return None
    files = layer_files(d)
    if not files:
        raise CheckpointError(
            f"{d}: the model-states files hold no weights ('module' is None, a pipeline checkpoint) and no "
            "layer_<i>-model_states.pt file is present; the layer files are missing"
        )
    layers = {i: open_file(f) for i, f in sorted(files.items())}
    named = [_stage_names(m) for m in mains]
    if all(n is not None for n in named):
        owners = _owners_by_names(d, files, named)  # type: ignore[arg-type]
    else:
        owners = _owners_by_counts(d, files, layers, mains)
    modules: list[dict[str, Any]] = [{} for _ in mains]
    for i, state in layers.items():
        s = owners[i]
        names = set(named[s] or ())
        tied = [n for n in names if n.startswith(TIED_PREFIX) and n.split(".", 2)[-1] in state]
        if tied and not any(f"{i}.{k}" in names for k in state):
            continue  # the tied module's copy: its weights are the optimizer's masters of tied_modules.<key>.*
        modules[s].update({f"{i}.{k}": v for k, v in state.items()})
    return modules


def _owners_by_names(d: Path, files: dict[int, str], named: list[list[str]]) -> dict[int, int]:
    """ZeRO 1: stage ``s`` holds the layers its parameter names start with; layers without parameters (buffers
    only) go with the stage before them."""
    first_of: dict[int, int] = {}
    for s, names in enumerate(named):
        for n in names:
            head = n.split(".", 1)[0]
            if head.isdigit():
                i = int(head)
                if i not in files:
                    raise CheckpointError(
                        f"{d}: parameter {n!r} of pipeline stage {s} is in layer {i}, but layer_{i:02d}-model_states.pt"
                        " is missing; the checkpoint is incomplete"
                    )
                first_of.setdefault(s, i)
                first_of[s] = min(first_of[s], i)
    starts = sorted((i, s) for s, i in first_of.items())
    owners = {}
    for i in files:
        before = [s for start, s in starts if start <= i]
        owners[i] = before[-1] if before else 0
    return owners


def _owners_by_counts(d: Path, files: dict[int, str], layers: dict[int, dict], mains: list[dict]) -> dict[int, int]:
    """ZeRO 0: stage ``s``'s optimizer holds ``k_s`` parameters; the layer files, in order, fill stage 0's count,
    then stage 1's, and so on ([Note: DeepSpeed pipeline checkpoints])."""
    counts = [_optimizer_count(m) for m in mains]
    params = {i: sum(1 for v in state.values() if getattr(v, "is_floating_point", lambda: False)()) for i, state in
              layers.items()}  # fmt: skip
    buffers = {b for m in mains for b in (m.get("buffer_names") or ())}
    for i, state in layers.items():
        params[i] -= sum(1 for k in state if f"{i}.{k}" in buffers)
    if any(c is None for c in counts) or sum(params.values()) != sum(counts):  # type: ignore[arg-type]
        present = ", ".join(files[i] for i in sorted(files))
        raise CheckpointError(
            f"{d}: the stages' optimizers hold {counts} parameters, the layer files {sum(params.values())}; a layer "
            f"file is missing, or a TiedLayerSpec was saved at ZeRO stage 0 (which records no names: save at "
            f"ZeRO stage 1). Present: {present}"
        )
    owners, s, filled = {}, 0, 0
    for i in sorted(layers):
        while s < len(counts) - 1 and filled == counts[s]:
            s, filled = s + 1, 0
        owners[i] = s
        filled += params[i]
    return owners
