"""Every DeepSpeed config key, classified once: what shardtrain does with it.

One table (:data:`RULES`) says for each key of DeepSpeed's config reference whether it is

* **supported**: same meaning as in DeepSpeed (a field of :class:`shardtrain.config.sections.Config`);
* **accepted, no effect**: the value is checked, then dropped, because what it asks for is what shardtrain always
  does, or it tunes machinery shardtrain does not have;
* **refused value**: some values are accepted (without effect), the others asked for something not built here;
* **not supported**: any value is refused with what to do instead.

A supported key may still do nothing in some combinations (``stage3_*`` keys below stage 3, an ``nvme_path`` without
``device: nvme``, a monitor's path with the monitor off): :data:`NO_EFFECT_WHEN` lists those modes, the docs table
says them in the key's row and :func:`no_effect_here` names, for one config, the keys it gives that do nothing there
(``shardtrain config check`` prints them). ``tests/config/test_config_keys.py`` shows every supported key's effect.

:func:`classify` walks a raw config dict with that table before pydantic validates it, and returns the dict that
pydantic sees (aliases renamed, no-effect keys removed) with every problem found, not only the first.
``docs/config.md`` holds :func:`markdown_table`'s output; ``tests/config/test_config_deepspeed.py`` keeps them equal
(regenerate with ``python -m shardtrain.config.deepspeed_keys``).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, StrictBool, StrictFloat, StrictInt, StrictStr, TypeAdapter, ValidationError

AUTO = "auto"
Auto = Literal["auto"]
"""Marker type of a value written ``"auto"``: kept by ``load_config``, replaced at ``initialize``."""


_NUMBER = StrictInt | StrictFloat


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == AUTO


class Kind(str, Enum):
    SUPPORTED = "supported"
    NO_EFFECT = "accepted, no effect"
    REFUSED_VALUE = "refused value"
    NOT_SUPPORTED = "not supported"


@dataclass(frozen=True)
class Rule:
    path: str
    kind: Kind
    note: str
    """Supported: the meaning. No effect: why. Refused value / not supported: what it asks for, what to do."""
    values: str = ""
    """Values in words (docs): type and default, or the accepted values of a refused-value key."""
    check: Any = None
    """A type the value must have (validated by pydantic) before it is accepted without effect."""
    accept: Callable[[Any], bool] | None = None
    """Refused value: the values accepted (with no effect); any other value is refused."""
    auto: str = ""
    """Where ``"auto"`` is resolved from at ``initialize``; empty: ``"auto"`` is an error."""
    shown: Callable[[Any], str] | None = None
    """Refused value: the part of a refused section that asked for it, for the message."""
    warn_when: Callable[[Any], bool] | None = None
    """No effect, diagnostic: the values that turn the diagnostic on, accepted with a warning (``note``)."""
    deepspeed_refuses: bool = False
    """Not supported: DeepSpeed refuses the key as well (``note`` says why, in its words)."""


def _whole(v: Any) -> Any:
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _supported(path: str, values: str, note: str, auto: str = "") -> Rule:
    return Rule(path, Kind.SUPPORTED, note, values, auto=auto)


def _no_effect(path: str, values: str, note: str, check: Any = None, auto: str = "") -> Rule:
    return Rule(path, Kind.NO_EFFECT, note, values, check=check, auto=auto)


def _only(path: str, accepted: Any, note: str) -> Rule:
    """A key accepted (without effect) only at the value that is shardtrain's behaviour."""
    if isinstance(accepted, bool):
        shown, check = ("`true`" if accepted else "`false`"), StrictBool
    else:
        shown, check = (f'`"{accepted}"`' if isinstance(accepted, str) else f"`{accepted}`"), None
    return Rule(
        path,
        Kind.REFUSED_VALUE,
        note,
        shown,
        check=check,
        accept=lambda v: v == accepted and isinstance(v, bool) == isinstance(accepted, bool),
    )


def _disabled(path: str, note: str) -> Rule:
    """A section accepted (without effect) while its ``enabled`` is false or absent."""
    return Rule(
        path,
        Kind.REFUSED_VALUE,
        note,
        "section with `enabled: false`",
        check=dict,
        accept=lambda v: v.get("enabled", False) is False,
        shown=lambda v: f"enabled: {_describe(v.get('enabled'))}",
    )


def _diagnostic(path: str, note: str) -> Rule:
    """A diagnostic DeepSpeed has and shardtrain does not (a section with ``enabled``, or a bool): accepted without
    effect; turned on, it is accepted with a warning saying what to use instead (``note``). It changes no number of
    the training, so a config that asks for it still trains as DeepSpeed trains it."""
    if path in ("memory_breakdown", "dump_state"):
        return Rule(path, Kind.NO_EFFECT, note, "bool; `true` warns", check=StrictBool, warn_when=lambda v: v is True)
    return Rule(
        path,
        Kind.NO_EFFECT,
        note,
        "section; `enabled: true` warns",
        check=dict,
        warn_when=lambda v: v.get("enabled", False) is True,
    )


def _not_supported(path: str, note: str) -> Rule:
    return Rule(path, Kind.NOT_SUPPORTED, note)


def _deepspeed_refuses(path: str, note: str) -> Rule:
    """A key DeepSpeed's engine refuses too (see [Note: DeepSpeed's defaults]): refused here with its reason."""
    return Rule(path, Kind.NOT_SUPPORTED, note, deepspeed_refuses=True)


# [Note: DeepSpeed's pipeline keys]
# DeepSpeed 0.19.8 fills its `pipeline` section with defaults (`runtime/config.py`'s `get_pipeline_config`) and copies
# any key given; its PipelineEngine then reads only `activation_checkpoint_interval`, `use_reentrant`,
# `pipe_partitioned` and `grad_partitioned`. `stages`, `partition` and `seed_layers` are never read: the stages,
# the cut and the seeding are the PipelineModule's `num_stages`, `partition_method` and `seed_layers`, which the shim's
# PipelineModule takes as DeepSpeed's does. So `partition` and `seed_layers` are accepted without effect at any value,
# as DeepSpeed ignores them; `stages` is kept and must name the pipeline's size (a config that says 4 for a 2-stage
# module contradicts itself; `config.plan` refuses it). `pipe_partitioned`/`grad_partitioned` split what crosses a
# stage boundary into 1/tp pieces only when DeepSpeed's model-parallel size is above 1; pipeline parallelism with
# tensor parallelism is refused here, so DeepSpeed sends whole tensors too: the same bytes and values at any value
# (when pp x tp is built, `true` becomes a p2p volume the shardtrain pipeline does not cut: revisit these rows).
# `activation_checkpoint_interval` > 0 checkpoints layers in runs of that many ([Note: DeepSpeed's checkpoint
# interval] in engine/parallelize.py).
_ZERO_PP_SAME = "shardtrain communicates in full precision over all data-parallel ranks (the result of ZeRO without it)"
_Z = "zero_optimization."

# -- DeepSpeed-MoE's layer arguments and AutoEP's section ([Note: DeepSpeed's MoE keys]) ----------------------------
_MODEL_ROUTES = "the routing is the model's own router's (its transformers forward), which this value would change"
_FOUND = (
    "the MoE layers and their experts are found from the model (its transformers expert-parallel plan and fused "
    "experts modules, docs/expert-parallel.md); a custom pattern is not read"
)
_CAPACITY = (
    "with `drop_tokens: false` DeepSpeed-MoE sizes each expert's capacity to the tokens it gets, as here (no "
    "capacity, no token dropped); given without `drop_tokens: false` it is refused: DeepSpeed-MoE would drop the "
    "tokens over each expert's capacity"
)


def _one_of(path: str, accepted: tuple[Any, ...], note: str) -> Rule:
    """A key accepted (without effect) at the values listed, which are what the model already does."""
    floats = [a for a in accepted if type(a) is float]
    shown = ", ".join(f"`{json.dumps(v)}`" for v in accepted if not (type(v) is int and float(v) in floats))
    return Rule(
        path,
        Kind.REFUSED_VALUE,
        note,
        shown,
        accept=lambda v: any(v == a and isinstance(v, bool) == isinstance(a, bool) for a in accepted),
    )


_AUTOEP_PATTERN_KEYS = (
    "moe_layer_pattern", "expert_pattern", "router_pattern", "expert_w1", "expert_w2", "expert_w3", "num_experts_attr",
    "top_k_attr", "has_shared_experts", "shared_experts_pattern", "shared_experts_gate_pattern",
)  # fmt: skip
"""AutoEP's keys that tell it where the MoE layers, routers and expert weights of a model are."""

