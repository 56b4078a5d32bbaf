"""The tiny random mixture-of-experts models the expert-parallel tests train: a Mixtral or a Qwen3-MoE with two
layers of ``experts`` experts, top-2 routing, built from a config (nothing is downloaded)."""

from __future__ import annotations

import torch

VOCAB = 32


def tiny_moe(kind: str, experts: int, seed: int = 0, router_logits: bool = True, **overrides):
    """``kind`` ``"mixtral"`` or ``"qwen3_moe"``, seeded with ``seed``; ``router_logits``: the model returns its
    router logits and adds the load-balancing loss (coefficient 0.1) to its loss. ``overrides``: config values
    that replace the defaults (``num_attention_heads`` a sequence- or tensor-parallel size divides, a vocabulary a
    tensor-parallel size divides, ...)."""
    import transformers

    torch.manual_seed(seed)
    shared = dict(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts_per_tok=2, output_router_logits=router_logits, initializer_range=0.2,
        max_position_embeddings=32, tie_word_embeddings=False, attn_implementation="eager",
    )  # fmt: skip
    if router_logits:
        shared["router_aux_loss_coef"] = 0.1
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(
            **{**shared, "intermediate_size": 24, "num_local_experts": experts, **overrides}
        )
        return transformers.MixtralForCausalLM(cfg)
    own = dict(
        intermediate_size=24, moe_intermediate_size=12, num_experts=experts, decoder_sparse_step=1, head_dim=4,
        norm_topk_prob=True,
    )  # fmt: skip
    cfg = transformers.Qwen3MoeConfig(**{**shared, **own, **overrides})
    return transformers.Qwen3MoeForCausalLM(cfg)


def row_batches(dp: int, n: int, seq: int) -> list[torch.Tensor]:
    """``n`` global micro-batches of ``seq`` tokens, one row per data-parallel rank (the ranks of a rank's sequence-
    and tensor-parallel groups are given the same row)."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (dp, seq), generator=g) for _ in range(n)]


def one_process(
    kind: str, experts: int, dp: int, steps: int, gas: int, clip: float, overrides: dict, seq: int, lr: float
) -> dict:
    """One process on the whole global batch of :func:`row_batches`: each micro-step's loss is the mean of the
    data-parallel ranks' losses on their rows (each with its row's load-balancing loss, kept per row in ``aux``),
    AdamW at ``lr``, the gradient clipped to ``clip``."""
    model = tiny_moe(kind, experts, **overrides)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    batches = row_batches(dp, steps * gas, seq)
    losses, norms, aux = [], [], []
    for step in range(steps):
        total = 0.0
        for m in range(gas):
            ids = batches[step * gas + m]
            outs = [model(input_ids=ids[r : r + 1], labels=ids[r : r + 1]) for r in range(dp)]
            loss = sum(o.loss for o in outs) / dp
            aux.append([float(o.aux_loss.detach()) for o in outs])
            (loss / gas).backward()
            total += loss.item() / gas
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "norms": norms, "aux": aux, "params": model.state_dict(), "init": init}
