"""A delay line: hands items to a callback when an emulated link would have delivered them.

`put(item, nbytes)` stamps the item with `clock.now()`, asks the `LinkDirection` for its delivery
time, and `deliver(item)` is called at that time, in FIFO order. Two modes:
- threaded (default): one background thread sleeps on the clock and calls `deliver`;
- synchronous (`threaded=False`): nothing runs on its own; `poll()` delivers what is due at
  `clock.now()` — the mode for `FakeClock` tests and discrete-event drivers.
A passthrough direction (unlimited bandwidth, no latency) calls `deliver` inline in `put`, with no
queue and no thread hop, so an un-emulated loopback costs nothing.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from fedpipe.emulation.clock import Clock
from fedpipe.emulation.direction import LinkDirection

__all__ = ["DelayLine", "DelayLineClosed", "DelayLineStats"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# The worker sleeps at most this long at a time, so close(drop=True) is prompt even on slow links.
_MAX_SLEEP_SLICE_S = 0.05


class DelayLineClosed(RuntimeError):
    """`put` or `poll` on a DelayLine that was closed (or whose `deliver` callback failed)."""


@dataclass(frozen=True)
class DelayLineStats:
    """Delivery accounting.

    Lateness = clock time when `deliver` was called minus the scheduled delivery time: what sleeping
    costs on a busy machine (0 with a FakeClock).
    """

    delivered: int = 0
    dropped: int = 0
    late_total_s: float = 0.0
    late_max_s: float = 0.0

    @property
    def late_mean_s(self) -> float:
        return self.late_total_s / self.delivered if self.delivered else 0.0


class DelayLine(Generic[T]):
    """Delivers items through an emulated `LinkDirection`, in FIFO order (see module doc)."""

    def __init__(
        self,
        direction: LinkDirection,
        clock: Clock,
        deliver: Callable[[T], None],
        *,
        threaded: bool = True,
        name: str = "delay-line",
    ) -> None:
        self.direction = direction
        self.clock = clock
        self.name = name
        self._deliver = deliver
        self._threaded = threaded
        self._queue: collections.deque[tuple[float, T]] = collections.deque()
        self._cond = threading.Condition()
        self._in_flight = 0  # popped from the queue, deliver() not yet returned
        self._closed = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._stats = DelayLineStats()

    # -- producer side -------------------------------------------------------------------------

    def put(self, item: T, nbytes: int, *, sent_at: float | None = None) -> float:
        """Send `item` (`nbytes` on the wire) now, or at `sent_at`; returns its delivery time."""
        with self._cond:
            self._check_open()
            at = self.direction.schedule(nbytes, self.clock.now() if sent_at is None else sent_at)
            if not self.direction.is_passthrough:
                self._queue.append((at, item))
                self._start_worker_locked()
                self._cond.notify_all()
                return at
            self._in_flight += 1
        self._deliver_one(at, item)
        return at

    def pending(self) -> int:
        """Items put but not yet delivered (queued, or inside `deliver` right now)."""
        with self._cond:
            return len(self._queue) + self._in_flight

    def next_delivery_at(self) -> float | None:
        """Delivery time of the oldest queued item, or None when the queue is empty."""
        with self._cond:
            return self._queue[0][0] if self._queue else None

    def stats(self) -> DelayLineStats:
        with self._cond:
            return self._stats

    # -- synchronous mode ----------------------------------------------------------------------

    def poll(self) -> int:
        """Deliver every item due at `clock.now()` in the caller's thread; returns how many.

        Only for `threaded=False`. Exceptions from `deliver` propagate to the caller.
        """
        if self._threaded:
            raise RuntimeError(
                f"DelayLine {self.name!r}: poll() is for threaded=False lines; this one delivers "
                "from its own thread."
            )
        count = 0
        while (entry := self._pop_due(self.clock.now())) is not None:
            self._deliver_one(*entry)
            count += 1
        return count

    def _pop_due(self, now: float) -> tuple[float, T] | None:
        with self._cond:
            if self._error is not None or not self._queue or self._queue[0][0] > now:
                return None
            self._in_flight += 1
            return self._queue.popleft()

    # -- shutdown ------------------------------------------------------------------------------

    def close(self, *, drop: bool = False, timeout: float | None = None) -> None:
        """Stop accepting items; deliver everything already put (sleeping on the clock until each is
        due), or with `drop=True` discard what has not been delivered yet. Idempotent.

        `timeout` (real seconds) bounds the wait for the worker thread; TimeoutError if exceeded.
        Re-raises (as DelayLineClosed) an exception that `deliver` raised in the worker thread.
        """
        with self._cond:
            self._closed = True
            if drop:
                self._drop_queued_locked()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError(
                    f"DelayLine {self.name!r}: {self.pending()} items still pending after "
                    f"{timeout} s; is deliver() blocked? Use close(drop=True) to discard them."
                )
        elif not self._threaded:
            self._drain_synchronously()
        self._raise_if_failed()

    def _drain_synchronously(self) -> None:
        while (at := self.next_delivery_at()) is not None:
            self.clock.sleep_until(at)
            self.poll()

    def _drop_queued_locked(self) -> None:
        dropped = len(self._queue)
        self._queue.clear()
        if dropped:
            self._update_stats_locked(dropped=dropped)

    def __enter__(self) -> DelayLine[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close(drop=exc_info[0] is not None)

    # -- delivery ------------------------------------------------------------------------------

    def _deliver_one(self, at: float, item: T) -> None:
        late = max(0.0, self.clock.now() - at)
        try:
            self._deliver(item)
        finally:
            with self._cond:
                self._in_flight -= 1
                self._update_stats_locked(delivered=1, late=late)
                self._cond.notify_all()

    def _update_stats_locked(
        self, *, delivered: int = 0, dropped: int = 0, late: float = 0.0
    ) -> None:
        s = self._stats
        self._stats = DelayLineStats(
            delivered=s.delivered + delivered,
            dropped=s.dropped + dropped,
            late_total_s=s.late_total_s + late,
            late_max_s=max(s.late_max_s, late),
        )

    def _start_worker_locked(self) -> None:
        if self._threaded and self._thread is None:
            self._thread = threading.Thread(
                target=self._run_worker, name=f"fedpipe-{self.name}", daemon=True
            )
            self._thread.start()

    def _run_worker(self) -> None:
        try:
            while (entry := self._next_entry()) is not None:
                self._deliver_one(*entry)
        except BaseException as err:  # the consumer failed: remember it, stop, drop the rest
            log.exception("[%s] deliver() raised; dropping the remaining items", self.name)
            with self._cond:
                self._error = err
                self._drop_queued_locked()
                self._cond.notify_all()

    def _next_entry(self) -> tuple[float, T] | None:
        """Block until the head item is due and pop it; None once closed and drained/dropped."""
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return None
                head = self._queue[0]
                at = head[0]
                now = self.clock.now()
                if now >= at:
                    self._queue.popleft()
                    self._in_flight += 1
                    return head
            # Sleep outside the lock so producers can keep putting; in slices so a drop is prompt.
            self.clock.sleep_until(min(at, now + _MAX_SLEEP_SLICE_S))

    # -- errors --------------------------------------------------------------------------------

    def _check_open(self) -> None:
        self._raise_if_failed()
        if self._closed:
            raise DelayLineClosed(
                f"DelayLine {self.name!r} is closed; create a new one to send more."
            )

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise DelayLineClosed(
                f"DelayLine {self.name!r}: deliver() raised {self._error!r} in the delivery "
                "thread; later items were dropped."
            ) from self._error
