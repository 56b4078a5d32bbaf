"""Every DeepSpeed key is classified once: supported, accepted without effect, refused value, not supported."""

from pathlib import Path

import pytest
from pydantic import BaseModel

from shardtrain.config.deepspeed_keys import ALIASES, RULES, RULES_BY_PATH, Kind, markdown_table
from shardtrain.config.sections import Config, inspect_config, load_config
from shardtrain.errors import ConfigError

DOC = Path(__file__).parents[2] / "docs" / "config.md"


def _field_paths(model: type[BaseModel], prefix: str = "") -> set[str]:
    paths = set()
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        paths.add(path)
        for candidate in getattr(info.annotation, "__args__", (info.annotation,)):
            if (
                isinstance(candidate, type)
                and issubclass(candidate, BaseModel)
                and path not in ("optimizer", "scheduler")
            ):
                paths |= _field_paths(candidate, f"{path}.")
    return paths


def test_doc_table_is_the_code_table():
    doc = DOC.read_text()
    start = doc.index("| key | classification |")
    end = doc.index("<!-- end of key table -->")
    assert doc[start:end] == markdown_table(), "regenerate the table: python -m shardtrain.config.deepspeed_keys"


def test_supported_rules_are_exactly_the_config_fields():
    supported = {r.path for r in RULES if r.kind is Kind.SUPPORTED}
    fields = _field_paths(Config) | {"optimizer.type", "optimizer.params", "scheduler.type", "scheduler.params"}
    fields.add("optimizer.params.torch_adam")  # read by the Adam types' weight_decay default
    fields.add("optimizer.params.bias_correction")  # read by the Adam types' optimizer choice
    # DeepSpeed-MoE's and AutoEP's sections, read as the expert_parallel_size field ([Note: DeepSpeed's MoE keys])
    fields |= {"moe", "moe.ep_size", "expert_parallel", "expert_parallel.enabled", "expert_parallel.autoep_size"}
    assert supported == fields
    assert len(RULES_BY_PATH) == len(RULES)  # one rule per key
    assert all(canonical in RULES_BY_PATH for canonical in ALIASES.values())


@pytest.mark.parametrize(
    ("config", "path"),
    [
        ({"zero_optimization": {"contiguous_gradients": True}}, "zero_optimization.contiguous_gradients"),
        ({"zero_optimization": {"allgather_partitions": True}}, "zero_optimization.allgather_partitions"),
        ({"zero_optimization": {"reduce_scatter": True}}, "zero_optimization.reduce_scatter"),
        # DeepSpeed's other paths to the same values
        ({"zero_optimization": {"contiguous_gradients": False}}, "zero_optimization.contiguous_gradients"),
        ({"zero_optimization": {"stage": 2, "reduce_scatter": False}}, "zero_optimization.reduce_scatter"),
        ({"disable_allgather": True}, "disable_allgather"),
        ({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 8}}, "zero_hpz_partition_size: no effect at"),
        ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "zero_quantized_weights"),
        ({"zero_optimization": {"stage": 3, "zero_quantized_gradients": True}}, "zero_quantized_gradients"),
        ({"zero_optimization": {"stage": 3, "zeropp_loco_param": {"err_beta": 0.8}}}, "zeropp_loco_param"),
        ({"zero_optimization": {"stage": 3, "paro_strategy": "NIG"}}, "paro_strategy"),
        # keys DeepSpeed does not read
        ({"bf16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}}, "bf16.initial_scale_power"),
        ({"fp16": {"enabled": True, "fp16_scale_tolerance": 0.25}}, "fp16.fp16_scale_tolerance"),
        ({"fp16": {"enabled": True, "opt_level": "O2"}}, "fp16.opt_level"),
        ({"comms_config": {"verbose": False}}, "comms_config"),
        ({"monitor_config": {"enabled": True, "tag": "x"}}, "monitor_config"),
        ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "offload_param.device: no effect at"),
        ({"fp16": {"auto_cast": True}}, "fp16.auto_cast: no effect without `fp16.enabled: true`"),
        ({"prescale_gradients": True, "gradient_predivide_factor": 2}, "gradient_predivide_factor: no effect"),
        ({"zero_optimization": {"offload_optimizer": {"pipeline_read": True}}}, "offload_optimizer.pipeline_read"),
        ({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9}}, "stage3_max_live_parameters"),
        ({"aio": {"block_size": 1048576, "queue_depth": 8}}, "aio"),
        ({"flops_profiler": {"enabled": True, "top_modules": 3}}, "flops_profiler.top_modules"),
        ({"flops_profiler": {"profile_step": 3}}, "flops_profiler.profile_step: no effect without"),
        ({"comms_logger": {"enabled": False}}, "comms_logger"),
        ({"memory_breakdown": False}, "memory_breakdown"),
        ({"_comment": "anything"}, "_comment"),
        ({"zero_optimization": {"stage": 2, "stage3_prefetch_bucket_size": 0}}, "stage3_prefetch_bucket_size"),
        ({"zero_optimization": {"stage": 1, "stage3_param_persistence_threshold": 10}}, "applies to stage 3 only"),
    ],
)
def test_accepted_without_effect(config, path):
    report = inspect_config(config)
    assert report.ok, report.problems
    assert any(path in note for note in report.no_effect), report.no_effect
    assert load_config(config) == report.config


