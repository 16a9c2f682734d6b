"""Packed rows: several examples in one row, told apart by per-token segment ids.

A packed row holds whole examples one after another (and a tail of pads, a segment of its
own). ``segments`` (B, T) numbers each token's example within its row: 0, 0, 0, 1, 1, 2, ...
(non-decreasing, starting at 0). A token attends to the earlier tokens of its own segment only
(:func:`segment_mask`), and its position counts from its segment's first token
(:func:`segment_positions`), so an example computes what it computes alone in a row of its
own. What crosses the stage link are each row's segment lengths (:func:`segment_lengths`,
:func:`segments_from_lengths`), which sum to the row's T.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "segment_lengths",
    "segment_mask",
    "segment_positions",
    "segments_from_lengths",
]


def segments_from_lengths(lengths: Sequence[Sequence[int]], seq_len: int) -> Tensor:
    """(B, T) segment ids of rows whose segments have ``lengths`` (each row's sum to T).

    Raises ValueError naming the row when a length is < 1 or a row's lengths do not sum to T.
    """
    rows = []
    for r, row in enumerate(lengths):
        if any(n < 1 for n in row) or sum(row) != seq_len:
            raise ValueError(
                f"row {r}: segment lengths {list(row)} must each be >= 1 and sum to the row's "
                f"{seq_len} tokens"
            )
        ids = torch.arange(len(row), dtype=torch.long)
        rows.append(torch.repeat_interleave(ids, torch.tensor(list(row), dtype=torch.long)))
    if not rows:
        return torch.zeros((0, seq_len), dtype=torch.long)
    return torch.stack(rows)


def segment_lengths(segments: Tensor) -> list[list[int]]:
    """Each row's segment lengths, in order: the inverse of :func:`segments_from_lengths`."""
    out = []
    for row in segments.detach().to("cpu", torch.long):
        _, counts = torch.unique_consecutive(row, return_counts=True)
        out.append([int(n) for n in counts])
    return out


def segment_positions(segments: Tensor) -> Tensor:
    """(B, T) positions that restart at 0 on each segment's first token."""
    length = segments.shape[1]
    index = torch.arange(length, device=segments.device).expand_as(segments)  # (B, T)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def segment_mask(segments: Tensor, window: int | None = None) -> Tensor:
    """(B, 1, T, T) bool, True where query i may attend key j: j <= i, the same segment, and
    (with a sliding ``window``) i - j < window."""
    length = segments.shape[1]
    i = torch.arange(length, device=segments.device).unsqueeze(1)  # (T, 1)
    j = torch.arange(length, device=segments.device).unsqueeze(0)  # (1, T)
    allowed = j <= i
    if window is not None:
        allowed = allowed & (j > i - window)
    same = segments.unsqueeze(2) == segments.unsqueeze(1)  # (B, T, T)
    return (same & allowed).unsqueeze(1)
