"""Per-session work queues served round-robin: the server's fairness policy, as data.

The StageServer's single compute worker takes its next item from here. Each session has its own
FIFO (a device's messages must be computed in the order it sent them), and the worker serves the
sessions that have work in turn, one item each, so a device that floods the server with work
delays another device by at most one of its items per turn instead of by its whole backlog.
The queue knows nothing of torch or gRPC; tests drive it directly.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["FairQueue"]

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class FairQueue(Generic[K, T]):
    """FIFO per key; ``get`` serves the keys that have items round-robin, one item per turn."""

    def __init__(self) -> None:
        self._queues: dict[K, deque[T]] = {}
        self._ring: deque[K] = deque()  # keys with at least one item, in serving order
        self._cond = threading.Condition()
        self._closed = False

    def put(self, key: K, item: T) -> None:
        """Append ``item`` to ``key``'s FIFO; a key that was idle joins the end of the ring."""
        with self._cond:
            items = self._queues.setdefault(key, deque())
            if not items:
                self._ring.append(key)
            items.append(item)
            self._cond.notify()

    def get(self, timeout: float | None = None) -> tuple[K, T] | None:
        """The next ``(key, item)`` in round-robin order; None once closed or after ``timeout``."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._ring or self._closed, timeout):
                return None
            if self._closed:
                return None
            key = self._ring.popleft()
            items = self._queues[key]
            item = items.popleft()
            if items:
                self._ring.append(key)  # back of the line: the others go first
            else:
                del self._queues[key]
            return key, item

    def clear(self, key: K) -> list[T]:
        """Remove and return everything queued for ``key``."""
        with self._cond:
            items = self._queues.pop(key, deque())
            if items:
                self._ring.remove(key)
            return list(items)

    def pending(self, key: K) -> int:
        """How many items ``key`` has queued."""
        with self._cond:
            return len(self._queues.get(key, ()))

    def __len__(self) -> int:
        with self._cond:
            return sum(len(q) for q in self._queues.values())

    def close(self) -> None:
        """Wake every waiting ``get`` with None; later ``get`` calls return None at once."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
