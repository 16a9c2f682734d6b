"""``[model]``: which model, where it is cut, and the LoRA adapters trained on it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedpipe.config.checks import check, split_entries
from fedpipe.config.cuts import parse_cuts

__all__ = ["ModelConfig", "parse_lora_targets"]


def parse_lora_targets(value: Any, key: str = "model.lora_targets") -> tuple[str, ...]:
    """``"q_proj, v_proj"`` or ``["q_proj", "v_proj"]`` -> ("q_proj", "v_proj"); () for none
    (the family's default targets)."""
    return split_entries(value, key, "module name")


@dataclass(frozen=True)
class ModelConfig:
    """Which model, where it is cut, and the LoRA adapters trained on it."""

    name: str = "tiny-llama"  # tiny-llama | tiny-gpt2 | small-llama | default | HF folder | .gguf
    head_layers: int = 1
    tail_layers: int = 1
    split: str = "u"  # "u": labels stay on the device; "two": the server computes the loss
    # Cuts the StageServer offers besides head_layers+tail_layers: "H+T" pairs, a list or
    # comma-separated (e.g. "1+1,2+2"); the server holds every block they need, each device
    # picks one.
    cuts: tuple[tuple[int, int], ...] = ()
    lora_r: int = 8
    lora_alpha: int = 16
    # Module names LoRA wraps, a list or comma-separated; none: the family's default
    lora_targets: tuple[str, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        check(self.split in ("u", "two"), f"model.split must be 'u' or 'two', got {self.split!r}")
        check(self.head_layers >= 1, f"model.head_layers must be >= 1, got {self.head_layers}")
        check(self.tail_layers >= 0, f"model.tail_layers must be >= 0, got {self.tail_layers}")
        check(self.lora_r >= 1, f"model.lora_r must be >= 1, got {self.lora_r}")
        object.__setattr__(self, "cuts", parse_cuts(self.cuts, "model.cuts"))
        object.__setattr__(self, "lora_targets", parse_lora_targets(self.lora_targets))

    @property
    def offered_cuts(self) -> tuple[tuple[int, int], ...]:
        """(head, tail) pairs the server offers: head_layers+tail_layers first, then ``cuts``."""
        return tuple(dict.fromkeys(((self.head_layers, self.tail_layers), *self.cuts)))
