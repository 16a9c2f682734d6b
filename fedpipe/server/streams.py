"""A session's Exchange stream on the server side, and the back-pressure on it.

Every message a device sends holds one of its session's ``max_pending`` slots (and its bytes)
from :meth:`StreamHandle.submit` until its reply has been taken by
:meth:`StreamHandle.next_reply`, so work waiting for the compute worker and replies waiting for
a slow reader both count against the device. The runtime that owns the stream does the
counting under its lock (:class:`StreamOwner`).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

from fedpipe.messages import StageMsg
from fedpipe.server.sessions import SessionInfo

__all__ = ["Reply", "StreamHandle", "StreamOwner", "message_bytes"]

Reply = StageMsg | BaseException


class StreamOwner(Protocol):
    """The runtime behind a stream: it counts what the stream holds, under its own lock."""

    def _submit(self, handle: StreamHandle, msg: StageMsg) -> None: ...
    def _echo(self, handle: StreamHandle, msg: StageMsg) -> None: ...
    def _decoding(self, handle: StreamHandle, nbytes: int) -> int: ...
    def _finish(self, handle: StreamHandle) -> None: ...
    def _taken(self, handle: StreamHandle, nbytes: int, item: object) -> None: ...
    def _break(self, handle: StreamHandle) -> None: ...
    def _detach(self, handle: StreamHandle) -> None: ...
    def _give(self, nbytes: int) -> None: ...


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
        self._owner._submit(self, msg)

    def echo(self, msg: StageMsg) -> None:
        """Answer a link probe at once, beside the compute queue (counted like a reply)."""
        self._owner._echo(self, msg)

    @contextmanager
    def decoding(self, nbytes: int) -> Iterator[None]:
        """Hold budget for decoding one frame of ``nbytes`` on the wire while it decodes."""
        held = self._owner._decoding(self, nbytes)
        try:
            yield
        finally:
            self._owner._give(held)

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
        self._owner._finish(self)

    # -- server to device -----------------------------------------------------------------------
    def next_reply(self, timeout: float) -> object | None:
        """A ``StageMsg``, an exception to end the stream with, ``END``, or None on timeout."""
        try:
            item, nbytes = self._replies.get(timeout=timeout)
        except queue.Empty:
            return None
        if nbytes >= 0:
            self._owner._taken(self, nbytes, item)
        return item

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error`` (e.g. a message the transport could not decode)."""
        self._owner._break(self)
        self._end(error)

    def close(self) -> None:
        """The stream is over; its unfinished step is forgotten unless a newer stream took over."""
        self._owner._detach(self)

    def _end(self, item: object) -> None:
        self._replies.put((item, -1))

    def _reply(self, item: Reply, nbytes: int) -> None:
        self._replies.put((item, nbytes))


def message_bytes(msg: object) -> int:
    """Tensor bytes a message holds (what the pending limits count)."""
    if not isinstance(msg, StageMsg):
        return 0
    return sum(t.numel() * t.element_size() for t in (msg.tensor, msg.labels) if t is not None)
