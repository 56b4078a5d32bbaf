"""Convergence debugging: subscribers on module forward/backward, statistics, run comparison.

* :class:`SubscriberManager` attaches :class:`Subscriber` objects to a model (or an engine) with hooks;
* :class:`StatisticsSubscriber` writes per-step statistics of every activation and gradient;
* :func:`inspect_activation` reports an intermediate tensor from inside a forward;
* :func:`iter_tensors` / :func:`map_tensors` walk (and rebuild) nested inputs and outputs, for subscriber authors;
* ``shardtrain compare RUN_A RUN_B`` (:mod:`shardtrain.debug.compare`) finds the first divergence between two runs.

See ``docs/debugging.md`` for a walkthrough.
"""

from shardtrain.debug.manager import SubscriberManager, inspect_activation
from shardtrain.debug.statistics import StatisticsSubscriber
from shardtrain.debug.subscriber import Subscriber
from shardtrain.debug.tensor_summary import tensor_stats
from shardtrain.tree import iter_tensors, map_tensors

__all__ = [
    "StatisticsSubscriber",
    "Subscriber",
    "SubscriberManager",
    "inspect_activation",
    "iter_tensors",
    "map_tensors",
    "tensor_stats",
]
