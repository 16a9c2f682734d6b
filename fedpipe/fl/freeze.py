"""Freezing as training converges (``pipeline.freeze = progressive``): the ServerApp's decision.

PipeTransformer and AutoFreeze freeze a model's layers one by one as they converge, lowest
first, and take them out of the backward; TimelyFreeze picks how many per stage. fedpipe does
it per round, from what the ServerApp sees anyway: every round's global adapters, the device
side's (Flower's aggregate) and the StageServer's. A block's *movement* in a round is the
relative change of its adapter, ``||theta_t - theta_{t-1}|| / ||theta_{t-1}||`` over all of the
block's LoRA tensors (by global block index, so head, server and tail blocks are measured
alike). A block has *converged* when its movement fell to ``pipeline.freeze_ratio`` of the
largest it made so far (the first rounds' movement grows while B leaves zero, so the peak, not
the first round, is the reference).

After round ``t`` (``t >= pipeline.freeze_after``) the lowest blocks freeze while each has
converged, in order, up to ``pipeline.freeze_max`` of the model's blocks: the frozen blocks are
always ``0 .. frozen_below - 1``, so one number carries the decision, to the devices in the
round's config and to the StageServer in BeginRound. Frozen blocks stay frozen for the run
(their global values are pinned: no aggregation, momentum or rounding moves them), and the
decision's state goes into every checkpoint so that a resumed run goes on from it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fedpipe.config import PipelineConfig
from fedpipe.lora.aggregation import DELTA_SUFFIX, adapter_block
from fedpipe.lora.freezing import is_frozen

__all__ = ["FreezeRule", "FreezeState", "block_movement", "pin_frozen"]


@dataclass(frozen=True)
class FreezeRule:
    """When blocks freeze: ``ratio`` of a block's peak movement, not before round ``after``,
    at most ``max_blocks`` blocks."""

    ratio: float = 0.5
    after: int = 2
    max_blocks: int = 0

    @classmethod
    def of(cls, pipeline: PipelineConfig, num_layers: int) -> FreezeRule:
        """The rule ``pipeline.freeze_*`` set for a model of ``num_layers`` blocks."""
        most = int(math.floor(pipeline.freeze_max * num_layers))
        return cls(ratio=pipeline.freeze_ratio, after=pipeline.freeze_after, max_blocks=most)


@dataclass
class FreezeState:
    """The decision so far: blocks below ``frozen_below`` are frozen; each block's largest
    movement (``peaks``) and every round's movements (``history``, for the run's record)."""

    frozen_below: int = 0
    peaks: dict[int, float] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)

    def decide(self, rule: FreezeRule, round_: int, movement: Mapping[int, float]) -> int:
        """Take round ``round_``'s ``movement`` into this state; the new ``frozen_below``.

        Frozen blocks stay frozen: the result never goes down. A block freezes only when every
        block below it is frozen and its own movement was measured this round and fell to
        ``rule.ratio`` of its peak.
        """
        for block, value in movement.items():
            self.peaks[block] = max(self.peaks.get(block, 0.0), value)
        below = self.frozen_below
        if round_ >= rule.after:
            while below < rule.max_blocks and below in movement:
                if movement[below] > rule.ratio * self.peaks[below]:
                    break
                below += 1
        self.history.append(
            {
                "round": round_,
                "frozen_below": below,
                "movement": {str(b): round(v, 6) for b, v in sorted(movement.items())},
            }
        )
        self.frozen_below = below
        return below

    def to_json(self) -> dict[str, Any]:
        """What a checkpoint keeps (JSON: block indices as strings)."""
        return {
            "frozen_below": self.frozen_below,
            "peaks": {str(b): v for b, v in sorted(self.peaks.items())},
            "history": self.history,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> FreezeState:
        """The state a checkpoint kept (None or empty: nothing frozen yet)."""
        if not data:
            return cls()
        peaks = {int(b): float(v) for b, v in dict(data.get("peaks", {})).items()}
        return cls(int(data.get("frozen_below", 0)), peaks, list(data.get("history", [])))


def block_movement(
    before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor]
) -> dict[int, float]:
    """Each block's relative change from ``before`` to ``after`` (LoRA tensors by global key).

    Keys held by only one side, base deltas and tensors outside blocks are left out; so is a
    block that did not change at all (no device trained it this round: nothing was measured).
    """
    change: dict[int, float] = {}
    size: dict[int, float] = {}
    for key in sorted(set(before) & set(after)):
        block = adapter_block(key)
        if block is None or key.endswith(DELTA_SUFFIX):
            continue
        old, new = before[key].float(), after[key].float()
        change[block] = change.get(block, 0.0) + float((new - old).pow(2).sum())
        size[block] = size.get(block, 0.0) + float(old.pow(2).sum())
    return {
        b: math.sqrt(change[b] / size[b]) for b in sorted(change) if change[b] > 0 and size[b] > 0
    }


def pin_frozen(
    state: Mapping[str, torch.Tensor], before: Mapping[str, torch.Tensor], frozen_below: int
) -> dict[str, torch.Tensor]:
    """``state`` with every tensor of a frozen block taken from ``before`` (bit for bit)."""
    return {
        k: before[k] if is_frozen(k, frozen_below) and k in before else v for k, v in state.items()
    }
