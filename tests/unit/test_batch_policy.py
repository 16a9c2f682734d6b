"""The batching policy on its own: lanes, budget, shares, bounded delay, measured waits.

Driven through the real FairQueue, without torch, threads or clocks.
"""

from __future__ import annotations

import random

import pytest

from fedpipe.server.batch_policy import (
    BatchChoice,
    BatchPolicy,
    Item,
    Lane,
    QueueView,
    SessionView,
    choose_batch,
)
from fedpipe.server.fair_queue import FairQueue, Snapshot

Q = FairQueue[str, Item]


def _view(snap: Snapshot[str, Item], **extra: float) -> QueueView:
    ring = tuple(
        SessionView(key, tuple(Item(i.lane, i.tokens, 0.0) for i, _ in items))
        for key, items in snap.ring
    )
    return QueueView(ring, snap.served, snap.skipped, **extra)  # type: ignore[arg-type]


def _take(q: Q, policy: BatchPolicy) -> tuple[list[tuple[str, Item]], BatchChoice]:
    got = q.take_batch(
        lambda snap: choose_batch(policy, _view(snap)), depth=policy.quantum, timeout=0
    )
    assert got is not None
    return got


def test_disabled_is_todays_round_robin_one_message_at_a_time() -> None:
    rng = random.Random(0)
    plain: Q = FairQueue(quantum=2)
    policed: Q = FairQueue(quantum=2)
    policy = BatchPolicy(enabled=False)
    order_plain, order_policed = [], []
    for step in range(300):
        if rng.random() < 0.6:
            key = rng.choice("abcd")
            item = Item(rng.choice(list(Lane)), rng.randint(1, 600), float(step))
            plain.put(key, item)
            policed.put(key, item)
        if rng.random() < 0.5 and len(plain):
            order_plain.append(plain.get(timeout=0))
            taken, plan = _take(policed, policy)
            assert len(taken) == 1 and not plan.end_turn
            order_policed += taken
    assert order_plain == order_policed and len(order_plain) > 100


def test_round_trips_first_then_eval_then_forwards() -> None:
    view = QueueView(
        (
            SessionView("f", (Item(Lane.FORWARD, 256),)),
            SessionView("e", (Item(Lane.EVAL, 256),)),
            SessionView("b", (Item(Lane.BACKWARD, 256),)),
            SessionView("b2", (Item(Lane.BACKWARD, 128), Item(Lane.FORWARD, 128))),
        )
    )
    plan = choose_batch(BatchPolicy(), view)
    assert plan is not None
    assert plan.lane is Lane.BACKWARD and plan.picks == (("b", 1), ("b2", 1))  # not b2's forward
    assert plan.tokens == 384


def test_a_heavy_session_takes_its_share_and_the_budget_holds() -> None:
    heavy = SessionView("heavy", tuple(Item(Lane.FORWARD, 512) for _ in range(10)))
    light = [SessionView(f"l{i}", (Item(Lane.FORWARD, 256),) * 3) for i in range(3)]
    plan = choose_batch(BatchPolicy(batch_tokens=2048, quantum=2), QueueView((heavy, *light)))
    assert plan is not None
    # First pass: one each (512 + 3 x 256 = 1280); second pass: heavy's 512 fits, then one 256.
    assert plan.picks == (("heavy", 2), ("l0", 2), ("l1", 1), ("l2", 1))
    assert plan.tokens == 2048
    huge = SessionView("huge", (Item(Lane.FORWARD, 9000),))
    plan = choose_batch(BatchPolicy(batch_tokens=2048), QueueView((huge, *light)))
    assert plan is not None and plan.picks == (("huge", 1),)  # the head runs, alone


@pytest.mark.parametrize("seed", range(5))
def test_no_session_waits_more_than_its_bound_however_the_others_flood(seed: int) -> None:
    """A session at ring position p is served within (p + 1) * (max_skips + 1) calls."""
    rng = random.Random(seed)
    policy = BatchPolicy(batch_tokens=1024, quantum=2, max_skips=2)
    q: Q = FairQueue(quantum=2)
    keys = [f"s{i}" for i in range(6)]
    waiting = {k: 0 for k in keys}  # calls since the session last had work and no service
    worst = 0
    for _ in range(2000):
        for key in keys:  # s0 floods urgent work; the others trickle in, often forwards only
            if key == "s0":
                for _ in range(3):
                    q.put(key, Item(rng.choice([Lane.CONTROL, Lane.BACKWARD]), 512))
            elif rng.random() < 0.3:
                q.put(key, Item(Lane.FORWARD, rng.randint(64, 2048)))
        ring = [key for key, _ in q._snapshot(1).ring]
        taken, _ = _take(q, policy)
        served = {key for key, _ in taken}
        for position, key in enumerate(ring):
            waiting[key] = 0 if key in served else waiting[key] + 1
            assert waiting[key] <= len(ring) * (policy.max_skips + 1), (key, position)
            worst = max(worst, waiting[key])
    assert worst > 0  # the flood did delay the others: the bound was exercised


def test_waiting_to_fill_is_a_measured_fraction_and_only_for_expected_work() -> None:
    ring = (SessionView("a", (Item(Lane.FORWARD, 256, waited_s=0.001),)),)
    policy = BatchPolicy(max_wait_s=0.005, wait_fraction=0.25)

    def wait(**extra: float) -> float:
        plan = choose_batch(policy, QueueView(ring, **extra))  # type: ignore[arg-type]
        assert plan is not None
        return plan.wait_s

    assert wait(expected=2, call_s=0.0) == 0.0  # nothing measured: no guess
    assert wait(expected=0, call_s=0.1) == 0.0  # nobody is mid-step: nothing will come
    assert wait(expected=2, call_s=0.012) == pytest.approx(0.003 - 0.001)  # 25 % of the call
    assert wait(expected=2, call_s=1.0) == pytest.approx(0.005 - 0.001)  # the cap
    assert choose_batch(
        BatchPolicy(enabled=False), QueueView(ring, expected=3, call_s=1)
    ) == BatchChoice((("a", 1),), Lane.FORWARD, 256, end_turn=False)


def test_take_batch_waits_then_takes_what_arrived() -> None:
    q: Q = FairQueue()
    q.put("a", Item(Lane.FORWARD, 256))
    calls: list[int] = []

    def choose(snap: Snapshot[str, Item]) -> BatchChoice | None:
        calls.append(len(snap.ring))
        if len(calls) == 1:
            q.put("b", Item(Lane.FORWARD, 256))  # arrives while the worker waits
            return BatchChoice((("a", 1),), Lane.FORWARD, 256, wait_s=0.01)
        return choose_batch(BatchPolicy(), _view(snap))

    got = q.take_batch(choose, depth=2, timeout=0)
    assert got is not None
    assert [key for key, _ in got[0]] == ["a", "b"] and calls == [1, 2]
    assert len(q) == 0


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="batch_tokens must be >= 1"):
        BatchPolicy(batch_tokens=0)
    with pytest.raises(ValueError, match="wait_fraction"):
        BatchPolicy(wait_fraction=2)
