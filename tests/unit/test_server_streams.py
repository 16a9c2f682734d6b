"""The streams room: the StreamLedger alone writes a stream's state, through its methods.

No model and no worker: the ledger feeds a list standing in for the worker's queue.
"""

from __future__ import annotations

import threading

import pytest
import torch

from fedpipe.errors import (
    AuthError,
    IdleTimeoutError,
    InvalidRequestError,
    SessionStateError,
    StageCapacityError,
    StreamReplacedError,
)
from fedpipe.messages import END, Kind, StageMsg
from fedpipe.server.budget import ByteBudget
from fedpipe.server.sessions import RuntimeLimits, SessionInfo
from fedpipe.server.streams import RESET, StreamHandle, StreamLedger


class Inbox:
    """The worker's queue as the ledger sees it: what was put and cleared, per session."""

    def __init__(self) -> None:
        self.items: list[tuple[str, object]] = []

    def put(self, key: str, item: tuple[StreamHandle | None, object]) -> None:
        self.items.append((key, item[1]))

    def clear(self, key: str) -> list[object]:
        gone = [i for k, i in self.items if k == key]
        self.items = [(k, i) for k, i in self.items if k != key]
        return gone


def _ledger(**limits: float) -> tuple[StreamLedger, Inbox, ByteBudget]:
    inbox, budget = Inbox(), ByteBudget(2**30)
    lim = RuntimeLimits(**limits)  # type: ignore[arg-type]
    ledger = StreamLedger(
        threading.RLock(),
        budget,
        lim,
        inbox=inbox,
        prefetch=lambda t: None,
        hidden_size=8,
        grace_s=0.5,
    )
    return ledger, inbox, budget


def _info(device: str = "dev", sid: str = "s" * 32) -> SessionInfo:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    return SessionInfo(sid, device, 1, opt, microbatch_size=2, seq_len=4)


def _act(step: int = 0, mb: int = 0) -> StageMsg:
    return StageMsg(Kind.ACTIVATION, step, mb, tensor=torch.zeros(2, 4, 8))  # 256 bytes


def test_a_message_holds_a_slot_and_its_bytes_until_its_reply_is_taken() -> None:
    ledger, inbox, budget = _ledger()
    info = _info()
    handle = ledger.attach(info, info.stream_key)
    handle.submit(_act())
    assert (handle.pending, handle.pending_bytes, budget.used) == (1, 256, 256)
    assert inbox.items == [(info.session_id, inbox.items[0][1])]
    reply = StageMsg(Kind.ACTIVATION, 0, 0, tensor=torch.zeros(2, 4, 2))  # 64 bytes
    ledger.deliver(handle, _act(), reply)
    assert (handle.pending_bytes, budget.used) == (64, 64) and handle.unread_since is not None
    assert handle.next_reply(timeout=1) is reply
    assert (handle.pending, handle.pending_bytes, budget.used) == (0, 0, 0)
    assert handle.unread_since is None


def test_a_streams_state_is_read_only_outside_the_ledger() -> None:
    ledger, _, _ = _ledger()
    info = _info()
    handle = ledger.attach(info, None)
    for name in ("pending", "pending_bytes", "broken", "unread_since", "echo_out", "closed"):
        with pytest.raises(AttributeError):
            setattr(handle, name, 1)


def test_past_max_pending_a_message_is_refused() -> None:
    ledger, _, _ = _ledger(max_pending=2)
    info = _info()
    handle = ledger.attach(info, None)
    handle.submit(_act(mb=0))
    handle.submit(_act(mb=1))
    with pytest.raises(StageCapacityError, match="server.max_pending"):
        handle.submit(_act(mb=2))


def test_a_wrong_stream_key_or_a_closed_session_is_refused_before_anything_changes() -> None:
    ledger, _, _ = _ledger()
    info = _info()
    with pytest.raises(AuthError, match="stream key"):
        ledger.attach(info, "not-the-key")
    info.closed = True
    with pytest.raises(SessionStateError, match="closed"):
        ledger.attach(info, info.stream_key)
    assert info.stream is None and ledger.open_by_device() == {}


