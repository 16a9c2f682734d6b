"""Per-session work queues served round-robin: the server's fairness policy, as data.

The StageServer's single compute worker takes its next item from here. Each session has its own
FIFO (a device's messages must be computed in the order it sent them), and the worker serves the
sessions that have work in turn, a few queued items each, so a device that floods the server
with work delays another device by at most one turn's worth of its items instead of by its whole
backlog.
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
    """FIFO per key; ``get`` serves the keys that have items round-robin.

    A turn serves up to ``quantum`` items of one key that are already queued (the server
    switches adapters between sessions, which costs as much as a small microbatch), so a key
    waits at most ``quantum`` items per other key with work.
    """

    def __init__(self, *, quantum: int = 1) -> None:
        if quantum < 1:
            raise ValueError(f"quantum must be >= 1, got {quantum}")
        self.quantum = quantum
        self._queues: dict[K, deque[T]] = {}
        self._ring: deque[K] = deque()  # keys with at least one item, in serving order
        self._turn: K | None = None  # the key at the head of the ring being served
        self._served = 0  # items served in the current turn
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
            key = self._ring[0]
            if key != self._turn:
                self._turn, self._served = key, 0
            items = self._queues[key]
            item = items.popleft()
            self._served += 1
            if not items:
                del self._queues[key]
                self._ring.popleft()
                self._turn = None
            elif self._served >= self.quantum:
                self._ring.rotate(-1)  # back of the line: the others go first
                self._turn = None
            return key, item

    def clear(self, key: K) -> list[T]:
        """Remove and return everything queued for ``key``."""
        with self._cond:
            items = self._queues.pop(key, deque())
            if items:
                self._ring.remove(key)
                if self._turn == key:
                    self._turn = None
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
