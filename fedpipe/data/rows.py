"""One example, one row: instruction examples as right-padded rows of input ids and labels.

An example is never cut across rows nor shares a row (and so attention) with another. A row
holds one example from its start, then pads (the tokenizer's pad, else its eos) whose labels are
-100: attention is causal, so no real token sees a pad, and pads count in no loss. An example
longer than ``seq_len`` is truncated (``overlong = "truncate"``) to the window of ``seq_len``
tokens that keeps all of its answers and as much of the prompt before them as fits (the prompt
loses its start), or, when the answers alone do not fit, the window from its start (or from just
before its first answer token); or it is dropped (``"drop"``). An example
left with no token that counts (a chat without an assistant turn) is dropped.

With ``packing``, several whole examples share a row instead (first fit, in order: each goes
into the first row with room for it, else a new one; none is ever cut). Each row then comes
with its segment ids (fedpipe.split.packing): a token attends only to its own example, at
positions that restart at 0, and each example's first label is -100, so the shifted loss of
the example before it never predicts it. A packed row computes what its examples compute in
rows of their own, in fewer rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import torch

from fedpipe.config import OVERLONG
from fedpipe.data.blocks import even_picks
from fedpipe.data.documents import Document
from fedpipe.data.masks import IGNORE_INDEX, LossOn, encode_example
from fedpipe.split.packing import segments_from_lengths

__all__ = [
    "OVERLONG",
    "ExampleCounts",
    "ExampleRows",
    "Overlong",
    "example_rows",
    "held_out_rows",
    "pack_examples",
]

Overlong = Literal["truncate", "drop"]


@dataclass(frozen=True)
class ExampleCounts:
    """What became of a device's examples: rows made, and how many were cut or left out."""

    rows: int = 0
    truncated: int = 0  # longer than seq_len, cut to it
    dropped_overlong: int = 0  # longer than seq_len, left out (overlong = "drop")
    dropped_unanswered: int = 0  # nothing in the loss (no assistant turn, an empty answer)

    def metrics(self) -> dict[str, int]:
        """``{"examples-rows": ..., ...}``: flat keys for a device's reply."""
        return {f"examples-{k.replace('_', '-')}": v for k, v in asdict(self).items()}


@dataclass(frozen=True)
class ExampleRows:
    """Rows of examples: ``input_ids`` and ``labels`` (N, seq_len), and the counts; packed
    rows also have their ``segments`` (N, seq_len), each row's examples numbered from 0.
    ``row_tokens`` (N,): each row's tokens of examples (the rest are pads)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    counts: ExampleCounts
    segments: torch.Tensor | None = None
    row_tokens: torch.Tensor | None = None

    def take(self, indices: Sequence[int]) -> ExampleRows:
        """The rows at ``indices`` (the counts stay those of the whole set)."""
        picks = torch.tensor(list(indices), dtype=torch.long)
        segments = None if self.segments is None else self.segments[picks]
        tokens = None if self.row_tokens is None else self.row_tokens[picks]
        return ExampleRows(self.input_ids[picks], self.labels[picks], self.counts, segments, tokens)


def example_rows(
    docs: Sequence[Document],
    tokenizer: Any,
    seq_len: int,
    *,
    loss_on: LossOn = "answers",
    overlong: Overlong = "truncate",
    max_rows: int | None = None,
    packing: bool = False,
) -> ExampleRows:
    """One row per document (the first ``max_rows`` rows that are made, with ``max_rows``),
    or with ``packing`` the documents' examples packed into rows (the first ``max_rows``)."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    if overlong not in OVERLONG:
        raise ValueError(f"overlong must be one of {OVERLONG}, got {overlong!r}")
    rows: list[tuple[list[int], list[int]]] = []
    counts = {"truncated": 0, "dropped_overlong": 0, "dropped_unanswered": 0}
    for doc in docs:
        if max_rows is not None and len(rows) >= max_rows and not packing:
            break
        ids, labels = encode_example(doc, tokenizer, loss_on=loss_on)
        if len(ids) > seq_len:
            if overlong == "drop":
                counts["dropped_overlong"] += 1
                continue
            ids, labels = _truncate(ids, labels, seq_len)
            counts["truncated"] += 1
        if all(label == IGNORE_INDEX for label in labels[1:]):  # the shift skips labels[0]
            counts["dropped_unanswered"] += 1
            continue
        rows.append((ids, labels))
    pad = _pad_id(tokenizer)
    if packing:
        packed = pack_examples(rows, seq_len, pad=pad, counts=counts)
        return packed if max_rows is None else packed.take(range(min(max_rows, _n(packed))))
    return _padded(rows, seq_len, pad, ExampleCounts(rows=len(rows), **counts))


