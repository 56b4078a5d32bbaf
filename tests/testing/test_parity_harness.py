"""The public parity harness (``shardtrain.testing.parity``) on a model of the user's own: it passes a correct run at
worlds 1, 2 and 3, and it fails, naming the step, a run whose loss is not what the recipe says."""

import pytest
import torch
from torch import nn

from shardtrain.testing.parity import Recipe, assert_parity, check_parity, reference_run

ROWS, STEPS, GAS = 12, 3, 2  # 12 rows split over 1, 2 and 3 ranks


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU())
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return Regressor()


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(ROWS, 16, generator=g), torch.randn(ROWS, 4, generator=g)) for _ in range(STEPS * GAS)]


def mean_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def summed_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Not a mean over rows: a rank's sum is a fraction of the whole batch's, so no engine can match it."""
    x, y = batch
    return nn.functional.mse_loss(model(x), y, reduction="sum")


@pytest.mark.parametrize("stage", [1, 3])
def test_a_correct_run_passes_at_worlds_1_2_and_3(stage):
    recipe = Recipe(make_model, make_optimizer, batches, mean_loss, gas=GAS, clip=0.5,
                    config={"zero_optimization": {"stage": stage}})  # fmt: skip
    results = check_parity(recipe, worlds=(1, 2, 3))
    assert sorted(results) == [1, 2, 3] and [len(r) for r in results.values()] == [1, 2, 3]
    for ranks in results.values():
        assert all(len(r["losses"]) == STEPS for r in ranks)
    # the check is not vacuous: every parameter moved, and losses fell
    ref = reference_run(recipe)
    assert all((ref["params"][k] - ref["init"][k]).norm() > 0 for k in ref["params"])
    assert ref["losses"][-1] < ref["losses"][0]


def test_a_loss_that_is_not_a_mean_over_rows_fails_with_its_step():
    recipe = Recipe(make_model, make_optimizer, batches, summed_loss, gas=GAS, clip=0.0,
                    config={"zero_optimization": {"stage": 2}})  # fmt: skip
    with pytest.raises(AssertionError) as err:
        check_parity(recipe, worlds=(2,))
    assert str(err.value).startswith("world 2: step 0: loss")


def test_results_that_drift_are_named_by_step_and_tensor():
    recipe = Recipe(make_model, make_optimizer, batches, mean_loss, gas=GAS, clip=0.5)
    ref = reference_run(recipe)
    good = {"losses": list(ref["losses"]), "norms": list(ref["norms"]), "params": dict(ref["params"])}
    assert_parity([good], ref)
    with pytest.raises(AssertionError, match="step 2: grad norm"):
        assert_parity([{**good, "norms": [*ref["norms"][:2], ref["norms"][2] * 1.01]}], ref)
    moved = dict(ref["params"])
    moved["head.bias"] = moved["head.bias"] + 0.05
    with pytest.raises(AssertionError, match=r"head\.bias: error"):
        assert_parity([{**good, "params": moved}], ref)


def test_recipes_the_harness_cannot_split_are_refused():
    recipe = Recipe(make_model, make_optimizer, batches, mean_loss)
    with pytest.raises(ValueError, match="12 rows does not split over 5 ranks"):
        recipe.engine_config(5)
    with pytest.raises(ValueError, match="6 micro-batches are not a whole number of steps of gas 4"):
        _ = Recipe(make_model, make_optimizer, batches, mean_loss, gas=4).steps
    shared = Recipe(make_model, make_optimizer, batches, mean_loss, config={"sequence_parallel_size": 2})
    with pytest.raises(ValueError, match=r"tensor_parallel\.size 1 x sequence_parallel_size 2 does not divide the 3"):
        shared.data_parallel(3)
    with pytest.raises(ValueError, match="does not divide the 3"):
        check_parity(shared, worlds=(3,))  # before any rank starts
    with pytest.raises(ValueError, match=r"12 rows does not split over 5 ranks \(the data-parallel ranks of 10\)"):
        shared.engine_config(10)


def test_a_layout_maps_ranks_to_rows():
    """[Note: the layout a recipe describes]: rows split over the data-parallel ranks only, keyword batches too, and
    the reference's loss the whole batch's unless the recipe asks for the ranks' mean."""
    layout = {"tensor_parallel": {"size": 2}, "sequence_parallel_size": 3}
    recipe = Recipe(make_model, make_optimizer, batches, mean_loss, gas=GAS, config=layout)
    assert recipe.data_parallel(12) == 2
    assert recipe.engine_config(12)["train_micro_batch_size_per_gpu"] == ROWS // 2
    assert recipe.engine_config(6)["train_micro_batch_size_per_gpu"] == ROWS
    x, y = batches()[0]
    part = recipe.rows_of((x, y), 1, 3)
    assert torch.equal(part[0], x[4:8]) and torch.equal(part[1], y[4:8])
    keywords = recipe.rows_of({"x": x, "flag": False}, 2, 3)
    assert torch.equal(keywords["x"], x[8:]) and keywords["flag"] is False
    model = make_model()
    whole = mean_loss(model, (x, y))
    assert torch.equal(recipe.reference_loss(model, (x, y), 3), whole)
    summed = Recipe(make_model, make_optimizer, batches, summed_loss, per_rank_loss=True)
    ranks = sum(summed_loss(model, (x[r], y[r])) for r in (slice(0, 6), slice(6, 12))) / 2
    assert torch.allclose(summed.reference_loss(model, (x, y), 2), ranks)
    assert not torch.allclose(ranks, summed_loss(model, (x, y)))


def test_a_tensor_parallel_run_passes_at_worlds_2_and_4():
    """The regressor's hidden layers split column- then row-wise over 2 ranks, at dp 1 and dp 2."""
    layout = {"tensor_parallel": {"size": 2}, "zero_optimization": {"stage": 1}}
    plan = {"body.0": "colwise", "body.2": "rowwise"}
    recipe = Recipe(make_model, make_optimizer, batches, mean_loss, gas=GAS, clip=0.5, config=layout, tp_plan=plan)
    results = check_parity(recipe, worlds=(2, 4))
    assert [len(r) for r in results.values()] == [2, 4]


def test_the_documented_example_runs_as_a_script(tmp_path):
    """docs/parity.md's example, written to a file and run as a user would (the ranks import it)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "parity.md").read_text()
    code = re.search(r"```python\n(.*?)```", doc, re.S).group(1)
    script = tmp_path / "my_check.py"
    script.write_text(
        "import torch\nfrom torch import nn\n\n\nclass MyModel(nn.Sequential):\n    def __init__(self):\n"
        "        super().__init__(nn.Linear(16, 8), nn.GELU(), nn.Linear(8, 4))\n\n\n" + code
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
