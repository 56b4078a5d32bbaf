"""The pipeline tests' recipe: a small GPT or Hugging Face Llama, its optimizer and the global micro-batches every
pipeline test trains on (tests/pipeline_parallel/)."""

from __future__ import annotations

import torch
from torch import nn

from shardtrain.models.gpt import GPT, GPTConfig

VOCAB, SEQ, LAYERS = 64, 16, 4
STEPS, GAS, MICRO, CLIP = 3, 4, 2, 0.5


def make_model(kind: str, tied: bool = False) -> nn.Module:
    """``tied``: the output head is the input embedding (GPT-2's and ``tie_word_embeddings``' layout)."""
    torch.manual_seed(0)
    if kind == "gpt":
        return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_layer=LAYERS, n_head=4, tie_embeddings=tied))
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(cfg)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def global_batches(kind: str, dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every micro-step's global rows: GPT's targets are the next tokens, Llama's labels the tokens (it shifts)."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(STEPS * GAS):
        x = torch.randint(0, VOCAB, (MICRO * dp, SEQ), generator=g)
        out.append((x, torch.roll(x, -1, dims=1) if kind == "gpt" else x.clone()))
    return out
