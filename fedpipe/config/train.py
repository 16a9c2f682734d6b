"""``[train]``: local training on each device."""

from __future__ import annotations

from dataclasses import dataclass

from fedpipe.config.checks import check

__all__ = ["TrainConfig"]


@dataclass(frozen=True)
class TrainConfig:
    """Local training on each device."""

    batch_size: int = 8
    seq_len: int = 128
    local_steps: int = 4
    lr: float = 2e-3
    weight_decay: float = 0.0
    eval_batches: int = 4
    # Tokens whose logits the tail's loss holds at once: the LM head and cross-entropy run over
    # chunks of this many (fedpipe.split.loss), the same loss and gradients; 0: the full logits.
    loss_chunk: int = 256

    def __post_init__(self) -> None:
        check(self.batch_size >= 1, f"train.batch_size must be >= 1, got {self.batch_size}")
        check(
            self.loss_chunk == 0 or self.loss_chunk >= 32,
            f"train.loss_chunk must be 0 (the full logits) or >= 32 tokens, got "
            f"{self.loss_chunk}: shorter chunks take the matrix library's small-product path, "
            "whose logits differ from the full product's in the last digit",
        )
        check(self.seq_len >= 2, f"train.seq_len must be >= 2, got {self.seq_len}")
        check(self.local_steps >= 1, f"train.local_steps must be >= 1, got {self.local_steps}")
        check(self.lr > 0, f"train.lr must be > 0, got {self.lr}")
