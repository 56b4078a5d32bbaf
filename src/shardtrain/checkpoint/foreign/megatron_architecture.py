"""The shape of a Megatron GPT model, from Megatron-LM's ``args``, and the transformers config that reproduces it
(a Llama, or a Mixtral with experts); any other architecture is refused by name."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardtrain.errors import CheckpointError


@dataclass(frozen=True)
class Architecture:
    """The shape of a Megatron GPT model, from Megatron-LM's ``args``: what un-fusing and the Hugging Face
    config need."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    groups: int
    head_dim: int
    vocab: int
    max_positions: int
    eps: float
    rope_theta: float
    tied: bool
    experts: int | None
    top_k: int
    qkv_bias: bool

    @staticmethod
    def from_args(args: Any, source: Path) -> Architecture:
        """Check that ``args`` describe a model a Llama (dense) or Mixtral (MoE) reproduces, and keep its shape."""
        a = vars(args) if not isinstance(args, dict) else args

        def get(key: str, default: Any = None) -> Any:
            return a.get(key, default)

        refusals = [
            (get("normalization", "LayerNorm") != "RMSNorm", f"normalization={get('normalization', 'LayerNorm')!r}"),
            (not get("swiglu", False), "no swiglu (a Llama MLP is SwiGLU)"),
            (get("add_bias_linear", True), "add_bias_linear (Llama's linear layers have no bias)"),
            (get("position_embedding_type", "learned_absolute") != "rope", "position embeddings are not rotary"),
            (get("rotary_interleaved", False), "rotary_interleaved"),
            (get("qk_layernorm", False), "qk_layernorm"),
            (get("multi_latent_attention", False), "multi-latent attention"),
            (get("rotary_percent", 1.0) != 1.0, f"rotary_percent={get('rotary_percent')}"),
            ((get("moe_shared_expert_intermediate_size") or 0) > 0, "shared experts"),
        ]
        if bad := [what for cond, what in refusals if cond]:
            raise CheckpointError(
                f"{source}: a Megatron model with {', '.join(bad)}; shardtrain reads Llama-style GPT models "
                "(RMSNorm, SwiGLU, rotary, no linear bias) and their Mixtral-style MoE versions"
            )
        heads = int(get("num_attention_heads"))
        experts = get("num_experts")
        ffn = get("moe_ffn_hidden_size") if experts else get("ffn_hidden_size")
        return Architecture(
            layers=int(get("num_layers")),
            hidden=int(get("hidden_size")),
            ffn=int(ffn or get("ffn_hidden_size")),
            heads=heads,
            groups=int(get("num_query_groups") or heads) if get("group_query_attention", False) else heads,
            head_dim=int(get("kv_channels") or get("hidden_size") // heads),
            vocab=int(get("padded_vocab_size") or 0),
            max_positions=int(get("max_position_embeddings") or get("seq_length") or 4096),
            eps=float(get("norm_epsilon", 1e-5)),
            rope_theta=float(get("rotary_base", 10000)),
            tied=not get("untie_embeddings_and_output_weights", False),
            experts=int(experts) if experts else None,
            top_k=int(get("moe_router_topk", 2)),
            qkv_bias=bool(get("add_qkv_bias", False)),
        )

    def hf_config(self, dtype: torch.dtype) -> dict[str, Any]:
        """A transformers ``config.json`` of the model (Llama, or Mixtral with experts)."""
        config: dict[str, Any] = {
            "hidden_size": self.hidden,
            "intermediate_size": self.ffn,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.groups,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab,
            "max_position_embeddings": self.max_positions,
            "rms_norm_eps": self.eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tied,
            "hidden_act": "silu",
            "dtype": str(dtype).removeprefix("torch."),
        }
        if self.experts is None:
            return {
                **config,
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "attention_bias": self.qkv_bias,
                "mlp_bias": False,
            }
        if self.qkv_bias:
            raise CheckpointError("a Megatron MoE model with add_qkv_bias has no Mixtral counterpart")
        return {
            **config,
            "model_type": "mixtral",
            "architectures": ["MixtralForCausalLM"],
            "num_local_experts": self.experts,
            "num_experts_per_tok": self.top_k,
            "sliding_window": None,
            "router_aux_loss_coef": 0.0,
        }
