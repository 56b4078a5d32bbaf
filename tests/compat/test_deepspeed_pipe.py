"""A DeepSpeed ``PipelineModule`` script run as written through ``shardtrain.deepspeed``: the stage boundaries are
DeepSpeed's own for the same layer list, each rank builds only its stage's layers, and training at pp 2 and pp 3
equals the same layers trained in one process (losses every step, gradient norms, final parameters)."""

from __future__ import annotations

import os
import random

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported anywhere in this process

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardtrain.deepspeed as deepspeed
from shardtrain.compat.deepspeed.runtime.pipe.module import partition_layers, set_random_seed
from shardtrain.deepspeed.pipe import LayerSpec, PipelineModule
from shardtrain.errors import ConfigError
from shardtrain.testing import run_distributed
from shardtrain.testing.parity import assert_parity, train_one_process

STEPS, GAS, MICRO, CLIP, WIDTH, CLASSES = 3, 4, 2, 0.5, 8, 5
LR, BETAS, EPS, WD = 3e-3, (0.9, 0.95), 1e-8, 0.1


class Block(nn.Module):
    """A layer with a count of its constructions that allocate (off the meta device), to see which stage built what."""

    built = 0

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        Block.built += self.fc.weight.device.type != "meta"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Head(nn.Linear):
    pass


def layers() -> list:
    """Modules, LayerSpecs and a callable, of unequal parameter counts (so "parameters" and "uniform" differ)."""
    return [
        LayerSpec(nn.Linear, WIDTH, 2 * WIDTH),
        nn.Tanh(),
        LayerSpec(Block, 2 * WIDTH),
        LayerSpec(Block, 2 * WIDTH),
        lambda x: x * 0.5,
        LayerSpec(Block, 2 * WIDTH),
        LayerSpec(Block, 2 * WIDTH),
        LayerSpec(Head, 2 * WIDTH, CLASSES),
    ]


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels)


def pipeline_module(num_stages: int) -> PipelineModule:
    # seed_layers: each layer's initial values from base_seed + its index, whichever stage builds it
    return PipelineModule(layers(), num_stages=num_stages, loss_fn=loss_fn, seed_layers=True)


def global_batches(dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randn(MICRO * dp, WIDTH, generator=g), torch.randint(0, CLASSES, (MICRO * dp,), generator=g))
        for _ in range(STEPS * GAS)
    ]


# -- the partition ----------------------------------------------------------------------------------------------


def _deepspeeds_boundaries(specs: list, num_stages: int, method: str) -> list[int]:
    """DeepSpeed's ``PipelineModule._partition_layers`` on ``specs``, without the process groups its constructor
    makes (rank 1 of a (pipe, data) topology, so that it prints nothing)."""
    from deepspeed.runtime.pipe.module import PipelineModule as DSPipelineModule
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    ds = object.__new__(DSPipelineModule)
    nn.Module.__init__(ds)
    ds._layer_specs, ds._num_layers, ds.num_stages = list(specs), len(specs), num_stages
    ds._topo, ds.global_rank, ds.loss_fn = PipeDataParallelTopology(num_pp=num_stages, num_dp=2), 1, None
    ds._partition_layers(method=method)
    return list(ds.parts)


def _deepspeed_specs(specs: list) -> list:
    """The same list with DeepSpeed's ``LayerSpec`` (its partition tells layer kinds apart by its own class)."""
    from deepspeed.runtime.pipe.module import LayerSpec as DSLayerSpec

    return [
        DSLayerSpec(s.typename, *s.module_args, **s.module_kwargs) if isinstance(s, LayerSpec) else s for s in specs
    ]


@pytest.mark.parametrize("method", ["parameters", "uniform", "type:block", "type:^(Head|Linear)$"])
@pytest.mark.parametrize("num_stages", [2, 3, 4])
def test_partition_is_deepspeeds(method, num_stages):
    pytest.importorskip("deepspeed.runtime.pipe.module")
    specs = layers()
    ours = partition_layers(specs, num_stages, method)
    assert ours == _deepspeeds_boundaries(_deepspeed_specs(specs), num_stages, method)
    assert ours[0] == 0 and ours[-1] == len(specs) and ours == sorted(ours)


