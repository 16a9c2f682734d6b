"""A session's Exchange stream on the server side, and the back-pressure on it.

Every message a device sends holds one of its session's ``max_pending`` slots (and its bytes)
from :meth:`StreamHandle.submit` until its reply has been taken by
:meth:`StreamHandle.next_reply`, so work waiting for the compute worker and replies waiting for
a slow reader both count against the device. The :class:`StreamLedger` keeps that count for
every stream, with the server-wide byte budget, each device's open streams and the streams the
server ended that have not gone yet; the runtime (:class:`StreamOwner`) decides what a message
means for its session, and calls the ledger under its own lock.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

from fedpipe.errors import StageCapacityError
from fedpipe.messages import Kind, StageMsg
from fedpipe.server.budget import ByteBudget
from fedpipe.server.sessions import RuntimeLimits, SessionInfo

__all__ = ["Reply", "StreamHandle", "StreamLedger", "StreamOwner", "message_bytes"]

Reply = StageMsg | BaseException  # what the server answers a message with: a reply, or an error


class StreamOwner(Protocol):
    """The runtime behind a stream: what a stream's messages mean for its session."""

    def stream_submit(self, handle: StreamHandle, msg: StageMsg) -> None: ...
    def stream_echo(self, handle: StreamHandle, msg: StageMsg) -> None: ...
    def stream_decoding(self, handle: StreamHandle, nbytes: int) -> int: ...
    def stream_finish(self, handle: StreamHandle) -> None: ...
    def stream_taken(self, handle: StreamHandle, nbytes: int, item: object) -> None: ...
    def stream_break(self, handle: StreamHandle) -> None: ...
    def stream_close(self, handle: StreamHandle) -> None: ...
    def stream_give(self, nbytes: int) -> None: ...


