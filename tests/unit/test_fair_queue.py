"""The compute worker's queue: FIFO within a session, round-robin across sessions."""

from __future__ import annotations

import threading

from fedpipe.server.fair_queue import FairQueue


def _drain(q: FairQueue[str, int]) -> list[tuple[str, int]]:
    out = []
    while (got := q.get(timeout=0)) is not None:
        out.append(got)
    return out


def test_sessions_alternate_and_keep_their_own_order() -> None:
    q: FairQueue[str, int] = FairQueue()
    for i in range(5):
        q.put("flood", i)
    q.put("calm", 0)
    q.put("calm", 1)
    assert _drain(q) == [
        ("flood", 0),
        ("calm", 0),
        ("flood", 1),
        ("calm", 1),
        ("flood", 2),
        ("flood", 3),
        ("flood", 4),
    ]


def test_a_late_session_waits_at_most_one_turn_per_other_session() -> None:
    q: FairQueue[str, int] = FairQueue()
    for i in range(100):
        q.put("a", i)
        q.put("b", i)
    q.put("late", 0)
    order = [key for key, _ in _drain(q)]
    assert order.index("late") <= 2  # behind one item of each session ahead of it


def test_clear_pending_and_len() -> None:
    q: FairQueue[str, int] = FairQueue()
    for i in range(3):
        q.put("x", i)
    q.put("y", 9)
    assert (q.pending("x"), q.pending("y"), len(q)) == (3, 1, 4)
    assert q.clear("x") == [0, 1, 2]
    assert q.clear("x") == []
    assert _drain(q) == [("y", 9)]


def test_close_wakes_a_waiting_get() -> None:
    q: FairQueue[str, int] = FairQueue()
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(q.get()))
    waiter.start()
    q.close()
    waiter.join(timeout=5)
    assert got == [None]
    assert q.get(timeout=0) is None


def test_a_quantum_serves_queued_items_of_one_key_together() -> None:
    q: FairQueue[str, int] = FairQueue(quantum=2)
    for i in range(5):
        q.put("a", i)
    q.put("b", 0)
    q.put("b", 1)
    q.put("b", 2)
    assert [k for k, _ in _drain(q)] == ["a", "a", "b", "b", "a", "a", "b", "a"]
