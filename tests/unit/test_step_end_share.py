"""The step-end share of ``fedpipe bench pipeline``: which spans of a step's trace it takes."""

from __future__ import annotations

import pytest
from fedpipe_bench.pipeline import device_step_end, step_end

from fedpipe.trace import Event


def _step(*spans: tuple[str, str, float, float]) -> list[Event]:
    return [Event(name, lane, start, end) for name, lane, start, end in spans]


def test_device_step_end_runs_from_the_last_backward_to_the_optimizer_end() -> None:
    events = _step(
        ("F0", "device", 0.0, 1.0),
        ("a0", "uplink", 1.0, 1.5),
        ("T0", "device", 3.0, 4.0),
        ("Sb0", "server", 4.5, 5.0),  # another lane: never the device's backward
        ("B0", "device", 6.0, 7.0),
        ("O", "device", 7.25, 7.5),
    )
    assert device_step_end(events) == pytest.approx(0.5)


def test_a_frozen_head_ends_its_step_from_the_last_tail() -> None:
    events = _step(("F0", "device", 0.0, 1.0), ("T0", "device", 2.0, 3.0), ("O", "device", 3, 4))
    assert device_step_end(events) == pytest.approx(1.0)


def test_a_step_without_an_optimizer_has_no_step_end() -> None:
    assert device_step_end(_step(("B0", "device", 0.0, 1.0))) == 0.0


def test_the_share_adds_the_server_step_to_the_device_end_over_the_median_step() -> None:
    end = step_end([1.0, 2.0, 3.0], [0.01, 0.03, 0.02], [0.04, 0.04])
    assert end == {"device_s": 0.02, "server_s": 0.04, "share": pytest.approx(0.03)}