def test_balanced_partition_cuts_where_deepspeeds_does_on_random_weights():
    """Our own balanced partition against DeepSpeed's ``partition_balanced`` itself, on weights with many ties
    (small integers) and without (floats): the same boundaries, its tie-breaks included."""
    utils = pytest.importorskip("deepspeed.runtime.utils")
    from shardtrain.compat.deepspeed.runtime.pipe.partition import partition_balanced

    rng = random.Random(0)
    for case in range(300):
        n, parts = rng.randint(1, 14), rng.randint(1, 6)
        weights = [rng.randint(0, 4) if case % 2 else rng.uniform(0, 10) for _ in range(n)]
        want = [int(b) for b in utils.partition_balanced(weights, parts)]
        assert partition_balanced(weights, parts) == want, (weights, parts)


def test_partition_by_parameters_allocates_nothing():
    """DeepSpeed builds every LayerSpec to count its parameters; here they are built on the meta device: nothing
    allocated, torch's generator untouched (so a stage's initial values do not depend on the other stages' layers)."""
    state = torch.random.get_rng_state()
    assert partition_layers(layers(), 3, "parameters") == [0, 3, 6, 8]
    assert torch.equal(state, torch.random.get_rng_state())


def test_refusals_name_what():
    with pytest.raises(ConfigError, match="activation_checkpoint_interval must be >= 0"):
        PipelineModule(layers(), num_stages=1, activation_checkpoint_interval=-1)
    with pytest.raises(ConfigError, match="'profile' is not implemented"):
        PipelineModule(layers(), num_stages=1, partition_method="profile")
    with pytest.raises(ConfigError, match="no layer's class name matches"):
        PipelineModule(layers(), num_stages=1, partition_method="type:Conv")
    with pytest.raises(TypeError, match=r"LayerSpec only supports torch\.nn\.Module types"):
        LayerSpec(len)


# -- the script, trained -------------------------------------------------------------------------------------------


