"""The planner reads ``activation_checkpointing.policy``: the activations it reports for ``full`` and ``selective``
are what the engine's policies keep (fewer bytes saved for backward than without checkpointing)."""

from shardtrain.estimate.planner import estimate_memory
from shardtrain.models.gpt import GPT, GPTConfig


def _gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=256, seq_len=128, d_model=64, n_layer=4, n_head=4))


def _saved(policy: str) -> tuple[int, str]:
    config = {"train_micro_batch_size_per_gpu": 2, "activation_checkpointing": {"policy": policy}}
    est = estimate_memory(_gpt, config, world_size=1, seq_len=128, device_type="cpu")
    (row,) = [r for r in est.rows if r.component.startswith("activations saved for backward")]
    return row.nbytes, est.layout.describe()


def test_estimate_reports_the_activations_of_each_policy():
    """Failed before: the planner did not read the section (and the config refused `policy` as unknown)."""
    none, full, selective = _saved("none"), _saved("full"), _saved("selective")
    assert full[0] < selective[0] < none[0], (none, full, selective)
    assert "selective checkpointing" in selective[1] and "checkpointing" in full[1] and "checkpointing" not in none[1]
