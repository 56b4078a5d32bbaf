"""Real DeepSpeed checkpoints for the migration tests, and the shardtrain run that resumes them.

:func:`write_deepspeed_checkpoints` trains a small model with DeepSpeed itself (CPU accelerator, gloo, the ranks of
``run_distributed``) at the given ZeRO stages and precisions, saves a checkpoint after :data:`SAVE_AT` steps and
keeps training to :data:`STEPS`: the losses after the save are DeepSpeed's own continuation from that checkpoint
(the same engine going on; its resume at the same layout is exact). :func:`resume` loads a checkpoint into a
shardtrain engine of any world size and stage, built from another seed so that every value must come from the
checkpoint, and trains the same steps.

The model has what real models have: a tied pair (embedding and LM head), a frozen parameter, a persistent buffer,
and parameters of several shapes. No 0-dim parameter: DeepSpeed's broadcast at initialize fails on one.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported anywhere in this process

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, SEQ, ROWS = 13, 8, 5, 6  # 6 rows: 3 per rank at DeepSpeed's world 2, and 6, 3, 2 at worlds 1-3
SAVE_AT, STEPS = 3, 6
LR, WD, CLIP = 1e-2, 0.1, 1.0


def lr_lambda(step: int) -> float:
    """A warm-up, so that the scheduler state matters after the resume."""
    return min(1.0, (step + 1) / 5)


class DSNet(nn.Module):
    def __init__(self, seed: int = 0, tied: bool = True) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.fc = nn.Linear(DIM, DIM)
        self.frozen = nn.Parameter(torch.randn(DIM, DIM) * 0.3, requires_grad=False)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.scale = nn.Parameter(torch.tensor([1.0 + seed]))
        self.register_buffer("mix", torch.randn(3, DIM))
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + torch.tanh(self.fc(h) @ self.frozen.to(h.dtype))
        h = self.norm(h) + self.mix.mean(0).to(h.dtype)
        logits = self.head(h) * self.scale
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        out.append((x, torch.roll(x, -1, 1)))
    return out


def _global_mean(value: float) -> float:
    """The loss of the global batch: every rank's micro-batch has the same number of rows."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _train(call, steps: range, dp: int | None = None, dp_rank: int | None = None) -> list[float]:
    """The loss of each step; rank ``dp_rank`` of ``dp`` data-parallel ranks (default: every rank) trains on its
    rows of the global batch (the ranks of a tensor-parallel group on the same rows)."""
    world = dp or dist.get_world_size()
    rank = dist.get_rank() if dp_rank is None else dp_rank
    rows = ROWS // world
    losses = []
    for s in steps:
        x, y = (t[rank * rows : (rank + 1) * rows] for t in batches()[s])
        losses.append(_global_mean(call(x, y)))
    return losses


# Which optimizer DeepSpeed builds, and how its ``step`` is saved ([Note: DeepSpeed's step counts] in
# deepspeed_format.py): "torch_adam" the config's AdamW with ``torch_adam: true`` (torch's AdamW, a tensor step);
# "fused" the config's AdamW as most scripts write it (DeepSpeed's FusedAdam, built for the CPU accelerator: a
# C++ extension JIT-compiled on first use, about 100 s on a 2-core machine, cached in the venv (tests/conftest.py);
# an int step); "cpu_offload" the same with ``offload_optimizer`` (DeepSpeedCPUAdam, an int step); "client" a
# torch AdamW passed to ``initialize``.
OPTIMIZERS = ("torch_adam", "fused", "cpu_offload", "client")


def case_name(stage: int, dtype: str, optimizer: str = "torch_adam") -> str:
    return f"ds_stage{stage}_{dtype}" + ("" if optimizer == "torch_adam" else f"_{optimizer}")


def _deepspeed_optimizer(optimizer: str, config: dict, trainable: list) -> torch.optim.Optimizer | None:
    """Sets ``config``'s optimizer section for ``optimizer`` (one of :data:`OPTIMIZERS`); returns the client
    optimizer to pass to ``initialize``, if any."""
    params = {"lr": LR, "weight_decay": WD}
    if optimizer == "client":
        return torch.optim.AdamW(trainable, **params)
    if optimizer == "torch_adam":
        params["torch_adam"] = True
    elif optimizer == "cpu_offload":
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    elif optimizer != "fused":
        raise ValueError(optimizer)
    config["optimizer"] = {"type": "AdamW", "params": params}
    return None


