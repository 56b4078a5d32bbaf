"""TRL's trainers on shardtrain: :class:`ShardtrainSFTTrainer` and :class:`ShardtrainDPOTrainer`.

TRL's trainers subclass ``transformers.Trainer`` and keep its loop: ``compute_loss`` is theirs, the backward goes
through ``accelerator.backward`` and the checkpoints through the Trainer's methods, which is what
:class:`~shardtrain.integrations.hf_trainer.ShardtrainTrainerMixin` replaces. A run written for TRL with
``SFTConfig(..., deepspeed="ds_config.json")`` becomes::

    from shardtrain.compat.trl_trainers import ShardtrainSFTTrainer

    trainer = ShardtrainSFTTrainer(model, args=SFTConfig(...), ..., shardtrain_config="ds_config.json")

What TRL does differently under DeepSpeed, and what it gets here instead:

* Its fused LM head (``add_fused_lm_head``) reads ``lm_head.weight`` without calling ``lm_head``, and gathers it with
  ``deepspeed.zero.GatheredParameters`` when DeepSpeed's ZeRO-3 is on. Here the read happens inside the model's
  forward, where a ZeRO-3 parameter read outside its own module gathers its unit on demand (see
  [Note: guarded parameters] in ``shardtrain/zero/guarded.py``), so nothing is needed.
* DPO's reference model: TRL calls ``prepare_deepspeed(ref_model)`` with DeepSpeed on (an inference engine over the
  same config: sharded at ZeRO-3, whole below) and ``accelerator.prepare_model(ref_model, evaluation_mode=True)``
  without; the mixin answers the latter as the former (:func:`~shardtrain.integrations.hf_trainer.shard_frozen_model`).
  With a peft model there is no reference model (the adapter is disabled for the reference forward).
* ``sync_ref_model`` copies the trained weights into the reference model after steps; at ZeRO-3 both are sharded
  and TRL gathers them with DeepSpeed's ``GatheredParameters``: refused here at stage 3 (not refused below, where
  both models are whole; untested).
* Options TRL sets only when ``args.deepspeed_plugin`` is ZeRO-3 work around DeepSpeed issues and are not set here:
  peft's ``autocast_adapter_dtype=False`` (DeepSpeed gathers a unit into a buffer of one dtype; shardtrain's units
  keep a bucket per dtype, and under a bf16 section the engine casts fp32 adapters to bf16 over fp32 masters anyway)
  and reentrant gradient checkpointing with peft. Neither bf16 LoRA nor gradient checkpointing with peft is tested
  here.
"""

from __future__ import annotations

from typing import Any

from shardtrain.compat.hf_trainer import ShardtrainTrainerMixin

__all__ = ["ShardtrainDPOTrainer", "ShardtrainSFTTrainer"]

# TRL versions this module is tested with (tests/compat/test_trl.py): TRL's trainers are subclasses whose private paths
# (prepare_model for the reference model, the fused LM head) change between major versions.
TESTED_TRL = ">=1.16,<2"


def _trl() -> Any:
    try:
        import trl
    except ImportError as err:  # TRL is not a dependency of shardtrain
        raise ImportError(
            f"shardtrain.integrations.trl_trainers needs TRL (pip install 'trl{TESTED_TRL}', or shardtrain[trl])"
        ) from err
    major, minor = (int(x) for x in trl.__version__.split(".")[:2])
    if major != 1 or minor < 16:
        raise ImportError(
            f"shardtrain.integrations.trl_trainers works with trl{TESTED_TRL} (tested with 1.16); trl "
            f"{trl.__version__} is installed"
        )
    return trl


_TRL = _trl()


class ShardtrainSFTTrainer(ShardtrainTrainerMixin, _TRL.SFTTrainer):
    """``trl.SFTTrainer`` training on shardtrain: ``ShardtrainSFTTrainer(model, args=SFTConfig(...), ...,
    shardtrain_config="ds_config.json")``. ``peft_config=...`` works as with TRL (the adapter is what
    ``save_model`` writes)."""


class ShardtrainDPOTrainer(ShardtrainTrainerMixin, _TRL.DPOTrainer):
    """``trl.DPOTrainer`` training on shardtrain: ``ShardtrainDPOTrainer(model, ref_model=..., args=DPOConfig(...),
    ..., shardtrain_config="ds_config.json")``. A separate ``ref_model`` is sharded like the trained model at ZeRO-3
    (whole on every rank below), in the config's compute dtype, as DeepSpeed prepares it for TRL."""

    def _shardtrain_problems(self) -> list[str]:
        problems = super()._shardtrain_problems()
        if self.args.sync_ref_model and self.shardtrain_config.zero_optimization.stage == 3:
            problems.append(
                "sync_ref_model=True is not supported at ZeRO stage 3: both models are sharded and TRL copies the "
                "weights with DeepSpeed's GatheredParameters; use stage 1 or 2 (the reference model is then whole), "
                "or sync_ref_model=False"
            )
        return problems