_MOE_RULES: tuple[Rule, ...] = (
    _supported(
        "moe",
        "section",
        "DeepSpeed-MoE's layer arguments (those of `deepspeed.moe.layer.MoE`, as the inference config's `moe` "
        "section has them) for a transformers MoE model: the keys that say what the model's forward already does "
        "are accepted, the ones that would drop tokens or change its routing are refused ([Note: DeepSpeed's MoE "
        "keys])",
    ),
    _only("moe.enabled", True, "the section is read when given; remove it for no expert parallelism"),
    _supported("moe.ep_size", "int ≥ 1", "`expert_parallel_size` (DeepSpeed-MoE's name)"),
    _only(
        "moe.drop_tokens",
        False,
        "DeepSpeed-MoE's default `true` drops the tokens over each expert's capacity; the transformers model's "
        "forward drops none, and neither does expert parallelism (dropless)",
    ),
    _no_effect("moe.capacity_factor", "number", _CAPACITY, check=_NUMBER),
    _no_effect("moe.eval_capacity_factor", "number", _CAPACITY, check=_NUMBER),
    _no_effect("moe.min_capacity", "int", _CAPACITY, check=int),
    _no_effect(
        "moe.use_rts",
        "bool",
        "random token selection chooses which tokens an expert over its capacity keeps; without a capacity none is "
        "dropped",
        check=StrictBool,
    ),
    _no_effect(
        "moe.use_tutel",
        "bool",
        "Tutel's kernels for DeepSpeed-MoE's dispatch; tokens go to their experts by shardtrain's all-to-all",
        check=StrictBool,
    ),
    _only(
        "moe.use_residual",
        False,
        "Residual MoE (PR-MoE) adds a dense MLP and a learned mix to each MoE layer; the model's layers are as "
        "transformers builds them",
    ),
    _one_of("moe.type", ("standard",), "`residual` is Residual MoE (see `moe.use_residual`)"),
    _one_of(
        "moe.noisy_gate_policy",
        (None, "None"),
        f"`Jitter` and `RSample` add noise to the router's input or logits in training: {_MODEL_ROUTES}",
    ),
    _only(
        "moe.top2_2nd_expert_sampling",
        False,
        f"DeepSpeed-MoE's default `true` samples each token's second expert with Gumbel noise: {_MODEL_ROUTES}",
    ),
    _only(
        "moe.enable_expert_tensor_parallelism",
        False,
        "experts split over tensor-parallel ranks are not built; each rank of an expert group holds whole experts",
    ),
    _not_supported("moe.k", "the top-k is the model's own: its config's `num_experts_per_tok`"),
    _not_supported(
        "moe.num_experts",
        "the number of experts is the model's own: its config's `num_experts` / `num_local_experts` / "
        "`n_routed_experts`",
    ),
    _not_supported("moe.moe_experts", "the number of experts is the model's own (see `moe.num_experts`)"),
    *(
        _not_supported(f"moe.{key}", "process groups come from the mesh: set `expert_parallel_size`")
        for key in ("ep_group", "expert_group", "ep_mp_group")
    ),
    _supported(
        "expert_parallel",
        "section",
        "DeepSpeed's AutoEP section: with `enabled: true`, `autoep_size` is `expert_parallel_size`; the keys that "
        "leave the model's routing as it is are accepted, the others refused ([Note: DeepSpeed's MoE keys])",
    ),
    _supported("expert_parallel.enabled", "bool, `false`", "`true`: `autoep_size` sets `expert_parallel_size`"),
    _supported(
        "expert_parallel.autoep_size", "int ≥ 1, `1`", "`expert_parallel_size` (AutoEP's name), with `enabled: true`"
    ),
    _one_of(
        "expert_parallel.expert_tensor_parallel_size",
        (1,),
        "experts split over tensor-parallel ranks are not built; each rank of an expert group holds whole experts",
    ),
    *(
        _no_effect(f"expert_parallel.{key}", "bool", why, check=StrictBool)
        for key, why in (
            ("use_grouped_mm", "each rank runs its experts through the model's own experts implementation"),
            ("disable_triton_grouped_mm", "each rank runs its experts through the model's own experts implementation"),
            ("validate_folding_routing", "no folding of expert and tensor parallelism is built"),
        )
    ),
    _no_effect("expert_parallel.preset_model", "string", _FOUND, check=StrictStr),
    *(_one_of(f"expert_parallel.{key}", (None,), _FOUND) for key in _AUTOEP_PATTERN_KEYS),
    *(
        _one_of(f"expert_parallel.{key}", default, f"its default takes the model's own value; {_MODEL_ROUTES}")
        for key, default in (
            ("route_norm", (None,)),
            ("route_scale", (1.0, 1)),
            ("score_apply", ("auto",)),
            ("num_expert_groups", (None,)),
            ("num_limited_groups", (None,)),
            ("score_func", ("auto",)),
            ("top_k", ("auto",)),
            ("routed_scaling_factor", ("auto",)),
        )
    ),
    _one_of(
        "expert_parallel.combine_impl",
        ("auto", "weighted_sum", "legacy_bmm"),
        "how AutoEP adds each token's weighted expert outputs; the model's own forward adds them here",
    ),
    _one_of(
        "expert_parallel.load_balance_coeff",
        (None,),
        "auxiliary-loss-free load balancing (a routing bias AutoEP updates) is not built, as in DeepSpeed's AutoEP; "
        "the model's own routing bias (DeepSeek-V3's `e_score_correction_bias`) is kept as it is",
    ),
)


