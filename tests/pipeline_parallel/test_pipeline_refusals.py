"""What a pipeline-parallel engine refuses, by name and before anything hangs: the ordinary training calls,
micro-batches the schedule cannot run, models it cannot cut."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardtrain
from shardtrain.errors import ConfigError, RankMismatchError
from shardtrain.models.gpt import GPT, GPTConfig
from shardtrain.pipeline_parallel import check_can_cut, layers_of_stages
from shardtrain.testing import run_distributed

VOCAB, SEQ = 32, 8


def _gpt(tied: bool = False, layers: int = 2) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=16, n_layer=layers, n_head=2, tie_embeddings=tied))


def _batch(rows: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, VOCAB, (rows, SEQ))
    return x, torch.roll(x, -1, dims=1)


def _message(call) -> str:
    try:
        call()
    except ConfigError as err:
        return str(err)
    return "no error"


PIPE = {"pipeline_parallel_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}


def _refusals() -> dict[str, str]:
    out = {}
    few = {**PIPE, "gradient_accumulation_steps": 1}
    model = _gpt()
    out["few"] = _message(lambda: shardtrain.initialize(model, few, optimizer=torch.optim.SGD(model.parameters())))
    model = _gpt()
    engine = shardtrain.initialize(model, PIPE, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _batch()
    out["forward"] = _message(lambda: engine(x, y))
    out["backward"] = _message(lambda: engine.backward(torch.ones(())))
    out["step"] = _message(engine.step)
    out["shapes"] = _message(lambda: engine.train_batch(iter([_batch(2), _batch(3)])))
    mask = {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": y}
    out["keys"] = _message(lambda: engine.train_batch(iter([mask, mask])))
    out["ran out"] = _message(lambda: engine.train_batch(iter([_batch()])))
    # the refusals above left nothing half done: a step still runs, and the loss is the same on both stages
    out["loss"] = repr(float(engine.train_batch(iter([_batch(), _batch()]))))
    shorter = torch.randint(0, VOCAB, (2, SEQ - 2))  # a shorter sequence than the first step's
    out["later shape"] = _message(lambda: engine.train_batch(iter([(shorter, shorter), (shorter, shorter)])))
    # one rank's data runs out alone: both fail at once, naming it, instead of one waiting in the schedule
    short = [_batch()] if torch.distributed.get_rank() == 1 else [_batch(), _batch()]
    try:
        engine.train_batch(iter(short))
        out["alone"] = "no error"
    except RankMismatchError as err:
        out["alone"] = str(err)
    engine.close()
    return out


def test_pipeline_engine_refusals():
    results = run_distributed(_refusals, 2)
    for r in results:
        assert "needs at least pipeline_parallel_size (2) micro-batches" in r["few"], r["few"]
        for call in ("forward", "backward", "step"):
            assert "use loss = engine.train_batch(data_iter)" in r[call], r[call]
        assert "micro-batches of one pipeline step have inputs of different shapes" in r["shapes"], r["shapes"]
        assert "attention_mask" in r["keys"] and "one label key" in r["keys"], r["keys"]
        assert "data_iter ran out after 1 of the 2 micro-batches" in r["ran out"], r["ran out"]
        assert "where the first step's were (2, 8)" in r["later shape"], r["later shape"]
    assert results[0]["loss"] == results[1]["loss"]
    for r in results:
        assert "train_batch" in r["alone"] and "rank 1" in r["alone"], r["alone"]


def _not_a_pipeline() -> tuple[str, str]:
    model = nn.Linear(4, 4)
    engine = shardtrain.initialize(
        model, {"train_micro_batch_size_per_gpu": 1}, optimizer=torch.optim.SGD(model.parameters())
    )
    messages = _message(lambda: engine.train_batch(iter([]))), _message(lambda: engine.eval_batch(iter([])))
    engine.close()
    return messages


def _stages_disagree() -> str:
    model = _gpt()
    clip = 0.5 if torch.distributed.get_rank() == 1 else 1.0  # rank 1 holds the other stage
    try:
        shardtrain.initialize(model, {**PIPE, "gradient_clipping": clip}, optimizer=torch.optim.SGD(model.parameters()))
    except RankMismatchError as err:
        return str(err)
    return "no error"


def test_stages_with_other_configs_fail_at_initialize():
    for message in run_distributed(_stages_disagree, 2):
        assert "ranks disagree on the config" in message, message


def _ranks_given_other_shapes() -> str:
    model = _gpt()
    engine = shardtrain.initialize(model, PIPE, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    seq = SEQ if torch.distributed.get_rank() == 0 else SEQ - 2  # each rank's own shape, the same within its steps
    x = torch.randint(0, VOCAB, (2, seq))
    message = _message(lambda: engine.train_batch(iter([(x, x), (x, x)])))
    engine.close()
    return message


def test_pipeline_ranks_given_other_shapes_are_refused_by_name_on_every_rank():
    """The stages learn their activations' shapes at the first step: ranks of one pipeline given other shapes would
    exchange mismatched tensors ([Note: guarded stage exchanges])."""
    for message in run_distributed(_ranks_given_other_shapes, 2):
        assert "given micro-batches of different shapes" in message, message
        assert f"rank 0: inputs (2, {SEQ})" in message and f"rank 1: inputs (2, {SEQ - 2})" in message, message


def test_train_and_eval_batch_without_pipeline_are_refused():
    ((train, evaluate),) = run_distributed(_not_a_pipeline, 1)
    assert "set pipeline_parallel_size > 1" in train, train
    assert "eval_batch runs a pipeline schedule" in evaluate, evaluate


def test_models_that_cannot_be_cut_are_named():
    with pytest.raises(ConfigError, match="Sequential cannot be cut into pipeline stages yet"):
        check_can_cut(nn.Sequential(nn.Linear(2, 2)), 2)
    with pytest.raises(ConfigError, match="has 2 layers, fewer than the 3 pipeline stages"):
        check_can_cut(_gpt(), 3)
    # earlier stages take one more layer where they do not divide
    assert layers_of_stages(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]
