"""The async bench's figures from its clocks: time to a target loss, the loss at a wall time,
and a device's idle share of the window (fedpipe_bench.async_rounds)."""

from __future__ import annotations

import pytest
from fedpipe_bench.async_rounds import device_idle, loss_at, wall_to

EVALS = [
    {"round": 0, "at_s": 0.0, "eval_loss": 5.0},
    {"round": 1, "at_s": 2.0, "eval_loss": 4.5},
    {"round": 2, "at_s": 4.0, "eval_loss": 4.0},
    {"round": 3, "at_s": 6.0, "eval_loss": 4.2},
]


def test_time_to_target_is_the_first_evaluation_at_or_below_it() -> None:
    assert wall_to(EVALS, 4.5) == 2.0
    assert wall_to(EVALS, 4.1) == 4.0
    assert wall_to(EVALS, 3.9) is None


def test_loss_at_a_wall_time_is_the_last_evaluation_made_by_then() -> None:
    assert loss_at(EVALS, 5.9) == 4.0
    assert loss_at(EVALS, 6.0) == 4.2
    assert loss_at(EVALS, -1.0) is None


def test_idle_counts_what_a_node_waited_for_and_queued_work_once() -> None:
    # node 1: busy 0-4 and 6-10 of a 0-10 window (idle 0.2); node 2: busy 0-2, then a
    # message pushed at 1 while busy starts at 2 and ends at 3 (idle 0.7); node 3: still out
    pushed = [(0.0, 1, "a"), (6.0, 1, "b"), (0.0, 2, "c"), (1.0, 2, "d"), (5.0, 3, "e")]
    answered = [(4.0, 1, "a"), (10.0, 1, "b"), (2.0, 2, "c"), (3.0, 2, "d")]
    idle = device_idle(pushed, answered, 0.0, 10.0)
    assert idle[1] == pytest.approx(0.2)
    assert idle[2] == pytest.approx(0.7)
    assert idle[3] == pytest.approx(0.5)  # busy from 5 to the window's end
    late = device_idle(pushed, answered, 5.0, 10.0)  # before the window does not count
    assert late[1] == pytest.approx(0.2) and late[2] == pytest.approx(1.0)