def _script(pp: int, clip: float = CLIP, pipeline: dict | None = None) -> dict:
    """What a DeepSpeed pipeline script does, with `import shardtrain.deepspeed as deepspeed` (``pipeline``: the
    config's DeepSpeed ``pipeline`` section, if any)."""
    world = dist.get_world_size()
    Block.built = 0
    net = pipeline_module(pp)
    built = Block.built
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD}},
        "steps_per_print": 10**6,
        **({"pipeline": pipeline} if pipeline is not None else {}),
    }
    engine, _, _, _ = deepspeed.initialize(
        model=net, model_parameters=[p for p in net.parameters() if p.requires_grad], config=config
    )
    assert isinstance(engine, deepspeed.PipelineEngine)
    stage, dp = engine.stage_id, engine.grid.get_data_parallel_world_size()
    assert (engine.num_stages, dp, engine.micro_batches) == (pp, world // pp, GAS)
    assert engine.is_first_stage() == (stage == 0) and engine.is_last_stage() == (stage == pp - 1)
    with pytest.raises(ConfigError, match="only train_batch"):
        engine(torch.zeros(MICRO, WIDTH))
    rank = engine.grid.get_data_parallel_rank()
    rows = slice(rank * MICRO, (rank + 1) * MICRO)
    batches = [(x[rows], y[rows]) for x, y in global_batches(dp)]
    losses, norms = [], []
    for step in range(STEPS):
        losses.append(float(engine.train_batch(iter(batches[step * GAS : (step + 1) * GAS]))))
        norms.append(engine.get_global_grad_norm())
    out_eval = float(engine.eval_batch(iter(batches[:GAS])))  # the trained model on the first step's batches
    held = sorted({name.split(".")[0] for name, _ in engine.module.named_parameters()}, key=int)
    out = {"losses": losses, "norms": norms, "built": built, "held": held, "stage": stage, "eval": out_eval}
    out["params"] = engine.shardtrain_engine.full_state_dict()
    engine.destroy()
    return out


def _reference(dp: int) -> dict:
    batches = global_batches(dp)
    net = pipeline_module(1)  # one stage, every layer: no process group here

    def run(dtype: torch.dtype) -> dict:
        model = pipeline_module(1).to(dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        out = train_one_process(
            model, opt, lambda m, i: loss_fn(m(batches[i][0].to(dtype)), batches[i][1]), STEPS, GAS, CLIP
        )
        with torch.no_grad():
            out["eval"] = sum(float(loss_fn(model(x.to(dtype)), y)) for x, y in batches[:GAS]) / GAS
        return out

    assert net.parts == [0, len(layers())]
    ref = run(torch.float32)
    ref["exact"] = run(torch.float64)["params"]
    return ref


@pytest.mark.parametrize(("pp", "world"), [(2, 2), (3, 3)])
def test_pipeline_module_script_equals_one_process(pp, world):
    results = run_distributed(_script, world, pp)
    ref = _reference(world // pp)
    assert_parity(results, ref)
    assert all(r["eval"] == pytest.approx(ref["eval"], rel=1e-5) for r in results), ([r["eval"] for r in results], ref)
    bounds = partition_layers(layers(), pp, "parameters")
    for r in results:
        # each rank built only its stage's LayerSpecs and holds only that stage's layers, under their global index
        mine = range(bounds[r["stage"]], bounds[r["stage"] + 1])
        assert r["built"] == sum(isinstance(s, LayerSpec) and s.typename is Block for s in (layers()[i] for i in mine))
        assert all(int(i) in mine for i in r["held"]) and r["held"], (r, bounds)


def _deepspeeds_pipeline_section(**changes: object) -> dict:
    """The ``pipeline`` section DeepSpeed 0.19.8 fills in for a config without one (every key it has, at its
    default; ``use_reentrant`` is read by its PipelineEngine with None meaning true), with ``changes``."""
    from deepspeed.runtime.config import get_pipeline_config

    return {**get_pipeline_config({}), "use_reentrant": None, **changes}


@pytest.mark.parametrize("stages", ["auto", 2])
def test_deepspeeds_pipeline_section_at_its_defaults_trains_as_without_it(stages):
    # DeepSpeed's defaults (stages "auto", partition "best", pipe/grad_partitioned true, ...) written out: accepted,
    # and the script trains exactly as the same layers in one process (the section changes nothing)
    section = _deepspeeds_pipeline_section(stages=stages)
    assert set(section) == {"stages", "partition", "seed_layers", "activation_checkpoint_interval", "pipe_partitioned",
                            "grad_partitioned", "use_reentrant"}  # fmt: skip
    results = run_distributed(_script, 2, 2, CLIP, section)
    assert_parity(results, _reference(1))


def _mismatched_config(_: int) -> str:
    net = pipeline_module(2)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "pipeline_parallel_size": 1}
    with pytest.raises(ConfigError, match="pipeline_parallel_size 1 and the PipelineModule's num_stages 2"):
        deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    # DeepSpeed's pipeline.stages is not read by DeepSpeed; one that names another size than num_stages is refused
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "pipeline": {"stages": 3}}
    with pytest.raises(ConfigError, match=r"pipeline.stages 3 but the pipeline has 2 stage\(s\).*num_stages"):
        deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    return "ok"


def test_config_that_disagrees_with_num_stages_is_refused():
    assert run_distributed(_mismatched_config, 2, 0) == ["ok", "ok"]


# -- against DeepSpeed's own PipelineEngine ---------------------------------------------------------------------------


def _deepspeed_script(pp: int, clip: float) -> dict:
    """The same script under real DeepSpeed (CPU accelerator, gloo): its PipelineModule and PipelineEngine."""
    import contextlib
    import io

    import deepspeed as real

    real.init_distributed(dist_backend="gloo")  # as a script does (the process group exists: DeepSpeed adopts it)
    # seed_fn: DeepSpeed 0.19.8's default hands random.seed the numpy integer its balanced partition made, which
    # Python 3.11 refuses on every stage but the first; the same seeding, given an int
    net = real.pipe.PipelineModule(
        _deepspeed_specs(layers()),
        num_stages=pp,
        loss_fn=loss_fn,
        seed_layers=True,
        seed_fn=lambda seed: set_random_seed(int(seed)),
        partition_method="parameters",
    )
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": clip,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD, "torch_adam": True},
        },
        "steps_per_print": 10**6,
    }
    with contextlib.redirect_stdout(io.StringIO()):
        engine, _, _, _ = real.initialize(
            model=net, model_parameters=[p for p in net.parameters() if p.requires_grad], config=config
        )
    dp = engine.grid.get_data_parallel_world_size()
    rank = engine.grid.get_data_parallel_rank()
    rows = slice(rank * MICRO, (rank + 1) * MICRO)
    batches = [(x[rows], y[rows]) for x, y in global_batches(dp)]
    losses, norms = [], []
    with contextlib.redirect_stdout(io.StringIO()):
        for step in range(STEPS):
            losses.append(float(engine.train_batch(iter(batches[step * GAS : (step + 1) * GAS]))))
            norms.append(engine.get_global_grad_norm())
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params}


