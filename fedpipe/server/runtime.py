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

The runtime is the composition the StageServer drives; each job is a room of its own:
sessions (:class:`~fedpipe.server.session_table.SessionTable`), streams
(:class:`~fedpipe.server.streams.StreamLedger`, the one writer of a stream's state), commits
and the global adapter (:class:`~fedpipe.server.commit.Commits`), the compute worker
(:class:`~fedpipe.server.worker.ComputeWorker`) and the reaper
(:class:`~fedpipe.server.reaper.Reaper`). They share one lock (sessions, streams, counters)
and the bank lock, always taken after it and never held by I/O.

At the end of a round the ServerApp commits it: the adapters of devices whose Flower reply
arrived are averaged into the global server adapter (with the strategy's weights) and every
other session of the round is discarded, so a device that vanished leaves no trace.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fedpipe.lora import AdapterBank, BatchedAdapterBank
from fedpipe.lora.robust import AggregationRule
from fedpipe.server.batch_policy import BatchPolicy
from fedpipe.server.budget import ByteBudget
from fedpipe.server.commit import CommitResult, Commits
from fedpipe.server.device_copies import DeviceCopies
from fedpipe.server.executor import StageExecutor
from fedpipe.server.fair_queue import FairQueue
from fedpipe.server.reaper import Reaper
from fedpipe.server.scheduler import QueueItem
from fedpipe.server.session_table import SessionTable
from fedpipe.server.sessions import OptimizerFactory, RuntimeLimits, SessionInfo, adamw, seq_bound
from fedpipe.server.streams import StreamHandle, StreamLedger
from fedpipe.server.worker import ComputeWorker
from fedpipe.trace import Tracer
from fedpipe.wire.backend import CollectedRound, SessionRequest

__all__ = ["StageRuntime", "StageSettings"]

# A stream the server ended (replaced, idle, dropped) has this long to finish on its own before
# its RPC is cancelled: a device that reads gets the error; one that reads nothing is cut off.
_CANCEL_GRACE_S = 2.0


@dataclass(frozen=True)
class StageSettings:
    """What a :class:`StageRuntime` serves, and how (``fedpipe.server.build`` fills it in from
    the ``server.*`` settings and the model)."""

    mode: str  # "u": the middle stage; "two": the server's loss stage (two-part split)
    hidden_size: int
    device: torch.device
    dtype: torch.dtype = torch.float32
    limits: RuntimeLimits = field(default_factory=RuntimeLimits)
    max_positions: int = 0  # the model's positions (0: none stated)
    policy: BatchPolicy = field(default_factory=BatchPolicy)
    optimizer_factory: OptimizerFactory = adamw
    offload: bool = False  # server.offload: stash waiting microbatches in host memory
    input_grad_first: bool = False  # server.input_grad_first: weight gradients later


class StageRuntime:
    """Serves the middle stage (U-shaped split) or the server's loss stage (two-part split).

    ``tracer``: one "server" event per compute call; ``copies``: the host and GPU copies
    (a fresh :class:`DeviceCopies` of the device when None).
    """

    def __init__(
        self,
        bank: AdapterBank | BatchedAdapterBank,
        settings: StageSettings,
        *,
        tracer: Tracer | None = None,
        copies: DeviceCopies | None = None,
    ) -> None:
        self.bank = bank
        self.settings = settings
        # Uploads of decoded messages (started by the reader threads, so the next call's inputs
        # cross while this one computes) and the replies' copies back; CPU: a pass-through.
        self.copies = copies or DeviceCopies(settings.device)
        self.limits = settings.limits
        self.executor = StageExecutor(
            bank,
            mode=settings.mode,
            hidden_size=settings.hidden_size,
            device=settings.device,
            dtype=settings.dtype,
            max_in_flight=self.limits.max_in_flight,
            copies=self.copies,
            offload=settings.offload,
            input_grad_first=settings.input_grad_first,
        )
        self.max_seq_len = seq_bound(settings.max_positions, self.limits.max_seq_len)
        # What devices make the server hold, all together (fedpipe.server.budget).
        self.budget = ByteBudget(self.limits.memory_budget_bytes)
        self._lock = threading.RLock()  # sessions, streams, counters; never held by compute
        self._bank_lock = threading.RLock()  # the bank; taken after _lock, never before
        queue: FairQueue[str, QueueItem] = FairQueue(quantum=settings.policy.quantum)
        # What every stream holds and how many each device has open (fedpipe.server.streams).
        self.streams = StreamLedger(
            self._lock,
            self.budget,
            self.limits,
            inbox=queue,
            prefetch=self.copies.prefetch,
            hidden_size=settings.hidden_size,
            grace_s=_CANCEL_GRACE_S,
        )
        self._sessions = SessionTable(
            bank,
            executor=self.executor,
            streams=self.streams,
            inbox=queue,
            budget=self.budget,
            limits=self.limits,
            max_seq_len=self.max_seq_len,
            optimizer_factory=settings.optimizer_factory,
            lock=self._lock,
            bank_lock=self._bank_lock,
        )
        self._commits = Commits(bank, self._sessions, lock=self._lock, bank_lock=self._bank_lock)
        self._worker = ComputeWorker(
            queue,
            executor=self.executor,
            sessions=self._sessions,
            streams=self.streams,
            policy=settings.policy,
            bank_lock=self._bank_lock,
            tracer=tracer,
        )
        self._reaper = Reaper(self._sessions, self.streams, self.limits, lock=self._lock)

    # -- what it serves ---------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        return self.settings.mode

    @property
    def hidden_size(self) -> int:
        return self.settings.hidden_size

    @property
    def device(self) -> torch.device:
        return self.settings.device

    @property
    def dtype(self) -> torch.dtype:
        return self.settings.dtype

    @property
    def policy(self) -> BatchPolicy:
        return self.settings.policy

    @property
    def block_indices(self) -> tuple[int, ...]:
        """The global indices of the stage's blocks."""
        return self._commits.block_indices

    # -- test and bench hooks (what tests swap in on a built runtime) ------------------------------
    @property
    def optimizer_factory(self) -> OptimizerFactory:
        return self._sessions.optimizer_factory

    @optimizer_factory.setter
    def optimizer_factory(self, factory: OptimizerFactory) -> None:
        self._sessions.use_optimizer(factory)

    @property
    def tracer(self) -> Tracer | None:
        return self._worker.tracer

    @tracer.setter
    def tracer(self, tracer: Tracer | None) -> None:
        self._worker.trace_to(tracer)

    @property
    def calls(self) -> int:
        """Compute calls made (the worker's)."""
        return self._worker.calls

    @property
    def messages(self) -> int:
        """Messages those calls computed (``messages / calls``: the mean batch)."""
        return self._worker.messages

    # -- sessions ---------------------------------------------------------------------------------
    def open(self, request: SessionRequest, *, blocks: tuple[int, ...] | None = None) -> str:
        """Start a session on a fresh copy of the global adapter; replaces the device's old one.

        ``learning_rate`` 0 takes the server's default; ``microbatch_size`` and ``seq_len`` 0
        take the server's bounds. Anything outside the server's limits raises
        ``InvalidRequestError``. ``blocks``: the stage's blocks the device's cut leaves to the
        server (None: all). The StageServer has checked the rest (token, split, delta cache).
        In async rounds the session starts from its version's global adapter.
        """
        commits = self._commits
        return self._sessions.open(
            request,
            blocks=blocks,
            start=commits.start_of,
            per_version=commits.asynchronous,
            frozen_below=commits.frozen_below,
        )

    def session(self, session_id: str) -> SessionInfo:
        return self._sessions.session(session_id)

    def sessions(self) -> list[SessionInfo]:
        return self._sessions.all()

    def pending(self, session_id: str) -> int:
        """Messages of the session waiting for the worker."""
        return self._worker.pending(session_id)

    def close_session(self, session_id: str) -> int:
        """End a session; a trained adapter is kept until its round is committed.

        A session that completed no step (an evaluation, or a device that gave up) has nothing
        to merge and is dropped at once.
        """
        return self._sessions.close(session_id)

    def discard(self, session_id: str, *, reason: str) -> None:
        """Forget a session now (an admission that failed after it was opened)."""
        self._sessions.discard(session_id, reason=reason)

    def hold(self, session_id: str, nbytes: int, what: str) -> None:
        """Draw ``nbytes`` from the budget for the session itself (given back when it goes)."""
        self._sessions.hold(session_id, nbytes, what)

    def on_drop(self, listener: Callable[[SessionInfo], None]) -> None:
        """Call ``listener(info)`` (under the runtime's lock) when a session is forgotten."""
        self._sessions.on_drop(listener)

    # -- streams ----------------------------------------------------------------------------------
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
            return self.streams.attach(self._sessions.session(session_id), stream_key)

    # -- rounds and the global adapter ------------------------------------------------------------
    @property
    def frozen_below(self) -> int:
        """pipeline.freeze: sessions opened now train no block below this."""
        return self._commits.frozen_below

    def freeze_below(self, block: int) -> None:
        """BeginRound's pipeline.freeze: sessions opened from now on train no block below."""
        self._commits.freeze_below(block)

    def commit_round(self, round_: int, finished: dict[str, float]) -> CommitResult:
        """Merge the finished devices' adapters of ``round_``; drop the rest (:class:`Commits`)."""
        return self._commits.commit_round(round_, finished)

    def collect_round(self, round_: int, finished: dict[str, float]) -> CollectedRound:
        """Hand over the finished devices' adapters of ``round_``; drop every session of it."""
        return self._commits.collect_round(round_, finished)

    def begin_version(self, round_: int, window: int) -> None:
        """BeginRound: async rounds (``window`` > 0) keep each admitted version's global."""
        self._commits.begin_version(round_, window)

    def commit_updates(
        self,
        round_: int,
        merge: list[tuple[str, int, float]],
        discard: list[tuple[str, int]],
        *,
        server_lr: float = 1.0,
    ) -> CommitResult:
        """Async rounds: merge sessions as updates against their own version's global."""
        return self._commits.commit_updates(round_, merge, discard, server_lr=server_lr)

    def set_aggregation(self, mode: str, rule: AggregationRule | None = None) -> None:
        """How commits aggregate from now on (federated.aggregation), by which rule."""
        self._commits.set_aggregation(mode, rule)

    def global_state(self) -> dict[str, torch.Tensor]:
        """A copy of the global adapter (and folded base deltas), never half-way through a merge."""
        return self._commits.global_state()

    def load_global_state(self, state: dict[str, torch.Tensor] | None) -> None:
        """Replace the global adapter (None: the initial one); a new run forgets past commits."""
        self._commits.load_global_state(state)

    # -- the threads ------------------------------------------------------------------------------
    def stop(self) -> None:
        self._worker.stop()
        self._reaper.stop()

    def expire_idle(self, now: float | None = None) -> None:
        """End streams and drop open sessions idle past their deadlines (the reaper's)."""
        self._reaper.expire_idle(now)

    def cancel_stuck(self, now: float | None = None) -> None:
        """Cancel the RPC of ended streams still there past the grace (the reaper's)."""
        self._reaper.cancel_stuck(now)
