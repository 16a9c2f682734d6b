"""Spreading documents over simulated devices, and the held-out split shared by all of them.

Split first, then partition the training part: the evaluation set stays the same for every device
and every partitioning scheme. All functions are deterministic for a seed and keep each partition's
documents in their input order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from fedpipe.data.documents import Document

__all__ = ["Scheme", "partition", "train_eval_split", "describe"]

Scheme = Literal["iid", "by-source", "dirichlet"]
SCHEMES: tuple[str, ...] = ("iid", "by-source", "dirichlet")


def partition(
    docs: Sequence[Document],
    num_partitions: int,
    *,
    scheme: Scheme = "iid",
    alpha: float = 0.5,
    seed: int = 0,
) -> list[list[Document]]:
    """Split `docs` into `num_partitions` non-empty parts; every document lands in exactly one.

    - "iid": shuffle, then deal round-robin (sizes differ by at most one).
    - "by-source": each source goes whole to one partition, sources dealt round-robin in a seeded
      order (needs at least as many sources as partitions).
    - "dirichlet": each source's documents are divided over the partitions in proportions drawn
      from Dir(alpha); small alpha gives skewed, non-IID partitions. Empty partitions are then given
      one document each from the largest ones.
    """
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    if len(docs) < num_partitions:
        raise ValueError(
            f"{len(docs)} documents cannot fill {num_partitions} partitions; "
            "use fewer partitions or more data"
        )
    rng = np.random.default_rng(seed)
    if scheme == "iid":
        assignment = _assign_iid(len(docs), num_partitions, rng)
    elif scheme == "by-source":
        assignment = _assign_by_source(docs, num_partitions, rng)
    elif scheme == "dirichlet":
        if not alpha > 0:
            raise ValueError(f"alpha must be > 0 for the dirichlet scheme, got {alpha}")
        assignment = _assign_dirichlet(docs, num_partitions, alpha, rng)
    else:
        raise ValueError(f"unknown partition scheme {scheme!r}; choose one of {SCHEMES}")
    parts: list[list[Document]] = [[] for _ in range(num_partitions)]
    for doc, part in zip(docs, assignment, strict=True):
        parts[part].append(doc)
    return parts


def train_eval_split(
    docs: Sequence[Document], *, eval_fraction: float = 0.1, seed: int = 0
) -> tuple[list[Document], list[Document]]:
    """A seeded random held-out set of round(len * eval_fraction) documents (at least one when the
    fraction is > 0), and the rest for training; both keep the input order."""
    if not 0 <= eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    n_eval = max(1, round(len(docs) * eval_fraction)) if eval_fraction > 0 else 0
    if n_eval >= len(docs):
        raise ValueError(
            f"{len(docs)} documents are too few to hold out {n_eval} for evaluation and train on "
            "the rest; lower eval_fraction or add data"
        )
    held_out = np.zeros(len(docs), dtype=bool)
    held_out[np.random.default_rng(seed).permutation(len(docs))[:n_eval]] = True
    train = [d for d, h in zip(docs, held_out, strict=True) if not h]
    evaluation = [d for d, h in zip(docs, held_out, strict=True) if h]
    return train, evaluation


def describe(partitions: Sequence[Sequence[Document]]) -> list[dict[str, Any]]:
    """Per partition: its index, number of docs, characters, and documents per source (for logs)."""
    return [
        {
            "partition": i,
            "docs": len(part),
            "chars": sum(d.num_chars for d in part),
            "sources": dict(sorted(Counter(d.source for d in part).items())),
        }
        for i, part in enumerate(partitions)
    ]


def _assign_iid(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    assignment = np.empty(n, dtype=np.int64)
    assignment[rng.permutation(n)] = np.arange(n) % k
    return assignment


def _sources(docs: Sequence[Document]) -> dict[str, list[int]]:
    """Document indices per source, sources in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for i, doc in enumerate(docs):
        groups.setdefault(doc.source, []).append(i)
    return groups


def _assign_by_source(docs: Sequence[Document], k: int, rng: np.random.Generator) -> np.ndarray:
    groups = list(_sources(docs).values())
    if len(groups) < k:
        raise ValueError(
            f"by-source partitioning needs at least as many sources as partitions: "
            f"{len(groups)} sources for {k} partitions; use fewer partitions or the "
            "'dirichlet' or 'iid' scheme"
        )
    assignment = np.empty(len(docs), dtype=np.int64)
    for slot, g in enumerate(rng.permutation(len(groups))):
        assignment[groups[g]] = slot % k
    return assignment


def _assign_dirichlet(
    docs: Sequence[Document], k: int, alpha: float, rng: np.random.Generator
) -> np.ndarray:
    assignment = np.empty(len(docs), dtype=np.int64)
    for indices in _sources(docs).values():
        shuffled = rng.permutation(indices)
        proportions = rng.dirichlet(np.full(k, alpha))
        cuts = (np.cumsum(proportions)[:-1] * len(shuffled)).astype(np.int64)
        for part, chunk in enumerate(np.split(shuffled, cuts)):
            assignment[chunk] = part
    _fill_empty(assignment, k)
    return assignment


def _fill_empty(assignment: np.ndarray, k: int) -> None:
    """Move one document (the last) from the currently largest partition to each empty one."""
    for part in range(k):
        counts = np.bincount(assignment, minlength=k)
        if counts[part] == 0:
            donor = int(np.argmax(counts))
            assignment[np.flatnonzero(assignment == donor)[-1]] = part