def test_pipeline_module_script_equals_deepspeeds_pipeline_engine():
    """Without clipping: DeepSpeed 0.19.8's pipeline engine (fp32, ZeRO 0) clips by the norm of the first stage's
    gradients only (its clip_grad_norm_ counts the parameters of model-parallel rank 0, and the grid's model-parallel
    group is the pipeline's), where shardtrain clips by the norm over every stage, as one process does."""
    pytest.importorskip("deepspeed.runtime.pipe.engine")
    ours = run_distributed(_script, 2, 2, 0.0)
    theirs = run_distributed(_deepspeed_script, 2, 2, 0.0)
    for a, b in zip(ours, theirs):
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-5), (a["losses"], b["losses"])
    for name, value in {k: v for r in theirs for k, v in r["params"].items()}.items():
        torch.testing.assert_close(ours[0]["params"][name], value, rtol=1e-5, atol=1e-6)


def _from_training_data(_: int) -> dict:
    """``train_batch()`` without an iterator pulls from the loader of ``training_data``, again from its start when it
    runs out (DeepSpeed's RepeatingLoader); without either, it is refused by name."""
    x, y = (torch.cat(t) for t in zip(*global_batches(1)[: 2 * GAS]))  # two steps' rows
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": 10**6}
    net = pipeline_module(2)
    engine, _, loader, _ = deepspeed.initialize(
        model=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.0),  # no update: the third step repeats the first
        training_data=torch.utils.data.TensorDataset(x, y),
        config=config,
    )
    losses = [float(engine.train_batch()) for _ in range(3)]
    first = [float(engine.train_batch(iter(list(loader)[:GAS])))]
    bare = pipeline_module(2)
    plain, _, _, _ = deepspeed.initialize(model=bare, optimizer=torch.optim.SGD(bare.parameters()), config=config)
    with pytest.raises(ConfigError, match="without a data_iter"):
        plain.train_batch()
    return {"losses": losses, "first": first}


def test_train_batch_pulls_from_training_data():
    for r in run_distributed(_from_training_data, 2, 0):
        a, b, c = r["losses"]
        assert a != b and c == pytest.approx(a, rel=1e-6) and r["first"][0] == pytest.approx(a, rel=1e-6), r


def _checkpointed_script(pp: int, interval: int, in_config: bool = False) -> dict:
    """Training with every ``interval`` layers checkpointed (``in_config``: asked by the config's
    ``pipeline.activation_checkpoint_interval``, as DeepSpeed's PipelineEngine sets its module's), and how often
    each Block ran forward."""
    net = PipelineModule(
        layers(),
        num_stages=pp,
        loss_fn=loss_fn,
        seed_layers=True,
        activation_checkpoint_interval=0 if in_config else interval,
    )
    runs = {"n": 0}
    for layer in net.children():
        if isinstance(layer, Block):
            layer.fc.register_forward_hook(lambda *_: runs.__setitem__("n", runs["n"] + 1))
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": 10**6}
    if in_config:
        config["pipeline"] = {"activation_checkpoint_interval": interval}
    opt = torch.optim.AdamW(net.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=config)
    batches = global_batches(1)
    losses = [float(engine.train_batch(iter(batches[s * GAS : (s + 1) * GAS]))) for s in range(STEPS)]
    out = {"losses": losses, "runs": runs["n"], "params": engine.shardtrain_engine.full_state_dict()}
    engine.destroy()
    return out


def test_activation_checkpoint_interval_recomputes_and_trains_bitwise_the_same():
    """DeepSpeed's ``activation_checkpoint_interval``: chunks of 2 layers holding parameters recomputed in
    backward, reseeded as in their forward; the training is bitwise the one without it."""
    plain = run_distributed(_checkpointed_script, 2, 2, 0)
    chunked = run_distributed(_checkpointed_script, 2, 2, 2)
    for a, b in zip(plain, chunked):
        assert a["losses"] == b["losses"]
        assert b["runs"] > a["runs"] > 0, (a["runs"], b["runs"])  # the Blocks ran again in backward
    assert all(torch.equal(v, chunked[0]["params"][n]) for n, v in plain[0]["params"].items())


def test_config_activation_checkpoint_interval_sets_the_modules():
    """The config's ``pipeline.activation_checkpoint_interval`` is the module's, as DeepSpeed's PipelineEngine sets
    it: the same recomputations and the same training as the constructor's argument."""
    by_module = run_distributed(_checkpointed_script, 2, 2, 2)
    by_config = run_distributed(_checkpointed_script, 2, 2, 2, True)
    for a, b in zip(by_module, by_config):
        assert a["losses"] == b["losses"] and a["runs"] == b["runs"], (a["runs"], b["runs"])
    assert all(torch.equal(v, by_config[0]["params"][n]) for n, v in by_module[0]["params"].items())
