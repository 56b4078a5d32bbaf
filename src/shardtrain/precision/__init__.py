"""Mixed precision at run time: the parameter dtypes a precision policy can train (:mod:`.mixed`), fp16's loss
scaler (:mod:`.loss_scaler`) and FP8 training's conversion of linear layers to torchao's ``Float8Linear``
(:mod:`.float8`). The policies themselves are plain data in :mod:`shardtrain.plan.policies`."""