RULES: tuple[Rule, ...] = (
    # -- batch size ------------------------------------------------------------------------------
    _supported(
        "train_batch_size",
        "int ≥ 1",
        "global batch per optimizer step",
        auto="micro x accumulation x data-parallel size",
    ),
    _supported(
        "train_micro_batch_size_per_gpu",
        "int ≥ 1",
        "per-rank batch of one forward/backward",
        auto='`auto_values["train_micro_batch_size_per_gpu"]`, or from the other two',
    ),
    _supported(
        "gradient_accumulation_steps",
        "int ≥ 1",
        "micro-steps per optimizer step",
        auto='`auto_values["gradient_accumulation_steps"]`, or from the other two',
    ),
    _only(
        "managed_gradient_accumulation",
        True,
        "call `engine.step()` after every micro-step; it steps at the boundary (`false`, client-managed "
        "boundaries, is not supported)",
    ),
    # -- optimizer and scheduler -----------------------------------------------------------------
    _supported(
        "optimizer",
        "section",
        "optimizer built by `initialize` (or pass `optimizer=`)",
    ),
    _supported(
        "optimizer.type",
        "`Adam`, `AdamW`, `SGD`, `Muon`",
        "`Adam` means AdamW unless `params.adam_w_mode: false`, `AdamW` is AdamW whatever `adam_w_mode` says (as in "
        "DeepSpeed); `Muon` is DeepSpeed's Muon + Adam split (`shardtrain.optim.deepspeed_muon`, its keys `lr`, "
        "`momentum`, `weight_decay`, `ns_method`, `betas`, `eps`, `muon_lr`, `adam_lr`, `adam_w_mode`, `torch_adam`; "
        "docs/muon.md); other types (Lamb, OneBitAdam, ...) are refused: pass a torch optimizer to "
        "`initialize(optimizer=...)`",
    ),
    _supported(
        "optimizer.params",
        "dict",
        "keyword arguments of the torch optimizer (checked against its signature); `lr`, `betas`, `eps`, "
        '`weight_decay` may be `"auto"`',
        auto='`auto_values["lr"]`, `["betas"]`, `["eps"]`, `["weight_decay"]`',
    ),
    _supported(
        "optimizer.params.torch_adam",
        "bool, `false`",
        "DeepSpeed's choice between torch's Adam/AdamW and its fused kernel (the same update, other defaults): "
        "without it `weight_decay` defaults to 0.0 as in DeepSpeed's FusedAdam and CPUAdam, with `true` to torch's "
        "(0.01 for AdamW); the optimizer here is always torch's (see [Note: DeepSpeed's defaults])",
    ),
    _supported(
        "optimizer.params.bias_correction",
        "bool, `true`",
        "DeepSpeed's fused/CPU Adam argument (`Adam`, `AdamW`): `false` steps with the moments as they are, "
        "`lr * m / (sqrt(v) + eps)`, with `shardtrain.optim.adam.DeepSpeedAdam` (the weight decay as `adam_w_mode` "
        "says); `true` is torch's Adam/AdamW",
    ),
    _deepspeed_refuses(
        "optimizer.params.max_grad_norm",
        "not an optimizer parameter (the engine clips the global gradient norm, not the optimizer); use the "
        "top-level `gradient_clipping`",
    ),
    _no_effect("optimizer.legacy_fusion", "bool", "there are no fused DeepSpeed optimizers here", check=StrictBool),
    _supported(
        "scheduler",
        "section",
        "LR scheduler built by `initialize` (or pass `lr_scheduler=`), stepped once per optimizer step",
    ),
    _supported(
        "scheduler.type",
        "`WarmupLR`, `WarmupDecayLR`, `WarmupCosineLR`, `OneCycle`, `LRRangeTest`",
        "DeepSpeed's formulas, the learning rate of every step included (`OneCycle` also cycles Adam's beta1 as "
        "DeepSpeed does); the schedulers also load DeepSpeed's own state (`{'last_batch_iteration': k}`); other "
        "types are refused: pass a torch scheduler to `initialize(lr_scheduler=...)`",
    ),
    _supported(
        "scheduler.params",
        "dict",
        "WarmupLR/WarmupDecayLR: `warmup_min_lr` (0), `warmup_max_lr` (WarmupLR: the optimizer's lr; "
        "WarmupDecayLR: 0.001), `warmup_num_steps` (1000), "
        "`warmup_type` (`log`/`linear`), `total_num_steps` (WarmupDecayLR, required). WarmupCosineLR: "
        "`total_num_steps` (required), `warmup_min_ratio` (0), `warmup_num_steps` (1000), `cos_min_ratio` (0.0001), "
        "`warmup_type` (a ratio of the optimizer's lr). OneCycle: `cycle_min_lr`, `cycle_max_lr` (required), "
        "`cycle_first_step_size` (2000), `cycle_second_step_size`, `cycle_first_stair_count` (0), "
        "`cycle_second_stair_count`, `decay_step_size` (0), `decay_lr_rate` (0), `cycle_momentum` (true), "
        "`cycle_min_mom` (0.8), `cycle_max_mom` (0.9), `decay_mom_rate` (0). LRRangeTest: "
        "`lr_range_test_min_lr` (0.001), `lr_range_test_step_size` (2000), `lr_range_test_step_rate` (1), "
        "`lr_range_test_staircase` (false)",
        auto='`warmup_min_lr`: `auto_values["warmup_min_lr"]` or 0; `warmup_max_lr`: `["lr"]`; '
        "`warmup_num_steps`, `total_num_steps`: same names",
    ),
    _supported(
        "zero_allow_untested_optimizer",
        "bool, `false`",
        "accept at stages 1-3 (or under tensor parallelism) an optimizer not known to be element-wise whose step a "
        "probe at `initialize` finds element-wise on a small tensor; by default only SGD, Adam, AdamW, Adamax, NAdam, "
        "RAdam, Adagrad, Adadelta, RMSprop, ASGD, shardtrain's DeepSpeedAdam and their subclasses that keep their "
        "`step` are. Optimizers known to need whole tensors (Muon, Adafactor, LAMB, Shampoo, LBFGS, SparseAdam) or "
        "that the probe shows are not element-wise are refused whatever this key says (docs/muon.md); stage 0 "
        "without tensor parallelism accepts any optimizer",
    ),
    _no_effect(
        "zero_force_ds_cpu_optimizer",
        "bool",
        "offloaded steps run torch's own optimizer on the CPU",
        check=StrictBool,
    ),
    # -- communication ---------------------------------------------------------------------------
    _supported(
        "communication_data_type",
        "`fp32`, `bf16`, `fp16`; the compute dtype",
        "dtype gradients are reduced in (mixed precision only); absent: the compute dtype, as in DeepSpeed; `fp32` "
        "sums in full precision for twice the bytes",
    ),
    _no_effect(
        "seq_parallel_communication_data_type",
        "string",
        "the sequence-parallel all-to-alls run in the compute dtype",
        check=StrictStr,
    ),
    _only(
        "gradient_allreduce_op",
        "mean",
        'gradients are averaged over data-parallel ranks; `"sum"` is not supported',
    ),
    _supported(
        "prescale_gradients",
        "bool, `false`",
        "divide each gradient bucket by the data-parallel size before a summing reduction, instead of averaging "
        "during it (the same value up to rounding; in fp16/bf16 communication the smaller values cannot overflow); "
        "in graph mode at stage 3 the captured graph averages the units' gradients itself",
    ),
    _supported(
        "gradient_predivide_factor",
        "float > 0, `1.0`",
        "divide each gradient bucket by this factor before a summing reduction and by data-parallel size / factor "
        "after it (DeepSpeed's split of the average around the reduction)",
    ),
    _only("sparse_gradients", False, "sparse embedding gradients are not supported"),
    _no_effect(
        "disable_allgather",
        "bool",
        "DeepSpeed's broadcast instead of an all-gather of the updated parameters: the same values arrive; "
        "shardtrain always all-gathers",
        check=StrictBool,
    ),
    # -- precision -------------------------------------------------------------------------------
    _supported("fp16", "section", "fp16 compute with loss scaling"),
    _supported(
        "fp16.enabled",
        "bool, `false`",
        "fp16 compute, fp32 masters and optimizer state",
        auto='`auto_values["precision"] == "fp16"`; false when not given',
    ),
    _supported("fp16.loss_scale", "float ≥ 0, `0`", "`0` = dynamic scaling; a positive value is a static scale"),
    _supported("fp16.initial_scale_power", "int 0-64, `16`", "dynamic scaling starts at 2^this"),
    _supported(
        "fp16.loss_scale_window",
        "int ≥ 1, `1000`",
        "clean steps after which the scale doubles (on the next clean step, as DeepSpeed counts)",
    ),
    _supported(
        "fp16.hysteresis",
        "int ≥ 1, `2`",
        "overflows absorbed before the scale halves (restored after a clean window)",
    ),
    _supported(
        "fp16.min_loss_scale",
        "float ≥ 0, `1`",
        "the scale never halves below it, and an overflow at it raises an error; 0 (as DeepSpeed takes it): no floor",
    ),
    _supported(
        "fp16.auto_cast",
        "bool, `false`",
        "cast the floating tensors among `forward`'s positional arguments (in lists, tuples and dicts too) to fp16, "
        "as DeepSpeed does; keyword arguments are passed as given",
    ),
    _no_effect(
        "fp16.fp16_scale_tolerance",
        "number",
        "an old apex/DeepSpeed knob of the loss scaler that DeepSpeed's scaler no longer reads",
        check=_NUMBER,
    ),
    _no_effect(
        "fp16.opt_level",
        "string",
        "apex AMP's optimization level, not read by DeepSpeed's fp16 section (it belongs in `amp`)",
        check=StrictStr,
    ),
    _only(
        "fp16.consecutive_hysteresis",
        False,
        "the hysteresis allowance is restored after a clean window, not after every clean step",
    ),
    _only("fp16.fp16_master_weights_and_grads", False, "master weights and gradients are always fp32"),
    _supported("bf16", "section", "bf16 compute (also spelled `bfloat16`)"),
    _supported(
        "bf16.enabled",
        "bool, `false`",
        "bf16 compute, fp32 masters and optimizer state",
        auto='`auto_values["precision"] == "bf16"`; false when not given',
    ),
    _no_effect(
        "bf16.immediate_grad_update",
        "bool",
        "gradients are accumulated in fp32 and applied at the boundary",
        check=StrictBool,
    ),
    _supported(
        "bf16.check_grad_overflow",
        "bool, `true`",
        "skip a step whose gradients hold inf or NaN (parameters, masters, optimizer state and the scheduler "
        "untouched; `skipped_steps` counts it), as DeepSpeed does; `false` applies it at ZeRO stages 1-2 and is "
        "ignored at 0 and 3, where DeepSpeed's bf16 optimizers always skip",
    ),
    *(
        _no_effect(
            f"bf16.{key}",
            "number",
            "loss scaling applies to fp16 only (bf16 has fp32's range); DeepSpeed ignores it in `bf16` too",
            check=_NUMBER,
        )
        for key in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")
    ),
    _only(
        "bf16.bf16_master_weights_and_grads",
        False,
        "DeepSpeed's ZeRO (stages 1-3) then keeps the stepped weights and the reduced gradients in bf16, with no "
        "fp32 copy; here master weights and gradients are always fp32 (`true` is not supported: drop it; the fp32 "
        "masters cost 4 bytes per parameter, divided over the ranks by ZeRO stage 1 and up)",
    ),
    _only(
        "bf16.bf16_optimizer_states",
        False,
        "DeepSpeed then keeps Adam's moments in bf16 as well (it needs `bf16_master_weights_and_grads`); here "
        "optimizer state is always fp32 (`true` is not supported: drop it, or offload the state with "
        "`offload_optimizer`)",
    ),
    _disabled("amp", "apex AMP is not supported; use the `bf16` or `fp16` section"),
    _disabled(
        "torch_autocast",
        "DeepSpeed's mode of fp32 weights with the forward under `torch.autocast` (per-op casts) and the gradients "
        "of `lower_precision_safe_modules` reduced in the autocast dtype is not built; use the `bf16` or `fp16` "
        "section (weights cast to that dtype, fp32 masters), or call `torch.autocast` in your own forward",
    ),
    _supported("data_types", "section", "DeepSpeed's dtypes section"),
    _supported(
        "data_types.grad_accum_dtype",
        "`fp32` or the compute dtype; the compute dtype",
        "dtype gradients accumulate in over micro-steps; absent: the compute dtype, as in DeepSpeed; `fp32` is exact, "
        "for 2 bytes per parameter more",
    ),
    _supported(
        "gradient_clipping",
        "float ≥ 0, `1.0`",
        "clip the global gradient norm (0 = off); absent: 1.0, DeepSpeed's default",
        auto='`auto_values["gradient_clipping"]`',
    ),
    # -- ZeRO ------------------------------------------------------------------------------------
    _supported("zero_optimization", "section", "ZeRO settings (legacy `true`/`false` means stage 1/0)"),
    _supported(
        _Z + "stage",
        '0, 1, 2, 3 (also `"1"`); `0`',
        "what is partitioned (see architecture.md)",
    ),
    _supported(
        _Z + "reduce_bucket_size",
        "int ≥ 0 (`5e8` accepted), `5e8`",
        "elements per gradient bucket and parameter layout unit (0: one parameter per bucket); at stage 3 it groups "
        "the persistent parameters only (each unit is a bucket of its own). At stages 1-2 the default (DeepSpeed's) "
        "puts a small model in one bucket, whose reduction cannot overlap backward: ~25 MB worth of elements (DDP's "
        "bucket) overlaps (docs/benchmarks.md)",
        auto="hidden_size²",
    ),
    _supported(
        _Z + "allgather_bucket_size",
        "int ≥ 1, `5e8`",
        "at most this many elements of post-step all-gathers in flight (at stage 3 only persistent parameters are "
        "all-gathered after the step: units are gathered on use)",
    ),
    _supported(
        _Z + "overlap_comm",
        "bool, `true`",
        "launch each bucket's reduction during backward; `false` reduces after backward (graph mode at stage 3: "
        "each unit's reduce-scatter is waited for when issued instead of overlapping the next unit's backward)",
    ),
    _no_effect(
        _Z + "contiguous_gradients",
        "bool",
        "gradients are always copied into contiguous bucket buffers (`false` in DeepSpeed only saves that copy: "
        "the reduced values are the same)",
        check=StrictBool,
    ),
    _only(_Z + "allgather_partitions", True, "parameters are always all-gathered (not broadcast) after the step"),
    _no_effect(
        _Z + "reduce_scatter",
        "bool",
        "gradients are always reduce-scattered at stages 1 and 2 (`false` in DeepSpeed all-reduces them instead: "
        "each rank keeps its part, the same values)",
        check=StrictBool,
    ),
    _only(_Z + "grad_hooks", True, "reductions are launched from gradient hooks (see `overlap_comm`)"),
    _no_effect(
        _Z + "use_multi_rank_bucket_allreduce",
        "bool",
        "one reduction per bucket is the only schedule",
        check=StrictBool,
    ),
    _only(_Z + "ignore_unused_parameters", True, "unused parameters get a zero gradient"),
    _only(_Z + "load_from_fp32_weights", True, "checkpoints always load the fp32 masters"),
    _no_effect(
        _Z + "elastic_checkpoint",
        "bool",
        "checkpoints always load into any layout",
        check=StrictBool,
    ),
    _no_effect(
        _Z + "round_robin_gradients",
        "bool",
        "an ordering of DeepSpeed's gradient copies to the host; shardtrain copies each reduced shard once",
        check=StrictBool,
    ),
    _supported(
        _Z + "sub_group_size",
        "int ≥ 0, `1e9`",
        "with `offload_optimizer`, the optimizer steps each rank's fragments in sub-groups of about this many "
        "elements, one at a time (a fragment is never split), and one sub-group's state is what a swap buffer "
        "holds; without offload one step covers all fragments (the same numbers)",
    ),
    _supported(
        _Z + "offload_optimizer",
        "section",
        "optimizer state (and the fp32 masters of mixed precision) in host memory or in files: docs/offload.md",
    ),
    _supported(
        _Z + "offload_optimizer.device",
        '`"none"`, `"cpu"`, `"nvme"`; none',
        "stages 1-3. `cpu`: state in (pinned) host memory and the step on the CPU (on a CPU-only machine the "
        "state is already there); `nvme`: state in swap files, stepped one sub-group at a time",
    ),
    _supported(
        _Z + "offload_optimizer.nvme_path",
        "path",
        "directory for the swap files (required with `nvme`; checked writable at `initialize` on every rank)",
    ),
    _supported(
        _Z + "offload_optimizer.pin_memory", "bool, `true`", "page-locked host buffers (CUDA only; DeepSpeed's default)"
    ),
    _supported(
        _Z + "offload_optimizer.buffer_count",
        "int ≥ 1, `4`",
        "`nvme`: sub-group buffers in flight (read ahead, stepped, written back): the state held in memory",
    ),
    _supported(
        _Z + "offload_optimizer.ratio",
        "0 < float ≤ 1, `1`",
        "fraction of the rank's optimizer-state elements offloaded (the first sub-groups): `nvme`, the share in swap "
        "files, the rest resident; `cpu` on CUDA, the share with host masters stepped on the CPU, the rest stepped on "
        "the GPU (DeepSpeed's partial offload); `cpu` without a GPU, none (`initialize` warns)",
    ),
    _no_effect(
        _Z + "offload_optimizer.pipeline_read",
        "bool",
        "reads of the next sub-group always overlap the step",
        check=StrictBool,
    ),
    _no_effect(
        _Z + "offload_optimizer.pipeline_write",
        "bool",
        "writes of the previous sub-group always overlap the step",
        check=StrictBool,
    ),
    _no_effect(
        _Z + "offload_optimizer.fast_init",
        "bool",
        "swap files are created on the first write, never initialized ahead",
        check=StrictBool,
    ),
    _no_effect(
        _Z + "offload_optimizer.cpuadam_cores_perc",
        "number",
        "the CPU step uses torch's optimizers and torch's threads",
    ),
    _supported(
        _Z + "offload_param",
        "section",
        "stage 3: parameter shards in host memory or in files (below stage 3 DeepSpeed ignores it, and so does "
        "shardtrain)",
    ),
    _supported(
        _Z + "offload_param.device",
        '`"none"`, `"cpu"`, `"nvme"`; none',
        "stage 3 only. `nvme`: each unit's shard in a mapped swap file, read before its gather; `cpu`: on CUDA each "
        "unit's shard in page-locked host memory, copied to the GPU on a side stream before its gather (both need "
        "`offload_optimizer` on CUDA); on a CPU-only machine `cpu` is where the shards are already",
    ),
    _supported(_Z + "offload_param.nvme_path", "path", "directory for the parameter swap files"),
    _supported(
        _Z + "offload_param.pin_memory",
        "bool, `true`",
        "page-locked host shards of parameter offload (CUDA only: their copies to the GPU overlap compute only from "
        "page-locked memory; `false`: pageable shards, copied without that overlap)",
    ),
    _supported(
        _Z + "offload_param.buffer_count",
        "int ≥ 1, `5`",
        "`nvme`: at most this many units' shards are read ahead of their gather; the next read starts when one of "
        "them has been gathered",
    ),
    _supported(
        _Z + "offload_param.max_in_cpu",
        "int ≥ 0, `1e9`",
        "`nvme`: the first units holding this many elements stay in memory instead of on disk",
    ),
    _no_effect(
        _Z + "offload_param.buffer_size",
        "int ≥ 0",
        "the kernel's page cache holds the shards being read",
        check=int,
    ),
    _no_effect(
        _Z + "cpu_offload_use_pin_memory",
        "bool",
        "legacy spelling; use `offload_optimizer.pin_memory`",
        check=StrictBool,
    ),
    _supported(
        _Z + "zenflow",
        "section",
        "stall-free offload (DeepSpeed's ZenFlow), stages 1-2 with `offload_optimizer.device` `cpu`, on the CPU and "
        "CUDA: each step the "
        "most important gradient columns update at once, the rest accumulate and update on the host every "
        "`update_interval` steps: docs/offload.md#zenflow",
    ),
    _supported(
        _Z + "zenflow.topk_ratio",
        "0 < float < 1, `0.1`",
        "fraction of each 2-D weight's columns updated every step: those with the largest sum of absolute gradients "
        "over the rows at a selection step; non-2-D parameters update whole every step",
    ),
    _supported(
        _Z + "zenflow.select_strategy",
        '`"auto"`, `"step"`, `"epoch"`; `"auto"`',
        "`step`: columns reselected every `select_interval` steps; `epoch`/`auto`: every epoch, which without a data "
        "loader in `initialize` means once, at the first step after warm-up (DeepSpeed does the same then)",
    ),
    _supported(
        _Z + "zenflow.select_interval",
        'int ≥ 1 (a multiple of `update_interval`) or `"auto"`; `"auto"`',
        'steps (or epochs, `select_strategy` `"epoch"`) between reselections',
        auto='DeepSpeed\'s own value, with `select_strategy` `"auto"` only: once per epoch',
    ),
    _supported(
        _Z + "zenflow.update_interval",
        'int ≥ 1 or `"auto"`; `"auto"`',
        "the other columns' gradients are averaged over this many steps and applied by the host optimizer then",
        auto="DeepSpeed's adaptive interval: a host update when the other columns' gradients outweigh the selected "
        "ones' in `auto_ratio` of the 2-D weights (docs/offload.md#zenflow)",
    ),
    _supported(
        _Z + "zenflow.overlap_step",
        "bool, `false`",
        "the host update runs in a thread during the next `update_interval` steps and lands at their end (at most "
        "one interval late); `false`: it lands at once",
    ),
    _supported(
        _Z + "zenflow.full_warm_up_rounds",
        "int ≥ 0, `0`",
        "steps of plain full updates (every column, current gradients) before the split starts",
    ),
    _only(
        _Z + "zenflow.offload",
        False,
        "the selected columns' optimizer state in host memory is not built (it stays where the step runs)",
    ),
    _supported(
        _Z + "zenflow.auto_ratio",
        "0 ≤ float ≤ 1, `0.99`",
        'with `update_interval` `"auto"`: the fraction of 2-D weights that must call for a host update',
    ),
    _no_effect(
        _Z + "zenflow.pt_reserved_cores_perc",
        "0 ≤ float ≤ 1",
        "DeepSpeed splits the cores between training and its optimizer process; here the host update is a thread "
        "of the training process, on torch's threads",
        check=_NUMBER,
    ),
    _not_supported(
        _Z + "zenflow.steps_per_epoch",
        "DeepSpeed's engine sets it from its data loader, a user does not; remove it",
    ),
    _supported(
        _Z + "stage3_param_persistence_threshold",
        "int ≥ 0, `1e5`",
        "stage 3: parameters with fewer elements stay whole on every rank",
        auto="10 x hidden_size (stage 3)",
    ),
    _supported(
        _Z + "stage3_prefetch_bucket_size",
        "int ≥ 0, `5e7`",
        "stage 3: prefetch the next unit if it has at most this many elements (0 = no prefetch); graph mode: the "
        "captured graphs issue a unit's all-gather one unit ahead under the same bound",
        auto="0.9 x hidden_size² (stage 3)",
    ),
    _supported(
        _Z + "stage3_unit_classes",
        "list of class names",
        "stage 3 (shardtrain key): gather/release modules of these classes as units instead of repeated blocks",
    ),
    _supported(
        _Z + "stage3_gather_check",
        "bool, `true`",
        "stage 3 (shardtrain key): ranks on different module paths fail with the unit names before a gather mixes "
        "them: one 8-byte exchange before each gather until two passes of a kind gathered alike, none after while "
        "every rank follows that order; `false` turns it off",
    ),
    _no_effect(
        _Z + "stage3_max_live_parameters",
        "int ≥ 0",
        "at most the current and the prefetched units are gathered",
        check=int,
    ),
    _no_effect(
        _Z + "stage3_max_reuse_distance",
        "int ≥ 0",
        "units are released after every use",
        check=int,
    ),
    _no_effect(
        _Z + "stage3_model_persistence_threshold",
        "int ≥ 0",
        "persistence is decided per parameter (`stage3_param_persistence_threshold`) only",
        check=int,
    ),
    _no_effect(
        _Z + "stage3_module_granularity_threshold",
        "int ≥ 0",
        "units are transformer blocks or `stage3_unit_classes`, not chosen by granularity",
        check=int,
    ),
    _supported(
        _Z + "stage3_gather_16bit_weights_on_model_save",
        "bool, `false`",
        "stage 3: the DeepSpeed shim's `save_16bit_model` gathers and writes the full weights; without it it writes "
        "nothing and returns False, as DeepSpeed does (`engine.full_state_dict()` gathers them whatever it says)",
        auto="true (Hugging Face's Trainer saves the full weights with it)",
    ),
    _no_effect(
        _Z + "stage3_use_all_reduce_for_fetch_params",
        "bool",
        "units are fetched with one all-gather each",
        check=StrictBool,
    ),
    _no_effect(_Z + "stage3_allgather_sequential", "bool", "one all-gather per unit", check=StrictBool),
    _no_effect(_Z + "memory_efficient_linear", "bool", "linear layers are not replaced", check=StrictBool),
    _no_effect(_Z + "override_module_apply", "bool", "`module.apply` is not patched", check=StrictBool),
    _no_effect(_Z + "log_trace_cache_warnings", "bool", "there is no trace cache", check=StrictBool),
    _no_effect(
        _Z + "enable_sanity_checks",
        "bool",
        "see `stage3_gather_check` for shardtrain's check",
        check=StrictBool,
    ),
    _no_effect(
        _Z + "save_muon_momentum_buffer_in_memory",
        "bool",
        "Muon's momentum is optimizer state like Adam's moments, sharded and kept in memory (or offloaded) with it",
        check=StrictBool,
    ),
    _not_supported(_Z + "leaf_module", "use `zero_optimization.stage3_unit_classes` to choose units"),
    _only(_Z + "legacy_stage1", False, "there is one stage-1 implementation"),
    _only(_Z + "pipeline_loading_checkpoint", False, "there is no pipeline parallelism"),
    _supported(
        _Z + "zero_hpz_partition_size",
        "int ≥ 0, `1`",
        "ZeRO++ hpZ (stage 3): each rank keeps its slice of a unit's gathered parameters within groups of this many "
        "adjacent data-parallel ranks (one node) from the unit's forward to its backward, which gathers the unit "
        "there instead of over every rank; gradients and optimizer state stay sharded over every rank, the values "
        "are plain ZeRO-3's; must divide the data-parallel size; 0 or 1: off; not with `mics_shard_size`, tensor or "
        "sequence parallelism, `offload_param` or graph mode (docs/hybrid-sharding.md)",
    ),
    *(
        _no_effect(
            _Z + key,
            "bool",
            f"ZeRO++ {what}: an approximation of the full-precision collective shardtrain runs; " + _ZERO_PP_SAME,
            check=StrictBool,
        )
        for key, what in (
            ("zero_quantized_weights", "int8 parameter all-gathers (qwZ)"),
            ("zero_quantized_nontrainable_weights", "int8 storage of frozen parameters"),
            ("zero_quantized_gradients", "int4 gradient reduce-scatters (qgZ)"),
        )
    ),
    _no_effect(
        _Z + "zeropp_loco_param",
        "section",
        "error feedback for ZeRO++'s quantized gradients (LoCo); gradients are not quantized here",
        check=dict,
    ),
    _no_effect(
        _Z + "paro_strategy",
        "string",
        "PaRO (partial-redundancy partitioning, `NIG`, `IIG`, ...) chooses within which ranks each state is "
        "partitioned: a placement, the same values; shardtrain partitions over all data-parallel ranks as `stage` "
        "says",
        check=StrictStr,
    ),
    _supported(
        _Z + "mics_shard_size",
        "int, `-1`",
        "hybrid sharding (MiCS): stages 1-3 shard parameters, gradients and optimizer state within groups of this "
        "many adjacent data-parallel ranks and replicate them across groups (gradients reduce-scattered in a group, "
        "then all-reduced across groups); must divide the data-parallel size; -1: one group of all "
        "(docs/hybrid-sharding.md)",
    ),
    _no_effect(
        _Z + "mics_hierarchical_params_gather",
        "bool",
        "a shard group's all-gather is one collective (NCCL routes it over the nodes the group spans); DeepSpeed's "
        "two-level gather changes which links carry the bytes, not the values",
        check=StrictBool,
    ),
    # -- logging and monitoring ------------------------------------------------------------------
    _supported(
        "steps_per_print",
        "int ≥ 1 or `inf`; absent",
        "rank 0 logs loss, lr and grad norm (logger `shardtrain`) every this many steps; absent or `inf` (accelerate "
        "writes it): never, as in DeepSpeed",
    ),
    _supported(
        "wall_clock_breakdown",
        "bool, `false`",
        "log forward/backward/step wall-clock times every `steps_per_print` steps (rank 0)",
    ),
    _diagnostic(
        "dump_state",
        "the engine state is not printed at start: the resolved config is logged once by `initialize`, and "
        "`engine.config` holds it",
    ),
    _diagnostic(
        "memory_breakdown",
        "DeepSpeed's memory report is not built: `engine.state_bytes()` gives each rank's parameter, gradient and "
        "optimizer bytes",
    ),
    *(
        rule
        for monitor in ("tensorboard", "csv_monitor")
        for rule in (
            _supported(monitor, "section", f"write scalars with the {monitor} monitor"),
            _supported(f"{monitor}.enabled", "bool, `false`", "turn the monitor on"),
            _supported(
                f"{monitor}.output_path",
                "string, empty",
                "directory of the monitor's files; empty: the working directory",
            ),
            _supported(f"{monitor}.job_name", "string, `DeepSpeedJobName`", "subdirectory of `output_path`"),
        )
    ),
    _supported("wandb", "section", "log scalars to Weights & Biases (needs the `wandb` package)"),
    _supported("wandb.enabled", "bool, `false`", "turn the monitor on"),
    _supported("wandb.group", "string", "W&B group"),
    _supported("wandb.team", "string", "W&B team (entity)"),
    _supported("wandb.project", "string, `deepspeed`", "W&B project"),
    _diagnostic("comet", "the Comet monitor is not built: use `tensorboard`, `csv_monitor` or `wandb`"),
    _diagnostic(
        "comms_logger",
        "DeepSpeed's communication logger is not built: `engine.comm_stats()` counts each collective's calls and bytes",
    ),
    _no_effect(
        "comms_config",
        "section",
        "not read by DeepSpeed either (its communication logger is the top-level `comms_logger`)",
        check=dict,
    ),
    _no_effect(
        "log",
        "section",
        "not read by DeepSpeed either (its logging interval is the top-level `steps_per_print`)",
        check=dict,
    ),
    _no_effect(
        "cuda_visible_devices",
        "any",
        "not read by DeepSpeed either; set the `CUDA_VISIBLE_DEVICES` environment variable or the launcher's "
        "`--include`",
    ),
    _no_effect(
        "monitor_config",
        "section",
        "not read by DeepSpeed either (monitors are the top-level `tensorboard`, `csv_monitor`, `wandb`)",
        check=dict,
    ),
    _supported(
        "flops_profiler",
        "section",
        'model FLOPs counted once, TFLOP/s per rank and MFU in the monitor: docs/benchmarks-gpu.md, "MFU"',
    ),
    _supported("flops_profiler.enabled", "bool, `false`", "count at `profile_step`, then report TFLOP/s and MFU"),
    _supported(
        "flops_profiler.profile_step",
        "int ≥ 0, `1`",
        "the optimizer step whose forwards rank 0 counts (with `torch.utils.flop_counter`), after that many steps",
    ),
    _supported("flops_profiler.module_depth", "int ≥ -1, `-1`", "depth of the report's per-module table; -1: all"),
    _no_effect(
        "flops_profiler.top_modules",
        "int ≥ 1",
        "the per-module table lists every module to `module_depth`",
        check=int,
    ),
    _supported("flops_profiler.detailed", "bool, `true`", "write the per-module table in the report"),
    _supported("flops_profiler.output_file", "string", "write the report to this file instead of the log"),
    _supported(
        "flops_profiler.recompute_fwd_factor",
        "float in [0, 1], `0`",
        "share of the forward recomputed in backward: hardware TFLOP/s count `(3 + factor) x` the forward's FLOPs, "
        "model TFLOP/s and MFU `3 x`",
    ),
    _supported(
        "flops_profiler.peak_tflops",
        "float > 0",
        "shardtrain key: the device's peak TFLOP/s for MFU (default: the dense 16-bit peak of known GPUs)",
    ),
    _no_effect(
        "timers",
        "section",
        "DeepSpeed's throughput timers; see `wall_clock_breakdown`",
        check=dict,
    ),
    # -- activation checkpointing: DeepSpeed's section, with shardtrain's policy ------------------------
    _supported(
        "activation_checkpointing",
        "section",
        "activation checkpointing of the model's blocks (ZeRO-3's units, at every stage) by `policy`: "
        "docs/activation-checkpointing.md",
    ),
    _supported(
        "activation_checkpointing.policy",
        '`"none"`, `"full"`, `"selective"`, `"budget"`; `"none"`',
        "shardtrain key: `full` keeps each block's inputs and recomputes the block in backward; `selective` also "
        "keeps matmul and attention outputs and recomputes the rest; `none` recomputes nothing (DeepSpeed's "
        "section only configures `deepspeed.checkpointing`, which a model calls itself); `budget` picks per block "
        "under `memory_budget_gib`",
    ),
    _supported(
        "activation_checkpointing.memory_budget_gib",
        "number > 0; none",
        'shardtrain key, with `policy: "budget"` (required there, refused elsewhere): the GiB one rank\'s predicted '
        "peak must fit; the planner picks per block none, selective or full (the least recompute that fits)",
    ),
    _supported(
        "activation_checkpointing.budget_seq_len",
        "int ≥ 1; none",
        'shardtrain key, with `policy: "budget"` (required there, refused elsewhere): the tokens per sequence the '
        "budget is planned for",
    ),
    _supported(
        "activation_checkpointing.cpu_checkpointing",
        "bool, `false`",
        "the inputs checkpointed blocks keep wait in host memory between forward and backward (pinned, copied on a "
        "side stream, back one block ahead)",
    ),
    _supported(
        "activation_checkpointing.partition_activations",
        "bool, `false`",
        "with tensor parallelism each rank keeps 1/tp of a checkpointed block's inputs, all-gathered over the "
        "tensor-parallel group before the recompute (with `cpu_checkpointing` refused: not built)",
    ),
    _no_effect(
        "activation_checkpointing.number_checkpoints",
        "int ≥ 1",
        "it sizes DeepSpeed's contiguous checkpoint buffer; here the checkpointed blocks are ZeRO-3's units",
        check=StrictInt,
    ),
    _supported(
        "activation_checkpointing.contiguous_memory_optimization",
        "bool, `false`",
        "DeepSpeed's copy of the checkpoints into one preallocated buffer: `true` refused with a policy (not built: "
        "the caching allocator holds them)",
    ),
    _supported(
        "activation_checkpointing.synchronize_checkpoint_boundary",
        "bool, `false`",
        "a device synchronize around every checkpoint (a timing aid): `true` refused with a policy (not built)",
    ),
    _supported(
        "activation_checkpointing.profile",
        "bool, `false`",
        "DeepSpeed's timers around checkpoint calls: `true` refused with a policy (not built; use `flops_profiler` "
        "or torch's profiler)",
    ),
    # -- features that are not built -------------------------------------------------------------
    _not_supported("sparse_attention", "DeepSpeed's sparse attention modules are not provided"),
    _supported(
        "pipeline",
        "section",
        "pipeline parallelism's schedule (docs/pipeline-parallel.md), and DeepSpeed's pipeline engine keys at the "
        "values that are what shardtrain does ([Note: DeepSpeed's pipeline keys])",
    ),
    _supported(
        "pipeline.schedule",
        'str, `"1F1B"`',
        "a `torch.distributed.pipelining` schedule: `GPipe`, `1F1B`; with `stages_per_rank` > 1 `Interleaved1F1B`, "
        "`LoopedBFS`, the zero-bubble `InterleavedZeroBubble`, and (exactly 2) the V-shaped `ZBVZeroBubble` and "
        "`DualPipeV`",
    ),
    _supported("pipeline.stages_per_rank", "int ≥ 1, `1`", "stages each pipeline rank holds (multi-stage schedules)"),
    _supported(
        "pipeline.stages",
        'int ≥ 1 or `"auto"` (DeepSpeed\'s default)',
        "DeepSpeed's pipeline ranks, which DeepSpeed reads from its PipelineModule's `num_stages`, never from here: "
        "accepted when it is that number (`pipeline_parallel_size`, or a PipelineModule's `num_stages`), refused "
        "at initialize when it names another",
        auto="`pipeline_parallel_size` (a PipelineModule's `num_stages`)",
    ),
    _no_effect(
        "pipeline.partition",
        'str, `"best"`',
        "DeepSpeed reads no value of it: its PipelineModule's `partition_method` cuts the layers, as here",
        check=StrictStr,
    ),
    _no_effect(
        "pipeline.seed_layers",
        "bool, `false`",
        "DeepSpeed reads no value of it: its PipelineModule's `seed_layers` reseeds the layers, as here",
        check=StrictBool,
    ),
    _supported(
        "pipeline.activation_checkpoint_interval",
        "int ≥ 0, `0`",
        "DeepSpeed's PipelineEngine checkpoints the layers in runs of this many: a `PipelineModule`'s as DeepSpeed "
        "does (its `activation_checkpoint_interval`); a model cut here (shardtrain's GPT, Hugging Face decoders) "
        "checkpoints each block on its own, so 1 is `activation_checkpointing.policy` `full` and more is refused by "
        "name; under pipeline parallelism only (refused at `pipeline_parallel_size` 1)",
    ),
    _no_effect(
        "pipeline.use_reentrant",
        "bool or `null` (`true`)",
        "it picks DeepSpeed's reentrant or non-reentrant checkpoint function under `activation_checkpoint_interval` "
        "> 0: the same values; shardtrain's checkpoints are torch's non-reentrant ones at any value",
        check=StrictBool | None,
    ),
    *(
        _no_effect(
            f"pipeline.{key}",
            "bool, `true`",
            f"DeepSpeed splits the {what} sent between stages into 1/tp pieces only with tensor (model) parallelism, "
            "which is not built with a `PipelineModule` here (refused by name): without it DeepSpeed sends them "
            "whole, as here (shardtrain's GPT and Hugging Face models under pp x tp send them whole too)",
            check=StrictBool,
        )
        for key, what in (("pipe_partitioned", "activations"), ("grad_partitioned", "gradients"))
    ),
    _supported(
        "pipeline_parallel_size",
        "int ≥ 1, `1`",
        "pipeline parallelism: stages the model is cut into by layers, each held by world / size ranks; micro-batches "
        "per step = `gradient_accumulation_steps`: docs/pipeline-parallel.md",
    ),
    _supported("tensor_parallel", "section", "tensor parallelism on a (data, tensor) mesh: docs/tensor-parallel.md"),
    _supported(
        "tensor_parallel.size",
        "int ≥ 1, `1`",
        "ranks each layer is split across (Megatron-style, adjacent ranks); data-parallel size = world / size",
    ),
    _supported("tensor_parallel.autotp_size", "int ≥ 1", "DeepSpeed's name for `tensor_parallel.size`"),
    _supported(
        "sequence_parallel_size",
        "int ≥ 1, `1`",
        "Ulysses sequence parallelism: ranks sharing each sequence (all-to-all of the heads); data-parallel size = "
        "world / size: docs/sequence-parallel.md",
    ),
    _supported(
        "expert_parallel_size",
        "int ≥ 1, `1`",
        "expert parallelism (DeepSpeed-MoE's `ep_size`, one size for every MoE layer): ranks of an expert group, each "
        "holding num_experts / size experts of a transformers MoE model; it must divide the data-parallel size: "
        "docs/expert-parallel.md",
    ),
    *_MOE_RULES,
    _disabled("hybrid_engine", "the RLHF hybrid engine is not supported"),
    _no_effect(
        "aio",
        "section",
        "tunes DeepSpeed's libaio engine; shardtrain's swapper reads and writes with a small thread pool "
        "(`offload_*.buffer_count` sets what is in flight)",
        check=dict,
    ),
    _diagnostic(
        "autotuning",
        "DeepSpeed's autotuner (its launcher's `--autotuning` trial runs) is not built: size batches and buckets with "
        "`shardtrain estimate` and by hand; the config trains with the batch sizes it gives",
    ),
    _disabled("elasticity", "elastic batch sizes are not supported; give the batch sizes"),
    _not_supported("compression_training", "model compression is not supported"),
    _not_supported("weight_quantization", "weight quantization is not supported"),
    _disabled("quantize_training", "quantized training is not supported"),
    _disabled("data_efficiency", "data sampling and routing are not supported; do it in your data loader"),
    _disabled("curriculum_learning", "curriculum learning is not supported; do it in your data loader"),
    _disabled("progressive_layer_drop", "progressive layer drop is not supported"),
    _disabled("eigenvalue", "eigenvalue computation is not supported"),
    Rule(
        "compile",
        Kind.REFUSED_VALUE,
        "settings for DeepSpeed's `engine.compile()`; call `torch.compile` on the model yourself. "
        "`deepcompile: true` is not supported",
        "without `deepcompile: true`",
        check=dict,
        accept=lambda v: v.get("deepcompile", False) is False,
    ),
    _no_effect(
        "dataloader_drop_last",
        "bool",
        "`shardtrain.initialize` builds no data loader; `shardtrain.deepspeed.initialize(training_data=...)` "
        "does, and drops an incomplete last micro-batch with it, as DeepSpeed's loader does",
        check=StrictBool,
    ),
    _no_effect(
        "use_data_before_expert_parallelism",
        "bool",
        "orders DeepSpeed-MoE's token exchange around its own MoE layer; `expert_parallel_size` exchanges tokens in "
        "the transformers experts module, in expert order (docs/expert-parallel.md)",
        check=StrictBool,
    ),
    _only("graph_harvesting", False, "CUDA graphs are not captured by the engine"),
    _supported("checkpoint", "section", "checkpoint settings"),
    _no_effect(
        "checkpoint.tag_validation",
        '`"Warn"`, `"Ignore"` or `"Fail"`',
        "tags are always validated: one that is not a plain file name is refused",
        check=StrictStr,
    ),
    _no_effect("checkpoint.load_universal", "bool", "checkpoints always load into any layout", check=StrictBool),
    _only(
        "checkpoint.use_node_local_storage",
        False,
        "each node writing its own copy is not supported; checkpoints go to one directory every rank can read",
    ),
    _no_effect(
        "checkpoint.parallel_write",
        "section",
        "every rank always writes its own part in parallel (there is no pipeline parallelism)",
        check=dict,
    ),
    _no_effect(
        "checkpoint.checkpoint_serialization", "bool", "tunes DeepSpeed's fast checkpoint writer", check=StrictBool
    ),
    _supported(
        "checkpoint.writer", "section", "DeepSpeed's checkpoint writer settings; only `decoupled` has an effect"
    ),
    _supported(
        "checkpoint.writer.decoupled",
        "bool, `false`",
        "save checkpoints in the background: `save_checkpoint` returns once every rank holds a host copy, the files "
        "are written and `latest` moved by a background thread (the default of `save_checkpoint`'s `async_save`; "
        "docs/checkpoint-format.md)",
    ),
    *(
        _no_effect(f"checkpoint.writer.{key}", values, "tunes DeepSpeed's fast checkpoint writer", check=check)
        for key, values, check in (
            ("type", '`"mock"`, `"python"` or `"fast"`', StrictStr),
            ("io_buffer_size", "int", int),
            ("io_buffer_double", "bool", StrictBool),
            ("show_statistics", "bool", StrictBool),
            ("data_parallel", '`"replica"`, `"socket"` or `"machine"`', StrictStr),
            ("io_multiplier", "int", int),
        )
    ),
    _disabled("nebula", "the Nebula checkpoint service is not supported"),
    _disabled("datastates", "DataStates checkpointing is not supported"),
    # -- shardtrain's own keys -------------------------------------------------------------------
    _supported("seed", "int", "shardtrain key: seeds python, numpy and torch at `initialize`"),
    _supported(
        "device",
        '`"cpu"` or `"cuda"`, unset',
        "shardtrain key: where the engine trains; unset, the `SHARDTRAIN_DEVICE` environment variable decides (as "
        "DeepSpeed's `DS_ACCELERATOR`), then CUDA when available. "
        'A CUDA rank takes device `LOCAL_RANK`: docs/architecture.md, "Devices"',
    ),
    _supported(
        "collective_timeout_s",
        "float from 0.001 to 1e9, `1800`",
        "shardtrain key: seconds before a collective fails with a named error",
    ),
    _supported(
        "desync_check",
        "bool, `true`",
        "shardtrain key: before every engine call that communicates, ranks exchange where they are (call, global "
        "step, micro-step; one 32-byte all-gather per rank), so that a rank that takes an extra micro-step, skips "
        "`step()` or calls `full_state_dict()` alone fails at once on every rank, naming each; `false` saves it",
    ),
    _supported(
        "context_parallel_size",
        "int ≥ 1, `1`",
        "shardtrain key: context parallelism (ring attention): ranks sharing each sequence in load-balanced chunks; "
        "data-parallel size = world / size: docs/context-parallel.md",
    ),
    _supported(
        "tiled_logits_loss",
        "bool, `false`",
        "shardtrain key (ALST's `TiledFusedLogitsLoss`): the causal-LM loss over tiles of the tokens, each tile's "
        "logits recomputed in backward, so the whole logits never exist: docs/sequence-parallel.md",
    ),
    _supported(
        "tiled_logits_loss_shards",
        "int ≥ 1, ALST's default",
        "tiles of the tiled loss (default: fp32 logits in tiles of at most 1 GiB)",
    ),
    _supported(
        "tiled_mlp_compute",
        "bool, `false`",
        "ArcticTraining's key (ALST's `TiledMLP`): every MLP over tiles of the tokens, recomputed in backward: "
        "docs/sequence-parallel.md",
    ),
    _supported(
        "tiled_mlp_shards", "int ≥ 1, ALST's default", "tiles of the tiled MLP (default: `ceil(tokens / hidden size)`)"
    ),
    _supported("graph", "section", "shardtrain key: graph mode, captured per input schema: docs/graph-mode.md"),
    _supported("graph.enabled", "bool, `false`", "run the forward and backward as captured graphs"),
    _supported("graph.strict", "bool, `false`", "a construct that cannot be captured is an error, not a fallback"),
    _supported("graph.cache_size", "int ≥ 1, `8`", "captured graphs kept, least recently used evicted"),
    _supported(
        "graph.compiler",
        '`"aot_eager"` or `"inductor"`, `"aot_eager"`',
        "run the captured graphs as traced (eager numerics) or compiled by Inductor",
    ),
    _supported(
        "graph.dynamic_shapes",
        "bool, `true`",
        "graphs generic in the inputs' sizes; `false`: one graph per set of sizes, specialized on them",
    ),
    _supported("fp8", "section", "shardtrain key: float8 matmuls through torchao: docs/fp8.md"),
    _supported(
        "fp8.enabled",
        "bool, `false`",
        "the model's `nn.Linear` layers swapped for torchao's `Float8Linear` (the output head and sizes not divisible "
        "by 16 kept in high precision, logged by name)",
    ),
    _supported(
        "fp8.recipe",
        '`"tensorwise"`, `"rowwise"` or `"rowwise_with_gw_hp"`, `"tensorwise"`',
        "torchao's float8 training recipe: one scale per tensor, per row, or per row with the weight gradient's "
        "matmul in high precision",
    ),
    _supported(
        "fp8.emulate",
        "bool, `false`",
        "torchao's emulation (the same casts, matmuls on dequantized values): needed without float8 matmuls (the CPU, "
        "CUDA below capability 8.9), where `enabled` alone is refused",
    ),
    _supported("fp8.filter", "section", "which linear layers stay in high precision"),
    _supported(
        "fp8.filter.exclude",
        "list of patterns, `[]`",
        "module names (`fnmatch` patterns, e.g. `blocks.0.*`) of linear layers kept in high precision",
    ),
    _supported(
        "fp8.gather_in_float8",
        "bool, `true`",
        "ZeRO-3 gathers the converted weights for forward and backward in float8, 1 byte per element, cast with the "
        "whole weight's scale: the numerics of gathering them in the compute dtype, half of bf16's bytes",
    ),
)