def _n(rows: ExampleRows) -> int:
    return int(rows.input_ids.shape[0])


def pack_examples(
    examples: Sequence[tuple[list[int], list[int]]],
    seq_len: int,
    *,
    pad: int,
    counts: dict[str, int] | None = None,
) -> ExampleRows:
    """``examples`` ((ids, labels) pairs, each at most ``seq_len`` tokens) packed first fit
    into rows of ``seq_len``, with their segments (a row's pad tail is a segment of its own)."""
    bins: list[list[tuple[list[int], list[int]]]] = []
    room: list[int] = []
    for ids, labels in examples:
        if not 1 <= len(ids) <= seq_len or len(labels) != len(ids):
            raise ValueError(
                f"an example of {len(ids)} ids and {len(labels)} labels does not fit rows of "
                f"{seq_len} tokens: pack whole examples of 1 to seq_len tokens"
            )
        fit = next((b for b, free in enumerate(room) if free >= len(ids)), None)
        if fit is None:
            bins.append([])
            room.append(seq_len)
            fit = len(bins) - 1
        bins[fit].append((ids, [IGNORE_INDEX, *labels[1:]]))  # no loss across the boundary
        room[fit] -= len(ids)
    rows, lengths = [], []
    for b, members in enumerate(bins):
        rows.append(
            ([t for ids, _ in members for t in ids], [t for _, lab in members for t in lab])
        )
        lengths.append([len(ids) for ids, _ in members] + ([room[b]] if room[b] else []))
    padded = _padded(rows, seq_len, pad, ExampleCounts(rows=len(bins), **(counts or {})))
    return replace(padded, segments=segments_from_lengths(lengths, seq_len))


def _truncate(ids: list[int], labels: list[int], seq_len: int) -> tuple[list[int], list[int]]:
    """The window of ``seq_len`` tokens that keeps every answer token with one token before the
    first (it predicts that token) and as much before as fits; when the answers alone do not
    fit, the first ``seq_len`` tokens, or those from just before the first answer token if the
    prompt fills the row."""
    counted = [i for i, label in enumerate(labels) if label != IGNORE_INDEX]
    first, end = (counted[0], counted[-1] + 1) if counted else (0, len(ids))
    if end - first + 1 <= seq_len:
        start = max(0, end - seq_len)
    else:
        start = 0 if first < seq_len - 1 else first - 1
    return ids[start : start + seq_len], labels[start : start + seq_len]


def _padded(
    rows: list[tuple[list[int], list[int]]], seq_len: int, pad: int, counts: ExampleCounts
) -> ExampleRows:
    """(N, seq_len) tensors, each row right-padded with ``pad`` (labels: -100)."""
    input_ids = torch.full((len(rows), seq_len), pad, dtype=torch.long)  # (N, T)
    labels = torch.full((len(rows), seq_len), IGNORE_INDEX, dtype=torch.long)  # (N, T)
    for r, (ids, lab) in enumerate(rows):
        input_ids[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        labels[r, : len(lab)] = torch.tensor(lab, dtype=torch.long)
    tokens = torch.tensor([len(ids) for ids, _ in rows], dtype=torch.long)  # (N,)
    return ExampleRows(input_ids, labels, counts, row_tokens=tokens)


def _pad_id(tokenizer: Any) -> int:
    """The tokenizer's pad, else its eos (pads count in no loss, so any id would do)."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    raise ValueError("the tokenizer has neither a pad nor an eos token to pad rows with")


def held_out_rows(
    docs: Sequence[Document],
    tokenizer: Any,
    seq_len: int,
    n_rows: int,
    *,
    loss_on: LossOn = "answers",
    overlong: Overlong = "truncate",
    packing: bool = False,
) -> ExampleRows:
    """``n_rows`` rows spread evenly over the examples of ``docs`` (as ``held_out_blocks``
    spreads blocks over the text); fewer examples than asked: all. With ``packing``, over
    the packed rows."""
    if n_rows < 0:
        raise ValueError(f"n_rows must be >= 0, got {n_rows}")
    rows = example_rows(
        docs, tokenizer, seq_len, loss_on=loss_on, overlong=overlong, packing=packing
    )
    total = int(rows.input_ids.shape[0])
    return rows if total <= n_rows else rows.take(even_picks(total, n_rows))
