"""Frozen blocks (``pipeline.freeze = progressive``): which LoRA tensors train no longer.

Blocks freeze lowest first, so the frozen blocks are always ``0 .. frozen_below - 1`` by their
global index (the same on the device and the StageServer) and one number says which. A frozen
block's adapter gets no gradient (``requires_grad`` off), so no optimizer step moves it and no
aggregation averages it: it keeps the global value it had when it froze.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor, nn

from fedpipe.lora.aggregation import adapter_block

__all__ = ["freeze_blocks", "is_frozen", "trainable_part"]


def is_frozen(key: str, frozen_below: int) -> bool:
    """Whether the state-dict ``key`` lies in a frozen block (``layers.N.…`` with N below)."""
    block = adapter_block(key)
    return block is not None and block < frozen_below


def freeze_blocks(params: Mapping[str, nn.Parameter], frozen_below: int) -> int:
    """Turn off the gradient of every tensor of ``params`` (global keys) in a frozen block;
    the others are left as they are. Returns how many tensors it froze."""
    frozen = 0
    for key, param in params.items():
        if is_frozen(key, frozen_below):
            param.requires_grad_(False)
            frozen += 1
    return frozen


def trainable_part(state: Mapping[str, Tensor], frozen_below: int) -> dict[str, Tensor]:
    """``state`` without the tensors of frozen blocks (what a round may change)."""
    return {k: v for k, v in state.items() if not is_frozen(k, frozen_below)}
