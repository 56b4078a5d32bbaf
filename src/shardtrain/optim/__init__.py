"""Optimizers and LR schedulers that DeepSpeed config sections name and torch lacks, as torch classes:
:class:`~shardtrain.optim.adam.DeepSpeedAdam` (Adam without bias correction) and DeepSpeed's schedulers
(:mod:`.schedulers`)."""
