"""``initialize`` and the :class:`Engine`: the parts built from (model, plan, mesh) (:mod:`.build`),
forward / backward / step with accumulation (:mod:`.engine`), checkpoint save and load (:mod:`.checkpointing`)
and the monitor (:mod:`.monitor`)."""

from shardtrain.engine.engine import Engine, initialize

__all__ = ["Engine", "initialize"]
