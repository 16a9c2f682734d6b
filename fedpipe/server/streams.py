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
from typing import Protocol

import torch

from fedpipe.errors import InvalidRequestError
from fedpipe.messages import Kind, StageMsg
from fedpipe.server.sessions import SessionInfo

__all__ = ["MAX_ECHOES", "Reply", "StreamHandle", "StreamOwner", "message_bytes"]

Reply = StageMsg | BaseException
MAX_ECHOES = 64  # link probes (ECHO) one stream may send: they bypass the pending limits


class StreamOwner(Protocol):
    """The runtime behind a stream: it counts what the stream holds, under its own lock."""

    hidden_size: int

    def _submit(self, handle: StreamHandle, msg: StageMsg) -> None: ...
    def _finish(self, handle: StreamHandle) -> None: ...
    def _taken(self, handle: StreamHandle, nbytes: int) -> None: ...
    def _break(self, handle: StreamHandle) -> None: ...
    def _detach(self, handle: StreamHandle) -> None: ...


class StreamHandle:
    """One Exchange stream of a session: the device's messages in, the server's replies out.

    It is the :class:`fedpipe.wire.backend.StreamPort` the link servicer drives.
    """

    def __init__(self, owner: StreamOwner, info: SessionInfo, epoch: int) -> None:
        self.info = info
        self.epoch = epoch
        self._owner = owner
        self._replies: queue.SimpleQueue[tuple[object, int]] = queue.SimpleQueue()
        self.echoes = 0  # link probes answered on this stream
        # Guarded by the owner's lock:
        self.pending = 0
        self.pending_bytes = 0
        self.broken = False  # a reply was an error: the stream is ending, drop its later work
        self.last_active = time.monotonic()

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
        """Answer a link probe at once, beside the worker's replies (stage.proto: ECHO).

        The reply skips the compute queue, so a probe times the link, not the server's backlog;
        it holds no pending slot, so the count per stream is capped instead.
        """
        self.echoes += 1
        if self.echoes > MAX_ECHOES:
            raise InvalidRequestError(
                f"ECHO number {self.echoes} on one stream; a stream may probe the link "
                f"{MAX_ECHOES} times (a planner needs about 10)"
            )
        reply = StageMsg(Kind.ECHO, msg.step, msg.microbatch)
        if msg.tokens > 0:
            reply.tensor = torch.zeros(msg.tokens, self.info.seq_len, self._owner.hidden_size)
        self._end(reply)  # nbytes -1: no pending slot

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
            self._owner._taken(self, nbytes)
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
