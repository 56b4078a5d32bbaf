"""The planner: how many bytes each rank needs, which layouts fit a budget, and how fast each runs on a described
cluster (``shardtrain estimate``, ``shardtrain calibrate``).

See docs/estimate.md. ``estimate_memory`` gives one layout's bytes per rank (model state from the engine's own
layout code on storage-less parameters, activations from a fake-tensor run of the model); ``fitting_layouts`` lists
the layouts that fit a memory budget; ``measure_peak`` measures what the estimate is compared with. With
``cluster=`` (:mod:`.cluster`: built-in GPUs, a profile file ``shardtrain calibrate`` writes, :mod:`.calibrate`)
each estimate also carries its predicted step (:mod:`.timing`).
"""

from shardtrain.estimate.measure import PeakMeter, measure_peak
from shardtrain.estimate.planner import (
    Candidate,
    MemoryEstimate,
    Row,
    estimate_memory,
    fitting_layouts,
    fmt_bytes,
    parse_bytes,
)
from shardtrain.estimate.source import ModelSource, resolve_source

__all__ = [
    "Candidate",
    "MemoryEstimate",
    "ModelSource",
    "PeakMeter",
    "Row",
    "estimate_memory",
    "fitting_layouts",
    "fmt_bytes",
    "measure_peak",
    "parse_bytes",
    "resolve_source",
]
