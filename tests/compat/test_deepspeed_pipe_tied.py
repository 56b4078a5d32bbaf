"""A DeepSpeed ``PipelineModule`` script with a ``TiedLayerSpec`` (the input embedding reused as the output head
through ``forward_fn``) run through ``shardtrain.deepspeed`` at pp 2 and pp 3: equal to the same module trained in
one process, the tied weight equal on the first and last stage ([Note: weights tied across stages] in
pipeline_parallel/cut.py); a tie between other stages is refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardtrain.deepspeed as deepspeed
from shardtrain.deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from shardtrain.testing import run_distributed
from shardtrain.testing.parity import assert_parity, train_one_process

STEPS, GAS, MICRO, CLIP, WIDTH, VOCAB, SEQ = 3, 4, 2, 0.5, 8, 16, 6
LR, WD = 3e-3, 0.1
TIED = "tied_modules.embed.weight"


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


def head(embedding: nn.Embedding, h: torch.Tensor) -> torch.Tensor:
    """The output head: the embedding's weight as a linear layer (GPT-2's tie)."""
    return F.linear(h, embedding.weight)


def layers() -> list:
    return [
        TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH),
        *[LayerSpec(Block, WIDTH) for _ in range(4)],
        LayerSpec(nn.LayerNorm, WIDTH),
        TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH, forward_fn=head, tied_weight_attr="weight"),
    ]


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def global_batches(dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS * GAS):
        x = torch.randint(0, VOCAB, (MICRO * dp, SEQ), generator=g)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WD)


def _script(pp: int) -> dict:
    # seed_layers: each stage builds its own copy of the tied module from another seed; the engine starts the last
    # stage's from the first's, as DeepSpeed's _synchronize_tied_weights
    net = PipelineModule(layers(), num_stages=pp, loss_fn=loss_fn, seed_layers=True)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        "steps_per_print": 10**6,
    }
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=_optimizer(net.parameters()), config=config)
    rank, dp = engine.grid.get_data_parallel_rank(), engine.grid.get_data_parallel_world_size()
    rows = slice(rank * MICRO, (rank + 1) * MICRO)
    batches = [(x[rows], y[rows]) for x, y in global_batches(dp)]
    losses, norms = [], []
    for step in range(STEPS):
        losses.append(float(engine.train_batch(iter(batches[step * GAS : (step + 1) * GAS]))))
        norms.append(engine.get_global_grad_norm())
    held = dict(engine.module.named_parameters()).get(TIED)
    copies = engine.shardtrain_engine._pp_comm.all_gather_object(
        held.detach().clone() if held is not None else None, what="test: tied copies"
    )
    out = {"losses": losses, "norms": norms, "copies": [c for c in copies if c is not None]}
    out["params"] = engine.shardtrain_engine.full_state_dict()
    engine.destroy()
    return out


def _reference(dp: int) -> dict:
    batches = global_batches(dp)

    def run(dtype: torch.dtype) -> dict:
        model = PipelineModule(layers(), num_stages=1, loss_fn=loss_fn, seed_layers=True).to(dtype)
        return train_one_process(
            model,
            _optimizer(model.parameters()),
            lambda m, i: loss_fn(m(batches[i][0]), batches[i][1]),
            STEPS,
            GAS,
            CLIP,
        )

    ref = run(torch.float32)
    ref["exact"] = run(torch.float64)["params"]
    return ref


@pytest.mark.parametrize("pp", [2, 3])
def test_tied_layer_spec_script_equals_one_process(pp):
    results = run_distributed(_script, pp, pp)
    assert_parity(results, _reference(1))
    for r in results:
        first, last = r["copies"]  # held by the first and the last stage only, equal after training
        assert torch.equal(first, last)


def _tie_on_a_middle_stage() -> str:
    # three layers on three stages, one each: the tie spans stages 0 and 1, the last being 2
    specs = [TiedLayerSpec("w", nn.Linear, 4, 4), TiedLayerSpec("w", nn.Linear, 4, 4), LayerSpec(nn.Linear, 4, 4)]
    try:
        PipelineModule(specs, num_stages=3, partition_method="uniform")
    except deepspeed.NotProvidedError as err:
        return str(err)
    return "no error"


def test_a_tie_between_other_stages_than_the_ends_is_refused_by_name():
    for message in run_distributed(_tie_on_a_middle_stage, 3):
        assert "TiedLayerSpec 'w' on pipeline stages [0, 1]" in message, message
