"""Tensor parallelism composed with ZeRO, run through the engine: the models, their parity-harness recipes and the
per-rank body the tests in ``test_tp_engine.py`` spawn.

A :class:`Case` becomes a :class:`shardtrain.testing.parity.Recipe` (:func:`recipe`): every rank of a
tensor-parallel group gets its data-parallel rank's rows of the global batch, and the reference is the harness's one
process training the same model on the whole global batch with the same recipe (loss / accumulation steps,
``clip_grad_norm_``, AdamW or SGD with two param groups; bf16 with fp32 masters).

AdamW is blind to a wrongly scaled gradient: its update ``m / sqrt(v)`` does not change when a tensor's gradient is
doubled (a gradient summed twice, or one rank's share only on two ranks). SGD's update is the gradient itself, so
the ``optimizer="sgd"`` cases (no clipping, which would rescale every gradient alike) hold each parameter tensor
to a tight bound relative to the distance it moved.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from shardtrain.models.gpt import GPT, GPTConfig
from shardtrain.testing import parity

VOCAB, SEQ = 64, 16


@dataclass(frozen=True)
class Case:
    model: str = "gpt"  # "gpt" (the project's, fused QKV), "llama"/"qwen3" (HF, own plan), "gpt2" (HF, strided plan)
    steps: int = 4
    gas: int = 2
    micro: int = 2  # rows per data-parallel rank and micro-step
    clip: float = 0.5
    lr: float = 3e-3
    dtype: str = "fp32"  # or "bf16"
    optimizer: str = "adamw"  # or "sgd": sensitive to a wrongly scaled gradient (module docstring)


def make_model(case: Case, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if case.model == "gpt":
        return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_layer=2, n_head=4))
    if case.model == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            attn_implementation="eager",
        )
        return LlamaForCausalLM(cfg)
    if case.model == "qwen3":  # per-head q/k norms: replicated parameters with tp-partial gradients
        from transformers import Qwen3Config, Qwen3ForCausalLM

        cfg = Qwen3Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=SEQ,
            attn_implementation="eager",
        )
        return Qwen3ForCausalLM(cfg)
    if case.model == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            vocab_size=VOCAB,
            n_positions=SEQ,
            n_embd=32,
            n_layer=2,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            attn_implementation="eager",
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=0,
        )
        return GPT2LMHeadModel(cfg)
    raise ValueError(case.model)


def loss_of(out, targets: torch.Tensor) -> torch.Tensor:
    """The project's GPT returns its loss; a transformers model returns logits: mean cross-entropy in fp32."""
    if torch.is_tensor(out):
        return out
    logits = out.logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def forward(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss of ``model`` (a model, or an engine) on ``(x, y)``."""
    gpt = isinstance(getattr(model, "module", model), GPT)
    return loss_of(model(x, y), y) if gpt else loss_of(model(input_ids=x), y)


def batch_loss(model, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return forward(model, *batch)


def plan_for(case: Case):
    from shardtrain.tensor_parallel import GPT2_TP_PLAN, GPT_TP_PLAN

    if case.model == "gpt":
        return GPT_TP_PLAN
    if case.model == "gpt2":
        return GPT2_TP_PLAN
    return None  # Llama: the plan its config carries


def make_optimizer(model: nn.Module, lr: float, kind: str = "adamw") -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lr)
    return torch.optim.AdamW(groups, lr=lr)


def sgd_case(**overrides) -> Case:
    """SGD without clipping, at a learning rate that moves every tensor well above rounding in a few steps."""
    return Case(**{"optimizer": "sgd", "clip": 0.0, "lr": 0.5} | overrides)


def global_batches(case: Case, dp: int, steps: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(4321)
    out = []
    for _ in range((steps or case.steps) * case.gas):
        x = torch.randint(0, VOCAB, (case.micro * dp, SEQ), generator=g)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def recipe(case: Case, dp: int, steps: int | None = None, stage: int = 1, tp: int = 1, seed: int = 0) -> parity.Recipe:
    """``case`` as the harness's recipe for ``dp`` data-parallel ranks (the rows of its global batches) at ZeRO
    ``stage`` and ``tensor_parallel.size`` ``tp`` (what the engine is given; the reference reads neither)."""
    layout = {k: v for k, v in config_for(case, stage, tp).items() if k not in _RECIPE_KEYS}
    return parity.Recipe(
        make_model=functools.partial(make_model, case, seed),
        make_optimizer=functools.partial(_optimizer_of, case),
        batches=functools.partial(global_batches, case, dp, steps),
        loss=batch_loss,
        gas=case.gas,
        clip=case.clip,
        config=layout,
        tp_plan=plan_for(case),
    )


_RECIPE_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping")


def _optimizer_of(case: Case, model: nn.Module) -> torch.optim.Optimizer:
    return make_optimizer(model, case.lr, case.optimizer)


def reference_run(case: Case, dp: int, steps: int | None = None) -> dict:
    """The harness's one process on the whole global batch (bf16 as the engine does it: bf16 compute, fp32 masters
    made from the fp32 init, gradients summed in fp32 over micro-steps, the optimizer on the masters)."""
    return parity.reference_run(recipe(case, dp, steps), bf16=case.dtype == "bf16", exact=False)


def config_for(case: Case, stage: int, tp: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": case.micro,
        "gradient_accumulation_steps": case.gas,
        "gradient_clipping": case.clip,
        "tensor_parallel": {"size": tp},
        "bf16": {"enabled": case.dtype == "bf16"},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 3000,
            "allgather_bucket_size": 3000,
            "stage3_param_persistence_threshold": 0,
        },
    }


def build_engine(case: Case, stage: int, tp: int, seed: int = 0):
    dp = max(dist.get_world_size() // tp, 1)  # a tp size that does not divide the world: initialize refuses it
    return parity.build_engine(recipe(case, dp, stage=stage, tp=tp, seed=seed))


def train(engine, case: Case, batches, steps: range) -> tuple[list[float], list[float]]:
    """Train ``steps`` optimizer steps on this rank's rows; returns (mean loss over dp ranks, grad norm) per step."""
    dp_rank = engine.topology.dp_rank
    lo, hi = dp_rank * case.micro, (dp_rank + 1) * case.micro
    losses, norms = [], []
    for step in steps:
        step_loss = torch.zeros(())
        for m in range(case.gas):
            x, y = batches[step * case.gas + m]
            loss = forward_engine(engine, x[lo:hi], y[lo:hi])
            engine.backward(loss)
            engine.step()
            step_loss += loss.detach().float() / case.gas
        dist.all_reduce(step_loss)  # the same on the tp ranks: mean over every rank is the mean over dp ranks
        losses.append(float(step_loss) / dist.get_world_size())
        norms.append(engine.get_global_grad_norm())
    return losses, norms


