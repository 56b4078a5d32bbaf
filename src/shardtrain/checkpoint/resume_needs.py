"""What a checkpoint must hold for its optimizer state to resume, checked without the optimizer that will take it.

``inspect --verify`` has no target optimizer, so it checks what any resume of the saved one needs: every parameter
of a param group that has optimizer state has every key the others of its group have, and Adam's state (its
moments ``exp_avg`` / ``exp_avg_sq``, whichever class saved it: torch's, DeepSpeed's fused or CPU Adam, shardtrain's
``DeepSpeedAdam``) comes with its ``step``: the bias correction is computed from it, and torch's Adam fails with
``KeyError: 'step'`` without it. The load checks the same against the optimizer it loads into
(``engine/optimizer_needs.py``).
"""

from __future__ import annotations

from typing import Any

from shardtrain.checkpoint.format import Manifest

PARAM_GROUPS_KEY = "optimizer/param_groups"
_ADAM_MOMENTS = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq"})
_ADAM_NEEDS = frozenset({"step", "exp_avg", "exp_avg_sq"})


def optimizer_state_problems(manifest: Manifest, objects: dict[str, Any]) -> list[str]:
    """One message per optimizer state key that some parameters lack (empty: a resume finds what it needs)."""
    # not .get: a DCP reader's objects explain a missing key by raising, and a checkpoint without optimizer state
    # is no problem here (nothing to resume from)
    if PARAM_GROUPS_KEY not in objects or not isinstance(objects[PARAM_GROUPS_KEY], list):
        return []
    groups = objects[PARAM_GROUPS_KEY]
    saved: dict[str, set[str]] = {}
    for name in manifest.tensors:
        if name.startswith("optim/"):
            param, _, key = name.removeprefix("optim/").rpartition("/")
            saved.setdefault(param, set()).add(key)
    lacking: dict[str, list[str]] = {}  # key -> the parameters without it
    for group in groups:
        params = [p for p in group.get("params", ()) if saved.get(p)]
        every = set().union(*(saved[p] for p in params)) if params else set()
        if every & _ADAM_MOMENTS:
            every |= _ADAM_NEEDS
        for p in params:
            for key in sorted(every - saved[p]):
                lacking.setdefault(key, []).append(p)
    problems = []
    for key, params in sorted(lacking.items()):
        shown = ", ".join(repr(p) for p in params[:5]) + (f" and {len(params) - 5} more" if len(params) > 5 else "")
        why = (
            "Adam's moments without their step count cannot resume (its bias correction needs it)"
            if key == "step"
            else "a resume needs every state key of the optimizer for each parameter"
        )
        problems.append(
            f"optimizer state {key!r} is missing for {len(params)} parameter(s) that have other optimizer state "
            f"({shown}): {why}; load it with load_optimizer_states=False to keep the weights only"
        )
    return problems
