"""Emulate a slower device: after each block of compute, sleep (slowdown - 1) x its duration."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from fedpipe.emulation.clock import Clock, RealClock

__all__ = ["ComputeThrottle", "ThrottleStats"]


@dataclass(frozen=True)
class ThrottleStats:
    """Host compute measured inside `run()` blocks and the delay added to emulate the device."""

    calls: int = 0
    compute_s: float = 0.0
    added_s: float = 0.0

    @property
    def emulated_s(self) -> float:
        """What the compute would have taken on the device: compute_s + added_s."""
        return self.compute_s + self.added_s


class ComputeThrottle:
    """Stretch compute by `slowdown` (>= 1); thread-safe, each thread sleeps for its own blocks.

    The block is timed with `timer` (default: `clock.now`, wall time, so time the block spends
    waiting counts too: put only compute inside `run()`). Tests pass a `FakeClock` and advance it
    inside the block; the added delay then advances the same fake clock. `slowdown == 1.0` adds
    nothing.
    """

    def __init__(
        self,
        slowdown: float,
        clock: Clock | None = None,
        *,
        timer: Callable[[], float] | None = None,
    ) -> None:
        if not math.isfinite(slowdown) or slowdown < 1.0:
            raise ValueError(
                f"ComputeThrottle: slowdown must be a finite number >= 1.0 (got {slowdown}); "
                "a device faster than the host cannot be emulated, use 1.0."
            )
        self.slowdown = float(slowdown)
        self.clock: Clock = clock if clock is not None else RealClock()
        self._timer = timer if timer is not None else self.clock.now
        self._lock = threading.Lock()
        self._stats = ThrottleStats()

    @contextmanager
    def run(self) -> Iterator[None]:
        """Time the block, then sleep to stretch it. Nothing is added if the block raises."""
        start = self._timer()
        yield
        self.pad(self._timer() - start)

    def pad(self, compute_s: float) -> float:
        """Account `compute_s` of host compute timed elsewhere; sleep the extra and return it."""
        compute_s = max(0.0, compute_s)
        added = (self.slowdown - 1.0) * compute_s
        if added > 0.0:
            self.clock.sleep_until(self.clock.now() + added)
        with self._lock:
            s = self._stats
            self._stats = ThrottleStats(s.calls + 1, s.compute_s + compute_s, s.added_s + added)
        return added

    def stats(self) -> ThrottleStats:
        with self._lock:
            return self._stats

    def reset_stats(self) -> None:
        with self._lock:
            self._stats = ThrottleStats()

    def __repr__(self) -> str:
        return f"ComputeThrottle(slowdown={self.slowdown:g})"