RULES_BY_PATH: dict[str, Rule] = {r.path: r for r in RULES}

# -- supported keys without effect in some combinations --------------------------------------------


@dataclass(frozen=True)
class NoEffectWhen:
    """A supported key that has no effect in some combinations of the config (a mode): the docs table says so in its
    row, and ``inspect_config`` (so ``shardtrain config check``) lists the key under "no effect" for a config that
    gives the key and is in that mode."""

    path: str
    condition: str
    """The mode in words, for the docs and the report (``"without `graph.enabled: true`"``)."""
    reason: str
    """Why the key does nothing there."""
    when: Callable[[Any], bool]
    """Of the validated :class:`shardtrain.config.sections.Config`: whether it is in that mode (an ``"auto"`` value that
    decides the mode counts as not: it is resolved later)."""


def _zero_stage(cfg: Any) -> Any:
    return cfg.zero_optimization.stage


def _optimizer_offload(cfg: Any) -> str:
    return cfg.zero_optimization.offload_optimizer.device


def _param_offload(cfg: Any) -> str:
    return cfg.zero_optimization.offload_param.device


_OFF = "nothing is offloaded"
_NO_SWAP = "there are no swap files"

NO_EFFECT_WHEN: tuple[NoEffectWhen, ...] = (
    *(
        NoEffectWhen(
            f"fp8.{key}",
            "without `fp8.enabled: true`",
            "no layer is converted to float8",
            lambda c: not c.fp8.enabled,
        )
        for key in ("recipe", "emulate", "filter.exclude", "gather_in_float8")
    ),
    NoEffectWhen(
        "fp8.gather_in_float8",
        "with `graph.enabled: true`",
        "graph mode gathers the units as operations of its captured graphs, in the compute dtype",
        lambda c: bool(c.graph.enabled),
    ),
    NoEffectWhen(
        "fp8.gather_in_float8",
        "with ZeRO++ hpZ (`zero_hpz_partition_size` > 1)",
        "hpZ cuts its secondary shards from the units gathered in the compute dtype",
        lambda c: _zero_stage(c) == 3 and c.zero_optimization.zero_hpz_partition_size > 1,
    ),
    NoEffectWhen(
        "fp8.gather_in_float8",
        "at ZeRO stages 0-2",
        "parameters are whole on every rank: nothing is gathered before a matmul",
        lambda c: _zero_stage(c) != 3,
    ),
    NoEffectWhen(
        "fp8.gather_in_float8",
        'with a `recipe` other than `"tensorwise"`',
        "the rowwise recipes scale each row of the weight as the matmul uses it: it is gathered in the compute dtype",
        lambda c: c.fp8.recipe != "tensorwise",
    ),
    *(
        NoEffectWhen(
            f"activation_checkpointing.{key}",
            'with `policy: "none"`',
            "no block is checkpointed (DeepSpeed's section alone checkpoints nothing either)",
            lambda c: c.activation_checkpointing.policy == "none",
        )
        for key in (
            "cpu_checkpointing",
            "partition_activations",
            "contiguous_memory_optimization",
            "synchronize_checkpoint_boundary",
            "profile",
        )
    ),
    NoEffectWhen(
        "activation_checkpointing.partition_activations",
        "without tensor parallelism",
        "each rank's block inputs are its own already: nothing to partition",
        lambda c: c.tensor_parallel.degree == 1,
    ),
    *(
        NoEffectWhen(_Z + key, "at ZeRO stages 0-2", "applies to stage 3 only", lambda c: _zero_stage(c) != 3)
        for key in (
            "stage3_param_persistence_threshold",
            "stage3_prefetch_bucket_size",
            "stage3_gather_check",
        )
    ),
    NoEffectWhen(
        _Z + "stage3_unit_classes",
        'at ZeRO stages 0-2 with `activation_checkpointing.policy: "none"`',
        "applies to stage 3 only (and to the blocks a checkpointing policy checkpoints)",
        lambda c: _zero_stage(c) != 3 and c.activation_checkpointing.policy == "none",
    ),
    NoEffectWhen(
        _Z + "stage3_gather_check",
        "in graph mode (`graph.enabled: true`) at stage 3",
        "the captured graph has no per-gather check: the forward's desync check compares every rank's input schema "
        "(a different path is a different schema) and `initialize` warns",
        lambda c: c.graph.enabled is True and _zero_stage(c) == 3,
    ),
    NoEffectWhen(
        _Z + "allgather_bucket_size",
        "at ZeRO stage 0",
        "every rank steps whole parameters, so nothing is all-gathered after the step",
        lambda c: _zero_stage(c) == 0,
    ),
    NoEffectWhen(
        "zero_allow_untested_optimizer",
        "at ZeRO stage 0 without tensor parallelism",
        "stage 0 steps whole parameters and accepts any optimizer",
        lambda c: _zero_stage(c) == 0 and c.tensor_parallel.degree == 1,
    ),
    NoEffectWhen(
        _Z + "sub_group_size",
        "without `offload_optimizer`",
        "one optimizer step covers all fragments",
        lambda c: _optimizer_offload(c) == "none",
    ),
    NoEffectWhen(
        _Z + "offload_optimizer.nvme_path",
        "unless `offload_optimizer.device` is `nvme`",
        _NO_SWAP,
        lambda c: _optimizer_offload(c) != "nvme",
    ),
    NoEffectWhen(
        _Z + "offload_optimizer.buffer_count",
        "unless `offload_optimizer.device` is `nvme`",
        "it counts the buffers of sub-groups read from and written to swap files",
        lambda c: _optimizer_offload(c) != "nvme",
    ),
    *(
        NoEffectWhen(
            _Z + f"offload_optimizer.{key}",
            "without `offload_optimizer`",
            _OFF,
            lambda c: _optimizer_offload(c) == "none",
        )
        for key in ("pin_memory", "ratio")
    ),
    NoEffectWhen(
        _Z + "zero_hpz_partition_size",
        "at ZeRO stages 0-2",
        "only stage 3 gathers parameters for backward; DeepSpeed ignores it below stage 3 too",
        lambda c: _zero_stage(c) != 3,
    ),
    NoEffectWhen(
        _Z + "offload_param.device",
        "at ZeRO stages 0-2",
        "only stage 3 shards parameters; DeepSpeed hands `offload_param` to stage 3 alone and ignores it below",
        lambda c: _zero_stage(c) != 3,
    ),
    *(
        NoEffectWhen(
            _Z + f"offload_param.{key}",
            "unless `offload_param.device` is `nvme`",
            _NO_SWAP,
            lambda c: _param_offload(c) != "nvme",
        )
        for key in ("nvme_path", "max_in_cpu", "buffer_count")
    ),
    *(
        NoEffectWhen(
            f"fp16.{key}",
            "without `fp16.enabled: true`",
            "loss scaling applies to fp16 compute only",
            lambda c: c.fp16.enabled is False,
        )
        for key in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")
    ),
    *(
        NoEffectWhen(
            f"fp16.{key}",
            "with a static `fp16.loss_scale` (> 0)",
            "a static loss scale never changes",
            lambda c: c.fp16.enabled is True and c.fp16.loss_scale > 0,
        )
        for key in ("initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")
    ),
    NoEffectWhen(
        "gradient_predivide_factor",
        "with `prescale_gradients: true`",
        "prescaling divides by the data-parallel size itself (DeepSpeed ignores the factor there too)",
        lambda c: c.prescale_gradients,
    ),
    NoEffectWhen(
        "fp16.auto_cast",
        "without `fp16.enabled: true`",
        "inputs are cast to fp16 for fp16 compute only",
        lambda c: c.fp16.enabled is False,
    ),
    *(
        NoEffectWhen(
            f"flops_profiler.{key}",
            "without `flops_profiler.enabled: true`",
            "the flops profiler is off",
            lambda c: not c.flops_profiler.enabled,
        )
        for key in ("profile_step", "module_depth", "detailed", "output_file", "recompute_fwd_factor", "peak_tflops")
    ),
    *(
        NoEffectWhen(
            f"{monitor}.{key}",
            f"without `{monitor}.enabled: true`",
            "the monitor is off",
            lambda c, m=monitor: not getattr(c, m).enabled,
        )
        for monitor, keys in (
            ("tensorboard", ("output_path", "job_name")),
            ("csv_monitor", ("output_path", "job_name")),
            ("wandb", ("group", "team", "project")),
        )
        for key in keys
    ),
    NoEffectWhen(
        "tiled_logits_loss_shards",
        "without `tiled_logits_loss: true`",
        "the loss is not tiled",
        lambda c: not c.tiled_logits_loss,
    ),
    NoEffectWhen(
        "tiled_mlp_shards",
        "without `tiled_mlp_compute: true`",
        "the MLP is not tiled",
        lambda c: not c.tiled_mlp_compute,
    ),
    *(
        NoEffectWhen(
            f"graph.{key}", "without `graph.enabled: true`", "graph mode is off", lambda c: not c.graph.enabled
        )
        for key in ("strict", "cache_size", "compiler", "dynamic_shapes")
    ),
)


