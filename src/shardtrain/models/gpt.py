"""A small GPT (decoder-only transformer) used by the demo, the tests and the benchmarks.

It knows nothing of parallelism, and is written so that parallelism can be applied from outside: the fused
Q/K/V output is cut with ``chunk(3)`` and heads are counted with ``-1``, so a projection holding only some heads
works unchanged, and the loss is a submodule that a tensor-parallel plan can replace. ``tie_embeddings`` shares
the token embedding with the LM head (one Parameter used by two modules), as GPT-2 does; ``gelu_approximate="tanh"``
gives GPT-2's GELU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 64
    n_layer: int = 2
    n_head: int = 4
    tie_embeddings: bool = False
    dropout: float = 0.0
    gelu_approximate: str = "none"  # "tanh": GPT-2's GELU (torch.nn.GELU's ``approximate``)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)  # fused Q, K, V
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # 3 x [b, t, d] (fewer heads if the projection holds fewer)
        q, k, v = (z.view(b, t, -1, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = self.attention(q, k, v)  # [b, h, t, d/h]
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of ``[b, h, t, d/h]`` queries, keys and values; sequence parallelism replaces it on the
        instance (:func:`shardtrain.sequence_parallel.ulysses.install_gpt`)."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(approximate=cfg.gelu_approximate),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TokenCrossEntropy(nn.Module):
    """Mean cross-entropy of ``logits [b, t, vocab]`` against ``targets [b, t]``, in fp32 whatever the compute
    dtype (a bf16 loss is quantized at ~0.4%)."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.loss = TokenCrossEntropy()
        self.apply(self._init)
        if cfg.tie_embeddings:
            self.head.weight = self.tok.weight

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, position_ids: torch.Tensor | None = None):
        """Logits ``[b, t, vocab]``, or the mean cross-entropy loss when ``targets`` is given. ``position_ids``
        (``[b, t]`` or ``[t]``; default ``0..t-1``): the tokens' positions in their sequence, which differ from
        ``0..t-1`` when the sequence is split (sequence parallelism)."""
        t = idx.shape[1]
        if position_ids is None:
            position_ids = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x)
        h = self.ln_f(x)
        if targets is None:
            return self.head(h)
        return self.head_loss(h, targets)

    def head_loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of the final hidden states ``h [b, t, d]``: the head's logits, then :attr:`loss`. The tiled loss
        replaces it on the instance, so that the logits never exist whole
        (:func:`shardtrain.sequence_parallel.tiling.enable_tiled_logits_loss`)."""
        return self.loss(self.head(h), targets)


def num_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied weight counts once)."""
    return sum(p.numel() for p in model.parameters())
