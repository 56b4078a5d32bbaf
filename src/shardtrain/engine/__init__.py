"""``initialize`` and the :class:`Engine`: the parts built from (model, config, mesh) (:mod:`.build`),
forward / backward / step with accumulation (:mod:`.engine`), the training state saved and loaded
(:mod:`.training_state`) and the monitor (:mod:`.monitor`)."""

from shardtrain.engine.engine import Engine, initialize

__all__ = ["Engine", "initialize"]