def _given(cfg: Any, path: str) -> bool:
    """Whether the config gives ``path`` itself (not a default)."""
    node = cfg
    for part in path.split("."):
        if node is None or part not in getattr(node, "model_fields_set", ()):
            return False
        node = getattr(node, part)
    return True


def no_effect_here(cfg: Any) -> list[str]:
    """``path: no effect <mode>: why`` for each key ``cfg`` gives that has no effect in the combination it gives
    (the first reason of :data:`NO_EFFECT_WHEN` that holds, per key)."""
    lines: dict[str, str] = {}
    for note in NO_EFFECT_WHEN:
        if note.path not in lines and _given(cfg, note.path) and note.when(cfg):
            lines[note.path] = f"{note.path}: no effect {note.condition}: {note.reason}"
    return list(lines.values())


# DeepSpeed spellings of the same key: (alias, canonical path).
ALIASES: dict[str, str] = {
    "bfloat16": "bf16",
    **{
        _Z + name: _Z + "stage3_" + name
        for name in (
            "prefetch_bucket_size",
            "param_persistence_threshold",
            "model_persistence_threshold",
            "max_live_parameters",
            "max_reuse_distance",
            "gather_16bit_weights_on_model_save",
            "module_granularity_threshold",
            "use_all_reduce_for_fetch_params",
            "allgather_sequential",
        )
    },
    _Z + "stage3_gather_fp16_weights_on_model_save": _Z + "stage3_gather_16bit_weights_on_model_save",
}

