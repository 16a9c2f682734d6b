"""The worker room and the reaper room, with stand-ins for the executor and the session table.

The ComputeWorker takes work off the fair queue, computes it in one executor call and hands
each reply or error to its own stream through the ledger; the Reaper ends idle streams and
drops idle sessions.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import pytest
import torch

from fedpipe.errors import IdleTimeoutError, SessionStateError
from fedpipe.messages import Kind, StageMsg
from fedpipe.server.batch_policy import BatchPolicy
from fedpipe.server.budget import ByteBudget
from fedpipe.server.fair_queue import FairQueue
from fedpipe.server.reaper import Reaper
from fedpipe.server.scheduler import QueueItem
from fedpipe.server.sessions import RuntimeLimits, SessionInfo
from fedpipe.server.streams import StreamLedger
from fedpipe.server.worker import ComputeWorker
from fedpipe.trace import Tracer


class Executor:
    """Doubles each activation; fails a message of microbatch 9. Records every call."""

    weights_pending = False

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.resets: list[str] = []

    def compute_batch(self, work: Sequence[tuple[SessionInfo, StageMsg]]) -> list[object]:
        self.calls.append([info.device_id for info, _ in work])
        return [
            ValueError("bad microbatch")
            if msg.microbatch == 9
            else StageMsg(Kind.ACTIVATION, msg.step, msg.microbatch, tensor=msg.tensor * 2)
            for _, msg in work
        ]

    def reset(self, info: SessionInfo) -> None:
        self.resets.append(info.device_id)


class Sessions:
    """The session table as the worker and the reaper use it."""

    def __init__(self, *infos: SessionInfo) -> None:
        self.by_id = {i.session_id: i for i in infos}
        self.dropped: list[tuple[str, str]] = []

    def get(self, session_id: str) -> SessionInfo | None:
        return self.by_id.get(session_id)

    def all(self) -> list[SessionInfo]:
        return list(self.by_id.values())

    def mid_step(self) -> set[str]:
        return set()

    def drop(self, info: SessionInfo, *, reason: str) -> None:
        self.by_id.pop(info.session_id)
        self.dropped.append((info.device_id, reason))


def _info(device: str) -> SessionInfo:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    return SessionInfo(device * 24, device, 1, opt, microbatch_size=2, seq_len=4)


@pytest.fixture
def lock() -> threading.RLock:
    return threading.RLock()


def _ledger(lock: threading.RLock, queue: object, **limits: float) -> StreamLedger:
    return StreamLedger(
        lock,
        ByteBudget(2**30),
        RuntimeLimits(**limits),  # type: ignore[arg-type]
        inbox=queue,  # type: ignore[arg-type]
        prefetch=lambda t: None,
        hidden_size=8,
        grace_s=0.1,
    )


@pytest.fixture
def served(
    lock: threading.RLock,
) -> Iterator[tuple[ComputeWorker, Executor, Sessions, StreamLedger]]:
    queue: FairQueue[str, QueueItem] = FairQueue(quantum=2)
    ledger = _ledger(lock, queue)
    executor, sessions = Executor(), Sessions(_info("a"), _info("b"))
    worker = ComputeWorker(
        queue,
        executor=executor,  # type: ignore[arg-type]
        sessions=sessions,  # type: ignore[arg-type]
        streams=ledger,
        policy=BatchPolicy(),
        bank_lock=threading.RLock(),
        tracer=Tracer(),
    )
    yield worker, executor, sessions, ledger
    worker.stop()


def _act(mb: int) -> StageMsg:
    return StageMsg(Kind.ACTIVATION, 0, mb, tensor=torch.ones(2, 4, 8))


def test_each_reply_goes_to_its_own_stream_and_the_call_is_traced(served) -> None:  # type: ignore[no-untyped-def]
    worker, executor, sessions, ledger = served
    a, b = (ledger.attach(i, None) for i in sessions.all())
    a.submit(_act(0))
    b.submit(_act(1))
    for handle, mb in ((a, 0), (b, 1)):
        reply = handle.next_reply(timeout=10)
        assert isinstance(reply, StageMsg) and reply.microbatch == mb
        assert reply.tensor is not None and torch.all(reply.tensor == 2)
        assert handle.pending == 0
    assert worker.messages == 2 and worker.calls == len(executor.calls) >= 1
    assert worker.tracer is not None and worker.tracer.events


def test_a_failed_message_breaks_its_stream_and_resets_its_step(served) -> None:  # type: ignore[no-untyped-def]
    worker, executor, sessions, ledger = served
    info = sessions.all()[0]
    handle = ledger.attach(info, None)
    handle.submit(_act(9))
    error = handle.next_reply(timeout=10)
    assert isinstance(error, ValueError) and handle.broken and executor.resets == ["a"]
    handle.submit(_act(0))  # the stream is ending: later work is dropped, not refused
    assert worker.pending(info.session_id) == 0


def test_a_message_of_another_step_fails_alone(served) -> None:  # type: ignore[no-untyped-def]
    _, executor, sessions, ledger = served
    handle = ledger.attach(sessions.all()[0], None)
    handle.submit(StageMsg(Kind.ACTIVATION, 5, 0, tensor=torch.ones(2, 4, 8)))
    assert isinstance(handle.next_reply(timeout=10), SessionStateError)
    assert executor.calls == [[]]  # nothing of it reached the stage


def test_the_reaper_ends_idle_streams_and_drops_idle_sessions(lock: threading.RLock) -> None:
    queue: FairQueue[str, QueueItem] = FairQueue()
    limits = RuntimeLimits(stream_idle_s=100, session_idle_s=200)
    ledger = _ledger(lock, queue, stream_idle_s=100, session_idle_s=200)
    streaming, closed, idle = _info("a"), _info("b"), _info("c")
    closed.closed = True
    sessions = Sessions(streaming, closed, idle)
    handle = ledger.attach(streaming, None)
    reaper = Reaper(sessions, ledger, limits, lock=lock)  # type: ignore[arg-type]
    try:
        now = time.monotonic()
        reaper.expire_idle(now + 50)
        assert sessions.dropped == [] and streaming.stream is handle
        reaper.expire_idle(now + 150)  # the stream is idle, no session yet
        assert streaming.stream is None and sessions.dropped == []
        assert isinstance(handle.next_reply(timeout=1), IdleTimeoutError)
        reaper.expire_idle(now + 1000)
        assert [d for d, _ in sessions.dropped] == ["a", "c"]  # a closed session waits
        assert "server.session_idle_s" in sessions.dropped[0][1]
        cancelled: list[int] = []
        handle.bind_cancel(lambda: cancelled.append(1))
        reaper.cancel_stuck(now + 1000)  # it never ended: its RPC is cancelled
        assert cancelled == [1]
    finally:
        reaper.stop()
