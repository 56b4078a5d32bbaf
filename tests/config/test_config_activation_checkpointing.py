"""The ``activation_checkpointing`` section: DeepSpeed's keys honoured, mapped or refused by name, shardtrain's
``policy`` resolved into the plan's :class:`~shardtrain.plan.policies.ActivationPolicy`, and the combinations that
are not built refused before anything is touched."""

import pytest
import torch

import shardtrain
from shardtrain.config.plan import resolve_plan
from shardtrain.config.sections import inspect_config, load_config
from shardtrain.errors import ConfigError
from shardtrain.plan.policies import ActivationPolicy
from shardtrain.testing import run_distributed

AC = "activation_checkpointing"


@pytest.mark.parametrize(
    ("section", "policy"),
    [
        ({}, ActivationPolicy("none", False)),
        ({"policy": "full"}, ActivationPolicy("full", False)),
        ({"policy": "selective", "cpu_checkpointing": True}, ActivationPolicy("selective", True)),
        # DeepSpeed's keys alone checkpoint nothing: offload of nothing is no offload
        ({"cpu_checkpointing": True, "partition_activations": True}, ActivationPolicy("none", False)),
        ({"policy": "full", "number_checkpoints": 4}, ActivationPolicy("full", False)),
        (
            {"policy": "budget", "memory_budget_gib": 0.5, "budget_seq_len": 64, "cpu_checkpointing": True},
            ActivationPolicy("budget", True, memory_budget=2**29, budget_seq_len=64),
        ),
    ],
)
def test_the_plan_takes_the_policy(section, policy):
    assert resolve_plan(load_config({AC: section}), 1).activations == policy


@pytest.mark.parametrize(
    ("section", "fragment"),
    [
        ({"cpu_checkpointing": True}, 'cpu_checkpointing: no effect with `policy: "none"`'),
        ({"policy": "full", "partition_activations": True}, "partition_activations: no effect without tensor"),
        ({"policy": "full", "number_checkpoints": 2}, "number_checkpoints: it sizes DeepSpeed's contiguous"),
        # DeepSpeed's own example configs give these; alone they checkpoint nothing, in DeepSpeed as here
        ({"partition_activations": True, "contiguous_memory_optimization": True}, "contiguous_memory_optimization"),
        ({"profile": True, "synchronize_checkpoint_boundary": True}, "profile: no effect with"),
    ],
)
def test_deepspeed_keys_without_effect_are_reported(section, fragment):
    """A DeepSpeed config's section (Hugging Face's examples give all of these) still loads; what does nothing
    here is said so."""
    report = inspect_config({AC: section})
    assert report.ok, report.problems
    assert any(fragment in note for note in report.no_effect), report.no_effect


@pytest.mark.parametrize(
    ("config", "fragments"),
    [
        ({AC: {"policy": "budget"}}, ["policy 'budget' needs memory_budget_gib", "budget_seq_len"]),
        ({AC: {"policy": "budget", "memory_budget_gib": 8}}, ["policy 'budget' needs", "budget_seq_len"]),
        ({AC: {"policy": "full", "memory_budget_gib": 8}}, ["memory_budget_gib with policy 'full'", "'budget' only"]),
        ({AC: {"budget_seq_len": 512}}, ["budget_seq_len with policy 'none'"]),
        ({AC: {"policy": "budget", "memory_budget_gib": 0, "budget_seq_len": 8}}, [f"{AC}.memory_budget_gib"]),
        ({AC: {"policy": "layers"}}, [f"{AC}.policy"]),
        (
            {AC: {"policy": "full", "contiguous_memory_optimization": True}},
            ["contiguous_memory_optimization: true with policy 'full'", "not built"],
        ),
        ({AC: {"policy": "selective", "synchronize_checkpoint_boundary": True}}, ["synchronize_checkpoint_boundary"]),
        ({AC: {"policy": "full", "profile": True}}, ["profile: true", "flops_profiler"]),
        ({AC: {"number_checkpoints": "all"}}, ["number_checkpoints"]),
        ({AC: {"policy": "full"}, "graph": {"enabled": True}}, ["policy 'full' with graph.enabled", "graph mode off"]),
    ],
)
def test_refused_by_name(config, fragments):
    with pytest.raises(ConfigError) as err:
        load_config(config)
    for fragment in fragments:
        assert fragment in str(err.value), f"{fragment!r} not in: {err.value}"


def test_partitioned_activations_with_tensor_parallelism_and_host_offload_are_refused():
    section = {"policy": "full", "partition_activations": True}
    tp = {"tensor_parallel": {"size": 2}}
    assert resolve_plan(load_config({AC: section, **tp}), 2).activations == ActivationPolicy("full", False, True)
    cfg = load_config({AC: {**section, "cpu_checkpointing": True}, **tp})
    with pytest.raises(ConfigError, match=r"partition_activations with cpu_checkpointing and tensor_parallel\.size 2"):
        resolve_plan(cfg, 2)
    resolve_plan(load_config({AC: {"partition_activations": True}, **tp}), 2)  # no policy


def test_budget_with_pipeline_parallelism_is_refused():
    section = {"policy": "budget", "memory_budget_gib": 8, "budget_seq_len": 64}
    cfg = load_config({AC: section, "pipeline_parallel_size": 2})
    with pytest.raises(ConfigError, match=r"policy 'budget' with pipeline_parallel_size 2 is not built"):
        resolve_plan(cfg, 2)


def _refused(kind: str) -> str:
    if kind == "no blocks":
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    else:
        from helpers.model_cases import _llama

        model = _llama("non-reentrant")  # transformers' own gradient checkpointing on
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        config = {"train_micro_batch_size_per_gpu": 1, AC: {"policy": "full"}}
        shardtrain.initialize(model, config=config, optimizer=opt)
    except ConfigError as e:
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        assert not any(m._forward_pre_hooks for m in model.modules())  # refused before the model was touched
        return str(e)
    return "initialize accepted it"


def test_a_model_without_blocks_is_refused_by_name():
    (message,) = run_distributed(_refused, 1, "no blocks")
    assert "has no repeated blocks to checkpoint" in message and "stage3_unit_classes" in message, message


def test_a_model_checkpointing_itself_is_refused_by_name():
    """transformers' own gradient checkpointing and a policy would checkpoint every layer twice."""
    pytest.importorskip("transformers")
    (message,) = run_distributed(_refused, 1, "checkpointing itself")
    assert "would be checkpointed twice" in message and "gradient_checkpointing_enable" in message, message