# DeepSpeed's deprecated spellings of a section, translated as DeepSpeed translates them: legacy key -> the section
# ``true`` stands for (``false``: the section's default, nothing offloaded).
LEGACY_SECTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    _Z + "cpu_offload": (_Z + "offload_optimizer", {"device": "cpu"}),
    _Z + "cpu_offload_param": (_Z + "offload_param", {"device": "cpu"}),
}


def _legacy_sections(prefix: str, section: Mapping[str, Any], found: Findings) -> dict[str, Any]:
    """``section`` with DeepSpeed's deprecated spellings (:data:`LEGACY_SECTIONS`) written as their replacement."""
    out = dict(section)
    for legacy, (modern, value) in LEGACY_SECTIONS.items():
        old, new = legacy.rsplit(".", 1)[-1], modern.rsplit(".", 1)[-1]
        if not legacy.startswith(prefix + ".") or old not in out:
            continue
        given = out.pop(old)
        if not isinstance(given, bool):
            found.problems.append(f"{legacy}: expected true or false, got {_describe(given)}")
        elif new in out:  # DeepSpeed refuses a deprecated key beside its replacement too
            found.problems.append(f"{legacy}: given with {modern}, which replaces it; keep `{new}` only")
        elif given:
            out[new] = dict(value)
            found.renamed[modern] = legacy
    return out


