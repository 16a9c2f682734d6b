"""Token batches for tests that train through the stage link: random ids, labels equal to them.

One generator seeded once draws every batch's ids in turn, so a test gets the same tensors on
every run. ``pad_from`` marks row 0's tokens from that position on as padding (-100), which the
loss must not count.
"""

from __future__ import annotations

import torch

__all__ = ["random_batches"]


def random_batches(
    n: int,
    batch: int,
    seq: int,
    *,
    vocab: int = 256,
    seed: int = 0,
    pad_from: int | None = None,
) -> list[dict[str, torch.Tensor]]:
    """``n`` batches of ``batch`` x ``seq`` token ids below ``vocab``, drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, seq), generator=gen)
        labels = ids.clone()
        if pad_from is not None:
            labels[0, pad_from:] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out
