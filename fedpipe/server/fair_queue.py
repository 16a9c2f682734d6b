"""Per-session work queues served round-robin: the server's fairness policy, as data.

The StageServer's single compute worker takes its next item from here. Each session has its own
FIFO (a device's messages must be computed in the order it sent them), and the worker serves the
sessions that have work in turn, a few queued items each, so a device that floods the server
with work delays another device by at most one turn's worth of its items instead of by its whole
backlog.
The queue knows nothing of torch or gRPC; tests drive it directly.

``get`` takes one item (the unbatched server); ``take_batch`` shows a chooser (the batching
policy) the first items of every key, with how long each has waited, and takes what it picks,
all under the queue's lock, so nothing changes between the look and the take.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

__all__ = ["Choice", "FairQueue", "Snapshot"]

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")
C = TypeVar("C", bound="Choice")


class Choice(Protocol):
    """What a chooser returns to ``take_batch`` (a ``batch_policy.Plan`` is one)."""

    @property
    def picks(self) -> Sequence[tuple[Hashable, int]]: ...  # (key, first n items) to take

    @property
    def wait_s(self) -> float: ...  # > 0: wait this long (or until a put), then choose again

    @property
    def end_turn(self) -> bool: ...  # served keys go to the back (False: quantum turns)


@dataclass(frozen=True)
class Snapshot(Generic[K, T]):
    """The keys with work in serving order, each with its first items and their ages (s)."""

    ring: list[tuple[K, list[tuple[T, float]]]]
    served: int  # items the ring's head has had in its current turn
    skipped: int  # takes that passed the ring's head over


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
        self._queues: dict[K, deque[tuple[float, T]]] = {}  # (time queued, item)
        self._ring: deque[K] = deque()  # keys with at least one item, in serving order
        self._turn: K | None = None  # the key at the head of the ring being served
        self._served = 0  # items served in the current turn
        self._skipped = 0  # takes that passed the ring's head over
        self._clock = time.monotonic
        self._cond = threading.Condition()
        self._closed = False

    def put(self, key: K, item: T) -> None:
        """Append ``item`` to ``key``'s FIFO; a key that was idle joins the end of the ring."""
        with self._cond:
            items = self._queues.setdefault(key, deque())
            if not items:
                self._ring.append(key)
            items.append((self._clock(), item))
            self._cond.notify()

    def get(self, timeout: float | None = None) -> tuple[K, T] | None:
        """The next ``(key, item)`` in round-robin order; None once closed or after ``timeout``."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._ring or self._closed, timeout):
                return None
            if self._closed:
                return None
            key = self._ring[0]
            ((_, item),) = self._pop(key, 1, end_turn=False)
            return key, item

    def take_batch(
        self,
        choose: Callable[[Snapshot[K, T]], C | None],
        *,
        depth: int,
        timeout: float | None = None,
    ) -> tuple[list[tuple[K, T]], C] | None:
        """The items ``choose`` picks from a snapshot (first ``depth`` items of each key).

        Blocks until some key has work; None once closed or after ``timeout``. A choice that
        asks to wait is asked again after the wait or as soon as anything is put.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self._ring or self._closed, timeout):
                return None
            while not self._closed:
                choice = choose(self._snapshot(depth))
                if choice is None:
                    return None
                if choice.wait_s <= 0:
                    return self._take(choice), choice
                self._cond.wait(choice.wait_s)
            return None

    def _snapshot(self, depth: int) -> Snapshot[K, T]:
        now = self._clock()
        ring = [
            (key, [(item, now - t) for t, item in list(self._queues[key])[:depth]])
            for key in self._ring
        ]
        served = self._served if self._ring and self._ring[0] == self._turn else 0
        return Snapshot(ring, served, self._skipped)

    def _take(self, choice: Choice) -> list[tuple[K, T]]:
        head = self._ring[0] if self._ring else None
        out: list[tuple[K, T]] = []
        for key, n in choice.picks:
            if key in self._queues:  # typed as Hashable by the protocol; our own keys
                out += [(key, item) for _, item in self._pop(key, n, end_turn=choice.end_turn)]  # type: ignore[misc]
        served_head = any(key == head for key, _ in choice.picks)
        self._skipped = (
            0 if served_head or not self._ring or self._ring[0] != head else self._skipped + 1
        )
        return out

    def _pop(self, key: K, n: int, *, end_turn: bool) -> list[tuple[float, T]]:
        """Up to ``n`` items of ``key``; then the key leaves, keeps or ends its turn."""
        items = self._queues[key]
        popped = [items.popleft() for _ in range(min(n, len(items)))]
        if key != self._turn:
            self._turn, self._served = key, 0
        self._served += len(popped)
        if not items:
            del self._queues[key]
            self._ring.remove(key)
            self._turn = None
        elif end_turn or self._served >= self.quantum:
            self._ring.remove(key)
            self._ring.append(key)  # back of the line: the others go first
            self._turn = None
        return popped

    def clear(self, key: K) -> list[T]:
        """Remove and return everything queued for ``key``."""
        with self._cond:
            items = self._queues.pop(key, deque())
            if items:
                self._ring.remove(key)
                if self._turn == key:
                    self._turn = None
            return [item for _, item in items]

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