def test_a_new_stream_replaces_the_old_which_ends_and_resets_its_step() -> None:
    ledger, inbox, budget = _ledger(max_device_streams=2)
    info = _info()
    old = ledger.attach(info, None)
    old.submit(_act())
    new = ledger.attach(info, None)
    assert info.stream is new and old.broken and budget.used == 0
    assert inbox.items == [(info.session_id, RESET)]  # its queued work went, a reset came
    assert isinstance(old.next_reply(timeout=1), StreamReplacedError)
    assert ledger.open_by_device() == {"dev": 2}
    with pytest.raises(StageCapacityError, match="max_device_streams"):
        ledger.attach(info, None)
    with pytest.raises(StreamReplacedError):
        old.submit(_act())
    old.close()
    new.close()
    assert ledger.open_by_device() == {} and info.stream is None


def test_end_stream_ends_the_live_stream_with_what_it_is_given() -> None:
    ledger, inbox, _ = _ledger()
    info = _info()
    handle = ledger.attach(info, None)
    ledger.end_stream(info, END, reset=False)
    assert info.stream is None and handle.broken and inbox.items == []
    assert handle.next_reply(timeout=1) is END
    assert ledger.overdue(float("inf")) == []  # ended cleanly: nothing to cancel


def test_a_failed_stream_is_overdue_after_its_grace_unless_it_closed() -> None:
    ledger, _, _ = _ledger()
    a, b = _info("a", "a" * 32), _info("b", "b" * 32)
    ha, hb = ledger.attach(a, None), ledger.attach(b, None)
    ledger.fail(ha)
    ledger.fail(hb)
    hb.close()
    assert ha.broken and ledger.overdue(0.0) == []
    assert ledger.overdue(float("inf")) == [ha]
    assert ledger.overdue(float("inf")) == []  # forgotten once returned


def test_one_echo_at_a_time_and_at_most_max_echoes() -> None:
    ledger, inbox, _ = _ledger(max_echoes=2)
    info = _info()
    handle = ledger.attach(info, None)
    probe = StageMsg(Kind.ECHO, 0, 0, tokens=1)
    handle.echo(probe)
    assert handle.echo_out and inbox.items == []  # beside the worker's queue
    with pytest.raises(InvalidRequestError, match="one message at a time"):
        handle.echo(probe)
    got = handle.next_reply(timeout=1)
    assert isinstance(got, StageMsg) and got.kind is Kind.ECHO and not handle.echo_out
    handle.echo(probe)
    handle.next_reply(timeout=1)
    with pytest.raises(InvalidRequestError, match="probe"):
        handle.echo(probe)
    with pytest.raises(InvalidRequestError, match="rows"):
        handle.echo(StageMsg(Kind.ECHO, 0, 0, tokens=3))


def test_expire_ends_an_idle_stream_and_says_whether_the_session_is_busy() -> None:
    ledger, _, _ = _ledger(stream_idle_s=10)
    info = _info()
    handle = ledger.attach(info, None)
    now = handle.last_active
    assert not ledger.expire(info, now + 1)  # idle, not yet past the limit
    handle.submit(_act())
    assert ledger.expire(info, now + 5)  # work queued: busy
    ledger.deliver(handle, _act(), StageMsg(Kind.ACTIVATION, 0, 0))
    assert not ledger.expire(info, now + 60)  # its reply unread too long: ended
    assert info.stream is None
    error = handle.next_reply(timeout=1)  # the reply, then the error
    assert isinstance(handle.next_reply(timeout=1), IdleTimeoutError), error


def test_decoding_draws_at_most_the_sessions_largest_tensors() -> None:
    ledger, _, budget = _ledger()
    info = _info()
    handle = ledger.attach(info, None)
    with handle.decoding(10**9):
        assert budget.used == 2 * 4 * (8 * 4 + 8)
    assert budget.used == 0


def test_half_close_queues_the_end_after_what_was_sent() -> None:
    ledger, inbox, _ = _ledger()
    info = _info()
    handle = ledger.attach(info, None)
    handle.submit(_act())
    handle.finish()
    assert [i for _, i in inbox.items][1] is END