STALE_BUILD_S = 600  # a JIT build of DeepSpeed's CPU Adam ops takes about 100 s on 2 cores


def clear_stale_extension_builds() -> list[str]:
    """Remove the torch-extension build directories whose build lock is older than :data:`STALE_BUILD_S`.

    DeepSpeed JIT-compiles its CPU Adam ops into torch's extension directory (the venv's: ``tests/conftest.py``)
    under a lock file that torch's ``FileBaton`` waits on without a limit. A build killed midway (a test timed out
    during it) leaves the lock and no library, and every later build of that op waits forever. Such a directory is
    removed, so the next build starts clean; returns the names of what was removed."""
    import shutil
    import time

    from torch.utils.cpp_extension import get_default_build_root

    removed = []
    for lock in Path(get_default_build_root()).glob("*/*/lock"):
        if time.time() - lock.stat().st_mtime > STALE_BUILD_S:
            shutil.rmtree(lock.parent, ignore_errors=True)
            removed.append(lock.parent.name)
    return removed


def write_deepspeed_checkpoints(
    root: str, cases: list[tuple[int, str]], optimizer: str = "torch_adam"
) -> dict[str, dict]:
    """On every rank: train, save and continue with DeepSpeed for each ``(stage, dtype)``, its optimizer built as
    ``optimizer`` says (:data:`OPTIMIZERS`); returns per case the global losses before and after the save."""
    import deepspeed

    out = {}
    for stage, dtype in cases:
        model = DSNet(seed=0)
        trainable = [p for p in model.parameters() if p.requires_grad]
        config = {
            "train_micro_batch_size_per_gpu": ROWS // dist.get_world_size(),
            "gradient_accumulation_steps": 1,
            "gradient_clipping": CLIP,  # DeepSpeed's default is 1.0, shardtrain's 0: both explicit
            "zero_optimization": {"stage": stage},
            "steps_per_print": 10**6,
        }
        client = _deepspeed_optimizer(optimizer, config, trainable)
        if dtype != "fp32":
            config[dtype] = {"enabled": True}
        with contextlib.redirect_stdout(io.StringIO()):
            engine, opt, _, _ = deepspeed.initialize(
                model=model,
                model_parameters=trainable,
                optimizer=client,
                config=config,
                lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda),
            )

        def step(x, y, engine=engine):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return float(loss.detach().float())

        before = _train(step, range(SAVE_AT))
        name = case_name(stage, dtype, optimizer)
        engine.save_checkpoint(str(Path(root) / name), client_state={"epoch": 3, "note": "hi", "ids": torch.arange(4)})
        after = _train(step, range(SAVE_AT, STEPS))
        out[name] = {"before": before, "after": after}
        del engine, opt
    return out


