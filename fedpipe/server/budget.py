"""One byte budget for everything devices can make a StageServer hold.

Per-session limits (``server.max_pending_mb``, ``server.max_delta_cache_mb``, ...) bound one
device; their product over ``server.max_sessions`` sessions is far more than a server has. The
budget bounds the sum: messages queued for compute and replies not yet read, link probes'
replies, decodes in progress, and devices' delta caches (live in sessions and kept between
rounds) all draw from it, and a draw past it is refused with RESOURCE_EXHAUSTED naming
``server.memory_budget_mb``. The frozen model and the adapters are the server's own and are not
counted.
"""

from __future__ import annotations

import threading

from fedpipe.errors import StageCapacityError

__all__ = ["ByteBudget"]

_MIB = 2**20


class ByteBudget:
    """Bytes drawn by what devices sent or asked for; ``take`` refuses past the capacity."""

    def __init__(self, capacity: int, *, setting: str = "server.memory_budget_mb") -> None:
        if capacity <= 0:
            raise ValueError(f"{setting} must be > 0, got {capacity / _MIB:g} MiB")
        self.capacity = capacity
        self.setting = setting
        self.used = 0
        self.peak = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int, what: str) -> None:
        """Draw ``nbytes`` for ``what``, or raise StageCapacityError (nothing drawn)."""
        with self._lock:
            if self.used + nbytes > self.capacity:
                raise StageCapacityError(
                    f"{what} ({nbytes / _MIB:.1f} MiB) would pass the StageServer's memory "
                    f"budget: {self.used / _MIB:.1f} of {self.capacity / _MIB:g} MiB are held "
                    f"for devices ({self.setting}); retry later, or raise it"
                )
            self._add(nbytes)

    def force(self, nbytes: int) -> None:
        """Draw (or, negative, give back) bytes that cannot be refused: a computed reply."""
        with self._lock:
            self._add(nbytes)

    def give(self, nbytes: int) -> None:
        """Give back what was drawn."""
        with self._lock:
            self._add(-nbytes)

    def _add(self, nbytes: int) -> None:
        self.used += nbytes
        self.peak = max(self.peak, self.used)
        if self.used < 0:  # a bookkeeping bug must not turn into an unbounded budget
            raise AssertionError(f"byte budget below zero ({self.used}): a release was repeated")