def forward_engine(engine, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return forward(engine, x, y)


def run_cases(cases: list[tuple[Case, int, int]]) -> list[dict]:
    """Each (case, stage, tp) on this rank: losses, norms and rank 0's full state dict."""
    out = []
    for case, stage, tp in cases:
        engine = build_engine(case, stage, tp)
        batches = global_batches(case, engine.topology.dp)
        losses, norms = train(engine, case, batches, range(case.steps))
        out.append({"losses": losses, "norms": norms, "params": engine.full_state_dict()})
        engine.close()
    return out


SGD_MOVED_FRAC = 1e-4


def assert_parity(
    result: dict,
    ref: dict,
    what: str,
    loss_rtol: float = 2e-5,
    moved_frac: float = 5e-3,
) -> None:
    """fp32: losses within 2e-5 relative, every parameter tensor within 5e-3 of the distance it moved (L2); with
    SGD (``what`` says "sgd") within ``SGD_MOVED_FRAC``: its update is linear in the gradient, so only rounding
    separates the runs, and a tensor whose gradient is off by a factor moves by that factor.
    bf16 (rounding of bf16 gradients differs with the summation order): losses within 1e-3, norms 2e-2, total
    parameter error under a tenth of the total distance moved (the bar of tests/zero/test_mixed_precision.py)."""
    if "bf16" in what:
        return _assert_bf16_parity(result, ref, what)
    for s, (a, b) in enumerate(zip(result["losses"], ref["losses"])):
        assert abs(a - b) <= loss_rtol * abs(b), f"{what}: step {s}: loss {a} vs reference {b}"
    for s, (a, b) in enumerate(zip(result["norms"], ref["norms"])):
        assert abs(a - b) <= 1e-4 * abs(b), f"{what}: step {s}: grad norm {a} vs reference {b}"
    assert_params_parity(result, ref, what, SGD_MOVED_FRAC if "sgd" in what else moved_frac)


def assert_params_parity(result: dict, ref: dict, what: str, moved_frac: float) -> None:
    """Every parameter tensor within ``moved_frac`` of the distance it moved in the reference (L2)."""
    final = result["params"]
    assert final.keys() == ref["params"].keys(), what
    sgd = "sgd" in what
    failures = []
    for k, want in ref["params"].items():
        got = final[k].float()
        want = want.float()
        assert got.shape == want.shape, f"{what}: {k}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
        # L2 over the tensor: Adam turns rounding-level gradient differences of near-zero elements into
        # lr-sized steps element by element, so the bound is on the tensor, not on its worst element
        moved = (want - ref["init"][k].float()).norm().item()
        err = (got - want).norm().item()
        # SGD: p - lr * g rounds to p's own precision each step, whatever g's agreement: up to an ulp of every
        # element per step, far below the distance any tensor moves here (>1e-4 of its norm)
        floor = len(ref["losses"]) * torch.finfo(torch.float32).eps * want.norm().item() if sgd else 1e-7
        if err > moved_frac * moved + floor:
            failures.append(f"{what}: {k}: error {err:.3g} vs distance moved {moved:.3g} (L2)")
    assert not failures, "\n".join(failures)


def _assert_bf16_parity(result: dict, ref: dict, what: str) -> None:
    for s, (a, b) in enumerate(zip(result["losses"], ref["losses"])):
        assert abs(a - b) <= 1e-3 * abs(b), f"{what}: step {s}: loss {a} vs reference {b}"
    for s, (a, b) in enumerate(zip(result["norms"], ref["norms"])):
        assert abs(a - b) <= 2e-2 * abs(b), f"{what}: step {s}: grad norm {a} vs reference {b}"
    final = result["params"]
    err = sum((final[k].float() - w.float()).abs().sum().item() for k, w in ref["params"].items())
    moved = sum((w.float() - ref["init"][k].bfloat16().float()).abs().sum().item() for k, w in ref["params"].items())
    assert err <= 0.1 * moved, f"{what}: total parameter error {err:.3g} vs total distance moved {moved:.3g}"


def captured_sizes(engine) -> tuple[int, int]:
    """The engine's captured graphs of the last schema (graph mode, ``aot_eager``; 0 in eager mode) and their nodes
    whose value has a symbolic size: none when the graphs are specialized on the inputs' sizes
    (``graph.dynamic_shapes: false``)."""
    captured = getattr(engine._runtime, "captured", None)
    graphs = captured.graphs() if captured is not None else []
    symbolic = 0
    for _, gm in graphs:
        for node in gm.graph.nodes:
            val = node.meta.get("val")
            shape = val.shape if isinstance(val, torch.Tensor) else ()
            symbolic += isinstance(val, torch.SymInt) or any(not isinstance(d, int) for d in shape)
    return len(graphs), symbolic
