"""DeepSpeed's mixture-of-experts checkpoints, read as transformers' fused experts.

[Note: DeepSpeed AutoEP checkpoints]
DeepSpeed's AutoEP (``expert_parallel`` config; ``_save_moe_checkpoint``) replaces each MoE block's experts by
``experts.w1`` (gate) ``[n/E, I, H]``, ``experts.w3`` (up) ``[n/E, I, H]`` and ``experts.w2`` (down) ``[n/E, H, I]``;
rank ``ep_rank = dp_rank % E`` (adjacent ranks, as ours) holds experts ``[ep_rank * n/E, (ep_rank + 1) * n/E)``; its
router ``router.gate`` becomes the model's ``gate``. At ZeRO stages 1-2 the model-states file holds ``module``
without experts, ``param_shapes`` and ``ds_autoep_layers`` (per layer ``module_path``, ``num_experts``, ``ep_size``,
``expert_key_prefix``); the optimizer files partition the experts' group (``moe: True``) over the ``dp / E`` ranks
holding the same experts (rank ``r``: partition ``r // E`` of expert group ``r % E``); the per-expert
``layer_<L>_expert_<g>_...`` files hold the module's weights, but the ZeRO masters are read, as ``zero_to_fp32`` does.

transformers' fused experts are ``gate_up_proj [n, 2I, H]`` (per expert, gate rows then up rows) and ``down_proj
[n, H, I]``, so all experts' gate rows, flattened expert-major, are block 0 of 2 along dim 1 of ``gate_up_proj``:
element ``k`` of rank ``e``'s ``w1`` is its element ``e * (n/E) * I * H + k``. A ZeRO fragment ``[a, b)`` of ``w1`` is
``BlockFlatSlice(BlockSlice(1, 0, 2), e * (n/E) * I * H + a, b - a)`` (``w3``: block 1), of ``w2``
``FlatSlice(e * (n/E) * H * I + a, b - a)`` of ``down_proj``: the any-layout load reads them like other pieces, with
their optimizer state. Refused, naming what is missing: DeepSpeed's own ``MoE`` layer (expert modules whose keys name
no transformers parameter), expert files without ``ds_autoep_layers``, stage-0 and stage-3 AutoEP, expert tensors of
other shapes (no fused tensor holds them). For users: docs/migration-deepspeed-checkpoints.md, "AutoEP".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from shardtrain.checkpoint.format import BlockFlatSlice, BlockSlice, FlatSlice, Slice
from shardtrain.errors import CheckpointError

NATIVE_MOE_KEY = ".deepspeed_moe.experts.deepspeed_experts."


@dataclass(frozen=True)
class ExpertTensor:
    """Where one AutoEP expert tensor (``<prefix>.w1`` of a rank) lies in transformers' fused tensor."""

    name: str  # the fused tensor's name: <prefix>.gate_up_proj or <prefix>.down_proj
    global_shape: tuple[int, ...]
    block: BlockSlice | None  # w1: block 0 of 2 along dim 1; w3: block 1; w2: None (the whole tensor)
    per_rank: int  # elements of the local tensor: rank e's start in the (block's) flattening is e * per_rank

    def slice(self, ep_rank: int, start: int, length: int) -> Slice:
        """Elements ``[start, start + length)`` of rank ``ep_rank``'s local tensor, flattened."""
        at = ep_rank * self.per_rank + start
        return FlatSlice(at, length) if self.block is None else BlockFlatSlice(self.block, at, length)


@dataclass(frozen=True)
class AutoEPLayer:
    module_path: str
    prefix: str  # expert_key_prefix: <module_path>.experts
    num_experts: int
    ep: int


