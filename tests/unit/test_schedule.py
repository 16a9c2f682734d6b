"""Schedules as data: every named schedule is a valid step, and invalid ones are refused clearly."""

from __future__ import annotations

import pytest

from fedpipe.edge.schedules import SCHEDULES, Action, Op, Schedule, make_schedule

MS = range(1, 9)
TAIL = [True, False]


def _ops(has_tail: bool) -> tuple[Op, ...]:
    return (Op.FORWARD, Op.TAIL, Op.BACKWARD) if has_tail else (Op.FORWARD, Op.BACKWARD)


def _actions(text: str) -> tuple[Action, ...]:
    return tuple(Action.parse(a) for a in text.split())


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("has_tail", TAIL)
def test_every_schedule_is_a_complete_step_in_dependency_order(
    name: str, m: int, has_tail: bool
) -> None:
    schedule = make_schedule(name, m, has_tail=has_tail)
    ops = _ops(has_tail)
    assert schedule.name == name
    assert schedule.num_microbatches == m
    assert schedule.ops == ops
    expected = {Action(op, i) for op in ops for i in range(m)}
    assert len(schedule.actions) == len(expected)  # each action exactly once ...
    assert set(schedule.actions) == expected  # ... and none missing
    position = {a: i for i, a in enumerate(schedule.actions)}
    for i in range(m):
        order = [position[Action(op, i)] for op in ops]
        assert order == sorted(order), f"{schedule}: microbatch {i} out of dependency order"
    # Rebuilding from the printed form gives the same schedule: it prints what it is.
    printed = str(schedule).split(": ", 1)[1]
    assert _actions(printed) == schedule.actions


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("has_tail", TAIL)
def test_peak_in_flight(m: int, has_tail: bool) -> None:
    assert make_schedule("sequential", m, has_tail=has_tail).peak_in_flight() == 1
    assert make_schedule("gpipe", m, has_tail=has_tail).peak_in_flight() == m
    assert make_schedule("1f1b", m, has_tail=has_tail).peak_in_flight() == min(m, 4)
    for k in (1, 2, 3, 8):
        one_f_one_b = make_schedule("1f1b", m, has_tail=has_tail, max_in_flight=k)
        assert one_f_one_b.peak_in_flight() == min(m, k)
        assert one_f_one_b.max_in_flight == min(m, k)


def test_1f1b_interleaves_after_warm_up() -> None:
    assert str(make_schedule("1f1b", 4, max_in_flight=2)) == (
        "1f1b(M=4): F0 F1 T0 B0 F2 T1 B1 F3 T2 B2 T3 B3"
    )
    assert str(make_schedule("1f1b", 3, has_tail=False, max_in_flight=2)) == (
        "1f1b(M=3): F0 F1 B0 F2 B1 B2"
    )


def test_greedy_is_dynamic_with_its_cap() -> None:
    greedy = make_schedule("greedy", 5, max_in_flight=2)
    assert not greedy.strict
    assert greedy.max_in_flight == 2
    assert make_schedule("greedy", 5).max_in_flight is None
    assert all(make_schedule(n, 3).strict for n in ("sequential", "gpipe", "1f1b"))


@pytest.mark.parametrize(
    ("text", "m", "has_tail", "message"),
    [
        ("F0 F0 T0 B0", 1, True, "F0 appears twice"),
        ("F0 B0 B0", 1, False, "B0 appears twice"),
        ("F0 B0 T0", 1, True, "B0 comes before T0"),
        ("B0 F0", 1, False, "B0 comes before F0"),
        ("T0 F0 B0", 1, True, "T0 comes before F0"),
        ("B1 F0 F1 B0", 2, False, "B1 comes before F1"),
        ("F0 T0 B0 F1 T1", 2, True, "missing actions B1"),
        ("F0", 1, False, "missing actions B0"),
        ("", 2, False, "missing actions B0 B1 F0 F1"),
        ("F0 B0 F2 B2", 2, False, "F2 is not part of a 2-microbatch step"),
        ("F0 T0 B0", 1, False, "T0 is not part of a 1-microbatch step"),
    ],
)
def test_invalid_schedules_say_what_is_wrong(
    text: str, m: int, has_tail: bool, message: str
) -> None:
    actions = _actions(text) if text else ()
    with pytest.raises(ValueError, match=message) as info:
        Schedule("custom", m, actions, has_tail=has_tail)
    assert str(info.value).startswith("custom: "), "the error should name the schedule"


def test_schedule_needs_a_microbatch_and_a_positive_cap() -> None:
    with pytest.raises(ValueError, match="at least 1 microbatch, got 0"):
        Schedule("custom", 0, ())
    with pytest.raises(ValueError, match="max_in_flight must be >= 1, got 0"):
        Schedule("custom", 1, _actions("F0 B0"), has_tail=False, max_in_flight=0)
    with pytest.raises(ValueError, match="at least 1 microbatch"):
        make_schedule("gpipe", 0)


def test_action_parse_round_trip() -> None:
    for op in Op:
        for mb in (0, 1, 7, 123):
            action = Action(op, mb)
            assert Action.parse(str(action)) == action
    assert Action.parse("T3") == Action(Op.TAIL, 3)
    assert str(Action(Op.BACKWARD, 7)) == "B7"


@pytest.mark.parametrize("text", ["", "F", "X1", "f1", "Fx", "1F", "FB1"])
def test_action_parse_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError, match=f"bad action {text!r}: expected F<n>, T<n> or B<n>"):
        Action.parse(text)


def test_make_schedule_unknown_name_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'") as info:
        make_schedule("zigzag", 4)
    for name in SCHEDULES:
        assert name in str(info.value)
