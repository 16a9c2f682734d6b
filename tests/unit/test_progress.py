"""Which devices of a round are late, from the StageServer's step counts (fedpipe.fl.progress).

The sessions here are what RoundStatus answers (seconds before the answer); the rules are the
module's: a device is named late only when it is past its own step time, past the grace after
connecting or finishing, or not connected while the round has nothing else to wait for.
"""

from __future__ import annotations

import pytest

from fedpipe.fl.progress import LATE_STEPS, START_S, StepWatch, assess, by_device, step_seconds
from fedpipe.wire.backend import SessionProgress

STEPS, GRACE, START = 4, 30.0, 120.0


def _session(
    device: int, steps_done: int, *, opened: float, first: float = 0, last: float = 0
) -> SessionProgress:
    stepped = steps_done > 0
    return SessionProgress(
        device_id=str(device),
        steps_done=steps_done,
        opened_s_ago=opened,
        first_step_s_ago=first if stepped else None,
        last_step_s_ago=last if stepped else None,
        closed=steps_done >= STEPS,
    )


def _assess(sessions: list[SessionProgress], nodes: list[int], elapsed: float, **outcome: str):  # type: ignore[no-untyped-def]
    return assess(
        nodes,
        {s.device_id: s for s in sessions},
        {int(k.removeprefix("n")): v for k, v in outcome.items()},
        steps=STEPS,
        elapsed_s=elapsed,
        grace_s=GRACE,
        start_s=START,
    )


def test_step_time_is_measured_between_steps_and_after_one_since_the_open() -> None:
    assert step_seconds(_session(1, 3, opened=50, first=40, last=30)) == 5.0
    assert step_seconds(_session(1, 1, opened=50, first=38, last=38)) == 12.0
    assert step_seconds(_session(1, 0, opened=50)) is None


def test_training_devices_are_on_time_until_several_of_their_step_times_pass() -> None:
    # 2 s steps: late after max(grace, LATE_STEPS * 2 s) = 30 s without a step
    fast = _session(1, 2, opened=40, first=6, last=4)
    assert step_seconds(fast) == 2.0
    [on_time] = _assess([fast], [1], elapsed=40)
    assert (on_time.state, on_time.steps_done, on_time.why) == ("training", 2, "")
    stuck = _session(1, 3, opened=80, first=35, last=31)
    [late] = _assess([stuck], [1], elapsed=80)
    assert late.state == "late" and late.why == "no step for 31 s (its steps take 2.0 s)"
    # a slow device (20 s steps) gets LATE_STEPS of them, more than the grace
    bound = 20 * LATE_STEPS
    slow = _session(1, 2, opened=300, first=bound - 1 + 20, last=bound - 1)
    assert _assess([slow], [1], elapsed=300)[0].state == "training"
    slower = _session(1, 2, opened=300, first=bound + 1 + 20, last=bound + 1)
    [late] = _assess([slower], [1], elapsed=300)
    assert late.why == "no step for 101 s (its steps take 20.0 s)"


def test_a_connected_device_without_a_step_is_late_after_the_rounds_step_times() -> None:
    """Its first step may take long (planning, a slow device): LATE_STEPS of the slowest step
    time measured in the round, at least the grace; the start allowance while none is."""
    alone = _session(1, 0, opened=START - 1)
    assert _assess([alone], [1], elapsed=START)[0].state == "starting"
    [late] = _assess([_session(1, 0, opened=START + 1)], [1], elapsed=START + 10)
    assert late.why == "connected 121 s ago, no step done yet"
    fast = _session(2, 2, opened=40, first=6, last=4)  # 2 s steps: the grace bounds it
    assert _assess([_session(1, 0, opened=29), fast], [1, 2], 40)[0].state == "starting"
    assert _assess([_session(1, 0, opened=31), fast], [1, 2], 40)[0].state == "late"
    slow = _session(2, 2, opened=200, first=30, last=10)  # 20 s steps: 100 s
    assert _assess([_session(1, 0, opened=99), slow], [1, 2], 200)[0].state == "starting"
    assert _assess([_session(1, 0, opened=101), slow], [1, 2], 200)[0].state == "late"


