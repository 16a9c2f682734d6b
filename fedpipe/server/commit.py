"""Round commit on the StageServer: which sessions' adapters are merged into the global one.

At the end of a round the ServerApp names the devices whose Flower reply arrived, each with
its aggregation weight. Their sessions of that round that completed a step are merged (by the
bank's aggregation rule, ``federated.aggregation``); an adapter holding NaN or Inf never is,
and its device is reported with the reason. Every other session of the round is discarded.

A replica (one of several StageServers serving a run) does not merge: it hands the same
adapters over (CollectRound, :func:`finished_adapters`) and the ServerApp merges every replica's.

:class:`Commits` is the room that does it: it owns the global adapter's changes (commits,
collects, async rounds' versions and their updates, LoadAdapter, the aggregation rule, the
frozen blocks) and the answers kept for retries; it reads and drops sessions through the
sessions room.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from fedpipe.errors import InvalidRequestError
from fedpipe.lora import AdapterBank, BatchedAdapterBank
from fedpipe.lora.aggregation import held_blocks, split_deltas
from fedpipe.lora.robust import AggregationRule
from fedpipe.server.session_table import SessionTable
from fedpipe.server.sessions import SessionInfo
from fedpipe.wire.backend import CollectedRound

__all__ = [
    "KEEP_COLLECTS",
    "KEEP_COMMITS",
    "CommitResult",
    "Commits",
    "check_weights",
    "choose_merge",
    "finished_adapters",
    "non_finite",
]

log = logging.getLogger(__name__)

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


class Commits:
    """The commits room: what changes the global adapter, and the answers kept for retries.

    Synchronous rounds: :meth:`commit_round` merges a round's finished sessions into the
    global adapter, :meth:`collect_round` hands them over instead (a replica). Async rounds:
    :meth:`begin_version` keeps each admitted version's global adapter, and
    :meth:`commit_updates` merges sessions as updates against their own version's. Shares the
    runtime's lock and takes the bank lock inside it.
    """

    def __init__(
        self,
        bank: AdapterBank | BatchedAdapterBank,
        sessions: SessionTable,
        *,
        lock: threading.RLock,
        bank_lock: threading.RLock,
    ) -> None:
        self._bank, self._sessions = bank, sessions
        self._lock, self._bank_lock = lock, bank_lock
        self._commits: dict[int, CommitResult] = {}
        self._collected: dict[int, CollectedRound] = {}  # the last collected rounds (retries)
        # Async rounds (BeginRound's window > 0): the global adapter of each version whose
        # sessions are still admitted (a session starts from its version's, and its update is
        # merged against it); empty in synchronous rounds.
        self._versions: dict[int, dict[str, torch.Tensor]] = {}
        self._window = 0
        self._updates: dict[int, CommitResult] = {}  # versions merged (a retry's answer)
        # pipeline.freeze (BeginRound): sessions opened from now on train no adapter of a
        # block below this, and their commit leaves those blocks' global values as they are.
        self._frozen_below = 0

    # -- what a session opens from ----------------------------------------------------------------
    @property
    def frozen_below(self) -> int:
        return self._frozen_below

    def freeze_below(self, block: int) -> None:
        """pipeline.freeze: sessions opened from now on train no block below ``block``."""
        self._frozen_below = block

    def asynchronous(self) -> bool:
        """Whether rounds are async (a device's sessions of other versions stay)."""
        return self._window > 0

    def start_of(self, round_: int) -> dict[str, torch.Tensor] | None:
        """What a session of ``round_`` starts from: its version's global (async rounds), or
        None, the global adapter as it is now."""
        with self._lock:
            return self._versions.get(round_) if self._window else None

    @property
    def block_indices(self) -> tuple[int, ...]:
        """The global indices of the stage's blocks."""
        return tuple(getattr(self._bank.stage, "block_indices", ()))

    # -- synchronous rounds ------------------------------------------------------------------------
    def commit_round(self, round_: int, finished: dict[str, float]) -> CommitResult:
        """Average the finished devices' adapters of ``round_`` into the global one; drop the rest.

        ``finished`` maps device id to its aggregation weight (e.g. num-examples). An adapter
        holding NaN or Inf is never merged: its device is in ``dropped`` with the reason. A
        retried commit of a committed round returns the first result and changes nothing.
        """
        check_weights(finished)
        with self._lock:
            if round_ in self._commits:
                log.info("round %d was committed already; the retry gets its result", round_)
                return self._commits[round_]
            with self._bank_lock:
                result = self._commit(round_, finished)
            self._commits[round_] = result
            while len(self._commits) > KEEP_COMMITS:
                del self._commits[min(self._commits)]
            return result

    def _commit(self, round_: int, finished: dict[str, float]) -> CommitResult:
        merge, dropped = choose_merge(self._sessions.all(), round_, finished, self._bank.state_dict)
        for device_id, reason in dropped.items():
            log.warning("[%s] round %d: adapter not merged: %s", device_id, round_, reason)
        if merge:
            self._bank.merge(merge, blocks={s: self._trained_blocks(s) for s in merge})
            for session_id in merge:
                self._sessions.merged(session_id)
        stale = [s for s in self._sessions.all() if s.round <= round_]
        for info in stale:
            self._sessions.drop(
                info, reason=dropped.get(info.device_id, f"round {round_} committed")
            )
        return CommitResult(len(merge), len(stale), dropped)

    def _trained_blocks(self, session_id: str) -> tuple[int, ...] | None:
        """The blocks a session's adapter trained (None: all the stage's): its cut's, less the
        frozen ones, which its commit must leave as they are."""
        info = self._sessions.session(session_id)
        if not info.frozen_below:
            return info.blocks
        held = info.blocks if info.blocks is not None else self.block_indices
        return tuple(b for b in held if b >= info.frozen_below)

    def collect_round(self, round_: int, finished: dict[str, float]) -> CollectedRound:
        """Hand over the finished devices' adapters of ``round_`` and drop every session of it.

        What :meth:`commit_round` would merge, left to a merge across replicas: each finished
        device's adapter (the blocks its cut ran) and weight; NaN or Inf adapters are left out
        with the reason. The global adapter does not change here. A retried collect of the
        last rounds gets the first answer.
        """
        check_weights(finished)
        with self._lock:
            if round_ in self._collected:
                log.info("round %d was collected already; the retry gets its answer", round_)
                return self._collected[round_]
            with self._bank_lock:
                result = self._collect(round_, finished)
            self._collected[round_] = result
            while len(self._collected) > KEEP_COLLECTS:
                del self._collected[min(self._collected)]
            return result

    def _collect(self, round_: int, finished: dict[str, float]) -> CollectedRound:
        sessions = self._sessions.all()
        chosen, dropped = finished_adapters(sessions, round_, finished, self._bank.state_dict)
        for device_id, reason in dropped.items():
            log.warning("[%s] round %d: adapter not collected: %s", device_id, round_, reason)
        infos = [self._sessions.session(s) for s in chosen]
        states = [
            _held_copy(self._bank.state_dict(i.session_id), self._trained_blocks(i.session_id))
            for i in infos
        ]
        round_sessions = [s for s in sessions if s.round <= round_]
        microbatches = sum(s.microbatches for s in round_sessions if s.round == round_)
        for info in round_sessions:
            reason = "collected" if info.session_id in chosen else f"round {round_} committed"
            self._sessions.drop(info, reason=dropped.get(info.device_id, reason))
        return CollectedRound(
            devices=[i.device_id for i in infos],
            weights=[chosen[i.session_id] for i in infos],
            states=states,
            discarded=len(round_sessions) - len(infos),
            dropped=dropped,
            microbatches=microbatches,
        )

    # -- async rounds ------------------------------------------------------------------------------
    def begin_version(self, round_: int, window: int) -> None:
        """BeginRound: with ``window`` > 0 (async rounds), keep the global adapter as
        ``round_``'s beside those of the versions before it, ``window`` in all (a session of
        an older version trains on; the ServerApp refuses its update as stale and discards
        it). 0: synchronous rounds, none kept."""
        with self._lock, self._bank_lock:
            self._window = window
            if not window:
                self._versions.clear()
                return
            self._versions[round_] = {
                k: v.detach().clone() for k, v in split_deltas(self._bank.global_state())[0].items()
            }
            for old in [v for v in self._versions if not round_ - window < v <= round_]:
                del self._versions[old]

    def commit_updates(
        self,
        round_: int,
        merge: list[tuple[str, int, float]],
        discard: list[tuple[str, int]],
        *,
        server_lr: float = 1.0,
    ) -> CommitResult:
        """Async rounds: merge each (device, version) session of ``merge`` as its update
        against its version's global, ``global += server_lr x`` their weighted mean
        (:meth:`~fedpipe.lora.peft_bank.SharedAggregation.apply_updates`); drop the sessions
        of ``discard``. Every other session stays. An adapter holding NaN or Inf is never
        merged (``dropped``); a session that is gone (reaped, replaced) is ``dropped`` too.
        A retried commit of a merged version gets its first answer.
        """
        check_weights({f"{d}@{v}": w for d, v, w in merge})
        with self._lock:
            if merge and round_ in self._updates:
                log.info("version %d was merged already; the retry gets its result", round_)
                return self._updates[round_]
            with self._bank_lock:
                result = self._merge_updates(round_, merge, discard, server_lr)
            if merge:
                self._updates[round_] = result
                while len(self._updates) > KEEP_COMMITS:
                    del self._updates[min(self._updates)]
            return result

    def _merge_updates(
        self,
        round_: int,
        merge: list[tuple[str, int, float]],
        discard: list[tuple[str, int]],
        server_lr: float,
    ) -> CommitResult:
        by_key = {(s.device_id, s.round): s for s in self._sessions.all()}
        weights: dict[str, float] = {}
        starts: dict[str, dict[str, torch.Tensor]] = {}
        dropped: dict[str, str] = {}
        for device_id, version, weight in merge:
            info = by_key.get((device_id, version))
            start = self._versions.get(version)
            reason = (
                f"its session of version {version} is gone (reaped or replaced)"
                if info is None or info.steps_done == 0
                else f"version {version} is outside the versions this server keeps"
                if start is None
                else non_finite(self._bank.state_dict(info.session_id))
            )
            if reason or info is None or start is None:
                dropped[device_id] = reason
                log.warning("[%s] version %d: adapter not merged: %s", device_id, round_, reason)
                continue
            weights[info.session_id] = weight
            starts[info.session_id] = held_blocks(start, info.blocks)
        if weights and sum(weights.values()) > 0:
            self._bank.apply_updates(
                starts,
                weights,
                server_lr=server_lr,
                blocks={s: self._trained_blocks(s) for s in weights},
            )
            for session_id in weights:
                self._sessions.merged(session_id)
        else:
            weights = {}
        gone = [by_key[k] for k in discard if k in by_key and not by_key[k].dropped]
        for info in gone:
            self._sessions.drop(info, reason=f"version {info.round}: not aggregated")
        return CommitResult(len(weights), len(gone), dropped)

    # -- the global adapter ------------------------------------------------------------------------
    def set_aggregation(self, mode: str, rule: AggregationRule | None = None) -> None:
        """How commits aggregate from now on (federated.aggregation), by which rule."""
        with self._bank_lock:
            self._bank.set_aggregation(mode, rule)

    def global_state(self) -> dict[str, torch.Tensor]:
        """A copy of the global adapter (and folded base deltas), never half-way through a merge."""
        with self._bank_lock:
            return {k: v.detach().clone() for k, v in self._bank.global_state().items()}

    def load_global_state(self, state: dict[str, torch.Tensor] | None) -> None:
        """Replace the global adapter (None: the initial one); a new run forgets past commits."""
        if state is not None and (reason := non_finite(state)):
            raise InvalidRequestError(f"adapter refused: {reason}")
        with self._lock, self._bank_lock:
            if state is None:
                self._bank.reset_global_state()
            else:
                self._bank.set_global_state(state)
            self._commits.clear()
            self._collected.clear()
            self._versions.clear()  # BeginRound keeps the new run's from here on
            self._updates.clear()


def _held_copy(
    state: dict[str, torch.Tensor], blocks: tuple[int, ...] | None
) -> dict[str, torch.Tensor]:
    """A copy of the part of a session's adapter in ``blocks`` (what its cut trained)."""
    return {k: v.detach().clone() for k, v in held_blocks(state, blocks).items()}