class AutoEPNames:
    """The AutoEP layers a model-states file records, and the names they give to transformers' (see [Note: DeepSpeed
    AutoEP checkpoints])."""

    def __init__(self, layers: list[AutoEPLayer], where: str) -> None:
        self.layers, self.where = layers, where
        sizes = {layer.ep for layer in layers}
        if len(sizes) > 1:
            raise CheckpointError(f"{where}: AutoEP layers with different ep_size {sorted(sizes)}; not read here")
        self.ep = sizes.pop() if sizes else 1

    @staticmethod
    def of(main: dict, directory: Path, where: str) -> AutoEPNames | None:
        """The AutoEP layers of a checkpoint, None for one without experts; refuses the MoE layouts not read here."""
        module = main.get("module") if isinstance(main.get("module"), dict) else {}
        native = next((k for k in module if NATIVE_MOE_KEY in k), None)
        expert_files = sorted(p.name for p in directory.glob("*expert_*_model_states.pt"))
        if native is not None or (expert_files and not main.get("ds_autoep_layers")):
            what = f"its module holds {native!r}" if native is not None else f"it holds {expert_files[0]}"
            raise CheckpointError(
                f"{where}: a checkpoint of DeepSpeed's MoE layer (deepspeed.moe.layer.MoE: {what}) with no "
                "'ds_autoep_layers': its experts are modules of their own, which map onto no transformers fused "
                "experts (gate_up_proj / down_proj); only DeepSpeed AutoEP checkpoints of transformers models are "
                "read. Load it into DeepSpeed and save the model's state dict, or consolidate it with DeepSpeed's "
                "zero_to_fp32 and load the weights with load_full_state_dict"
            )
        records = main.get("ds_autoep_layers")
        if not records:
            return None
        layers = []
        for i, r in enumerate(records):
            missing = [k for k in ("module_path", "num_experts", "ep_size", "expert_key_prefix") if k not in r]
            if not isinstance(r, dict) or missing:
                raise CheckpointError(f"{where}: ds_autoep_layers entry {i} has no {missing}; the file is damaged")
            layout = r.get("checkpoint_format", "per_expert_files")
            if layout != "per_expert_files":
                raise CheckpointError(
                    f"{where}: AutoEP layer {r['module_path']!r} was saved as {layout!r} (ZeRO stage 3), which is "
                    "not read here; save the run at ZeRO stage 1 or 2"
                )
            layers.append(
                AutoEPLayer(r["module_path"], r["expert_key_prefix"], int(r["num_experts"]), int(r["ep_size"]))
            )
        return AutoEPNames(layers, where)

    def model_name(self, name: str) -> str | None:
        """transformers' name of a dense tensor of an AutoEP model: the router ``<layer>.router.gate.*`` is the
        model's ``<layer>.gate.*``; ``<layer>.gate.gate.*``, the alias of the router, is None (not a tensor of its
        own)."""
        for layer in self.layers:
            for alias, to in ((".gate.gate.", None), (".router.gate.", ".gate.")):
                head = layer.module_path + alias
                if name.startswith(head):
                    return None if to is None else layer.module_path + to + name[len(head) :]
        return name

    def expert(self, name: str, local_shape: tuple[int, ...]) -> ExpertTensor:
        """The fused tensor an AutoEP expert tensor (``<prefix>.w1`` / ``w2`` / ``w3``, a rank's experts) lies in."""
        for layer in self.layers:
            if not name.startswith(layer.prefix + ".") or name[len(layer.prefix) + 1 :] not in ("w1", "w2", "w3"):
                continue
            which = name[len(layer.prefix) + 1 :]
            local = layer.num_experts // layer.ep
            if len(local_shape) != 3 or local_shape[0] != local or local * layer.ep != layer.num_experts:
                raise CheckpointError(
                    f"{self.where}: AutoEP expert tensor {name!r} of shape {list(local_shape)} is not {local} experts "
                    f"([num_experts / ep_size, ...] with num_experts {layer.num_experts}, ep_size {layer.ep}); the "
                    "checkpoint is damaged or of a layout not read here"
                )
            _, rows, cols = local_shape
            per_rank = math.prod(local_shape)
            if which == "w2":  # down: [n/E, H, I] -> down_proj [n, H, I]
                return ExpertTensor(f"{layer.prefix}.down_proj", (layer.num_experts, rows, cols), None, per_rank)
            block = BlockSlice(1, 0 if which == "w1" else 1, 2)  # gate rows, then up rows, of each expert
            return ExpertTensor(f"{layer.prefix}.gate_up_proj", (layer.num_experts, 2 * rows, cols), block, per_rank)
        raise CheckpointError(
            f"{self.where}: {name!r} is in the experts' param group but is no AutoEP expert tensor (w1, w2 or w3 of "
            f"{', '.join(repr(layer.prefix) for layer in self.layers)}); the checkpoint is of a layout not read here"
        )


def check_expert_shapes(found: dict[str, dict[str, tuple[int, ...]]], where: str) -> None:
    """A layer's gate (w1) and up (w3) tensors must have the same shape, and its down (w2) the transposed one: then
    ``gate_up_proj`` and ``down_proj`` hold them (see [Note: DeepSpeed AutoEP checkpoints])."""
    for prefix, shapes in found.items():
        w1, w2, w3 = (shapes.get(k) for k in ("w1", "w2", "w3"))
        if w1 is None or w2 is None or w3 is None:
            missing = [k for k, v in (("w1", w1), ("w2", w2), ("w3", w3)) if v is None]
            raise CheckpointError(f"{where}: AutoEP experts {prefix!r} have no {missing} in the optimizer partitions")
        if w1 != w3 or w2 != (w1[0], w1[2], w1[1]):
            raise CheckpointError(
                f"{where}: AutoEP experts {prefix!r}: w1 {list(w1)}, w3 {list(w3)}, w2 {list(w2)} are not gate and up "
                "[n/E, I, H] and down [n/E, H, I], the layout transformers' fused experts hold"
            )
