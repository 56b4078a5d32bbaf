"""Multi-head latent attention (DeepSeek-V2's MLA) under tensor parallelism: transformers' ``mla_kv_a_proj`` style.

[Note: the latent key/value projection]
MLA compresses keys and values through a low-rank projection shared by every head, kept replicated: ``hidden ->
kv_a_proj_with_mqa -> [k_pass | k_rot]``; ``k_pass`` goes through ``kv_a_layernorm`` and ``kv_b_proj`` (colwise: this
rank's heads) to ``k_nope`` and values; ``k_rot`` is rotated and copied to every head of this rank. ``kv_b_proj``'s
Megatron **f** already sums ``k_pass``'s gradient over the ranks; ``k_rot`` bypasses it, so its gradient covers this
rank's heads only. The style puts **f** on the ``k_rot`` columns of the output only: on the whole output it would sum
``k_pass``'s gradient twice. Nothing is replaced or split; ``k_rot``'s width is the attention's ``qk_rope_head_dim``,
else the model's (text) config's.
"""

from __future__ import annotations

import torch
from torch import nn

from shardtrain.distributed.communicator import Communicator
from shardtrain.errors import LayoutError
from shardtrain.tensor_parallel.communication import copy_to_tp_region


def rope_width(model: nn.Module, modules: dict[str, nn.Module], name: str) -> int:
    """The ``k_rot`` columns at the end of ``name``'s output ([Note: the latent key/value projection])."""
    parent = modules.get(name.rpartition(".")[0])
    width = getattr(parent, "qk_rope_head_dim", None)
    if not isinstance(width, int):
        config = getattr(model, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        width = getattr(text, "qk_rope_head_dim", None)
    module = modules[name]
    out = getattr(module, "out_features", None)
    if not isinstance(width, int) or width <= 0:
        raise LayoutError(
            f"{name}: style 'mla_kv_a_proj' needs the rotary key width (qk_rope_head_dim) on its attention module "
            "or in the model's config, and finds neither. Add it, or leave the module out of the plan."
        )
    if not isinstance(module, nn.Linear) or not isinstance(out, int) or out <= width:
        raise LayoutError(
            f"{name} ({type(module).__name__}): style 'mla_kv_a_proj' applies to a linear projection whose output "
            f"ends with the {width} rotary key columns (qk_rope_head_dim), after the latent ones."
        )
    return width


def install_latent_kv_hook(module: nn.Module, comm: Communicator, rope: int, name: str) -> None:
    """**f** on the last ``rope`` columns of ``module``'s output, in a forward hook."""

    def hook(_module: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        latent, rot = out.split([out.shape[-1] - rope, rope], dim=-1)
        return torch.cat([latent, copy_to_tp_region(rot, comm, name)], dim=-1)

    module.register_forward_hook(hook)
