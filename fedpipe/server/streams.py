"""A session's Exchange stream on the server side, and the ledger that alone writes its state.

Every message a device sends holds one of its session's ``max_pending`` slots (and its bytes)
from :meth:`StreamHandle.submit` until its reply has been taken by
:meth:`StreamHandle.next_reply`, so work waiting for the compute worker and replies waiting for
a slow reader both count against the device. The :class:`StreamLedger` keeps that count for
every stream, with the server-wide byte budget, each device's open streams and the streams the
server ended that have not gone yet. It is the one writer of a stream's state (slots, bytes,
broken, unread, the link probe out) and of which stream is a session's: the handle forwards
what the transport does to the ledger's methods, the worker and the reaper call them too, and
every other reader sees the state through the handle's read-only properties.
"""

from __future__ import annotations

import hmac
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

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
from fedpipe.messages import END, Kind, StageMsg
from fedpipe.server.budget import ByteBudget
from fedpipe.server.sessions import RuntimeLimits, SessionInfo

__all__ = [
    "RESET",
    "Inbox",
    "Prefetch",
    "Reply",
    "StreamHandle",
    "StreamLedger",
    "message_bytes",
]

log = logging.getLogger(__name__)

Reply = StageMsg | BaseException  # what the server answers a message with: a reply, or an error
RESET = object()  # queue marker: forget the session's unfinished step


class Inbox(Protocol):
    """The compute worker's queue, as the ledger feeds it (a FairQueue of each session's items:
    the stream it came on, or None for a marker; a StageMsg, END or RESET)."""

    def put(self, key: str, item: tuple[StreamHandle | None, object]) -> None: ...
    def clear(self, key: str) -> object: ...


Prefetch = Callable[[torch.Tensor | None], object]  # starts a tensor's upload (DeviceCopies)


@dataclass
class _Account:
    """A stream's state; only :class:`StreamLedger` writes it, under the runtime's lock."""

    pending: int = 0
    pending_bytes: int = 0
    broken: bool = False  # a reply was an error: the stream is ending, drop its later work
    last_active: float = field(default_factory=time.monotonic)
    unread_since: float | None = None  # the oldest reply not yet taken, if any
    echo_out: bool = False  # a link probe's reply not yet taken
    released: bool = False  # its bytes went back to the budget (the stream was ended)
    closed: bool = False  # the transport is done with it