# Keys that belong elsewhere: refused with this message as it stands.
MISPLACED_KEYS: dict[str, str] = {}

# "auto" inside optimizer.params / scheduler.params (dicts that pydantic does not walk).
AUTO_PARAMS: dict[str, str] = {
    "optimizer.params.lr": 'auto_values["lr"]',
    "optimizer.params.betas": 'auto_values["betas"]',
    "optimizer.params.eps": 'auto_values["eps"]',
    "optimizer.params.weight_decay": 'auto_values["weight_decay"]',
    "scheduler.params.warmup_min_lr": 'auto_values["warmup_min_lr"], else 0',
    "scheduler.params.warmup_max_lr": 'auto_values["lr"]',
    "scheduler.params.warmup_num_steps": 'auto_values["warmup_num_steps"]',
    "scheduler.params.total_num_steps": 'auto_values["total_num_steps"]',
}


@dataclass
class Findings:
    """What :func:`classify` found: problems (``path: message``), keys accepted without effect, "auto" paths."""

    problems: list[str] = field(default_factory=list)
    no_effect: list[str] = field(default_factory=list)
    autos: dict[str, str] = field(default_factory=dict)
    """path -> where it is resolved from."""
    renamed: dict[str, str] = field(default_factory=dict)
    """canonical path -> the alias the config wrote it as (messages name what the user wrote)."""
    warnings: list[str] = field(default_factory=list)
    """Diagnostics the config turns on that are not built (``path: what to use instead``); logged at load."""

    def as_written(self, line: str) -> str:
        """``line`` (``path: message``) with a renamed path given back its written spelling."""
        for canonical, written in self.renamed.items():
            if line.startswith((canonical + ":", canonical + ".")):
                return written + line[len(canonical) :]
        return line


def _describe(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v)


