"""Where DeepSpeed 0.19 cuts a ``PipelineModule``: the boundaries its ``partition_uniform`` and
``partition_balanced`` (``deepspeed/runtime/utils.py``) give, computed here in our own code (the shim stands in for
DeepSpeed, so it cannot import it); tests/compat/test_deepspeed_pipe.py compares both with DeepSpeed's own
``PipelineModule._partition_layers``. Each returns ``num_parts + 1`` boundaries: part ``p`` holds the layers
``parts[p]:parts[p + 1]``."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """As many items per part as divide; the first ``num_items % num_parts`` parts one more."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Contiguous parts whose summed weights spread least (heaviest part minus lightest), found the way DeepSpeed
    finds them: part by part, each prefix of the layers keeps only its one best cut (so the result is DeepSpeed's
    cut, not always the best possible one), and among cuts of equal spread the one furthest right wins."""
    n = len(weights)
    if n <= num_parts:
        return partition_uniform(n, num_parts)
    prefix = [0.0, *itertools.accumulate(float(w) for w in weights)]
    # best[parts][end]: (spread, heaviest, lightest, start of the last part) of the first `end` layers in `parts`
    best: list[dict[int, tuple[float, float, float, int]]] = [{0: (0.0, 0.0, math.inf, 0)}]
    for parts in range(1, num_parts + 1):
        row: dict[int, tuple[float, float, float, int]] = {}
        for end in range(parts, n + 1):
            for start, (_, heaviest, lightest, _) in sorted(best[parts - 1].items()):
                if start >= end:
                    break
                last = prefix[end] - prefix[start]
                cut = (max(heaviest, last) - min(lightest, last), max(heaviest, last), min(lightest, last), start)
                if end not in row or cut[0] <= row[end][0]:
                    row[end] = cut
        best.append(row)
    bounds = [n]
    for parts in range(num_parts, 0, -1):
        bounds.append(best[parts][bounds[-1]][3])
    return bounds[::-1]


__all__ = ["partition_balanced", "partition_uniform"]