def test_a_device_that_did_its_steps_is_late_only_when_its_reply_does_not_come() -> None:
    assert _assess([_session(1, 4, opened=20, first=15, last=5)], [1], 20)[0].state == "finished"
    [late] = _assess([_session(1, 4, opened=60, first=55, last=40)], [1], 60)
    assert late.why == "did its 4 steps 40 s ago; no reply yet"


def test_an_unconnected_device_is_starting_while_others_train() -> None:
    """In a simulation with fewer slots than devices, the rest wait for the first ones."""
    training = _session(1, 2, opened=200, first=150, last=2)
    devices = _assess([training], [1, 2], elapsed=200)
    assert [(d.node_id, d.state) for d in devices] == [(1, "training"), (2, "starting")]


def test_an_unconnected_device_is_late_once_the_round_waits_for_it_alone() -> None:
    finished = _session(1, 4, opened=100, first=90, last=25)
    assert _assess([finished], [1, 2], elapsed=100, n1="done")[1].state == "starting"
    gone_quiet = _session(1, 4, opened=100, first=90, last=31)
    evaluator = SessionProgress("evaluator", 0, opened_s_ago=1.0)  # not a device of the round
    done, late = _assess([gone_quiet, evaluator], [1, 2], elapsed=100, n1="done")
    assert (done.state, done.steps_done) == ("done", 4)
    assert late.state == "late"
    assert late.why == "not connected to the StageServer 100 s into the round"


def test_while_no_device_has_connected_the_start_allowance_applies() -> None:
    """All devices loading the model at once is no fault: late only after start_s."""
    assert {d.state for d in _assess([], [1, 2], elapsed=START - 1)} == {"starting"}
    devices = _assess([], [1, 2], elapsed=START + 1)
    assert [d.why for d in devices] == ["not connected to the StageServer 121 s into the round"] * 2


def test_replies_in_decide_the_state_whatever_the_counts() -> None:
    failed = _session(2, 1, opened=90, first=80, last=80)
    devices = _assess([failed], [1, 2], elapsed=90, n1="done", n2="failed")
    assert [(d.state, d.steps_done, d.why) for d in devices] == [("done", 0, ""), ("failed", 1, "")]


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_the_newest_session_of_a_device_counts(order: tuple[int, int]) -> None:
    old, new = _session(1, 3, opened=90, first=80, last=60), _session(1, 1, opened=20, last=10)
    both = [(old, new)[i] for i in order]
    assert by_device(both) == {"1": new}


def test_the_start_allowance_grows_with_the_slowest_start_seen() -> None:
    """A deployed device starts its ClientApp and loads the model every round: once one took
    200 s to open its session, later rounds allow it twice that before calling it late."""
    seen: list[SessionProgress] = []
    watch = StepWatch(lambda round_: list(seen), steps=STEPS, grace_s=GRACE, connect_s=10.0)
    assert watch.start_s == START_S
    assert [d.state for d in watch.look(1, [1], {}, elapsed_s=START_S + 1) or []] == ["late"]
    seen.append(_session(1, 0, opened=100))
    watch.look(1, [1], {}, elapsed_s=300)  # it opened its session 200 s into the round
    assert watch.start_s == 400
    seen.clear()
    assert [d.state for d in watch.look(2, [1], {}, elapsed_s=399) or []] == ["starting"]
    assert [d.state for d in watch.look(2, [1], {}, elapsed_s=401) or []] == ["late"]
    assert (
        StepWatch(lambda round_: None, steps=STEPS, grace_s=1, connect_s=1).look(
            1, [1], {}, elapsed_s=1000
        )
        is None
    )  # the server cannot say: nothing is assessed
