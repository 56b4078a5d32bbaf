"""Models as users bring them, each trained under the engine and in one process on the same global batches.

A *case* names a model builder and how its loss is read off the forward's result. ``reference`` trains the
model in one process on the global batch; ``engine_run`` trains it on every rank of a ``run_distributed`` job
with this rank's slice. Both follow the same recipe: loss / accumulation steps, ``clip_grad_norm_``, AdamW.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import shardtrain
from shardtrain.models.gpt import GPT, GPTConfig

from helpers.parity import PARAM_TOL, assert_params_near

VOCAB, SEQ, MICRO = 64, 16, 2


@dataclasses.dataclass
class LossOutput:
    """A plain dataclass output: not a pytree torch knows."""

    loss: torch.Tensor
    logits: torch.Tensor


class DataclassGPT(GPT):
    def forward(self, idx, targets):
        logits = self.head(self.ln_f(self._trunk(idx)))
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        return LossOutput(loss, logits)

    def _trunk(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return x


class AuxLossGPT(DataclassGPT):
    """The gradient reaches the model only through a loss stored on a module attribute."""

    def forward(self, idx, targets):
        out = super().forward(idx, targets)
        self.aux_loss = out.loss
        return out.logits.detach()  # nothing here requires grad


class SecondGradGPT(GPT):
    """``head.weight`` (a root parameter) is used inside a reentrant checkpoint and again outside it, so it gets
    two gradients in one backward: once from the checkpoint's inner backward, once from the outer graph."""

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        w = self.head.weight
        x = checkpoint(lambda t: t + 0.1 * (t @ w.t()) @ w, x, use_reentrant=True)
        logits = self.head(self.ln_f(x))
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _gpt(cls=GPT, tie: bool = False, n_layer: int = 2) -> nn.Module:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_layer=n_layer, n_head=4, tie_embeddings=tie)
    return cls(cfg)


def _llama(checkpointing: str | None = None, lora: bool = False) -> nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    if checkpointing is not None:
        model.gradient_checkpointing_enable({"use_reentrant": checkpointing == "reentrant"})
        model.config.use_cache = False
    if lora:
        import peft

        torch.manual_seed(1)
        lora_cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
        model = peft.get_peft_model(model, lora_cfg)
        if checkpointing is not None:  # the inputs of checkpointed layers must require grad (as peft does)
            model.enable_input_require_grads()
        with torch.no_grad():  # peft starts lora_B at zero; make both adapters matter from step 1
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02)
    return model


BUILDERS = {
    "dataclass": lambda: _gpt(DataclassGPT),
    "aux_loss": lambda: _gpt(AuxLossGPT),
    "tied_no_root": lambda: _gpt(tie=True),
    "second_grad": lambda: _gpt(SecondGradGPT),
    "reverse": lambda: _gpt(n_layer=4),
    "llama_ckpt_reentrant": lambda: _llama("reentrant"),
    "llama_ckpt": lambda: _llama("non-reentrant"),
    "llama_lora": lambda: _llama(lora=True),
    "llama_lora_ckpt": lambda: _llama("non-reentrant", lora=True),
}


def loss_of(case: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
    if case.startswith("llama"):
        return model(input_ids=x, labels=x).loss
    if case == "reverse" and step >= 2:  # from step 2 on, the blocks run in the opposite order
        inner = model.module if isinstance(model, shardtrain.Engine) else model
        blocks = list(inner.blocks)
        inner.blocks = nn.ModuleList(blocks[::-1])
        try:
            return model(x, y)
        finally:
            inner.blocks = nn.ModuleList(blocks)
    out = model(x, y)
    if case == "aux_loss":
        inner = model.module if isinstance(model, shardtrain.Engine) else model
        return inner.aux_loss
    return out.loss if isinstance(out, LossOutput) else out


def batches(world: int, steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    return [torch.randint(0, VOCAB, (MICRO * world, SEQ), generator=g) for _ in range(steps)]


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.1)


def trained(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def reference(case: str, world: int, steps: int = 4) -> dict:
    """One process, the global batch: fp32 losses, grad norms and parameters, and the float64 run's parameters
    (``exact``, see [Note: parity bounds])."""
    ref = _reference(case, world, steps, torch.float32)
    ref["exact"] = _reference(case, world, steps, torch.float64)["params"]
    return ref


def _reference(case: str, world: int, steps: int, dtype: torch.dtype) -> dict:
    model = BUILDERS[case]().to(dtype)
    init = trained(model)
    opt = optimizer(model)
    losses, norms = [], []
    for s, x in enumerate(batches(world, steps)):
        loss = loss_of(case, model, x, torch.roll(x, -1, 1), s)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "params": trained(model), "init": init}


def engine_run(case: str, stage: int, steps: int = 4, zero: dict | None = None) -> dict:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model = BUILDERS[case]()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000, **(zero or {})},
    }
    engine = shardtrain.initialize(model, config=config, optimizer=optimizer(model))
    losses, norms, gathers = [], [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s, x in enumerate(batches(world, steps)):
            x = x[rank * MICRO : (rank + 1) * MICRO]
            loss = loss_of(case, engine, x, torch.roll(x, -1, 1), s)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            norms.append(engine.get_global_grad_norm())
            if engine._runtime.units:
                gathers.append([u.gathers for u in engine._runtime.units])
    full = engine.full_state_dict()
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    units = engine._runtime if engine._runtime.units else None
    return {
        "losses": losses,
        "norms": norms,
        "params": {k: v for k, v in full.items() if k in names} if full is not None else None,
        "state_bytes": engine.state_bytes(),
        "max_gathered": units.max_gathered if units else 0,
        "n_units": len(units.units) if units else 0,
        "root_units": sum(u.module is model for u in units.units) if units else 0,
        "gathers": gathers,
        "max_staging": engine._reducer.max_staging,
        "warnings": [str(w.message) for w in caught],
    }


def assert_parity(results: list[dict], ref: dict, loss_rtol: float = 1e-5, param_tol: float = PARAM_TOL) -> None:
    """Mean of the ranks' losses equals the reference's at every step; rank 0's final trainable parameters are
    within ``param_tol`` of the distance the reference moved them (per tensor, L2: [Note: parity bounds])."""
    world = len(results)
    for s, want in enumerate(ref["losses"]):
        got = sum(r["losses"][s] for r in results) / world
        assert abs(got - want) <= loss_rtol * abs(want), f"step {s}: loss {got} vs reference {want}"
        assert abs(results[0]["norms"][s] - ref["norms"][s]) <= 1e-4 * ref["norms"][s], f"step {s}: grad norm"
    assert_params_near(
        results[0]["params"], ref["params"], ref["init"], param_tol, exact=ref["exact"], require_moved=True
    )
