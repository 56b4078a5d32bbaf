"""Saved-tensor hooks pushed around a checkpointed block's forward: what keeps a block's inputs elsewhere than the
device's memory as they are (in host memory: :mod:`.host_offload`; partitioned over tensor-parallel ranks:
:mod:`.partition`) builds on :class:`BlockInputHooks`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class BlockInputHooks:
    """Pushes ``_pack``/``_unpack`` (a subclass's) as saved-tensor hooks around each installed block's forward,
    outside its checkpoint ([Note: the order of a checkpointed block's hooks] in :mod:`.recompute`), so they see
    exactly the inputs the checkpoint keeps. The recompute in backward saves into the checkpoint's own holders and
    is left alone. A subclass keeps ``_open`` (a list: the hooks pushed by the blocks running now, None where none
    was pushed) and may act at each block's entry (``_entering``)."""

    _open: list[Any]

    def install(self, block: nn.Module) -> list[Any]:
        """Push the hooks around ``block``'s forward, outermost; returns the handles."""
        return [
            block.register_forward_pre_hook(self._enter, prepend=True),
            block.register_forward_hook(self._leave, always_call=True),
        ]

    def _entering(self, module: nn.Module) -> None:
        """Called as a block's forward starts, before its hooks are pushed."""

    def _pack(self, t: torch.Tensor) -> Any:
        raise NotImplementedError

    def _unpack(self, packed: Any) -> torch.Tensor:
        raise NotImplementedError

    def _enter(self, module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled() or torch._C._current_autograd_node() is not None:  # the recompute
            self._open.append(None)
            return
        self._entering(module)
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._open.append(hooks)

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        hooks = self._open.pop()
        if hooks is not None:
            hooks.__exit__(None, None, None)


__all__ = ["BlockInputHooks"]
