"""Round commit on the StageServer: which sessions' adapters are merged into the global one.

At the end of a round the ServerApp names the devices whose Flower reply arrived, each with
its aggregation weight. Their sessions of that round that completed a step are merged (by the
bank's aggregation rule, ``federated.aggregation``); an adapter holding NaN or Inf never is,
and its device is reported with the reason. Every other session of the round is discarded.

A replica (one of several StageServers serving a run) does not merge: it hands the same
adapters over (CollectRound, :func:`finished_adapters`) and the ServerApp merges every replica's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from fedpipe.errors import InvalidRequestError
from fedpipe.server.sessions import SessionInfo

__all__ = [
    "KEEP_COLLECTS",
    "KEEP_COMMITS",
    "CommitResult",
    "check_weights",
    "choose_merge",
    "finished_adapters",
    "non_finite",
]

KEEP_COMMITS = 64  # committed rounds remembered so that a retried commit is answered the same
# Collected rounds remembered for a retried collect: few, as each holds every session's adapters
# (a commit's answer is a few numbers); the ServerApp retries only the round it is in.
KEEP_COLLECTS = 2


@dataclass(frozen=True)
class CommitResult:
    """What a CommitRound did; a retried commit of the same round gets the same result."""

    merged: int
    discarded: int
    dropped: dict[str, str] = field(default_factory=dict)  # device id -> why it was not merged


def check_weights(finished: dict[str, float]) -> None:
    """Aggregation weights must be finite and >= 0 (raises naming the bad ones)."""
    bad = {d: w for d, w in finished.items() if not (math.isfinite(w) and w >= 0)}
    if bad:
        raise InvalidRequestError(f"aggregation weights must be finite and >= 0, got {bad}")


def choose_merge(
    sessions: Iterable[SessionInfo],
    round_: int,
    finished: dict[str, float],
    state_of: Callable[[str], dict[str, torch.Tensor]],
) -> tuple[dict[str, float], dict[str, str]]:
    """(session id -> weight, for the adapters to merge; device id -> why it is not merged).

    Candidates are the sessions of ``round_`` of finished devices that completed a step;
    ``state_of(session_id)`` reads a session's adapter to check it is finite. Nothing is
    merged when their weights sum to 0.
    """
    merge, dropped = finished_adapters(sessions, round_, finished, state_of)
    if not merge or sum(merge.values()) <= 0:
        merge = {}
    return merge, dropped


def finished_adapters(
    sessions: Iterable[SessionInfo],
    round_: int,
    finished: dict[str, float],
    state_of: Callable[[str], dict[str, torch.Tensor]],
) -> tuple[dict[str, float], dict[str, str]]:
    """:func:`choose_merge`'s candidates, whatever their weights sum to (a replica's part:
    the sum that counts is over every replica's)."""
    merge: dict[str, float] = {}
    dropped: dict[str, str] = {}
    for info in sessions:
        if info.round != round_ or info.device_id not in finished or info.steps_done == 0:
            continue
        reason = non_finite(state_of(info.session_id))
        if reason:
            dropped[info.device_id] = reason
        else:
            merge[info.session_id] = finished[info.device_id]
    return merge, dropped


def non_finite(state: dict[str, torch.Tensor]) -> str:
    """Why an adapter must not be merged ("" when every value is finite)."""
    for name, value in state.items():
        bad = int((~torch.isfinite(value)).sum())
        if bad:
            return f"{bad} of {value.numel()} values of {name} are NaN or Inf"
    return ""
