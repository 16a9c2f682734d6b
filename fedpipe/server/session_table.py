"""The sessions room: which device sessions the StageServer holds, opened, looked up and dropped.

:class:`SessionTable` owns the table of :class:`~fedpipe.server.sessions.SessionInfo` (one per
device and round, or per device and version in async rounds), the places reserved by opens in
progress, and what a session holds beside its stream (budget for its delta cache, its adapter
in the bank). Dropping a session ends its stream (the ledger), clears its queued work, gives
back what it held, tells the listeners and removes its adapter. The runtime calls it for
OpenSession / CloseSession; the commits room for the sessions of a round; the worker and the
reaper to look sessions up and drop idle ones.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable

import torch

from fedpipe.errors import StageCapacityError, UnknownSessionError
from fedpipe.lora import AdapterBank, BatchedAdapterBank
from fedpipe.lora.freezing import freeze_blocks
from fedpipe.messages import END
from fedpipe.server.budget import ByteBudget
from fedpipe.server.executor import StageExecutor
from fedpipe.server.sessions import (
    OptimizerFactory,
    RuntimeLimits,
    SessionInfo,
    check_declared,
    check_optimizer,
    short_id,
)
from fedpipe.server.streams import Inbox, StreamLedger
from fedpipe.wire.backend import SessionRequest

__all__ = ["SessionTable"]

log = logging.getLogger(__name__)


class SessionTable:
    """The open sessions, by id; shares the runtime's lock (and its bank lock, taken after)."""

    def __init__(
        self,
        bank: AdapterBank | BatchedAdapterBank,
        *,
        executor: StageExecutor,
        streams: StreamLedger,
        inbox: Inbox,
        budget: ByteBudget,
        limits: RuntimeLimits,
        max_seq_len: int,
        optimizer_factory: OptimizerFactory,
        lock: threading.RLock,
        bank_lock: threading.RLock,
    ) -> None:
        self._bank, self._executor, self._streams, self._inbox = bank, executor, streams, inbox
        self._budget, self._limits, self._max_seq_len = budget, limits, max_seq_len
        self._optimizer_factory = optimizer_factory
        self._lock, self._bank_lock = lock, bank_lock
        self._sessions: dict[str, SessionInfo] = {}
        self._opening = 0  # sessions being opened: their adapter is being added
        self._drop_listeners: list[Callable[[SessionInfo], None]] = []

    @property
    def optimizer_factory(self) -> OptimizerFactory:
        return self._optimizer_factory

    def use_optimizer(self, factory: OptimizerFactory) -> None:
        """Sessions opened from now on train with ``factory``'s optimizer."""
        self._optimizer_factory = factory

    # -- open -----------------------------------------------------------------------------------
    def open(
        self,
        request: SessionRequest,
        *,
        blocks: tuple[int, ...] | None,
        start: Callable[[int], dict[str, torch.Tensor] | None],
        per_version: Callable[[], bool],
        frozen_below: int,
    ) -> str:
        """Start a session from ``start(round)`` (None: the global adapter as it is now);
        replaces the device's sessions (all of them, or with ``per_version()`` its session of
        the same version). Refuses settings outside the limits, and a session past
        ``max_sessions``. ``frozen_below``: its adapter's blocks below this train nothing."""
        device_id, round_, frozen_head = request.device_id, request.round, request.frozen_head
        codecs = (request.downlink_codec, request.gradient_codec)
        lr = check_optimizer(self._limits, request.learning_rate, request.weight_decay)
        rows, tokens = check_declared(
            self._limits, self._max_seq_len, request.microbatch_size, request.seq_len
        )
        with self._lock:
            for old in self._replaced_by(device_id, round_, per_version()):
                self.drop(old, reason="replaced by a new session")
            init = start(round_)
            held = len(self._sessions) + self._opening
            if held >= self._limits.max_sessions:
                raise StageCapacityError(
                    f"StageServer holds {held} sessions, its limit "
                    f"(server.max_sessions = {self._limits.max_sessions}); retry later or raise it"
                )
            self._opening += 1  # a reserved place: adding the adapter may take a while
        session_id = secrets.token_urlsafe(24)  # 192 random bits
        try:
            with self._bank_lock:  # not under the lock: other sessions' streams keep flowing
                self._bank.add(session_id, init=init)
                freeze_blocks(self._bank.named_parameters(session_id), frozen_below)
                opt = self._optimizer_factory(
                    self._bank.parameters(session_id), lr, request.weight_decay
                )
        finally:
            with self._lock:
                self._opening -= 1
        info = SessionInfo(
            session_id,
            device_id,
            round_,
            opt,
            rows,
            tokens,
            codecs,
            frozen_head=frozen_head,  # frozen-device mode
            frozen_below=frozen_below,
            blocks=blocks,
        )
        with self._lock:
            for old in self._replaced_by(device_id, round_, per_version()):
                self.drop(old, reason="replaced by a newer session")  # a concurrent open
            self._sessions[session_id] = info
        log.info(
            "[%s] session %s opened for round %d (microbatch <= %d, seq_len <= %d, lr %g)",
            device_id,
            short_id(session_id),
            round_,
            rows,
            tokens,
            lr,
        )
        return session_id

    def _replaced_by(self, device_id: str, round_: int, per_version: bool) -> list[SessionInfo]:
        """The sessions a new one of ``device_id`` for ``round_`` replaces: all the device's
        (synchronous rounds), or its session of the same version (async rounds, where a
        device's update of an older version may still wait in the ServerApp's buffer)."""
        return [
            s
            for s in self._sessions.values()
            if s.device_id == device_id and (not per_version or s.round == round_)
        ]

    # -- look-ups -------------------------------------------------------------------------------
    def session(self, session_id: str) -> SessionInfo:
        """The session, or ``UnknownSessionError``."""
        with self._lock:
            try:
                return self._sessions[session_id]
            except KeyError:
                raise UnknownSessionError(
                    f"unknown session {short_id(session_id)}: it was never opened, was closed, "
                    "expired "
                    "or was discarded when its round was committed; open a new session"
                ) from None

    def get(self, session_id: str) -> SessionInfo | None:
        with self._lock:
            return self._sessions.get(session_id)

    def all(self) -> list[SessionInfo]:
        with self._lock:
            return list(self._sessions.values())

    def mid_step(self) -> set[str]:
        """Sessions whose next message is on its way (gradients, steps): a forward cached and
        a live stream."""
        with self._lock:
            return {s.session_id for s in self._sessions.values() if s.cache and s.stream}

    # -- close and drop --------------------------------------------------------------------------
    def close(self, session_id: str) -> int:
        """End a session; a trained adapter is kept until its round is committed. One that
        completed no step has nothing to merge and is dropped at once. Its steps done."""
        with self._lock:
            info = self.session(session_id)
            info.closed = True
            self._streams.end_stream(info, END)
            if info.steps_done == 0:
                self.drop(info, reason="closed without a completed step")
            return info.steps_done

    def discard(self, session_id: str, *, reason: str) -> None:
        """Forget a session now (an admission that failed after it was opened)."""
        with self._lock:
            info = self._sessions.get(session_id)
            if info is not None:
                self.drop(info, reason=reason)

    def hold(self, session_id: str, nbytes: int, what: str) -> None:
        """Draw ``nbytes`` from the budget for the session itself (given back when it goes)."""
        with self._lock:
            info = self.session(session_id)
            self._budget.take(nbytes, what)
            info.held_bytes += nbytes

    def on_drop(self, listener: Callable[[SessionInfo], None]) -> None:
        """Call ``listener(info)`` (under the runtime's lock) when a session is forgotten."""
        self._drop_listeners.append(listener)

    def drop(self, info: SessionInfo, *, reason: str) -> None:
        """Forget a session; its stream, if any, ends NOT_FOUND, its adapter goes."""
        with self._lock:
            self._sessions.pop(info.session_id, None)
            info.dropped = True
            self._inbox.clear(info.session_id)
            error = UnknownSessionError(f"session {info.short} was dropped: {reason}")
            self._streams.end_stream(info, error, reset=False)
            self._budget.give(info.held_bytes)
            info.held_bytes = 0
            for listener in self._drop_listeners:
                listener(info)
            with self._bank_lock:
                self._executor.forget(info)
                if info.session_id in self._bank.names():
                    self._bank.remove(info.session_id)
        log.info("[%s] session %s dropped: %s", info.device_id, info.short, reason)

    def merged(self, session_id: str) -> SessionInfo:
        """A session whose adapter the bank has merged (and removed): forgotten, nothing more
        to give back (lock held)."""
        info = self._sessions.pop(session_id)
        info.dropped = True
        return info
