"""The worker room: the one compute thread that runs every session's work on the stage.

:class:`ComputeWorker` takes the work its :class:`~fedpipe.server.batch_policy.BatchPolicy`
picks off the fair queue (the streams' ledger fills it), runs it in one executor call under the
bank lock, hands each reply or error to its stream through the ledger, times its calls for the
policy and traces each with the sessions in it. When idle with weight gradients left for later
(``server.input_grad_first``) it computes them.
"""

from __future__ import annotations

import logging
import threading
import time

from fedpipe.errors import SessionStateError, UnknownSessionError
from fedpipe.messages import END, Kind, StageMsg
from fedpipe.server.batch_policy import BatchChoice, BatchPolicy, Lane, choose_batch
from fedpipe.server.executor import StageExecutor
from fedpipe.server.fair_queue import FairQueue, Snapshot
from fedpipe.server.scheduler import RESET, TRACE_NAMES, QueueItem, queue_view, trace_args
from fedpipe.server.session_table import SessionTable
from fedpipe.server.sessions import SessionInfo
from fedpipe.server.streams import Reply, StreamHandle, StreamLedger
from fedpipe.trace import Tracer

__all__ = ["ComputeWorker"]

log = logging.getLogger(__name__)


class ComputeWorker:
    """Serves the queue on its own thread from construction until :meth:`stop`."""

    def __init__(
        self,
        queue: FairQueue[str, QueueItem],
        *,
        executor: StageExecutor,
        sessions: SessionTable,
        streams: StreamLedger,
        policy: BatchPolicy,
        bank_lock: threading.RLock,
        tracer: Tracer | None = None,
    ) -> None:
        self._queue, self._executor, self._sessions, self._streams = (
            queue,
            executor,
            sessions,
            streams,
        )
        self.policy = policy
        self._bank_lock = bank_lock
        self._tracer = tracer  # one "server" event per call, with the sessions in it
        self.calls = 0  # compute calls made, and the messages they computed (mean batch)
        self.messages = 0
        self._call_s = 0.0  # moving average of a compute call's seconds (the policy's wait)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stage-compute", daemon=True)
        self._thread.start()

    @property
    def tracer(self) -> Tracer | None:
        return self._tracer

    def trace_to(self, tracer: Tracer | None) -> None:
        """Record each call from now on in ``tracer`` (None: stop tracing)."""
        self._tracer = tracer

    def pending(self, session_id: str) -> int:
        """Messages of the session waiting for the worker."""
        return self._queue.pending(session_id)

    def stop(self) -> None:
        self._stopped.set()
        self._queue.close()
        self._thread.join(timeout=10)

    # -- the loop ----------------------------------------------------------------------------------
    def _run(self) -> None:
        while (got := self._next_batch()) is not None:
            taken, plan = got
            try:
                self.serve(taken, plan)
            except Exception:  # a bug here must not stop every session's compute
                log.exception("the compute worker failed on a call of %d messages", len(taken))

    def _next_batch(self) -> tuple[list[tuple[str, QueueItem]], BatchChoice] | None:
        """The work the policy picks, once there is some (None when stopped)."""
        mid_step = self._sessions.mid_step()  # their next message is on its way

        def choose(snap: Snapshot[str, QueueItem]) -> BatchChoice | None:
            return choose_batch(self.policy, queue_view(snap, mid_step, self._call_s))

        if self._executor.weights_pending:  # B/W split: weight gradients fill idle time
            got = self._queue.take_batch(choose, depth=self.policy.quantum, timeout=0)
            if got is not None or self._stopped.is_set():
                return got
            with self._bank_lock:
                self._executor.compute_weight_grads()
        return self._queue.take_batch(choose, depth=self.policy.quantum)

    def serve(self, taken: list[tuple[str, QueueItem]], plan: BatchChoice) -> None:
        """Run the messages of one call; resets and stream ends in their session's order."""
        start = time.perf_counter()
        work: list[tuple[SessionInfo, StageMsg, StreamHandle]] = []
        for session_id, (handle, item) in taken:
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
                self._streams.fail(handle)
            elif handle.broken:
                continue  # its session failed in this call: the step is undone
            self._streams.deliver(handle, msg, reply)

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
            replies = self._executor.compute_batch([work[i] for i in runnable])
        for i, reply in zip(runnable, replies, strict=True):
            results[i] = reply
        return [r if r is not None else RuntimeError("no reply") for r in results]

    def _reset_step(self, info: SessionInfo) -> None:
        """Forget a failed step's graphs and gradients; the session may retry the same step."""
        with self._bank_lock:
            self._executor.reset(info)

    def _measured(self, seconds: float) -> None:
        self._call_s = seconds if not self._call_s else 0.8 * self._call_s + 0.2 * seconds

    def _device_of(self, session_id: str) -> str:
        info = self._sessions.get(session_id)
        return info.device_id if info is not None else "?"

    def _trace(self, taken: list[tuple[str, QueueItem]], plan: BatchChoice, start: float) -> None:
        if self._tracer is None:
            return
        args = trace_args(taken, plan, self._device_of)
        self._tracer.add(TRACE_NAMES[plan.lane], "server", start, time.perf_counter(), args)