class StreamHandle:
    """One Exchange stream of a session: the device's messages in, the server's replies out.

    It is the :class:`fedpipe.wire.backend.StreamPort` the link servicer drives.
    """

    def __init__(self, owner: StreamOwner, info: SessionInfo, epoch: int) -> None:
        self.info = info
        self.epoch = epoch
        self._owner = owner
        self._replies: queue.SimpleQueue[tuple[object, int]] = queue.SimpleQueue()
        self._cancel: Callable[[], object] | None = None  # ends the RPC (the transport's)
        # Guarded by the owner's lock:
        self.pending = 0
        self.pending_bytes = 0
        self.broken = False  # a reply was an error: the stream is ending, drop its later work
        self.last_active = time.monotonic()
        self.unread_since: float | None = None  # the oldest reply not yet taken, if any
        self.echo_out = False  # a link probe's reply not yet taken
        self.released = False  # its bytes went back to the budget (the stream was ended)
        self.closed = False  # the transport is done with it

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

    # -- device to server -----------------------------------------------------------------------
    def submit(self, msg: StageMsg) -> None:
        """Queue one device message for the worker; raises past the session's bounds."""
        self._owner.stream_submit(self, msg)

    def echo(self, msg: StageMsg) -> None:
        """Answer a link probe at once, beside the compute queue (counted like a reply)."""
        self._owner.stream_echo(self, msg)

    @contextmanager
    def decoding(self, nbytes: int) -> Iterator[None]:
        """Hold budget for decoding one frame of ``nbytes`` on the wire while it decodes."""
        held = self._owner.stream_decoding(self, nbytes)
        try:
            yield
        finally:
            self._owner.stream_give(held)

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
        self._owner.stream_finish(self)

    # -- server to device -----------------------------------------------------------------------
    def next_reply(self, timeout: float) -> object | None:
        """A ``StageMsg``, an exception to end the stream with, ``END``, or None on timeout."""
        try:
            item, nbytes = self._replies.get(timeout=timeout)
        except queue.Empty:
            return None
        if nbytes >= 0:
            self._owner.stream_taken(self, nbytes, item)
        return item

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error`` (e.g. a message the transport could not decode)."""
        self._owner.stream_break(self)
        self.end(error)

    def close(self) -> None:
        """The stream is over; its unfinished step is forgotten unless a newer stream took over."""
        self._owner.stream_close(self)

    # -- what the runtime puts on it ------------------------------------------------------------
    def end(self, item: object) -> None:
        """End the replies with ``item`` (``END``, or an error), after those already queued."""
        self._replies.put((item, -1))

    def reply(self, item: Reply, nbytes: int) -> None:
        """Queue a reply that holds ``nbytes`` (counted until :meth:`next_reply` takes it)."""
        self._replies.put((item, nbytes))


class StreamLedger:
    """What every open stream holds, counted: slots and bytes per stream (drawn from the
    server-wide budget), each device's streams not yet closed, and the streams the server
    ended that have not gone yet (cancelled once their grace has passed).

    Methods marked "lock held" are called with the runtime's lock, which the ledger shares,
    already taken; the others take it.
    """

    def __init__(
        self, lock: threading.RLock, budget: ByteBudget, limits: RuntimeLimits, *, grace_s: float
    ) -> None:
        self._lock, self.budget, self.limits, self.grace_s = lock, budget, limits, grace_s
        self._per_device: dict[str, int] = {}  # device -> its streams not yet closed
        self._ending: dict[StreamHandle, float] = {}  # ended by the server, not yet gone: by when

    def open_by_device(self) -> dict[str, int]:
        """Each device's streams not yet closed, live or ending."""
        with self._lock:
            return dict(self._per_device)

    def opening(self, info: SessionInfo) -> None:
        """Count one more stream of ``info``'s device, or refuse it past the limit (lock held)."""
        device, most = info.device_id, self.limits.max_device_streams
        open_now = self._per_device.get(device, 0)
        if open_now >= most:
            raise StageCapacityError(
                f"device {device!r} has {open_now} streams open, its limit "
                f"(server.max_device_streams = {most}); use one stream per session and read "
                "its replies"
            )
        self._per_device[device] = open_now + 1

    def admit(self, handle: StreamHandle, nbytes: int, what: str) -> None:
        """Count one more queued or unread item of ``nbytes``, or refuse it (lock held)."""
        info, lim = handle.info, self.limits
        if handle.pending >= lim.max_pending:
            raise StageCapacityError(
                f"session {info.short} has {handle.pending} messages queued or "
                f"unread, its limit (server.max_pending = {lim.max_pending}); read the "
                "replies and send less ahead"
            )
        if handle.pending_bytes + nbytes > lim.max_pending_bytes:
            raise StageCapacityError(
                f"session {info.short} has {handle.pending_bytes} bytes queued or "
                f"unread, {what} of {nbytes} more passes its limit "
                f"(server.max_pending_mb = {lim.max_pending_bytes / 2**20:g})"
            )
        self.budget.take(nbytes, f"{what} of session {info.short}")
        handle.pending += 1
        handle.pending_bytes += nbytes
        handle.last_active = info.last_seen = time.monotonic()

    def computed(self, handle: StreamHandle, before: int, after: int) -> None:
        """A queued message of ``before`` bytes became a reply of ``after`` (lock held)."""
        change = after - before
        handle.pending_bytes += change
        if not handle.released:
            self.budget.force(change)
        if handle.unread_since is None:
            handle.unread_since = time.monotonic()

    def taken(self, handle: StreamHandle, nbytes: int, item: object) -> None:
        """The transport took a reply of ``nbytes`` off ``handle``: its slot is free."""
        with self._lock:
            handle.pending -= 1
            handle.pending_bytes -= nbytes
            if not handle.released:
                self.budget.give(nbytes)
            if isinstance(item, StageMsg) and item.kind is Kind.ECHO:
                handle.echo_out = False
            handle.last_active = handle.info.last_seen = time.monotonic()
            handle.unread_since = None if handle.nothing_unread() else handle.last_active

    def release(self, handle: StreamHandle) -> None:
        """Give the stream's queued and unread bytes back to the budget, once (lock held)."""
        if not handle.released:
            handle.released = True
            self.budget.give(handle.pending_bytes)

    def ending(self, handle: StreamHandle, *, restart: bool = False) -> None:
        """``handle`` ends with an error: cancel it if it lingers past the grace, counted from
        now (``restart``) or from when it first began to end (lock held)."""
        if handle.closed:
            return
        by = time.monotonic() + self.grace_s
        if restart:
            self._ending[handle] = by
        else:
            self._ending.setdefault(handle, by)

    def closed(self, handle: StreamHandle) -> None:
        """The transport is done with ``handle``: it holds nothing any more (lock held)."""
        if handle.closed:
            return
        handle.closed = True
        self.release(handle)
        self._ending.pop(handle, None)
        device = handle.info.device_id
        left = self._per_device.get(device, 1) - 1
        if left > 0:
            self._per_device[device] = left
        else:
            self._per_device.pop(device, None)

    def overdue(self, now: float) -> list[StreamHandle]:
        """The ended streams still there past their grace, forgotten as they are returned."""
        with self._lock:
            stuck = [h for h, by in self._ending.items() if now >= by]
            for handle in stuck:
                del self._ending[handle]
        return stuck


def message_bytes(msg: object) -> int:
    """Tensor bytes a message holds (what the pending limits count)."""
    if not isinstance(msg, StageMsg):
        return 0
    return sum(t.numel() * t.element_size() for t in (msg.tensor, msg.labels) if t is not None)
