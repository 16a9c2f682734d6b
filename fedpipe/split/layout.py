"""Which transformer blocks run where: a pure, validated layout.

U mode (default): the device runs blocks [0, head) and [num - tail, num) plus embeddings, final
norm, LM head and the loss, so text and labels stay on it; the server runs the middle. Mode "two":
the device runs only the head; the server runs everything after it, including the final norm, LM
head and loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["SplitMode", "SplitLayout", "split_layout"]

SplitMode = Literal["u", "two"]


@dataclass(frozen=True)
class SplitLayout:
    """Block counts per side; block indices are global (0 .. num_layers - 1)."""

    num_layers: int
    head_layers: int
    tail_layers: int
    mode: SplitMode = "u"

    def __post_init__(self) -> None:
        if self.mode not in ("u", "two"):
            raise ValueError(f"mode must be 'u' or 'two', got {self.mode!r}")
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.head_layers < 0 or self.tail_layers < 0:
            raise ValueError(
                f"head_layers and tail_layers must be >= 0, got {self.head_layers} and "
                f"{self.tail_layers}"
            )
        if self.mode == "two" and self.tail_layers != 0:
            raise ValueError(
                f"mode 'two' runs everything after the head on the server, so tail_layers must "
                f"be 0 (got {self.tail_layers}); use mode 'u' to keep {self.tail_layers} tail "
                "blocks on the device"
            )
        server = self.num_layers - self.head_layers - self.tail_layers
        if server < 1:
            raise ValueError(
                f"head_layers ({self.head_layers}) + tail_layers ({self.tail_layers}) leave "
                f"{server} of {self.num_layers} blocks for the server; it needs at least 1, so "
                f"keep head_layers + tail_layers <= {self.num_layers - 1}"
            )

    @property
    def head_blocks(self) -> range:
        return range(0, self.head_layers)

    @property
    def server_blocks(self) -> range:
        return range(self.head_layers, self.num_layers - self.tail_layers)

    @property
    def tail_blocks(self) -> range:
        return range(self.num_layers - self.tail_layers, self.num_layers)

    def __str__(self) -> str:
        return (
            f"SplitLayout[{self.mode}] head {_fmt(self.head_blocks)} | server "
            f"{_fmt(self.server_blocks)} | tail {_fmt(self.tail_blocks)} of {self.num_layers}"
        )


def _fmt(blocks: range) -> str:
    return f"{blocks.start}..{blocks.stop - 1}" if len(blocks) else "-"


def split_layout(
    config: Any, *, head_layers: int = 1, tail_layers: int = 1, mode: SplitMode = "u"
) -> SplitLayout:
    """A layout for ``config``'s block count; in mode "two" ``tail_layers`` is forced to 0."""
    num_layers = int(config.num_hidden_layers)
    return SplitLayout(num_layers, head_layers, 0 if mode == "two" else tail_layers, mode)