def resume(root: str, name: str, stage: int, dtype: str, load_optimizer_states: bool = True, tp: int = 1) -> dict:
    """On every rank: a shardtrain engine (another seed) loads ``root/name`` and trains the steps after the save.
    With ``tp`` > 1, ``fc`` is split over tensor-parallel groups of ``tp`` ranks (its output dimension)."""
    import shardtrain

    model = DSNet(seed=1)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    dp = dist.get_world_size() // tp
    config = {
        "train_micro_batch_size_per_gpu": ROWS // dp,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage},
        "tensor_parallel": {"size": tp},
    }
    if dtype != "fp32":
        config[dtype] = {"enabled": True}
    tp_plan = {"fc": "colwise_gather_output"} if tp > 1 else None
    engine = shardtrain.initialize(model, config=config, optimizer=opt, lr_scheduler=sched, tp_plan=tp_plan)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "per-rank RNG states are not restored": DeepSpeed saves none
        client = engine.load_checkpoint(str(Path(root) / name), load_optimizer_states=load_optimizer_states)

    def step(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return float(loss.detach().float())

    losses = _train(step, range(SAVE_AT, STEPS), dp, engine.topology.dp_rank)
    return {
        "losses": losses,
        "client_state": client,
        "global_step": engine.global_step,
        "global_samples": engine.global_samples,
    }


def zero_to_fp32(path: str) -> dict[str, torch.Tensor]:
    """DeepSpeed's own consolidation of a checkpoint directory (quietly)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return get_fp32_state_dict_from_zero_checkpoint(path)


# -- tensor parallelism: DeepSpeed AutoTP (mp_rank_XX files) -------------------------------------------------------
TP_SAVE_AT, TP_STEPS = 2, 4


def tiny_llama(seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(cfg)


def llama_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (2, 8), generator=g) for _ in range(TP_STEPS)]


def write_autotp_checkpoint(root: str) -> dict:
    """DeepSpeed AutoTP over 2 ranks (tensor parallel 2, data parallel 1, ZeRO-1): train, save, continue."""
    import deepspeed

    model = tiny_llama()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
        "tensor_parallel": {"autotp_size": 2},
        "steps_per_print": 10**6,
    }
    with contextlib.redirect_stdout(io.StringIO()):
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    losses = []
    for x in llama_batches()[:TP_SAVE_AT]:
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    engine.save_checkpoint(root)
    after = []
    for x in llama_batches()[TP_SAVE_AT:]:
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        after.append(float(loss.detach()))
    return {"before": losses, "after": after}


def resume_llama(root: str, stage: int) -> list[float]:
    """A shardtrain engine (data parallel only, another seed) loads the AutoTP checkpoint and goes on; every rank
    sees the whole batch rows split between them."""
    import shardtrain

    model = tiny_llama(seed=1)
    world = dist.get_world_size()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    config = {
        "train_micro_batch_size_per_gpu": 2 // world,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage},
    }
    engine = shardtrain.initialize(model, config=config, optimizer=opt)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine.load_checkpoint(root)
    rank, rows = dist.get_rank(), 2 // world
    losses = []
    for x in llama_batches()[TP_SAVE_AT:]:
        mine = x[rank * rows : (rank + 1) * rows]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        losses.append(_global_mean(float(loss.detach())))
    return losses


# -- fp16: DeepSpeed's CPU accelerator refuses it; the writing ranks are told it is supported -----------------------
FP16_SAVE_AT, FP16_STEPS = 5, 10
# 2**20 overflows the first steps (the scaled loss's gradients pass fp16's 65504); a window of 2 and a hysteresis
# of 2 make the allowance, the clean-step count and the growth all change within these few steps.
FP16 = {"enabled": True, "initial_scale_power": 13, "loss_scale_window": 2, "hysteresis": 2, "min_loss_scale": 1}
FP16_STAGE = 2


def _allow_fp16_on_cpu() -> None:
    """DeepSpeed's ``initialize`` refuses fp16 when the accelerator says it lacks it (the CPU accelerator asks
    oneDNN, which says no on most CPUs); torch's CPU kernels for this model's fp16 ops exist, so say yes. Only in
    the DeepSpeed-writing ranks (a subprocess each)."""
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True  # supported_dtypes() asks this too


def _fp16_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(FP16_STEPS):
        x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        out.append((x, torch.roll(x, -1, 1)))
    return out


def _train_fp16(call, steps: range, dp: int, dp_rank: int) -> tuple[list[float], list[tuple[float, int]]]:
    """The global loss per step, and (the loss scale, the count of skipped steps) after each step."""
    rows = ROWS // dp
    losses, scales = [], []
    for s in steps:
        x, y = (t[dp_rank * rows : (dp_rank + 1) * rows] for t in _fp16_batches()[s])
        loss, scale, skipped = call(x, y)
        losses.append(_global_mean(loss))
        scales.append((scale, skipped))
    return losses, scales


def write_fp16_checkpoint(root: str) -> dict:
    """On every rank (world 2): DeepSpeed ZeRO-2 fp16 with dynamic loss scaling trains, saves after
    :data:`FP16_SAVE_AT` steps and goes on; returns the losses and DeepSpeed's ``cur_scale`` after each step."""
    import deepspeed

    _allow_fp16_on_cpu()
    model = DSNet(seed=0)
    config = {
        "train_micro_batch_size_per_gpu": ROWS // dist.get_world_size(),
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "torch_adam": True}},
        "zero_optimization": {"stage": FP16_STAGE},
        "fp16": FP16,
        "steps_per_print": 10**6,
    }
    with contextlib.redirect_stdout(io.StringIO()):
        engine, *_ = deepspeed.initialize(
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda),
        )

    def step(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return float(loss.detach().float()), float(engine.optimizer.cur_scale), engine.skipped_steps

    rank, world = dist.get_rank(), dist.get_world_size()
    before, scales_before = _train_fp16(step, range(FP16_SAVE_AT), world, rank)
    engine.save_checkpoint(root)
    after, scales_after = _train_fp16(step, range(FP16_SAVE_AT, FP16_STEPS), world, rank)
    skipped = engine.skipped_steps
    return {
        "before": before,
        "after": after,
        "scales_before": scales_before,
        "scales": scales_after,
        "skipped": skipped,
    }


def resume_fp16(root: str, stage: int) -> dict:
    """On every rank: a shardtrain fp16 engine (another seed, the same ``fp16`` section) loads the DeepSpeed fp16
    checkpoint and trains the steps after the save; the losses and ``engine.loss_scale`` after each step."""
    import warnings

    import shardtrain

    model = DSNet(seed=1)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    dp = dist.get_world_size()
    config = {
        "train_micro_batch_size_per_gpu": ROWS // dp,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage},
        "fp16": FP16,
    }
    engine = shardtrain.initialize(model, config=config, optimizer=opt, lr_scheduler=sched)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine.load_checkpoint(root)
    loaded_scale = engine.loss_scale

    def step(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return float(loss.detach().float()), engine.loss_scale, engine.skipped_steps

    losses, scales = _train_fp16(step, range(FP16_SAVE_AT, FP16_STEPS), dp, engine.topology.dp_rank)
    return {"losses": losses, "scales": scales, "loaded_scale": loaded_scale}


# -- DeepSpeed AutoTP at every ZeRO stage (tensor parallel x data parallel), and its resume ---------------------------
AUTOTP_ROWS = 6  # the global batch: 6, 3, 2 rows per data-parallel rank at 1, 2, 3 of them


def autotp_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 64, (AUTOTP_ROWS, 8), generator=g) for _ in range(TP_STEPS)]


