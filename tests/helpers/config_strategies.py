"""Hypothesis strategies for DeepSpeed-style configs, valid and invalid: every key shardtrain knows (its own and every
DeepSpeed key of :data:`shardtrain.config.deepspeed_keys.RULES`, aliases included), near-miss spellings, unknown keys,
and for each key either a plausible value or anything (wrong types, out of range, ``"auto"``, NaN, nesting)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from shardtrain.config.auto import AUTO_VALUE_KEYS
from shardtrain.config.deepspeed_keys import ALIASES, RULES_BY_PATH
from shardtrain.config.sections import Config


def _model_paths(model, prefix: str = "") -> list[str]:
    out = []
    for name, f in model.model_fields.items():
        path = f"{prefix}{name}"
        out.append(path)
        for arg in getattr(f.annotation, "__args__", (f.annotation,)):
            if isinstance(arg, type) and hasattr(arg, "model_fields"):
                out += _model_paths(arg, path + ".")
    return out


KNOWN_PATHS = sorted({*RULES_BY_PATH, *ALIASES, *_model_paths(Config)})

# unknown keys: any letters (a key with '.', ':' or ',' could not be told from the path in a message)
_names = st.text(st.characters(categories=["L", "N"], include_characters="_-"), min_size=1, max_size=8)
numbers = st.one_of(
    st.integers(-2, 4),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.5, 1.0, 5e8, 1e-3, 0.0, -0.0, 1e308]),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    numbers,
    st.text(max_size=6),
    st.sampled_from(["auto", "Auto", "1", "2", "3", "fp32", "bf16", "fp16", "cpu", "none", "mean", "log", "x"]),
)
anything = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.one_of(_names, st.sampled_from(["enabled", "type", "params", "stage"])), inner, max_size=3),
    ),
    max_leaves=6,
)

_sizes = st.one_of(st.integers(0, 4000), st.just("auto"), st.just(5e8), st.floats(0, 1e9))
optimizer_params = st.fixed_dictionaries(
    {},
    optional={
        "lr": st.one_of(st.floats(0, 1), st.just("auto"), anything),
        "betas": st.one_of(st.tuples(st.floats(0, 1), st.floats(0, 1)).map(list), st.just("auto"), anything),
        "eps": st.one_of(st.floats(0, 1e-3), st.just("auto")),
        "weight_decay": st.one_of(st.floats(0, 0.5), st.just("auto"), anything),
        "momentum": st.floats(0, 1),
        "adam_w_mode": st.one_of(st.booleans(), anything),
        "torch_adam": st.booleans(),
        "lrr": st.floats(0, 1),
    },
)
scheduler_params = st.fixed_dictionaries(
    {},
    optional={
        "warmup_min_lr": st.one_of(st.floats(0, 1e-3), st.just("auto")),
        "warmup_max_lr": st.one_of(st.floats(0, 1e-2), st.just("auto"), anything),
        "warmup_num_steps": st.one_of(st.integers(-1, 100), st.just("auto")),
        "total_num_steps": st.one_of(st.integers(0, 100), st.just("auto"), anything),
        "warmup_type": st.sampled_from(["log", "linear", "cos"]),
    },
)

# plausible values of the keys a config usually sets; any other key gets ``anything``
PLAUSIBLE: dict[str, st.SearchStrategy] = {
    "train_batch_size": st.one_of(st.integers(0, 12), st.just("auto")),
    "train_micro_batch_size_per_gpu": st.one_of(st.integers(0, 4), st.just("auto")),
    "gradient_accumulation_steps": st.one_of(st.integers(0, 3), st.just("auto")),
    "gradient_clipping": st.one_of(st.floats(0, 2), st.just("auto")),
    "optimizer": st.fixed_dictionaries(
        {"type": st.sampled_from(["Adam", "AdamW", "adamw", "SGD", "Lamb"])}, optional={"params": optimizer_params}
    ),
    "scheduler": st.fixed_dictionaries(
        {"type": st.sampled_from(["WarmupLR", "WarmupDecayLR", "OneCycle"])}, optional={"params": scheduler_params}
    ),
    "zero_optimization.stage": st.one_of(st.integers(0, 4), st.sampled_from(["2", "3"])),
    "zero_optimization.reduce_bucket_size": _sizes,
    "zero_optimization.allgather_bucket_size": _sizes,
    "zero_optimization.stage3_param_persistence_threshold": _sizes,
    "zero_optimization.stage3_prefetch_bucket_size": _sizes,
    "zero_optimization.overlap_comm": st.booleans(),
    "zero_optimization.stage3_unit_classes": st.lists(st.sampled_from(["Linear", "Block", "Nope"]), max_size=2),
    "zero_optimization.offload_optimizer": st.fixed_dictionaries({"device": st.sampled_from(["none", "cpu"])}),
    "bf16.enabled": st.one_of(st.booleans(), st.just("auto")),
    "fp16.enabled": st.one_of(st.booleans(), st.just("auto")),
    "fp16.loss_scale": st.floats(0, 2**16),
    "fp16.initial_scale_power": st.integers(0, 70),
    "communication_data_type": st.sampled_from(["fp32", "bf16", "fp16", "fp8"]),
    "collective_timeout_s": st.one_of(st.floats(-1, 3600), st.just("auto")),
    "steps_per_print": st.integers(-1, 20),
    "seed": st.one_of(st.integers(-1, 2**40), anything),
    "wall_clock_breakdown": st.booleans(),
}


def _near_miss(path: str) -> st.SearchStrategy[str]:
    """A key one edit away from a known one (a typo)."""
    *parents, key = path.split(".")

    def typo(data: tuple[int, str]) -> str:
        i, c = data
        i %= len(key)
        return ".".join([*parents, key[:i] + c + key[i + 1 :]])

    return st.tuples(st.integers(0, 40), st.sampled_from("aesx_")).map(typo)


@st.composite
def _entry(draw, noisy: bool) -> tuple[str, Any]:
    """(dotted path, value): mostly a usual key with a plausible value (so that deep checks are reached), else
    (``noisy``) a known key with any value, a typo of a known key, or an unknown key."""
    kind = draw(st.sampled_from(["plausible"] * 6 + ["known"] * 2 + ["typo", "unknown"] if noisy else ["plausible"]))
    if kind == "plausible":
        path = draw(st.sampled_from(sorted(PLAUSIBLE)))
        return path, draw(PLAUSIBLE[path])
    if kind == "known":
        return draw(st.sampled_from(KNOWN_PATHS)), draw(anything)
    if kind == "typo":
        return draw(st.sampled_from(KNOWN_PATHS).flatmap(_near_miss)), draw(anything)
    return draw(_names), draw(anything)


@st.composite
def configs(draw, noisy: bool = True) -> dict[str, Any]:
    """A config dict: a few dotted paths with values, nested into sections (a path under a key that already holds a
    value replaces it with a section, as a user merging two files might). Without ``noisy``, only usual keys with
    plausible values: most such configs build an engine."""
    out: dict[str, Any] = {}
    for _ in range(draw(st.integers(0, 6))):
        path, value = draw(_entry(noisy))
        node = out
        *parents, last = path.split(".")
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[last] = value
    return out


auto_values = st.dictionaries(
    st.one_of(st.sampled_from(sorted(AUTO_VALUE_KEYS)), _names),
    st.one_of(st.integers(0, 16), st.floats(0, 1), st.sampled_from(["fp32", "bf16", "fp16", "fp64"]), anything),
    max_size=3,
)
