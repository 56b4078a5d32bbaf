"""DeepSpeed's layer partition arithmetic (``deepspeed/runtime/utils.py``: ``partition_uniform``,
``partition_balanced``), ported line for line so that a ``PipelineModule`` is cut at the layers DeepSpeed 0.19 cuts
it; tests/compat/test_deepspeed_pipe.py compares both with DeepSpeed's own ``PipelineModule._partition_layers``.
Each returns ``num_parts + 1`` boundaries: part ``p`` holds the layers ``parts[p]:parts[p + 1]``."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """As many items per part as divide; the first ``num_items % num_parts`` parts one more."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """The linear partition that minimises the spread (heaviest minus lightest part) of the parts' summed weights,
    by DeepSpeed's dynamic programme, its ties broken as DeepSpeed breaks them (the last split point that reaches the
    least spread)."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    dp_max = np.full((n + 1, m + 1), np.inf)
    dp_min = np.full((n + 1, m + 1), np.inf)
    dp_cost = np.full((n + 1, m + 1), np.inf)
    position = np.zeros((n + 1, m + 1), dtype=int)
    prefix_sum = np.zeros(n + 1)
    prefix_sum[1:] = np.cumsum(weights)
    dp_max[0, 0] = 0
    dp_cost[0, 0] = 0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                max_sum = max(dp_max[k, j - 1], prefix_sum[i] - prefix_sum[k])
                min_sum = min(dp_min[k, j - 1], prefix_sum[i] - prefix_sum[k])
                cost = max_sum - min_sum
                if dp_cost[i, j] >= cost:
                    dp_cost[i, j], dp_max[i, j], dp_min[i, j], position[i, j] = cost, max_sum, min_sum, k
    parts = [n]
    for j in reversed(range(1, m + 1)):
        parts.append(int(position[parts[-1], j]))
    parts.reverse()
    return parts


__all__ = ["partition_balanced", "partition_uniform"]
