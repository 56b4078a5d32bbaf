"""Graph mode: capture a module's forward and backward once per input schema and run the captured graphs.

``capture(module)`` wraps a plain module; ``initialize(model, config={"graph": {"enabled": true}})`` runs the
engine's forward through it. See :mod:`shardtrain.graph.captured` for the design and
:mod:`shardtrain.graph.schema` for what decides reuse.
"""

from shardtrain.graph.captured import COMPILERS, CapturedModule, GraphStats, capture
from shardtrain.graph.schema import Schema, TensorSpec, ValueSpec, differences, schema_of

__all__ = [
    "COMPILERS",
    "CapturedModule",
    "GraphStats",
    "Schema",
    "TensorSpec",
    "ValueSpec",
    "capture",
    "differences",
    "schema_of",
]