def autotp_name(stage: int, dtype: str = "fp32") -> str:
    return f"autotp_stage{stage}_{dtype}"


def _llama_steps(call, steps: range, dp: int, dp_rank: int) -> list[float]:
    """The global loss of each step; data-parallel rank ``dp_rank`` of ``dp`` takes its rows of the global batch
    (the ranks of one tensor-parallel group take the same rows)."""
    rows = AUTOTP_ROWS // dp
    losses = []
    for x in autotp_batches()[steps.start : steps.stop]:
        mine = x[dp_rank * rows : (dp_rank + 1) * rows]
        # every rank of a data-parallel rank's tensor-parallel group has its loss: the mean over all ranks is
        # the mean over data-parallel ranks
        losses.append(_global_mean(call(mine)))
    return losses


# frozen in the AutoTP tests: a column-parallel weight (split) and the embedding (replicated); their shapes keep
# a stage-0 checkpoint's optimizer parameters matchable to the module's (a frozen LayerNorm weight would not)
AUTOTP_FROZEN = ("model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight")


def _freeze(model: nn.Module, frozen: tuple[str, ...]) -> list[nn.Parameter]:
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    return [p for p in model.parameters() if p.requires_grad]


def write_autotp_checkpoints(
    root: str, stages: list[int], tp: int = 2, dtype: str = "fp32", frozen: tuple[str, ...] = AUTOTP_FROZEN
) -> dict:
    """On every rank: DeepSpeed AutoTP (``tp`` ranks per tensor-parallel group, the world's other factor data
    parallel) at each ZeRO stage of ``stages``: train :data:`TP_SAVE_AT` steps with a warm-up LambdaLR, save to
    ``root/autotp_stage<s>_<dtype>`` with a client state, and go on to :data:`TP_STEPS`; the parameters named in
    ``frozen`` are not trained. Returns per stage the
    global losses before and after the save and, for this rank, its tensor-parallel rank and the shards its engine
    held at the save (parameters and ``exp_avg``, cloned; fp32 stage 0 only, where the optimizer steps the module's
    own parameters)."""
    import deepspeed

    world = dist.get_world_size()
    dp, dp_rank, tp_rank = world // tp, dist.get_rank() // tp, dist.get_rank() % tp  # DeepSpeed's (dp, tp) mesh
    out = {}
    for stage in stages:
        model = tiny_llama()
        trainable = _freeze(model, frozen)
        config = {
            "train_micro_batch_size_per_gpu": AUTOTP_ROWS // dp,
            "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "torch_adam": True}},
            "zero_optimization": {"stage": stage},
            "tensor_parallel": {"autotp_size": tp},
            "steps_per_print": 10**6,
        }
        if dtype != "fp32":
            config[dtype] = {"enabled": True}
        with contextlib.redirect_stdout(io.StringIO()):
            engine, *_ = deepspeed.initialize(
                model=model,
                model_parameters=trainable,
                config=config,
                lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda),
            )

        def step(x, engine=engine):
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            return float(loss.detach().float())

        before = _llama_steps(step, range(TP_SAVE_AT), dp, dp_rank)
        name = autotp_name(stage, dtype)
        engine.save_checkpoint(str(Path(root) / name), client_state={"epoch": 3, "ids": torch.arange(4)})
        shards: dict[str, dict[str, torch.Tensor]] = {"param": {}, "exp_avg": {}}
        if stage == 0 and dtype == "fp32":
            state = engine.optimizer.state
            for pname, p in engine.module.named_parameters():
                shards["param"][pname] = p.detach().clone()
                if p.requires_grad:
                    shards["exp_avg"][pname] = state[p]["exp_avg"].clone()
        after = _llama_steps(step, range(TP_SAVE_AT, TP_STEPS), dp, dp_rank)
        out[name] = {"before": before, "after": after, "tp_rank": tp_rank, "dp_rank": dp_rank, "shards": shards}
        del engine
    return out