def _check_type(rule: Rule, value: Any) -> str | None:
    if rule.check is None:
        return None
    if rule.check is dict:
        return None if isinstance(value, Mapping) else f"expected a section (a mapping), got {_describe(value)}"
    if rule.check is int:
        value = _whole(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return f"expected a whole number ≥ 0, got {_describe(value)}"
        return None
    try:
        TypeAdapter(rule.check).validate_python(value)
    except ValidationError as err:
        return f"{err.errors()[0]['msg']} (got {_describe(value)})"
    return None


def _apply_rule(rule: Rule, value: Any, found: Findings) -> None:
    """A rule of any kind but SUPPORTED: record a problem or a no-effect note; the key leaves the data."""
    path = rule.path
    if rule.kind is Kind.NOT_SUPPORTED:
        if rule.deepspeed_refuses:
            found.problems.append(f"{path}: refused, as DeepSpeed refuses it: {rule.note}")
        else:
            found.problems.append(f"{path}: a DeepSpeed key shardtrain does not support ({rule.note})")
        return
    bad_type = _check_type(rule, value)
    if bad_type:
        found.problems.append(f"{path}: {bad_type}")
        return
    if rule.accept is not None and not rule.accept(value):
        shown = rule.shown(value) if rule.shown else _describe(value)
        found.problems.append(
            f"{path}: {shown} is not supported: {rule.note}. Accepted (no effect): {rule.values}, or remove the key"
        )
        return
    found.no_effect.append(f"{path}: {rule.note}")
    if rule.warn_when is not None and rule.warn_when(value):
        found.warnings.append(f"{path}: accepted without effect: {rule.note}")


def _known_here(prefix: str, model: type[BaseModel] | None) -> list[str]:
    names = set(model.model_fields) if model else set()
    dotted = f"{prefix}." if prefix else ""
    for path in (*RULES_BY_PATH, *ALIASES, *LEGACY_SECTIONS):
        if path.startswith(dotted) and "." not in path[len(dotted) :]:
            names.add(path[len(dotted) :])
    return sorted(names)


def unknown_key_message(path: str, key: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{path}: unknown key {key!r}{hint} Allowed keys here: {', '.join(sorted(allowed))}"


def _section_model(model: type[BaseModel] | None, key: str) -> type[BaseModel] | None:
    if model is None or key not in model.model_fields:
        return None
    annotation = model.model_fields[key].annotation
    for candidate in getattr(annotation, "__args__", (annotation,)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def classify(data: Mapping[str, Any], model: type[BaseModel], prefix: str = "") -> tuple[dict[str, Any], Findings]:
    """Walk ``data`` (a raw config section) with :data:`RULES`; return what pydantic should validate, and findings."""
    found = Findings()
    out = _walk(data, model, prefix, found)
    if not prefix:
        _adam_weight_decay(out)
        _moe_sections(out, found)
    return out, found


# [Note: DeepSpeed's MoE keys]
# DeepSpeed gives expert parallelism in DeepSpeed-MoE's layer arguments (`MoE(ep_size=..., capacity_factor=...,
# drop_tokens=...)`, mirrored by the inference config's `moe` section) and in AutoEP's `expert_parallel` section. Both
# are read as sections: `moe.ep_size` and, with `enabled: true`, `expert_parallel.autoep_size` are
# `expert_parallel_size`. The other keys say how DeepSpeed's own layer routes and drops tokens; transformers' models
# route with their own router and drop none, so a key is accepted (without effect) where its value says the same
# (`drop_tokens: false`, a capacity factor with it, no noisy gate, AutoEP's "auto" routing) and refused by name
# otherwise. DeepSpeed's default `drop_tokens: true` drops tokens: a capacity key is refused unless `drop_tokens: false`
# comes with it.
_EP_SIZE_KEYS = {"moe": "ep_size", "expert_parallel": "autoep_size"}


def _moe_sections(out: dict[str, Any], found: Findings) -> None:
    """The ``moe`` and ``expert_parallel`` sections (see [Note: DeepSpeed's MoE keys]): their keys checked, their
    expert-parallel size written as ``expert_parallel_size``, the sections removed."""
    for section, size_key in _EP_SIZE_KEYS.items():
        if section not in out:
            continue
        value = out.pop(section)
        if not isinstance(value, Mapping):
            found.problems.append(f"{section}: expected a section (a mapping), got {_describe(value)}")
            continue
        size = None
        for key, v in value.items():
            path = f"{section}.{key}"
            rule = RULES_BY_PATH.get(path)
            if rule is None:
                found.problems.append(unknown_key_message(path, str(key), _known_here(section, None)))
            elif rule.kind is not Kind.SUPPORTED:
                _apply_rule(rule, v, found)
            elif key == size_key:
                size = v
            elif not isinstance(v, bool):  # expert_parallel.enabled
                found.problems.append(f"{path}: expected true or false, got {_describe(v)}")
        if section == "moe":
            given = [k for k in ("capacity_factor", "eval_capacity_factor", "min_capacity") if k in value]
            if given and value.get("drop_tokens") is not False:
                found.problems.append(
                    f"moe.{given[0]}: DeepSpeed-MoE drops the tokens over each expert's capacity unless "
                    "`drop_tokens: false` is given (its default is true); the transformers model's forward drops "
                    "none: add `drop_tokens: false` (the capacity then follows the tokens, as here) or remove the key"
                )
        elif value.get("enabled") is not True:  # AutoEP off: the section says nothing
            if size is not None:
                found.no_effect.append("expert_parallel.autoep_size: AutoEP is off (`enabled` is not true)")
            continue
        if size is None:
            continue
        if (
            "expert_parallel_size" in out
            and not is_auto(out["expert_parallel_size"])
            and out["expert_parallel_size"] != size
        ):
            other = found.renamed.get("expert_parallel_size", "expert_parallel_size")
            found.problems.append(
                f"{section}.{size_key}: {_describe(size)} differs from {other} "
                f"{_describe(out['expert_parallel_size'])}; both set the expert-parallel size: give one of them"
            )
            continue
        out["expert_parallel_size"] = size
        found.renamed.setdefault("expert_parallel_size", f"{section}.{size_key}")


# [Note: DeepSpeed's defaults]
# A DeepSpeed config means here what it means in the DeepSpeed release the shim follows (0.19.8): every key that
# changes the numbers or the files written has DeepSpeed's default when absent (`gradient_clipping` 1.0, Adam's
# `weight_decay` 0.0, the bf16 overflow skip, reductions in the compute dtype, no periodic log, monitors written
# every step), and what DeepSpeed refuses is refused with its reason. Where shardtrain's own choice is better (fp32
# reductions, fp32 gradient accumulation) it is one key away, named in docs/config.md; tests/config/
# test_deepspeed_defaults.py holds every default against DeepSpeed's own config objects.


def _adam_weight_decay(out: dict[str, Any]) -> None:
    """``Adam``/``AdamW`` without ``weight_decay``: DeepSpeed builds its FusedAdam (CPUAdam with offload), whose
    default is 0.0, unless ``torch_adam: true`` asks for torch's class and its default (0.01 for AdamW). The optimizer
    here is always torch's, so DeepSpeed's 0.0 is written in (see [Note: DeepSpeed's defaults]). ``torch_adam`` says
    nothing more and leaves the section here."""
    optimizer = out.get("optimizer")
    params = optimizer.get("params", {}) if isinstance(optimizer, Mapping) else None
    if not isinstance(params, Mapping):
        return
    torch_adam = params.get("torch_adam", False)
    params = {k: v for k, v in params.items() if k != "torch_adam"}
    adam = str(optimizer.get("type", "")).lower() in ("adam", "adamw")
    if adam and "weight_decay" not in params and torch_adam is not True:
        params["weight_decay"] = 0.0
    out["optimizer"] = {**optimizer, "params": params}


def _walk(data: Mapping[str, Any], model: type[BaseModel] | None, prefix: str, found: Findings) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for raw_key, raw_value in data.items():
        key, value = str(raw_key), raw_value
        path = f"{prefix}.{key}" if prefix else key
        if path in ALIASES:
            canonical = ALIASES[path]
            key, path = canonical.rsplit(".", 1)[-1], canonical
            if key in data:
                found.problems.append(
                    f"{path}: given twice, as {path!r} and as its alias {prefix_join(prefix, raw_key)!r}"
                )
                continue
            found.renamed[path] = prefix_join(prefix, raw_key)
        if not prefix and key.startswith("_"):
            found.no_effect.append(f"{path}: a comment (a key starting with '_')")
            continue
        if path == "zero_optimization" and isinstance(value, bool):  # DeepSpeed's legacy form
            value = {"stage": 1 if value else 0}
        if path == "zero_optimization" and isinstance(value, Mapping):
            value = _legacy_sections(path, value, found)
        if path in MISPLACED_KEYS:
            found.problems.append(f"{path}: {MISPLACED_KEYS[path]}")
            continue
        rule = RULES_BY_PATH.get(path)
        if is_auto(value):
            if rule is not None and rule.auto and rule.kind is Kind.NO_EFFECT:
                found.no_effect.append(f"{path}: {rule.note}")
                continue
            if rule is not None and rule.auto:
                found.autos[path] = rule.auto
                out[key] = value
            else:
                found.problems.append(
                    f'{path}: "auto" cannot be derived for this key (only for the keys Hugging Face\'s Trainer '
                    "fills in; see docs/config.md); give a value"
                )
            continue
        if rule is not None and rule.kind is not Kind.SUPPORTED:
            _apply_rule(rule, value, found)
            continue
        if rule is None and (model is None or key not in model.model_fields):
            found.problems.append(unknown_key_message(path, key, _known_here(prefix, model)))
            continue
        section = _section_model(model, key)
        if section is not None and isinstance(value, Mapping):
            value = _walk(value, section, path, found)
        elif path in ("optimizer.params", "scheduler.params") and isinstance(value, Mapping):
            value = dict(value)
            for name, v in list(value.items()):
                entry = RULES_BY_PATH.get(f"{path}.{name}")
                if entry is not None and entry.kind is not Kind.SUPPORTED:
                    _apply_rule(entry, value.pop(name), found)
                elif is_auto(v):
                    if f"{path}.{name}" in AUTO_PARAMS:
                        found.autos[f"{path}.{name}"] = AUTO_PARAMS[f"{path}.{name}"]
                    else:
                        found.problems.append(f'{path}.{name}: "auto" cannot be derived for this key; give a value')
        out[key] = value
    return out


def prefix_join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


# -- the docs table ----------------------------------------------------------------------------------


def markdown_table() -> str:
    """The table in docs/config.md: every key, its classification, values and meaning or reason."""
    lines = [
        "| key | classification | values | meaning, or why no effect / what to do |",
        "|---|---|---|---|",
    ]
    for r in RULES:
        kind = r.kind.value
        if r.kind is Kind.REFUSED_VALUE:
            kind = f"refused value (accepted, no effect: {r.values})"
        if r.warn_when is not None:
            kind = "accepted, no effect (a warning when on)"
        values = "" if r.kind is Kind.REFUSED_VALUE else r.values
        auto = f' `"auto"`: {r.auto}.' if r.auto else ""
        modes = "".join(f" No effect {n.condition}: {n.reason}." for n in NO_EFFECT_WHEN if n.path == r.path)
        lines.append(f"| `{r.path}` | {kind} | {values} | {r.note}.{auto}{modes} |".replace("..", "."))
    for alias, canonical in ALIASES.items():
        lines.append(f"| `{alias}` | alias | | DeepSpeed's other spelling of `{canonical}` |")
    for legacy, (modern, value) in LEGACY_SECTIONS.items():
        section = json.dumps(value)
        lines.append(
            f"| `{legacy}` | legacy spelling | bool | DeepSpeed's deprecated form of `{modern}`: `true` is "
            f"`{section}`, `false` nothing offloaded; not together with `{modern.rsplit('.', 1)[-1]}` |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