class StreamHandle:
    """One Exchange stream of a session: the device's messages in, the server's replies out.

    It is the :class:`fedpipe.wire.backend.StreamPort` the link servicer drives. What the
    transport does on it goes to its :class:`StreamLedger`; its state (slots, bytes, broken
    ...) is the ledger's to write and is read here through read-only properties.
    """

    def __init__(self, ledger: StreamLedger, info: SessionInfo, epoch: int) -> None:
        self.info = info
        self.epoch = epoch
        self._ledger = ledger
        self._replies: queue.SimpleQueue[tuple[object, int]] = queue.SimpleQueue()
        self._cancel: Callable[[], object] | None = None  # ends the RPC (the transport's)
        self._account = _Account()  # written by the ledger alone

    # -- what the link servicer reads -----------------------------------------------------------
    @property
    def session_id(self) -> str:
        return self.info.session_id

    @property
    def device_id(self) -> str:
        return self.info.device_id

    @property
    def microbatch_size(self) -> int:
        return self.info.microbatch_size

    @property
    def seq_len(self) -> int:
        return self.info.seq_len

    @property
    def codecs(self) -> tuple[str, str]:
        return self.info.codecs

    # -- its state, as the ledger keeps it (read-only) ------------------------------------------
    @property
    def pending(self) -> int:
        """Messages queued for compute and replies not yet taken."""
        return self._account.pending

    @property
    def pending_bytes(self) -> int:
        return self._account.pending_bytes

    @property
    def broken(self) -> bool:
        """A reply was an error, or the server ended it: its later work is dropped."""
        return self._account.broken

    @property
    def last_active(self) -> float:
        return self._account.last_active

    @property
    def unread_since(self) -> float | None:
        """When the oldest reply not yet taken was queued (None: none)."""
        return self._account.unread_since

    @property
    def echo_out(self) -> bool:
        """A link probe's reply is not yet taken."""
        return self._account.echo_out

    @property
    def released(self) -> bool:
        return self._account.released

    @property
    def closed(self) -> bool:
        return self._account.closed

    # -- device to server -----------------------------------------------------------------------
    def submit(self, msg: StageMsg) -> None:
        """Queue one device message for the worker; raises past the session's bounds."""
        self._ledger.submit(self, msg)

    def echo(self, msg: StageMsg) -> None:
        """Answer a link probe at once, beside the compute queue (counted like a reply)."""
        self._ledger.echo(self, msg)

    @contextmanager
    def decoding(self, nbytes: int) -> Iterator[None]:
        """Hold budget for decoding one frame of ``nbytes`` on the wire while it decodes."""
        held = self._ledger.decoding(self, nbytes)
        try:
            yield
        finally:
            self._ledger.give(held)

    def bind_cancel(self, cancel: Callable[[], object]) -> None:
        """How the transport's RPC is cancelled when the server ends a stream that hangs."""
        self._cancel = cancel

    def cancel(self) -> None:
        if self._cancel is not None:
            self._cancel()

    def nothing_unread(self) -> bool:
        return self._replies.empty()

    def finish(self) -> None:
        """The device half-closed: end the replies after those to everything it sent."""
        self._ledger.finish(self)

    # -- server to device -----------------------------------------------------------------------
    def next_reply(self, timeout: float) -> object | None:
        """A ``StageMsg``, an exception to end the stream with, ``END``, or None on timeout."""
        try:
            item, nbytes = self._replies.get(timeout=timeout)
        except queue.Empty:
            return None
        if nbytes >= 0:
            self._ledger.taken(self, nbytes, item)
        return item

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error`` (e.g. a message the transport could not decode)."""
        self._ledger.fail(self)
        self.end(error)

    def close(self) -> None:
        """The stream is over; its unfinished step is forgotten unless a newer stream took over."""
        self._ledger.close(self)

    # -- what the ledger puts on it -------------------------------------------------------------
    def end(self, item: object) -> None:
        """End the replies with ``item`` (``END``, or an error), after those already queued."""
        self._replies.put((item, -1))

    def reply(self, item: Reply, nbytes: int) -> None:
        """Queue a reply that holds ``nbytes`` (counted until :meth:`next_reply` takes it)."""
        self._replies.put((item, nbytes))


class StreamLedger:
    """Every stream's state, and the one place that writes it: slots and bytes per stream
    (drawn from the server-wide budget), which stream is a session's live one, each device's
    streams not yet closed, and the streams the server ended that have not gone yet (cancelled
    once their grace has passed).

    It shares the runtime's lock (re-entrant: a caller may hold it already). Its callers: the
    handle (what the transport does), the runtime (attach, a session's stream ended when the
    session closes or goes), the worker (a reply computed, a stream broken by a failed step)
    and the reaper (idle and stuck streams).
    """

    def __init__(
        self,
        lock: threading.RLock,
        budget: ByteBudget,
        limits: RuntimeLimits,
        *,
        inbox: Inbox,
        prefetch: Prefetch,
        hidden_size: int,
        grace_s: float,
    ) -> None:
        self._lock, self.budget, self.limits, self.grace_s = lock, budget, limits, grace_s
        self._inbox, self._prefetch, self._hidden_size = inbox, prefetch, hidden_size
        self._per_device: dict[str, int] = {}  # device -> its streams not yet closed
        self._ending: dict[StreamHandle, float] = {}  # ended by the server, not yet gone: by when

    def open_by_device(self) -> dict[str, int]:
        """Each device's streams not yet closed, live or ending."""
        with self._lock:
            return dict(self._per_device)

    # -- the runtime: a session's stream starts and ends ------------------------------------------
    def attach(self, info: SessionInfo, stream_key: str | None) -> StreamHandle:
        """Start ``info``'s stream; a live older stream ends ABORTED (its step is undone).

        ``stream_key``: what the stream presented (None: an in-process caller). A key other
        than the session's is refused before anything of the session changes. A device holds
        at most ``max_device_streams`` streams not yet closed, live or ending.
        """
        with self._lock:
            if stream_key is not None and not hmac.compare_digest(
                stream_key.encode(), info.stream_key.encode()
            ):
                raise AuthError(
                    f"stream for session {info.short} refused: its stream key does not match "
                    "the one OpenSession gave (send the fedpipe-stream-key it answered)"
                )
            if info.closed:
                raise SessionStateError(f"session {info.short} is closed; open a new session")
            self._opening(info)
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

    def end_stream(self, info: SessionInfo, end: object, *, reset: bool = True) -> None:
        """End ``info``'s live stream, if any, with ``end`` (``END`` or an error); ``reset``:
        queue the reset of its unfinished step (not for a session that is going)."""
        with self._lock:
            if info.stream is not None:
                self._unlink(info, info.stream, end, reset=reset)

    def _unlink(
        self, info: SessionInfo, handle: StreamHandle, end: object, *, reset: bool = True
    ) -> None:
        """Detach ``handle`` from ``info`` and end it (lock held).

        What it holds goes back to the budget at once. Ended with an error, a stream whose
        transport does not finish it within the grace (its device reads nothing, so the
        transport is stuck sending) is cancelled by the reaper.
        """
        handle._account.broken = True
        if info.stream is handle:
            info.stream = None
            info.last_seen = time.monotonic()
            self._inbox.clear(info.session_id)
            if reset:
                self._inbox.put(info.session_id, (None, RESET))
        self._release(handle)
        if end is not END:
            self._ending_from(handle, restart=True)
        handle.end(end)

    # -- the handle: what the transport does -------------------------------------------------------
    def submit(self, handle: StreamHandle, msg: StageMsg) -> None:
        """Queue one device message for the worker; raises past the session's bounds."""
        info = handle.info
        nbytes = message_bytes(msg)
        if not info.dropped and not handle.broken:  # before the worker can take it
            self._prefetch(msg.tensor)  # a refused message frees its copy as it goes
            self._prefetch(msg.labels)
        with self._lock:
            if info.dropped:
                raise UnknownSessionError(f"session {info.short} was dropped")
            if info.stream is not handle:
                raise StreamReplacedError(f"stream {handle.epoch} is no longer the session's")
            if handle.broken:
                return  # the stream is ending with an error already
            self._admit(handle, nbytes, "a message")
            self._inbox.put(info.session_id, (handle, msg))

    def echo(self, handle: StreamHandle, msg: StageMsg) -> None:
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
        nbytes = msg.tokens * info.seq_len * self._hidden_size * 4
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
            self._admit(handle, nbytes, "a link probe's reply")
            info.echoes += 1
            account = handle._account
            account.echo_out = True
            if account.unread_since is None:
                account.unread_since = time.monotonic()
        reply = StageMsg(Kind.ECHO, msg.step, msg.microbatch)
        if msg.tokens > 0:
            reply.tensor = torch.zeros(msg.tokens, info.seq_len, self._hidden_size)
        handle.reply(reply, nbytes)

    def decoding(self, handle: StreamHandle, nbytes: int) -> int:
        """Draw what decoding one frame may allocate (the session's largest tensors at most);
        returns what was drawn, for :meth:`give`."""
        info = handle.info
        bound = info.microbatch_size * info.seq_len * (self._hidden_size * 4 + 8)
        nbytes = min(nbytes, bound)
        self.budget.take(nbytes, f"decoding a message of session {info.short}")
        return nbytes

    def give(self, nbytes: int) -> None:
        """Budget drawn by :meth:`decoding`, given back."""
        self.budget.give(nbytes)

    def finish(self, handle: StreamHandle) -> None:
        """The device half-closed: end the replies after those to everything it sent."""
        with self._lock:
            if handle.info.stream is handle:
                self._inbox.put(handle.info.session_id, (handle, END))

    def taken(self, handle: StreamHandle, nbytes: int, item: object) -> None:
        """The transport took a reply of ``nbytes`` off ``handle``: its slot is free."""
        with self._lock:
            account = handle._account
            account.pending -= 1
            account.pending_bytes -= nbytes
            if not account.released:
                self.budget.give(nbytes)
            if isinstance(item, StageMsg) and item.kind is Kind.ECHO:
                account.echo_out = False
            account.last_active = handle.info.last_seen = time.monotonic()
            account.unread_since = None if handle.nothing_unread() else account.last_active

    def fail(self, handle: StreamHandle) -> None:
        """The stream ends with an error (its own, its RPC's end, or a failed step of the
        worker's): its later work is dropped, and it is cancelled if it lingers."""
        with self._lock:
            handle._account.broken = True
            self._ending_from(handle)

    def close(self, handle: StreamHandle) -> None:
        """The transport is done with ``handle`` (its RPC ended): it holds nothing any more."""
        with self._lock:
            info = handle.info
            if info.stream is handle:  # a stream that was replaced touches nothing
                self._unlink(info, handle, END)
            account = handle._account
            if account.closed:
                return
            account.closed = True
            self._release(handle)
            self._ending.pop(handle, None)
            left = self._per_device.get(info.device_id, 1) - 1
            if left > 0:
                self._per_device[info.device_id] = left
            else:
                self._per_device.pop(info.device_id, None)

    # -- the worker ----------------------------------------------------------------------------
    def deliver(self, handle: StreamHandle, msg: StageMsg, reply: Reply) -> None:
        """The worker's ``reply`` to ``msg``: the message's bytes become the reply's, and the
        reply goes on the stream."""
        before = message_bytes(msg)
        after = message_bytes(reply) if isinstance(reply, StageMsg) else 0
        with self._lock:
            account = handle._account
            account.pending_bytes += after - before
            if not account.released:
                self.budget.force(after - before)
            if account.unread_since is None:
                account.unread_since = time.monotonic()
        handle.reply(reply, after)

    # -- the reaper ----------------------------------------------------------------------------
    def expire(self, info: SessionInfo, now: float) -> bool:
        """End ``info``'s stream if it is idle past ``server.stream_idle_s`` (nothing sent,
        or its replies unread); whether the session is busy (its live stream holds work)."""
        lim = self.limits
        with self._lock:
            handle = info.stream
            if handle is None:
                return False
            account = handle._account
            busy = account.pending > 0
            stalled = (
                account.unread_since is not None and now - account.unread_since > lim.stream_idle_s
            )
            if stalled or (not busy and now - account.last_active > lim.stream_idle_s):
                self._unlink(info, handle, _idle_error(info, handle, now, lim, stalled))
                return False
            return busy

    def overdue(self, now: float) -> list[StreamHandle]:
        """The ended streams still there past their grace, forgotten as they are returned."""
        with self._lock:
            stuck = [h for h, by in self._ending.items() if now >= by]
            for handle in stuck:
                del self._ending[handle]
        return stuck

    # -- inside (lock held) --------------------------------------------------------------------
    def _opening(self, info: SessionInfo) -> None:
        """Count one more stream of ``info``'s device, or refuse it past the limit."""
        device, most = info.device_id, self.limits.max_device_streams
        open_now = self._per_device.get(device, 0)
        if open_now >= most:
            raise StageCapacityError(
                f"device {device!r} has {open_now} streams open, its limit "
                f"(server.max_device_streams = {most}); use one stream per session and read "
                "its replies"
            )
        self._per_device[device] = open_now + 1

    def _admit(self, handle: StreamHandle, nbytes: int, what: str) -> None:
        """Count one more queued or unread item of ``nbytes``, or refuse it."""
        info, lim, account = handle.info, self.limits, handle._account
        if account.pending >= lim.max_pending:
            raise StageCapacityError(
                f"session {info.short} has {account.pending} messages queued or "
                f"unread, its limit (server.max_pending = {lim.max_pending}); read the "
                "replies and send less ahead"
            )
        if account.pending_bytes + nbytes > lim.max_pending_bytes:
            raise StageCapacityError(
                f"session {info.short} has {account.pending_bytes} bytes queued or "
                f"unread, {what} of {nbytes} more passes its limit "
                f"(server.max_pending_mb = {lim.max_pending_bytes / 2**20:g})"
            )
        self.budget.take(nbytes, f"{what} of session {info.short}")
        account.pending += 1
        account.pending_bytes += nbytes
        account.last_active = info.last_seen = time.monotonic()

    def _release(self, handle: StreamHandle) -> None:
        """Give the stream's queued and unread bytes back to the budget, once."""
        account = handle._account
        if not account.released:
            account.released = True
            self.budget.give(account.pending_bytes)

    def _ending_from(self, handle: StreamHandle, *, restart: bool = False) -> None:
        """``handle`` ends with an error: cancel it if it lingers past the grace, counted from
        now (``restart``) or from when it first began to end."""
        if handle.closed:
            return
        by = time.monotonic() + self.grace_s
        if restart:
            self._ending[handle] = by
        else:
            self._ending.setdefault(handle, by)


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


def message_bytes(msg: object) -> int:
    """Tensor bytes a message holds (what the pending limits count)."""
    if not isinstance(msg, StageMsg):
        return 0
    return sum(t.numel() * t.element_size() for t in (msg.tensor, msg.labels) if t is not None)
