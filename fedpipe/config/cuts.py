"""Cuts (``"2+1"``: head and tail blocks a device runs), as ``model.cuts`` and
``federated.device_cuts`` write them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fedpipe.config.checks import check, list_entries

__all__ = ["format_cut", "format_cuts", "parse_cuts"]


def _cut(item: Any, key: str) -> tuple[int, int]:
    """One cut: ``"2+1"`` (a bare ``"2"``: no tail blocks) or a (head, tail) pair."""
    pair = isinstance(item, (list, tuple)) and len(item) == 2
    if pair and all(isinstance(v, int) and not isinstance(v, bool) for v in item):
        cut, text = (item[0], item[1]), f"{item[0]}+{item[1]}"
    else:
        text = item.strip() if isinstance(item, str) else repr(item)
        head, _, tail = text.partition("+")
        try:
            cut = (int(head), int(tail or 0))
        except ValueError:
            raise ValueError(
                f"{key}: {text!r} is not a cut; write head+tail block counts such as 2+1"
            ) from None
    check(cut[0] >= 1 and cut[1] >= 0, f"{key}: cut {text!r} needs head >= 1 and tail >= 0 blocks")
    return cut


def parse_cuts(value: str | Sequence[Any], key: str) -> tuple[tuple[int, int], ...]:
    """``"1+1, 2+2"`` or ``["1+1", "2+2"]`` -> ((1, 1), (2, 2)); a bare ``"2"`` means no tail
    blocks (mode "two"); blank entries of a string are skipped."""
    if isinstance(value, str):
        return tuple(_cut(c, key) for c in value.split(",") if c.strip())
    return tuple(_cut(c, key) for c in list_entries(value, key))


def format_cut(cut: tuple[int, int]) -> str:
    """(2, 1) -> ``"2+1"``, the form ``model.cuts`` and ``federated.device_cuts`` take."""
    return f"{cut[0]}+{cut[1]}"


def format_cuts(cuts: Sequence[tuple[int, int]]) -> str:
    """((2, 1), (1, 1)) -> ``"2+1,1+1"``: a cut list as it is written (:func:`parse_cuts`)."""
    return ",".join(format_cut(c) for c in cuts)
