"""The server side of the pipeline: one middle stage shared by many device sessions.

Each session (one device, one round) trains its own LoRA adapter on the shared, frozen middle
blocks. One compute worker runs every session's work; the transport's threads decode and
encode around it so that I/O keeps flowing while the worker computes. The worker walks the
server's half of the schedule implicitly: it answers ``ACTIVATION`` with a forward and
``OUTPUT_GRAD`` with a backward, in the order the device's schedule sent them, and applies the
session's optimizer on ``STEP_END``.

With batching on (the default, :class:`~fedpipe.server.batch_policy.BatchPolicy`), the
worker asks the policy which ready messages of which sessions to compute together, and the
executor runs them in one call of the frozen stage (one matmul over every session's tokens, each
session's adapter on its own rows); each reply goes to its own stream. With it off, the worker
computes one message at a time.

No device can poison, crash or starve the others: settings a device asks for are checked
against :class:`RuntimeLimits` at open, each session's queued work is bounded, the worker serves
sessions round-robin, at most two queued messages per session per turn or call
(:class:`~fedpipe.server.fair_queue.FairQueue`), a failed step leaves
no graph or gradient behind, one stream per session is live (a newer one replaces it), idle
streams and sessions expire, and no adapter holding NaN or Inf is ever merged.

At the end of a round the ServerApp commits it: the adapters of devices whose Flower reply
arrived are averaged into the global server adapter (with the strategy's weights) and every
other session of the round is discarded, so a device that vanished leaves no trace.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from collections.abc import Callable

import torch

from fedpipe.errors import (
    AuthError,
    IdleTimeoutError,
    InvalidRequestError,
    SessionStateError,
    StageCapacityError,
    StreamReplacedError,
    UnknownSessionError,
)
from fedpipe.lora import AdapterBank, BatchedAdapterBank
from fedpipe.lora.aggregation import held_blocks, split_deltas
from fedpipe.lora.freezing import freeze_blocks
from fedpipe.lora.robust import AggregationRule
from fedpipe.messages import END, Kind, StageMsg
from fedpipe.server.batch_policy import BatchChoice, BatchPolicy, Lane, choose_batch
from fedpipe.server.budget import ByteBudget
from fedpipe.server.commit import (
    KEEP_COLLECTS,
    KEEP_COMMITS,
    CommitResult,
    check_weights,
    choose_merge,
    finished_adapters,
    non_finite,
)
from fedpipe.server.device_copies import DeviceCopies
from fedpipe.server.executor import StageExecutor
from fedpipe.server.fair_queue import FairQueue, Snapshot
from fedpipe.server.scheduler import RESET, TRACE_NAMES, QueueItem, queue_view, trace_args
from fedpipe.server.sessions import (
    OptimizerFactory,
    RuntimeLimits,
    SessionInfo,
    adamw,
    check_declared,
    check_optimizer,
    seq_bound,
    short_id,
)
from fedpipe.server.streams import Reply, StreamHandle, StreamLedger, message_bytes
from fedpipe.trace import Tracer
from fedpipe.wire.backend import CollectedRound, SessionRequest

__all__ = ["StageRuntime"]

log = logging.getLogger(__name__)

# A stream the server ended (replaced, idle, dropped) has this long to finish on its own before
# its RPC is cancelled: a device that reads gets the error; one that reads nothing is cut off.
_CANCEL_GRACE_S = 2.0


class StageRuntime:
    """Serves the middle stage (U-shaped split) or the server's loss stage (two-part split)."""

    def __init__(
        self,
        bank: AdapterBank | BatchedAdapterBank,
        *,
        mode: str,
        hidden_size: int,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        limits: RuntimeLimits | None = None,
        max_positions: int = 0,
        optimizer_factory: OptimizerFactory | None = None,
        policy: BatchPolicy | None = None,
        tracer: Tracer | None = None,
        copies: DeviceCopies | None = None,
        offload: bool = False,
        input_grad_first: bool = False,
    ) -> None:
        self.bank = bank
        # Uploads of decoded messages (started by the reader threads, so the next call's inputs
        # cross while this one computes) and the replies' copies back; CPU: a pass-through.
        self.copies = copies or DeviceCopies(device)
        # Which ready work runs together. A bank that cannot batch (GPT-2) still takes batches:
        # it computes their groups one after another, and the policy keeps the fairness.
        self.policy = policy or BatchPolicy()
        self.tracer = tracer  # one "server" event per call, with the sessions in it
        self.calls = 0  # compute calls made, and the messages they computed (mean batch)
        self.messages = 0
        self._call_s = 0.0  # moving average of a compute call's seconds (the policy's wait)
        self.optimizer_factory = optimizer_factory or adamw
        self.mode = mode
        self.hidden_size = hidden_size
        self.device = device
        self.dtype = dtype
        self.limits = limits or RuntimeLimits()
        self.executor = StageExecutor(
            bank,
            mode=mode,
            hidden_size=hidden_size,
            device=device,
            dtype=dtype,
            max_in_flight=self.limits.max_in_flight,
            copies=self.copies,
            offload=offload,
            input_grad_first=input_grad_first,
        )
        self.max_seq_len = seq_bound(max_positions, self.limits.max_seq_len)
        # What devices make the server hold, all together (fedpipe.server.budget).
        self.budget = ByteBudget(self.limits.memory_budget_bytes)
        self._sessions: dict[str, SessionInfo] = {}
        self._drop_listeners: list[Callable[[SessionInfo], None]] = []
        self._commits: dict[int, CommitResult] = {}
        # pipeline.freeze (BeginRound): sessions opened from now on train no adapter of a
        # block below this, and their commit leaves those blocks' global values as they are.
        self.frozen_below = 0
        self._collected: dict[int, CollectedRound] = {}  # the last collected rounds (retries)
        # Async rounds (BeginRound's window > 0): the global adapter of each version whose
        # sessions are still admitted (a session starts from its version's, and its update is
        # merged against it); empty in synchronous rounds.
        self._versions: dict[int, dict[str, torch.Tensor]] = {}
        self._window = 0
        self._updates: dict[int, CommitResult] = {}  # versions merged (a retry's answer)
        self._opening = 0  # sessions being opened: their adapter is being added
        self._lock = threading.RLock()  # sessions, streams, counters; never held by compute
        self._bank_lock = threading.RLock()  # the bank; taken after _lock, never before
        # What every stream holds and how many each device has open (fedpipe.server.streams).
        self.streams = StreamLedger(self._lock, self.budget, self.limits, grace_s=_CANCEL_GRACE_S)
        self._queue: FairQueue[str, QueueItem] = FairQueue(quantum=self.policy.quantum)
        self._stopped = threading.Event()
        self._worker = threading.Thread(target=self._run, name="stage-compute", daemon=True)
        self._reaper = threading.Thread(target=self._reap, name="stage-reaper", daemon=True)
        self._worker.start()
        self._reaper.start()

    # -- sessions ---------------------------------------------------------------------------
    def open(self, request: SessionRequest, *, blocks: tuple[int, ...] | None = None) -> str:
        """Start a session on a fresh copy of the global adapter; replaces the device's old one.

        ``learning_rate`` 0 takes the server's default; ``microbatch_size`` and ``seq_len`` 0
        take the server's bounds. Anything outside the server's limits raises
        ``InvalidRequestError``. ``blocks``: the stage's blocks the device's cut leaves to the
        server (None: all). The StageServer has checked the rest (token, split, delta cache).
        """
        device_id, round_, frozen_head = request.device_id, request.round, request.frozen_head
        codecs = (request.downlink_codec, request.gradient_codec)
        lr = check_optimizer(self.limits, request.learning_rate, request.weight_decay)
        rows, tokens = check_declared(
            self.limits, self.max_seq_len, request.microbatch_size, request.seq_len
        )
        with self._lock:
            for old in self._replaced_by(device_id, round_):
                self._drop(old, reason="replaced by a new session")
            start = self._start_of(round_)
            held = len(self._sessions) + self._opening
            if held >= self.limits.max_sessions:
                raise StageCapacityError(
                    f"StageServer holds {held} sessions, its limit "
                    f"(server.max_sessions = {self.limits.max_sessions}); retry later or raise it"
                )
            self._opening += 1  # a reserved place: adding the adapter may take a while
        session_id = secrets.token_urlsafe(24)  # 192 random bits
        try:
            frozen_below = self.frozen_below
            with self._bank_lock:  # not under _lock: other sessions' streams keep flowing
                self.bank.add(session_id, init=start)
                freeze_blocks(self.bank.named_parameters(session_id), frozen_below)
                opt = self.optimizer_factory(
                    self.bank.parameters(session_id), lr, request.weight_decay
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
            for old in self._replaced_by(device_id, round_):
                self._drop(old, reason="replaced by a newer session")  # a concurrent open
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

    def _replaced_by(self, device_id: str, round_: int) -> list[SessionInfo]:
        """The sessions a new one of ``device_id`` for ``round_`` replaces: all the device's
        (synchronous rounds), or its session of the same version (async rounds, where a
        device's update of an older version may still wait in the ServerApp's buffer)."""
        return [
            s
            for s in self._sessions.values()
            if s.device_id == device_id and (not self._window or s.round == round_)
        ]

    def _start_of(self, round_: int) -> dict[str, torch.Tensor] | None:
        """What a session of ``round_`` starts from: its version's global (async rounds), or
        None, the global adapter as it is now."""
        return self._versions.get(round_) if self._window else None

    def session(self, session_id: str) -> SessionInfo:
        with self._lock:
            try:
                return self._sessions[session_id]
            except KeyError:
                raise UnknownSessionError(
                    f"unknown session {short_id(session_id)}: it was never opened, was closed, "
                    "expired "
                    "or was discarded when its round was committed; open a new session"
                ) from None

    def sessions(self) -> list[SessionInfo]:
        with self._lock:
            return list(self._sessions.values())

    def pending(self, session_id: str) -> int:
        """Messages of the session waiting for the worker."""
        return self._queue.pending(session_id)

    def close_session(self, session_id: str) -> int:
        """End a session; a trained adapter is kept until its round is committed.

        A session that completed no step (an evaluation, or a device that gave up) has nothing
        to merge and is dropped at once.
        """
        with self._lock:
            info = self.session(session_id)
            info.closed = True
            if info.stream is not None:
                self._unlink(info, info.stream, END)
            if info.steps_done == 0:
                self._drop(info, reason="closed without a completed step")
            return info.steps_done

    def discard(self, session_id: str, *, reason: str) -> None:
        """Forget a session now (an admission that failed after it was opened)."""
        with self._lock:
            info = self._sessions.get(session_id)
            if info is not None:
                self._drop(info, reason=reason)

    def hold(self, session_id: str, nbytes: int, what: str) -> None:
        """Draw ``nbytes`` from the budget for the session itself (given back when it goes)."""
        with self._lock:
            info = self.session(session_id)
            self.budget.take(nbytes, what)
            info.held_bytes += nbytes

    def on_drop(self, listener: Callable[[SessionInfo], None]) -> None:
        """Call ``listener(info)`` (under the runtime's lock) when a session is forgotten."""
        self._drop_listeners.append(listener)

    def _drop(self, info: SessionInfo, *, reason: str) -> None:
        """Forget a session (caller holds ``_lock``); its stream, if any, ends NOT_FOUND."""
        self._sessions.pop(info.session_id, None)
        info.dropped = True
        self._queue.clear(info.session_id)
        if info.stream is not None:
            error = UnknownSessionError(f"session {info.short} was dropped: {reason}")
            self._unlink(info, info.stream, error, reset=False)
        self.budget.give(info.held_bytes)
        info.held_bytes = 0
        for listener in self._drop_listeners:
            listener(info)
        with self._bank_lock:
            self.executor.forget(info)
            if info.session_id in self.bank.names():
                self.bank.remove(info.session_id)
        log.info("[%s] session %s dropped: %s", info.device_id, info.short, reason)

    # -- streams ----------------------------------------------------------------------------
    def attach(self, session_id: str, stream_key: str | None = None) -> StreamHandle:
        """Start the session's stream; a live older stream ends ABORTED and its step is undone.

        ``stream_key``: what the stream presented (the transport always passes it; only
        in-process callers, which hold the runtime itself, pass None). A key other than the
        session's is refused before anything of the session changes, so a client that learnt
        only the session id cannot end the device's stream.

        A device holds at most ``max_device_streams`` streams not yet closed, live or ending
        (a stream the server ended is cancelled if it has not gone within a grace).
        """
        with self._lock:
            info = self.session(session_id)
            if stream_key is not None and not hmac.compare_digest(
                stream_key.encode(), info.stream_key.encode()
            ):
                raise AuthError(
                    f"stream for session {info.short} refused: its stream key does not match "
                    "the one OpenSession gave (send the fedpipe-stream-key it answered)"
                )
            if info.closed:
                raise SessionStateError(f"session {info.short} is closed; open a new session")
            self.streams.opening(info)
            old = info.stream
            info.streams_opened += 1
            handle = StreamHandle(self, info, info.streams_opened)
            if old is not None:
                replaced = StreamReplacedError(
                    f"stream {old.epoch} of session {info.short} was replaced by stream "
                    f"{handle.epoch}; use one stream per session"
                )
                self._unlink(info, old, replaced)  # queues the reset of its unfinished step
                log.info("[%s] stream %d replaces %d", info.device_id, handle.epoch, old.epoch)
            info.stream = handle
            info.last_seen = time.monotonic()
            return handle

    def _unlink(
        self, info: SessionInfo, handle: StreamHandle, end: object, *, reset: bool = True
    ) -> None:
        """Detach ``handle`` from ``info`` and end it (caller holds ``_lock``).

        What it holds goes back to the budget at once. Ended with an error, a stream whose
        transport does not finish it within the grace (its device reads nothing, so the
        transport is stuck sending) is cancelled by the reaper.
        """
        handle.broken = True
        if info.stream is handle:
            info.stream = None
            info.last_seen = time.monotonic()
            self._queue.clear(info.session_id)
            if reset:
                self._queue.put(info.session_id, (None, RESET))
        self.streams.release(handle)
        if end is not END:
            self.streams.ending(handle, restart=True)
        handle.end(end)

    # -- what a stream asks of its runtime (fedpipe.server.streams.StreamOwner) ----------------
    def stream_close(self, handle: StreamHandle) -> None:
        """The transport is done with ``handle`` (its RPC ended): it holds nothing any more."""
        with self._lock:
            if handle.info.stream is handle:  # a stream that was replaced touches nothing
                self._unlink(handle.info, handle, END)
            self.streams.closed(handle)

    def stream_break(self, handle: StreamHandle) -> None:
        """The stream ends with an error (its own or its RPC's end); cancelled if it lingers."""
        with self._lock:
            handle.broken = True
            self.streams.ending(handle)

    def stream_submit(self, handle: StreamHandle, msg: StageMsg) -> None:
        """Queue one device message for the worker; raises past the session's bounds."""
        info = handle.info
        nbytes = message_bytes(msg)
        if not info.dropped and not handle.broken:  # before the worker can take it
            self.copies.prefetch(msg.tensor)  # a refused message frees its copy as it goes
            self.copies.prefetch(msg.labels)
        with self._lock:
            if info.dropped:
                raise UnknownSessionError(f"session {info.short} was dropped")
            if info.stream is not handle:
                raise StreamReplacedError(f"stream {handle.epoch} is no longer the session's")
            if handle.broken:
                return  # the stream is ending with an error already
            self.streams.admit(handle, nbytes, "a message")
            self._queue.put(info.session_id, (handle, msg))

    def stream_echo(self, handle: StreamHandle, msg: StageMsg) -> None:
        """Answer a link probe at once, beside the worker's replies (stage.proto: ECHO).

        The reply skips the compute queue, so a probe times the link, not the server's backlog.
        It is counted like any reply (pending slots, bytes, the budget); one probe per stream is
        outstanding at a time, and a session probes at most ``max_echoes`` times.
        """
        info = handle.info
        if not 0 <= msg.tokens <= info.microbatch_size:
            raise InvalidRequestError(
                f"ECHO of {msg.tokens} rows; the session declared microbatches of at most "
                f"{info.microbatch_size}"
            )
        nbytes = msg.tokens * info.seq_len * self.hidden_size * 4
        with self._lock:
            if info.dropped or info.stream is not handle or handle.broken:
                return
            if handle.echo_out:
                raise InvalidRequestError(
                    "ECHO before the reply to the last one was read; a stream probes the link "
                    "one message at a time"
                )
            if info.echoes >= self.limits.max_echoes:
                raise InvalidRequestError(
                    f"ECHO number {info.echoes + 1} of session {info.short}; a session may probe "
                    f"the link {self.limits.max_echoes} times (a planner needs about 10)"
                )
            self.streams.admit(handle, nbytes, "a link probe's reply")
            info.echoes += 1
            handle.echo_out = True
            if handle.unread_since is None:
                handle.unread_since = time.monotonic()
        reply = StageMsg(Kind.ECHO, msg.step, msg.microbatch)
        if msg.tokens > 0:
            reply.tensor = torch.zeros(msg.tokens, info.seq_len, self.hidden_size)
        handle.reply(reply, nbytes)

    def stream_decoding(self, handle: StreamHandle, nbytes: int) -> int:
        """Draw what decoding one frame may allocate (the session's largest tensors at most)."""
        info = handle.info
        bound = info.microbatch_size * info.seq_len * (self.hidden_size * 4 + 8)
        nbytes = min(nbytes, bound)
        self.budget.take(nbytes, f"decoding a message of session {info.short}")
        return nbytes

    def stream_finish(self, handle: StreamHandle) -> None:
        """The device half-closed: end the replies after those to everything it sent."""
        with self._lock:
            if handle.info.stream is handle:
                self._queue.put(handle.info.session_id, (handle, END))

    def stream_give(self, nbytes: int) -> None:
        """Budget drawn by :meth:`stream_decoding`, given back."""
        self.budget.give(nbytes)

    def stream_taken(self, handle: StreamHandle, nbytes: int, item: object) -> None:
        """The transport took a reply off ``handle`` (the ledger frees its slot)."""
        self.streams.taken(handle, nbytes, item)

    # -- rounds and the global adapter -----------------------------------------------------
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
        merge, dropped = choose_merge(
            self._sessions.values(), round_, finished, self.bank.state_dict
        )
        for device_id, reason in dropped.items():
            log.warning("[%s] round %d: adapter not merged: %s", device_id, round_, reason)
        if merge:
            self.bank.merge(merge, blocks={s: self._trained_blocks(s) for s in merge})
            for session_id in merge:
                info = self._sessions.pop(session_id)
                info.dropped = True
        stale = [s for s in self._sessions.values() if s.round <= round_]
        for info in stale:
            self._drop(info, reason=dropped.get(info.device_id, f"round {round_} committed"))
        return CommitResult(len(merge), len(stale), dropped)

    def _trained_blocks(self, session_id: str) -> tuple[int, ...] | None:
        """The blocks a session's adapter trained (None: all the stage's): its cut's, less the
        frozen ones, which its commit must leave as they are."""
        info = self._sessions[session_id]
        if not info.frozen_below:
            return info.blocks
        held = info.blocks if info.blocks is not None else self.block_indices
        return tuple(b for b in held if b >= info.frozen_below)

    @property
    def block_indices(self) -> tuple[int, ...]:
        """The global indices of the stage's blocks."""
        return tuple(getattr(self.bank.stage, "block_indices", ()))

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
        chosen, dropped = finished_adapters(
            self._sessions.values(), round_, finished, self.bank.state_dict
        )
        for device_id, reason in dropped.items():
            log.warning("[%s] round %d: adapter not collected: %s", device_id, round_, reason)
        infos = [self._sessions[s] for s in chosen]
        states = [
            _held_copy(self.bank.state_dict(i.session_id), self._trained_blocks(i.session_id))
            for i in infos
        ]
        round_sessions = [s for s in self._sessions.values() if s.round <= round_]
        microbatches = sum(s.microbatches for s in round_sessions if s.round == round_)
        for info in round_sessions:
            reason = "collected" if info.session_id in chosen else f"round {round_} committed"
            self._drop(info, reason=dropped.get(info.device_id, reason))
        return CollectedRound(
            devices=[i.device_id for i in infos],
            weights=[chosen[i.session_id] for i in infos],
            states=states,
            discarded=len(round_sessions) - len(infos),
            dropped=dropped,
            microbatches=microbatches,
        )

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
                k: v.detach().clone() for k, v in split_deltas(self.bank.global_state())[0].items()
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
        by_key = {(s.device_id, s.round): s for s in self._sessions.values()}
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
                else non_finite(self.bank.state_dict(info.session_id))
            )
            if reason or info is None or start is None:
                dropped[device_id] = reason
                log.warning("[%s] version %d: adapter not merged: %s", device_id, round_, reason)
                continue
            weights[info.session_id] = weight
            starts[info.session_id] = held_blocks(start, info.blocks)
        if weights and sum(weights.values()) > 0:
            self.bank.apply_updates(
                starts,
                weights,
                server_lr=server_lr,
                blocks={s: self._trained_blocks(s) for s in weights},
            )
            for session_id in weights:
                info = self._sessions.pop(session_id)
                info.dropped = True
        else:
            weights = {}
        gone = [by_key[k] for k in discard if k in by_key and not by_key[k].dropped]
        for info in gone:
            self._drop(info, reason=f"version {info.round}: not aggregated")
        return CommitResult(len(weights), len(gone), dropped)

    def set_aggregation(self, mode: str, rule: AggregationRule | None = None) -> None:
        """How commits aggregate from now on (federated.aggregation), by which rule."""
        with self._bank_lock:
            self.bank.set_aggregation(mode, rule)

    def global_state(self) -> dict[str, torch.Tensor]:
        """A copy of the global adapter (and folded base deltas), never half-way through a merge."""
        with self._bank_lock:
            return {k: v.detach().clone() for k, v in self.bank.global_state().items()}

    def load_global_state(self, state: dict[str, torch.Tensor] | None) -> None:
        """Replace the global adapter (None: the initial one); a new run forgets past commits."""
        if state is not None and (reason := non_finite(state)):
            raise InvalidRequestError(f"adapter refused: {reason}")
        with self._lock, self._bank_lock:
            if state is None:
                self.bank.reset_global_state()
            else:
                self.bank.set_global_state(state)
            self._commits.clear()
            self._collected.clear()
            self._versions.clear()  # BeginRound keeps the new run's from here on
            self._updates.clear()

    # -- the worker -------------------------------------------------------------------------
    def stop(self) -> None:
        self._stopped.set()
        self._queue.close()
        self._worker.join(timeout=10)
        self._reaper.join(timeout=10)

    def _run(self) -> None:
        while (got := self._next_batch()) is not None:
            taken, plan = got
            try:
                self._serve_batch(taken, plan)
            except Exception:  # a bug here must not stop every session's compute
                log.exception("the compute worker failed on a call of %d messages", len(taken))

    def _next_batch(self) -> tuple[list[tuple[str, QueueItem]], BatchChoice] | None:
        """The work the policy picks, once there is some (None when stopped)."""
        with self._lock:  # sessions whose next message is on its way (gradients, steps)
            mid_step = {s.session_id for s in self._sessions.values() if s.cache and s.stream}

        def choose(snap: Snapshot[str, QueueItem]) -> BatchChoice | None:
            return choose_batch(self.policy, queue_view(snap, mid_step, self._call_s))

        if self.executor.weights_pending:  # B/W split: weight gradients fill idle time
            got = self._queue.take_batch(choose, depth=self.policy.quantum, timeout=0)
            if got is not None or self._stopped.is_set():
                return got
            with self._bank_lock:
                self.executor.compute_weight_grads()
        return self._queue.take_batch(choose, depth=self.policy.quantum)

    def _serve_batch(self, taken: list[tuple[str, QueueItem]], plan: BatchChoice) -> None:
        """Run the messages of one call; resets and stream ends in their session's order."""
        start = time.perf_counter()
        work: list[tuple[SessionInfo, StageMsg, StreamHandle]] = []
        for session_id, (handle, item) in taken:
            with self._lock:
                info = self._sessions.get(session_id)
            if info is None:
                continue
            if not isinstance(item, StageMsg) or any(
                w[0] is info and w[1].kind is Kind.STEP_END for w in work
            ):
                self._compute(work)  # what came before, first
                work = []
            if item is RESET:
                self._reset_step(info)
            elif handle is None or info.stream is not handle or handle.broken:
                continue  # leftovers of a stream that ended
            elif item is END:
                handle.end(END)
            else:
                assert isinstance(item, StageMsg)
                work.append((info, item, handle))
        self._compute(work)
        if plan.lane is not Lane.CONTROL:
            self._measured(time.perf_counter() - start)
        self._trace(taken, plan, start)

    def _compute(self, work: list[tuple[SessionInfo, StageMsg, StreamHandle]]) -> None:
        """One executor call for ``work``; each reply or error to its own stream."""
        if not work:
            return
        results = self._handle_batch([(info, msg) for info, msg, _ in work])
        self.calls += 1
        self.messages += len(work)
        for (info, msg, handle), reply in zip(work, results, strict=True):
            if isinstance(reply, Exception):
                if handle.broken:
                    continue  # an earlier message of the session failed in this call
                log.warning("[%s] %s failed: %s", info.device_id, msg, reply)
                self._reset_step(info)
                self.stream_break(handle)
            elif handle.broken:
                continue  # its session failed in this call: the step is undone
            self._deliver(handle, msg, reply)

    def _measured(self, seconds: float) -> None:
        self._call_s = seconds if not self._call_s else 0.8 * self._call_s + 0.2 * seconds

    def _device_of(self, session_id: str) -> str:
        with self._lock:
            info = self._sessions.get(session_id)
        return info.device_id if info is not None else "?"

    def _trace(self, taken: list[tuple[str, QueueItem]], plan: BatchChoice, start: float) -> None:
        if self.tracer is None:
            return
        args = trace_args(taken, plan, self._device_of)
        self.tracer.add(TRACE_NAMES[plan.lane], "server", start, time.perf_counter(), args)

    def _deliver(self, handle: StreamHandle, msg: StageMsg, reply: Reply) -> None:
        nbytes = message_bytes(reply) if isinstance(reply, StageMsg) else 0
        with self._lock:  # computed: the message's bytes become the reply's
            self.streams.computed(handle, message_bytes(msg), nbytes)
        handle.reply(reply, nbytes)

    def _reap(self) -> None:
        every = max(0.05, min(1.0, self.limits.stream_idle_s / 4, self.limits.session_idle_s / 4))
        while not self._stopped.wait(every):
            self.expire_idle()
            self.cancel_stuck()

    def cancel_stuck(self, now: float | None = None) -> None:
        """Cancel the RPC of streams the server ended that are still there past the grace.

        A device that reads nothing leaves its stream's transport blocked on flow control: the
        error queued for it is never sent, and the stream would hold its gRPC thread for good.
        """
        now = time.monotonic() if now is None else now
        for handle in self.streams.overdue(now):
            log.info(
                "[%s] stream %d of session %s did not end after the server ended it: cancelled",
                handle.info.device_id,
                handle.epoch,
                handle.info.short,
            )
            handle.cancel()

    def expire_idle(self, now: float | None = None) -> None:
        """End streams and drop open sessions idle past their deadlines (logged)."""
        now = time.monotonic() if now is None else now
        lim = self.limits
        with self._lock:
            for info in list(self._sessions.values()):
                handle = info.stream
                busy = handle is not None and handle.pending > 0
                unread = handle is not None and handle.unread_since is not None
                stalled = unread and now - handle.unread_since > lim.stream_idle_s  # type: ignore[union-attr, operator]
                if handle is not None and (
                    stalled or (not busy and now - handle.last_active > lim.stream_idle_s)
                ):
                    self._unlink(info, handle, _idle_error(info, handle, now, lim, stalled))
                    busy = False
                if not info.closed and not busy and now - info.last_seen > lim.session_idle_s:
                    idle = now - info.last_seen
                    reason = (
                        f"idle for {idle:.1f} s (server.session_idle_s = {lim.session_idle_s:g})"
                    )
                    self._drop(info, reason=reason)

    # -- compute (the executor runs it, under the bank lock) ---------------------------------
    def _handle_batch(self, work: list[tuple[SessionInfo, StageMsg]]) -> list[Reply]:
        """Replies (or errors) to ``work``; a message of another step or session fails alone."""
        results: list[Reply | None] = [None] * len(work)
        runnable = []
        with self._bank_lock:
            for i, (info, msg) in enumerate(work):
                if msg.step != info.step:
                    results[i] = SessionStateError(
                        f"message for step {msg.step}, but session {info.short} is at "
                        f"step {info.step}"
                    )
                elif info.dropped:
                    results[i] = UnknownSessionError(f"session {info.short} was dropped")
                else:
                    runnable.append(i)
            replies = self.executor.compute_batch([work[i] for i in runnable])
        for i, reply in zip(runnable, replies, strict=True):
            results[i] = reply
        return [r if r is not None else RuntimeError("no reply") for r in results]

    def _reset_step(self, info: SessionInfo) -> None:
        """Forget a failed step's graphs and gradients; the session may retry the same step."""
        with self._bank_lock:
            self.executor.reset(info)


def _held_copy(
    state: dict[str, torch.Tensor], blocks: tuple[int, ...] | None
) -> dict[str, torch.Tensor]:
    """A copy of the part of a session's adapter in ``blocks`` (what its cut trained)."""
    return {k: v.detach().clone() for k, v in held_blocks(state, blocks).items()}


def _idle_error(
    info: SessionInfo, handle: StreamHandle, now: float, lim: RuntimeLimits, stalled: bool
) -> IdleTimeoutError:
    """Why a stream is ended for idleness (logged): nothing sent, or replies left unread."""
    if stalled:
        idle = now - (handle.unread_since or now)
        what = f"its replies unread for {idle:.1f} s"
    else:
        idle = now - handle.last_active
        what = f"idle for {idle:.1f} s"
    log.info("[%s] stream %d %s: ended", info.device_id, handle.epoch, what)
    return IdleTimeoutError(
        f"stream {what}, over server.stream_idle_s = {lim.stream_idle_s:g}; open a new stream "
        "and read its replies"
    )
