"""Mixed precision at run time: the parameter dtypes a precision policy can train (:mod:`.mixed`) and fp16's loss
scaler (:mod:`.loss_scaler`). The policy itself is plain data in :mod:`shardtrain.plan.policies`."""