# DeepSpeed's diagnostics, turned on as these configs do: DeepSpeed 0.19.8 accepts each (its parser is run on them in
# tests/config/test_config_corpus.py); here each is accepted without effect, with a warning saying what to use.
@pytest.mark.parametrize(
    ("config", "instead"),
    [
        ({"autotuning": {"enabled": True, "fast": True, "arg_mappings": {}}}, "shardtrain estimate"),
        ({"comms_logger": {"enabled": True, "verbose": False, "prof_all": True}}, "engine.comm_stats()"),
        ({"memory_breakdown": True}, "engine.state_bytes()"),
        ({"dump_state": True}, "engine.config"),
        ({"comet": {"enabled": True, "project": "p"}}, "tensorboard"),
    ],
)
def test_diagnostics_turned_on_are_accepted_with_a_warning(config, instead, caplog):
    path = next(iter(config))
    report = inspect_config(config)
    assert report.ok, report.problems
    assert len(report.warnings) == 1 and report.warnings[0].startswith(f"{path}: accepted without effect")
    assert instead in report.warnings[0]
    with caplog.at_level("WARNING", logger="shardtrain"):
        assert load_config(config) == report.config
    assert any(instead in r.getMessage() for r in caplog.records)
    off = {path: False} if isinstance(config[path], bool) else {path: {**config[path], "enabled": False}}
    assert inspect_config(off).warnings == []


def test_min_loss_scale_zero_with_dynamic_scaling_is_refused_as_in_deepspeed():
    """DeepSpeed 0.19.8 refuses ``fp16.min_loss_scale`` <= 0 with dynamic scaling (its scale's floor); a static
    scale does not read it, and both accept it there."""
    with pytest.raises(ConfigError, match="min_loss_scale 0 with dynamic loss scaling"):
        load_config({"fp16": {"enabled": True, "loss_scale": 0, "min_loss_scale": 0}})
    assert load_config({"fp16": {"enabled": True, "loss_scale": 128, "min_loss_scale": 0}}).fp16.min_loss_scale == 0
    with pytest.raises(ConfigError, match="min_loss_scale"):
        load_config({"fp16": {"enabled": True, "min_loss_scale": -1}})


@pytest.mark.parametrize(
    ("config", "fragments"),
    [
        ({"zero_optimization": {"allgather_partitions": False}}, ["allgather_partitions: false", "`true`"]),
        ({"zero_optimization": {"contiguous_gradients": 0}}, ["contiguous_gradients", "valid boolean"]),
        ({"gradient_predivide_factor": 0}, ["gradient_predivide_factor", "greater than 0"]),
        ({"zero_optimization": {"zero_hpz_partition_size": True}}, ["zero_hpz_partition_size", "whole number"]),
        ({"bf16": {"loss_scale": "dynamic"}}, ["bf16.loss_scale", "got 'dynamic'"]),
        ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme"}}}, ["nvme_path", "'nvme'"]),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "disk"}}}, ["offload_param.device", "'nvme'"]),
        ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, ["offload_optimizer", "stage 1, 2 or 3"]),
        (
            {"zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}},
            ["zero_optimization.cpu_offload: given with zero_optimization.offload_optimizer", "keep"],
        ),
        ({"zero_optimization": {"stage": 3, "cpu_offload_param": "yes"}}, ["cpu_offload_param: expected true"]),
        ({"optimizer": {"type": "Adam", "params": {"bias_correction": 0}}}, ["bias_correction: expected true or"]),
        ({"flops_profiler": {"enabled": True, "recompute_fwd_factor": 2}}, ["recompute_fwd_factor", "less than"]),
        (
            {"flops_profiler": {"enabled": True}, "graph": {"enabled": True}},
            ["flops_profiler.enabled with graph.enabled", "graph mode off"],
        ),
        ({"tensor_parallel": {"size": 2, "autotp_size": 4}}, ["tensor_parallel", "disagree"]),
        ({"zero_optimization": {"sub_group_size": "big"}}, ["zero_optimization.sub_group_size", "valid integer"]),
        ({"zero_allow_untested_optimizer": "yes"}, ["zero_allow_untested_optimizer", "valid boolean"]),
    ],
)
def test_refused_values_name_key_value_and_what_is_accepted(config, fragments):
    with pytest.raises(ConfigError) as err:
        load_config(config)
    for fragment in fragments:
        assert fragment in str(err.value), f"{fragment!r} not in: {err.value}"


