"""A round's progress on the console: a live line on a terminal, plain lines elsewhere, and the
``progress``/``waiting`` records left out of summary.json."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from fedpipe.runs.folder import RunFolder
from fedpipe.runs.report import LiveReport, format_record
from fedpipe.runs.summary import build_summary


class _Terminal(io.StringIO):
    """stderr as a terminal: what a live line is drawn on."""

    def isatty(self) -> bool:
        return True


def _progress(round_: int, *steps_and_states: tuple[int, str], elapsed: float = 12.0) -> dict:
    devices = [
        {"node_id": 100 + p, "partition": p, "steps_done": done, "state": state}
        for p, (done, state) in enumerate(steps_and_states)
    ]
    return {"event": "progress", "round": round_, "elapsed_s": elapsed, "steps": 4,
            "devices": devices}  # fmt: skip


def _eval(round_: int) -> dict[str, Any]:
    return {"event": "eval", "round": round_, "eval_loss": 3.5, "eval_ppl": 33.1,
            "devices_trained": 2, "devices_failed": 0, "wall_s": 20.0}  # fmt: skip


def test_progress_line_gives_steps_done_per_device() -> None:
    rec = _progress(2, (4, "done"), (2, "training"), (0, "starting"), (1, "late"), (3, "failed"))
    assert format_record(rec, rounds=3) == (
        "round 2/3: 10/20 steps, 12 s; partition 0 4/4 done, partition 1 2/4, partition 2 "
        "starting, partition 3 1/4 late, partition 4 3/4 failed"
    )
    # before its first reply a device is known only by its Flower node id, cut short
    devices = [
        {"node_id": 17307674343159100829, "steps_done": 1, "state": "training"},
        {"node_id": 7, "steps_done": 0, "state": "starting"},
    ]
    unknown = {**rec, "devices": devices}
    assert format_record(unknown, rounds=3) == (
        "round 2/3: 1/8 steps, 12 s; node 173076… 1/4, node 7 starting"
    )


def test_waiting_line_names_the_late_devices_and_why() -> None:
    waiting = {
        "event": "waiting",
        "phase": "replies",
        "round": 2,
        "waiting_for": ["partition 1 (rpi-wifi)", "partition 3 (phone-lte)"],
        "why": ["no step for 95 s (its steps take 3.0 s)", "not connected to the StageServer"],
        "waited_s": 120.0,
        "deadline_s": 1800.0,
    }
    assert format_record(waiting, rounds=3) == (
        "round 2: waiting for partition 1 (rpi-wifi): no step for 95 s (its steps take 3.0 s); "
        "partition 3 (phone-lte): not connected to the StageServer (waited 120 s; goes on "
        "without them after 1800 s)"
    )


def test_off_a_terminal_progress_is_a_plain_line_at_most_every_report_period(
    tmp_path: Path,
) -> None:
    run = RunFolder.open(tmp_path, "log")
    out = io.StringIO()
    live = LiveReport(run.metrics_path, rounds=2, out=out, every_s=3600.0)
    assert not live.tty
    run.log_metrics(_progress(1, (0, "starting"), (0, "starting"), elapsed=0.0))
    live.poll()
    run.log_metrics(_progress(1, (1, "training"), (0, "starting")))
    run.log_metrics(_progress(1, (2, "training"), (1, "training")))
    live.poll()  # within the hour: not said again
    run.log_metrics(_eval(1))
    live.poll()
    assert out.getvalue().splitlines() == [
        "fedpipe: round 1/2: 0/8 steps, 0 s; partition 0 starting, partition 1 starting",
        "fedpipe: round 1/2: eval loss 3.5000 (ppl 33.1), 2/2 devices trained, up 0.0 kB, "
        "down 0.0 kB, 20.0 s",
    ]
    assert "\r" not in out.getvalue()


def test_off_a_terminal_the_latest_progress_is_said_when_the_period_allows(
    tmp_path: Path,
) -> None:
    run = RunFolder.open(tmp_path, "log")
    out = io.StringIO()
    live = LiveReport(run.metrics_path, rounds=2, out=out, every_s=0.0)
    run.log_metrics(_progress(1, (1, "training"), (0, "starting")))
    run.log_metrics(_progress(1, (2, "training"), (1, "training")))
    live.poll()  # two records since the last look: the newer one is said
    assert (
        out.getvalue() == "fedpipe: round 1/2: 3/8 steps, 12 s; partition 0 2/4, partition 1 1/4\n"
    )


def test_on_a_terminal_one_live_line_per_round_gives_way_to_its_result(tmp_path: Path) -> None:
    run = RunFolder.open(tmp_path, "tty")
    out = _Terminal()
    live = LiveReport(run.metrics_path, rounds=2, out=out)
    assert live.tty
    run.log_metrics(_progress(1, (1, "training"), (0, "starting")))
    live.poll()
    run.log_metrics(_progress(1, (3, "training"), (2, "training")))
    run.log_metrics({"event": "failure", "round": 1, "device": "partition 1", "reason": "gone"})
    live.poll()
    drawn = out.getvalue()
    assert "\rfedpipe: round 1/2 |" in drawn  # redrawn in place, not a new line each time
    assert "| 1/8 steps [" in drawn and "partition 0 1/4, partition 1 starting" in drawn
    assert "| 5/8 steps [" in drawn and "partition 0 3/4, partition 1 2/4" in drawn
    # a line said while the round runs goes above the live line, which is drawn again after it
    failure = "fedpipe: device partition 1 failed in round 1: gone\n"
    assert failure in drawn
    assert "| 5/8 steps [" in drawn.split(failure)[1]
    run.log_metrics(_eval(1))
    live.poll()
    rest = out.getvalue()[len(drawn) :]
    result = "fedpipe: round 1/2: eval loss 3.5000 (ppl 33.1), 2/2 devices trained, up 0.0 kB, "
    assert rest.rstrip("\n").endswith(result + "down 0.0 kB, 20.0 s")
    assert "steps [" not in rest.split("fedpipe: round 1/2: eval")[1]  # no live line after it
    live.stop()


def test_no_progress_prints_no_progress(tmp_path: Path) -> None:
    run = RunFolder.open(tmp_path, "quiet")
    for out in (io.StringIO(), _Terminal()):
        live = LiveReport(run.metrics_path, rounds=2, out=out, quiet=True, every_s=0.0)
        run.log_metrics(_progress(1, (1, "training"), (0, "late")))
        run.log_metrics({"event": "waiting", "phase": "replies", "round": 1,
                         "waiting_for": ["partition 1"], "why": ["x"], "waited_s": 30.0,
                         "deadline_s": 60.0})  # fmt: skip
        live.poll()
        live.stop()
        assert out.getvalue() == ""


def test_summary_leaves_progress_and_waiting_records_out() -> None:
    train = {"event": "train", "round": 1, "partition": 0, "train_loss": 3.0, "bytes_up": 10}
    history = [{**_eval(0), "eval_loss": 4.0}, train, _eval(1)]
    with_live = [
        history[0],
        _progress(1, (0, "starting"), elapsed=0.0),
        _progress(1, (2, "training")),
        {"event": "waiting", "phase": "replies", "round": 1, "waiting_for": ["partition 0"],
         "why": ["no step for 40 s"], "waited_s": 30.0, "deadline_s": 60.0},
        *history[1:],
        _progress(2, (1, "training")),  # a round that never finished
    ]  # fmt: skip
    assert build_summary(with_live, config={}) == build_summary(history, config={})
