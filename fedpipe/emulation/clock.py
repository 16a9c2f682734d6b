"""Clocks for the emulator: a real monotonic clock and a fake one that tests move by hand."""

from __future__ import annotations

import math
import threading
import time
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "FakeClock", "RealClock"]


@runtime_checkable
class Clock(Protocol):
    """What the link emulator needs from time: read it, and wait until a moment."""

    def now(self) -> float:
        """Seconds on a monotonic timeline (the origin is arbitrary)."""
        ...

    def sleep_until(self, t: float) -> None:
        """Return once `now() >= t` (immediately if `t` has passed)."""
        ...


class RealClock:
    """`time.monotonic`; `sleep_until` sleeps in a loop, because `time.sleep` may wake early."""

    def now(self) -> float:
        return time.monotonic()

    def sleep_until(self, t: float) -> None:
        while (remaining := t - time.monotonic()) > 0:
            time.sleep(remaining)

    def __repr__(self) -> str:
        return "RealClock()"


class FakeClock:
    """A clock that moves only when told: `advance(dt)`, `set(t)`, or `sleep_until(t)` (a jump).

    Thread-safe. Time never goes backwards: `sleep_until` a past moment is a no-op.
    """

    def __init__(self, start: float = 0.0) -> None:
        if not math.isfinite(start):
            raise ValueError(f"FakeClock start must be finite (got {start}).")
        self._now = float(start)
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._now

    def sleep_until(self, t: float) -> None:
        with self._lock:
            self._now = max(self._now, float(t))

    def advance(self, dt: float) -> float:
        """Move time forward by `dt` seconds (>= 0); returns the new time."""
        if not dt >= 0 or math.isinf(dt):
            raise ValueError(f"FakeClock.advance needs a finite dt >= 0 seconds (got {dt}).")
        with self._lock:
            self._now += dt
            return self._now

    def set(self, t: float) -> None:
        """Jump to time `t`, which must not be earlier than now."""
        with self._lock:
            if not t >= self._now or math.isinf(t):
                raise ValueError(
                    f"FakeClock.set({t}) would move time backwards or to infinity "
                    f"(now {self._now})."
                )
            self._now = float(t)

    def __repr__(self) -> str:
        return f"FakeClock(now={self.now()})"