@pytest.mark.parametrize(
    ("config", "fragments"),
    [
        ({"sparse_attention": {"mode": "fixed"}}, ["sparse_attention", "not provided"]),
        ({"zero_optimization": {"leaf_module": {}}}, ["zero_optimization.leaf_module", "stage3_unit_classes"]),
    ],
)
def test_not_supported_keys(config, fragments):
    with pytest.raises(ConfigError) as err:
        load_config(config)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_deepspeeds_pipeline_section_is_classified_key_by_key():
    # every key DeepSpeed's get_pipeline_config fills in (and use_reentrant, which its PipelineEngine reads) has a
    # rule, and the section as DeepSpeed writes it out loads: [Note: DeepSpeed's pipeline keys]
    from deepspeed.runtime.config import get_pipeline_config

    section = {**get_pipeline_config({}), "use_reentrant": None}
    assert all(f"pipeline.{key}" in RULES_BY_PATH for key in section), sorted(section)
    report = inspect_config({"pipeline_parallel_size": 2, "pipeline": section})
    assert report.problems == [] and report.config is not None
    assert report.config.pipeline.stages == "auto"
    assert report.autos == {"pipeline.stages": "`pipeline_parallel_size` (a PipelineModule's `num_stages`)"}
    ignored = {line.split(":")[0] for line in report.no_effect}
    # stages is checked, activation_checkpoint_interval checkpoints (at DeepSpeed's default 0: nothing)
    assert ignored == {f"pipeline.{k}" for k in section} - {
        "pipeline.stages",
        "pipeline.activation_checkpoint_interval",
    }
    assert report.config.pipeline.activation_checkpoint_interval == 0
    # the values DeepSpeed ignores or that change nothing without tensor parallelism are accepted at any value
    other = {"partition": "uniform", "seed_layers": True, "pipe_partitioned": False, "grad_partitioned": False}
    assert load_config({"pipeline": {**section, **other, "use_reentrant": False}}).pipeline.stages == "auto"


@pytest.mark.parametrize(
    ("pipeline", "fragment"),
    [
        ({"activation_checkpoint_interval": -1}, "pipeline.activation_checkpoint_interval: Input should be greater"),
        ({"pipe_partitioned": "yes"}, "pipeline.pipe_partitioned: Input should be a valid boolean"),
        ({"grad_partitioned": 1}, "pipeline.grad_partitioned: Input should be a valid boolean"),
        ({"partition": 3}, "pipeline.partition: Input should be a valid string"),
        ({"use_reentrant": "no"}, "pipeline.use_reentrant"),
        ({"stages": 0}, "pipeline.stages"),
        ({"stages": "all"}, "pipeline.stages"),
        ({"stage": 2}, "pipeline.stage: unknown key 'stage'; did you mean 'stages'?"),
    ],
)
def test_deepspeeds_pipeline_values_not_served_are_refused_by_name(pipeline, fragment):
    with pytest.raises(ConfigError) as err:
        load_config({"pipeline": pipeline})
    assert fragment in str(err.value), str(err.value)


@pytest.mark.parametrize(("config", "pp"), [({"pipeline_parallel_size": 2, "pipeline": {"stages": 4}}, 2),
                                             ({"pipeline": {"stages": 2}}, 1)])  # fmt: skip
