"""Telling an engine that crashed starting from other simulation outcomes, on real `flwr run` logs.

The logs in ``flower_logs/`` were written by real runs on a 2-core machine:
``ray-start-timed-out.log``: `fedpipe simulate` (tiny-llama, 2 devices) while its GCS server was
held stopped, so Ray's own 30 s wait for the GCS port file ran out; ``client-app-failed.log``:
the toy app of tests/integration with an out-dir its ClientApps cannot create (Ray started,
the run failed); ``completed.log``: the toy app run to completion;
``ray-node-timed-out.log``: a simulation test of the suite on a machine loaded by other work,
whose Ray node timed out starting (its raylet or GCS too slow).

Whatever Ray's start raised, the reason given is Ray's own message (a failure not seen before is
made from a real log with only the exception's text changed).

And what a retry takes back from a run folder: the records a ServerApp writes before any round,
never a round.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedpipe.launch.engines import FlwrRunResult, engine_start_failure
from fedpipe.launch.run import _FolderMark
from fedpipe.runs.folder import RunFolder

LOGS = Path(__file__).resolve().parent / "flower_logs"


def _result(log: str, status: str, returncode: int = 0) -> FlwrRunResult:
    path = LOGS / log
    return FlwrRunResult(1, status, returncode, path.read_text(), path, 60.0)


def _raised_in(log: str) -> str:
    """The exception Ray raised in a crash log (after Flower's "An exception occured!! ")."""
    line = next(line for line in log.splitlines() if "An exception occured!! " in line)
    return line.split("An exception occured!! ", 1)[1].strip()


@pytest.mark.parametrize(
    ("log", "reason"),
    [
        ("ray-start-timed-out.log", "Timed out waiting for file /tmp/ray/session_"),
        ("ray-node-timed-out.log", "The current node timed out during startup. This could"),
    ],
)
def test_an_engine_that_crashed_starting_is_recognised_with_rays_reason(
    log: str, reason: str
) -> None:
    assert (engine_start_failure(_result(log, "finished:failed")) or "").startswith(reason)


def test_a_ray_start_failure_not_seen_before_is_recognised_too() -> None:
    text = (LOGS / "ray-node-timed-out.log").read_text()
    other = "Failed to connect to GCS at address 192.0.2.2:6379 within 60 seconds."
    result = FlwrRunResult(
        1, "finished:failed", 0, text.replace(_raised_in(text), other), LOGS / "x.log", 60.0
    )
    assert engine_start_failure(result) == other


@pytest.mark.parametrize(
    ("log", "status", "returncode"),
    [
        ("client-app-failed.log", "finished:failed", 0),  # Ray started; the app failed
        ("completed.log", "finished:completed", 0),
        ("ray-start-timed-out.log", "finished:completed", 0),  # the outcome decides
        ("ray-start-timed-out.log", "finished:failed", -1),  # stopped at --timeout
    ],
    ids=["app-failed", "completed", "completed-with-that-text", "our-timeout"],
)
def test_other_outcomes_are_not_an_engine_that_did_not_start(
    log: str, status: str, returncode: int
) -> None:
    assert engine_start_failure(_result(log, status, returncode)) is None


def test_rays_text_alone_is_not_enough() -> None:
    """Ray's message without Flower's crash of its simulation runtime (e.g. an app that logs
    it) is not an engine that failed to start."""
    text = (LOGS / "ray-start-timed-out.log").read_text()
    kept = "\n".join(line for line in text.splitlines() if "Simulation Runtime crashed" not in line)
    result = FlwrRunResult(1, "finished:failed", 0, kept, LOGS / "x.log", 60.0)
    assert engine_start_failure(result) is None


def _write(folder: RunFolder, *records: dict[str, object]) -> None:
    for record in records:
        folder.log_metrics(record)


def _events(folder: RunFolder) -> list[tuple[object, object]]:
    return [(r["event"], r["round"]) for r in folder.history()]


def test_records_before_the_first_round_are_taken_back(tmp_path: Path) -> None:
    folder = RunFolder.open(tmp_path, "r")
    _write(folder, {"event": "start", "round": 0, "resumed": False}, {"event": "eval", "round": 0})
    _write(folder, {"event": "train", "round": 1}, {"event": "eval", "round": 1, "merged": 2})
    board = folder.path / "tensorboard"
    board.mkdir()
    (board / "events.out.tfevents.1").write_bytes(b"first run")
    mark = _FolderMark.of(folder)
    # a resumed attempt that got as far as its start, a wait and the evaluation it starts from
    _write(folder, {"event": "start", "round": 1, "resumed": True})
    _write(folder, {"event": "waiting", "round": 2, "phase": "connect"})
    _write(folder, {"event": "eval", "round": 1})
    (board / "events.out.tfevents.2").write_bytes(b"failed attempt")
    assert not mark.round_written(folder)
    mark.restore(folder)
    assert _events(folder) == [("start", 0), ("eval", 0), ("train", 1), ("eval", 1)]
    assert sorted(p.name for p in board.iterdir()) == ["events.out.tfevents.1"]


@pytest.mark.parametrize("written", ["train-record", "next-eval", "checkpoint"])
def test_an_attempt_that_wrote_a_round_is_seen(tmp_path: Path, written: str) -> None:
    folder = RunFolder.open(tmp_path, "r")
    mark = _FolderMark.of(folder)
    _write(folder, {"event": "start", "round": 0, "resumed": False}, {"event": "eval", "round": 0})
    if written == "train-record":
        _write(folder, {"event": "train", "round": 1, "partition": 0})
    elif written == "next-eval":
        _write(folder, {"event": "eval", "round": 1, "merged": 1})
    else:
        (folder.checkpoints_dir / "round-0001").mkdir()
    assert mark.round_written(folder)


def test_a_record_cut_short_is_not_a_round(tmp_path: Path) -> None:
    folder = RunFolder.open(tmp_path, "r")
    mark = _FolderMark.of(folder)
    _write(folder, {"event": "start", "round": 0, "resumed": False})
    with folder.metrics_path.open("a") as f:
        f.write(json.dumps({"event": "eval", "round": 0})[:10])  # its writer died mid-line
    assert not mark.round_written(folder)


def test_progress_with_no_step_done_is_not_a_round(tmp_path: Path) -> None:
    """The ServerApp records progress while the devices start: a round that never got a step
    (the engine failed under it) was not written; one with a step done was."""
    folder = RunFolder.open(tmp_path, "p")
    mark = _FolderMark.of(folder)
    waiting = {"event": "progress", "round": 1, "devices": [{"node_id": 1, "steps_done": 0}]}
    _write(folder, {"event": "start", "round": 0}, waiting)
    assert not mark.round_written(folder)
    _write(folder, {**waiting, "devices": [{"node_id": 1, "steps_done": 1}]})
    assert mark.round_written(folder)


@pytest.mark.parametrize(
    ("log", "first"),
    [
        ("ray-start-timed-out.log", "RuntimeError: Timed out waiting for file /tmp/ray/session_"),
        ("ray-node-timed-out.log", "Exception: The current node timed out during startup."),
        ("client-app-failed.log", "ray.exceptions.RayTaskError(ClientAppException): "),
    ],
)
def test_a_failed_runs_first_exception_is_read_from_its_log(log: str, first: str) -> None:
    """The one-line report of a failed run names what was raised first (colours stripped)."""
    assert (_result(log, "finished:failed").first_exception or "").startswith(first)


def test_a_run_without_a_traceback_has_no_first_exception() -> None:
    assert _result("completed.log", "finished:completed").first_exception is None