def resume_autotp(
    root: str,
    name: str,
    stage: int,
    tp: int = 1,
    load_optimizer_states: bool = True,
    dtype: str = "fp32",
    frozen: tuple[str, ...] = AUTOTP_FROZEN,
) -> dict:
    """On every rank: a shardtrain engine (another seed; tensor parallel ``tp`` with the model's own plan, data
    parallel over the rest; ``dtype`` fp32 or bf16) loads the AutoTP checkpoint ``root/name`` and trains the steps
    after the save (``frozen``: as the DeepSpeed run froze them)."""
    import warnings

    import shardtrain

    model = tiny_llama(seed=1)
    opt = torch.optim.AdamW(_freeze(model, frozen), lr=LR, weight_decay=WD)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    dp = dist.get_world_size() // tp
    config = {
        "train_micro_batch_size_per_gpu": AUTOTP_ROWS // dp,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage},
        "tensor_parallel": {"size": tp},
    }
    if dtype != "fp32":
        config[dtype] = {"enabled": True}
    engine = shardtrain.initialize(model, config=config, optimizer=opt, lr_scheduler=sched)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "per-rank RNG states are not restored": DeepSpeed saves none
        client = engine.load_checkpoint(str(Path(root) / name), load_optimizer_states=load_optimizer_states)

    def step(x):
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        return float(loss.detach().float())

    losses = _llama_steps(step, range(TP_SAVE_AT, TP_STEPS), dp, engine.topology.dp_rank)
    return {"losses": losses, "client_state": client, "global_step": engine.global_step, "lr": engine.get_lr()}


def ds_to_universal(tag_dir: str, out: str) -> dict[str, dict[str, torch.Tensor]]:
    """DeepSpeed's own reassembly of a ZeRO checkpoint, tensor parallelism included (``ds_to_universal``, in this
    process: one worker each): per parameter name, its whole ``fp32`` master and optimizer states."""
    from argparse import Namespace

    from deepspeed.checkpoint import ds_to_universal as convert

    args = Namespace(
        input_folder=tag_dir,
        output_folder=out,
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        # its strict check asserts that every name pattern of the tensor-parallel map was used, which a frozen
        # parameter's pattern is not (frozen parameters have no optimizer fragments to merge)
        strict=False,
        inject_missing_state=False,
    )
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        convert.main(args)
    result: dict[str, dict[str, torch.Tensor]] = {}
    for param_dir in sorted(p for p in (Path(out) / "zero").iterdir() if p.is_dir()):  # and optimizer_state.pt
        result[param_dir.name] = {
            f.stem: torch.load(f, map_location="cpu", weights_only=False)["param"] for f in param_dir.glob("*.pt")
        }
    return result


def resume_autotp_with_and_without_optimizer(root: str, name: str, stage: int) -> tuple[dict, dict]:
    """:func:`resume_autotp` (data parallel only) twice in the same processes: with the optimizer and scheduler
    states, then with the weights alone (a fresh optimizer and scheduler)."""
    return resume_autotp(root, name, stage), resume_autotp(root, name, stage, 1, False)


def resume_each(root: str, cases: list[tuple[str, int]]) -> list[dict]:
    """:func:`resume` (fp32) of each ``(checkpoint name, loading stage)`` in turn, in the same processes."""
    return [resume(root, name, stage, "fp32") for name, stage in cases]