def test_pipeline_stages_other_than_the_pipelines_size_are_refused(config, pp):
    from shardtrain.config.plan import resolve_plan

    with pytest.raises(ConfigError, match=rf"pipeline.stages {config['pipeline']['stages']} but the pipeline has {pp}"):
        resolve_plan(load_config(config), 4)
    assert resolve_plan(load_config({**config, "pipeline": {"stages": pp}}), 4).dims.pp == pp


def test_every_problem_is_reported_not_only_the_first():
    report = inspect_config(
        {
            "zero_optimization": {"stage": 7, "offload_optimizer": {"device": "tape"}, "stgae": 1},
            "sparse_gradients": True,
            "gradient_clipping": -1,
            "train_batch_sise": 8,
        }
    )
    keys = {p.split(":")[0] for p in report.problems}
    assert keys == {
        "zero_optimization.stage",
        "zero_optimization.offload_optimizer.device",
        "zero_optimization.stgae",
        "sparse_gradients",
        "gradient_clipping",
        "train_batch_sise",
    }, report.problems
    assert report.config is None
    assert any("did you mean 'train_batch_size'" in p for p in report.problems)


def test_aliases_and_legacy_spellings():
    assert load_config({"bfloat16": {"enabled": True}}).bf16.enabled is True
    assert load_config({"zero_optimization": {"stage": "2"}}).zero_optimization.stage == 2
    assert load_config({"zero_optimization": True}).zero_optimization.stage == 1
    assert load_config({"zero_optimization": False}).zero_optimization.stage == 0
    assert load_config({"zero_optimization": {}}).zero_optimization.stage == 0
    cfg = load_config(
        {"zero_optimization": {"stage": 3, "prefetch_bucket_size": 2e8, "param_persistence_threshold": 0}}
    )
    assert cfg.zero_optimization.stage3_prefetch_bucket_size == 200_000_000
    assert cfg.zero_optimization.stage3_param_persistence_threshold == 0
    report = inspect_config({"zero_optimization": {"stage": 3, "max_live_parameters": 0, "max_reuse_distance": 0}})
    assert report.ok and any("stage3_max_live_parameters" in n for n in report.no_effect)
    legacy = inspect_config({"zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True}})
    assert legacy.ok and legacy.config.zero_optimization.stage3_gather_16bit_weights_on_model_save is True
    with pytest.raises(ConfigError, match="given twice"):
        load_config({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}})
    with pytest.raises(ConfigError, match=r"bfloat16\.enabled"):  # the path as the config wrote it
        load_config({"bfloat16": {"enabled": "yes"}})


def test_legacy_offload_keys_are_read_as_deepspeed_reads_them():
    zero = load_config({"zero_optimization": {"stage": 2, "cpu_offload": True}}).zero_optimization
    assert zero.offload_optimizer.device == "cpu" and zero.offload_param.device == "none"
    zero = load_config({"zero_optimization": {"stage": 3, "cpu_offload": False, "cpu_offload_param": True}})
    assert zero.zero_optimization.offload_optimizer.device == "none"
    assert zero.zero_optimization.offload_param.device == "cpu"
    assert load_config({"zero_optimization": {"stage": 1, "cpu_offload": False}}) == load_config(
        {"zero_optimization": {"stage": 1}}
    )
    report = inspect_config(
        {"zero_optimization": {"stage": 1, "cpu_offload": True, "cpu_offload_use_pin_memory": True}}
    )
    assert report.ok and any("cpu_offload_use_pin_memory" in n for n in report.no_effect)


def test_auto_is_kept_by_load_config_and_refused_where_not_derivable():
    report = inspect_config({"train_batch_size": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})
    assert report.ok
    assert report.config.train_batch_size == "auto"
    assert set(report.autos) == {"train_batch_size", "optimizer.params.lr"}
    with pytest.raises(ConfigError, match='steps_per_print: "auto" cannot be derived'):
        load_config({"steps_per_print": "auto"})
    with pytest.raises(ConfigError, match=r'optimizer\.params\.momentum: "auto" cannot be derived'):
        load_config({"optimizer": {"type": "SGD", "params": {"momentum": "auto"}}})
    with pytest.raises(ConfigError, match="train_batch_size: Input should be a valid integer"):
        load_config({"train_batch_size": "automatic"})
