"""The reaper room: a thread that ends what devices left idle.

:class:`Reaper` ends streams idle past ``server.stream_idle_s`` (nothing sent, or replies left
unread; the ledger decides), drops open sessions idle past ``server.session_idle_s`` (the
sessions room), and cancels the RPCs of streams the server ended that are still there past
their grace (a device that reads nothing keeps its transport blocked on flow control).
"""

from __future__ import annotations

import logging
import threading
import time

from fedpipe.server.session_table import SessionTable
from fedpipe.server.sessions import RuntimeLimits
from fedpipe.server.streams import StreamLedger

__all__ = ["Reaper"]

log = logging.getLogger(__name__)


class Reaper:
    """Checks every quarter of the shorter idle limit (0.05 to 1 s), from construction until
    :meth:`stop`; :meth:`expire_idle` and :meth:`cancel_stuck` also run on demand."""

    def __init__(
        self,
        sessions: SessionTable,
        streams: StreamLedger,
        limits: RuntimeLimits,
        *,
        lock: threading.RLock,
    ) -> None:
        self._sessions, self._streams, self._limits, self._lock = sessions, streams, limits, lock
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._reap, name="stage-reaper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=10)

    def _reap(self) -> None:
        lim = self._limits
        every = max(0.05, min(1.0, lim.stream_idle_s / 4, lim.session_idle_s / 4))
        while not self._stopped.wait(every):
            self.expire_idle()
            self.cancel_stuck()

    def expire_idle(self, now: float | None = None) -> None:
        """End streams and drop open sessions idle past their deadlines (logged)."""
        now = time.monotonic() if now is None else now
        lim = self._limits
        with self._lock:  # the runtime's: no session opens, closes or steps meanwhile
            for info in self._sessions.all():
                busy = self._streams.expire(info, now)
                if not info.closed and not busy and now - info.last_seen > lim.session_idle_s:
                    idle = now - info.last_seen
                    reason = (
                        f"idle for {idle:.1f} s (server.session_idle_s = {lim.session_idle_s:g})"
                    )
                    self._sessions.drop(info, reason=reason)

    def cancel_stuck(self, now: float | None = None) -> None:
        """Cancel the RPC of streams the server ended that are still there past the grace.

        A device that reads nothing leaves its stream's transport blocked on flow control: the
        error queued for it is never sent, and the stream would hold its gRPC thread for good.
        """
        now = time.monotonic() if now is None else now
        for handle in self._streams.overdue(now):
            log.info(
                "[%s] stream %d of session %s did not end after the server ended it: cancelled",
                handle.info.device_id,
                handle.epoch,
                handle.info.short,
            )
            handle.cancel()
