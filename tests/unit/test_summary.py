"""summary.json from metrics records (current and older keys, resumed runs), the verdict,
the console lines, and Flower run-config nesting."""

from __future__ import annotations

import io
from pathlib import Path

from fedpipe.launch.run import nest
from fedpipe.runs.folder import RunFolder
from fedpipe.runs.report import LiveReport, format_record, report_lines
from fedpipe.runs.summary import build_summary, judge


def _train(round_: int, partition: int, loss: float, up: int, down: int) -> dict:
    return {
        "event": "train",
        "round": round_,
        "device": f"partition {partition} (loopback)",
        "partition": partition,
        "profile": "loopback",
        "train_loss": loss,
        "step_time_median_s": 0.5 + partition / 10,
        "bytes_up": up,
        "bytes_down": down,
        "num_examples": 8,
    }


def _eval(round_: int, loss: float, **extra: float) -> dict:
    return {"event": "eval", "round": round_, "eval_loss": loss, "eval_ppl": 2.0, **extra}


def test_summary_per_round_devices_and_failures() -> None:
    history = [
        {"event": "start", "round": 0, "resumed": False},
        _eval(0, 4.0, wall_s=1.0, elapsed_s=1.0),
        _train(1, 0, 3.9, 100, 120),
        _train(1, 1, 3.7, 50, 60),
        {
            "event": "failure",
            "round": 1,
            "device": "partition 2 (phone-lte)",
            "partition": 2,
            "reason": "DeviceFailure: gone",
        },
        _eval(1, 3.6, merged=2, discarded=1, wall_s=8.0, elapsed_s=9.0),
    ]
    summary = build_summary(history, config={"model.name": "tiny-llama"})
    r0, r1 = summary["rounds"]
    assert r0["eval_loss"] == 4.0 and "train_loss" not in r0 and "devices_trained" not in r0
    assert r1["train_loss"] == (3.9 + 3.7) / 2
    assert r1["bytes_up"] == 150 and r1["bytes_down"] == 180
    assert r1["step_times_s"] == {"0": 0.5, "1": 0.6}
    assert r1["devices_trained"] == 2 and r1["devices_failed"] == 1
    assert r1["wall_s"] == 8.0 and r1["elapsed_s"] == 9.0
    assert r1["merged"] == 2 and r1["discarded"] == 1
    assert summary["failures"] == [
        {
            "device": "partition 2 (phone-lte)",
            "round": 1,
            "reason": "DeviceFailure: gone",
            "partition": 2,
        }
    ]
    assert summary["devices"] == {"0": "partition 0 (loopback)", "1": "partition 1 (loopback)"}
    assert summary["first_eval_loss"] == 4.0 and summary["last_eval_loss"] == 3.6
    assert summary["eval_loss_drop_pct"] == (4.0 - 3.6) / 4.0 * 100
    assert judge(summary, rounds=1, max_failures=-1) == []
    assert judge(summary, rounds=1, max_failures=0) == [
        "1 device failures, more than federated.max_failures=0"
    ]
    assert judge(summary, rounds=2, max_failures=-1) == ["only 1 of 2 rounds completed"]


def test_summary_reads_runs_written_with_older_keys() -> None:
    history = [
        {"event": "eval", "round": 0, "eval_loss": 4.0, "wall_s": 1.0},
        {
            "event": "train",
            "round": 1,
            "partition-id": 1,
            "train-loss": 3.9,
            "step-time-median-s": 0.5,
            "bytes-up": 100,
            "bytes-down": 120,
        },
        {"event": "failed", "round": 1, "devices": 1},
        {"event": "eval", "round": 1, "eval_loss": 3.6, "merged": 1, "discarded": 1},
    ]
    r1 = build_summary(history, config={})["rounds"][1]
    assert r1["train_loss"] == 3.9 and r1["bytes_up"] == 100 and r1["bytes_down"] == 120
    assert r1["step_times_s"] == {"1": 0.5}
    assert r1["devices_trained"] == 1 and r1["devices_failed"] == 1


def test_crash_between_commit_and_checkpoint_counts_each_round_once(tmp_path: Path) -> None:
    """Round 2 was committed (its train records logged) but the ServerApp died before its
    checkpoint; the resumed run repeats round 2 from checkpoint 1. Its bytes and losses count
    once, from the repeat."""
    run = RunFolder.open(tmp_path, "crashed")
    for rec in (
        {"event": "start", "round": 0, "resumed": False},
        _eval(0, 4.0),
        _train(1, 0, 3.9, 100, 100),
        _eval(1, 3.8),
        _train(2, 0, 3.7, 100, 100),  # committed, then the crash: no eval, no checkpoint
        {"event": "failure", "round": 2, "device": "partition 1", "reason": "x"},
        {"event": "start", "round": 1, "resumed": True},
        _train(2, 0, 3.6, 100, 100),
        _eval(2, 3.5),
    ):
        run.log_metrics(rec)
    summary = build_summary(RunFolder.open(tmp_path, "crashed", resume=True).history(), config={})
    rounds = {r["round"]: r for r in summary["rounds"]}
    assert sorted(rounds) == [0, 1, 2]
    assert rounds[2]["bytes_up"] == 100 and rounds[2]["train_loss"] == 3.6
    assert rounds[2]["devices_trained"] == 1 and rounds[2]["devices_failed"] == 0
    assert rounds[1]["bytes_up"] == 100  # rounds up to the checkpoint are kept
    assert summary["failures"] == []


def test_a_round_where_no_device_trained_fails_the_run() -> None:
    history = [
        _eval(0, 4.0),
        {"event": "failure", "round": 1, "device": "partition 0 (loopback)", "reason": "boom"},
        {"event": "stop", "round": 1, "reason": "round 1: no device trained (1 failed)"},
    ]
    summary = build_summary(history, config={})
    problems = judge(summary, rounds=3, max_failures=-1)
    assert problems == ["stopped early: round 1: no device trained (1 failed)"]
    unstopped = build_summary(history[:-1], config={})  # e.g. a ServerApp that crashed
    assert judge(unstopped, rounds=3, max_failures=-1) == ["round 1: no device trained (1 failed)"]
    assert report_lines(summary)[1] == "round 1: eval loss -, 0/1 devices trained"


def test_console_lines() -> None:
    line = format_record(
        _eval(2, 3.5, train_loss=3.6, devices_trained=3, devices_failed=1, bytes_up=2_500_000,
              bytes_down=1_000, wall_s=12.25),
        rounds=3,
    )  # fmt: skip
    assert line == (
        "round 2/3: eval loss 3.5000 (ppl 2.0), train loss 3.6000, 3/4 devices trained, "
        "1 failed, up 2.5 MB, down 1.0 kB, 12.2 s"
    )
    failure = {"event": "failure", "round": 2, "device": "partition 1 (rpi-wifi)", "reason": "x"}
    assert format_record(failure, rounds=3) == "device partition 1 (rpi-wifi) failed in round 2: x"
    waiting = {
        "event": "waiting",
        "phase": "replies",
        "round": 2,
        "waiting_for": ["partition 1 (rpi-wifi)"],
        "waited_s": 30.0,
        "deadline_s": 120.0,
    }
    assert format_record(waiting, rounds=3) == (
        "round 2: waiting for partition 1 (rpi-wifi) (30 s; goes on without them after 120 s)"
    )
    assert format_record({"event": "train", "round": 1}, rounds=3) is None


def test_live_report_prints_records_appended_after_it_started(tmp_path: Path) -> None:
    run = RunFolder.open(tmp_path, "live")
    run.log_metrics(_eval(0, 4.0))  # before: not printed again (a resumed run's old records)
    out = io.StringIO()
    live = LiveReport(run.metrics_path, rounds=2, out=out)
    run.log_metrics({"event": "stop", "round": 1, "reason": "enough"})
    with run.metrics_path.open("a") as f:
        f.write('{"event": "stop", "ro')  # being written: printed once complete
    live.poll()
    assert out.getvalue() == "fedpipe: run stopped: enough\n"
    with run.metrics_path.open("a") as f:
        f.write('und": 2, "reason": "later"}\n')
    live.poll()
    assert out.getvalue().splitlines()[-1] == "fedpipe: run stopped: later"


def test_nest_turns_dotted_keys_into_tables() -> None:
    assert nest({"model.name": "x", "model.lora_r": 8, "run.dir": "/r", "top": 1}) == {
        "model": {"name": "x", "lora_r": 8},
        "run": {"dir": "/r"},
        "top": 1,
    }


def test_quiet_live_report_prints_only_failures_and_stops(tmp_path: Path) -> None:
    run = RunFolder.open(tmp_path, "quiet")
    out = io.StringIO()
    live = LiveReport(run.metrics_path, rounds=2, out=out, quiet=True)
    run.log_metrics(_eval(1, 3.0, devices_trained=1))
    run.log_metrics({"event": "failure", "round": 1, "device": "partition 0", "reason": "x"})
    live.poll()
    assert out.getvalue() == "fedpipe: device partition 0 failed in round 1: x\n"


def test_plans_reach_the_summary_and_the_console() -> None:
    plan = {
        "cut": "u:1+1",
        "microbatches": 4,
        "schedule": "greedy",
        "codec": "fp32",
        "gradient_codec": "fp32",
        "max_in_flight": 0,
        "predicted_s": 0.3,
        "measured_s": 0.32,
        "error": -0.0625,
        "why": "first plan, from this session's measurements",
    }
    replanned = {**plan, "microbatches": 8, "why": "re-planned: RTT 5.0 -> 100.0 ms (+1900%)"}
    history = [
        _eval(0, 4.0),
        {**_train(1, 0, 3.9, 1, 1), "plan": plan},
        _eval(1, 3.8),
        {**_train(2, 0, 3.7, 1, 1), "plan": replanned},
        _eval(2, 3.6),
    ]
    summary = build_summary(history, config={})
    assert summary["rounds"][1]["plans"] == {"0": plan}
    assert summary["plans"] == {"0": replanned}, "the latest plan per device"
    assert report_lines(summary)[-1] == (
        "partition 0 (loopback): plan u:1+1 M=8 greedy fp32, predicted 0.300 s, measured "
        "0.320 s (-6%); re-planned: RTT 5.0 -> 100.0 ms (+1900%)"
    )
    live = format_record(history[1], rounds=2)
    assert live == (
        "round 1: partition 0 (loopback): plan u:1+1 M=4 greedy fp32, predicted 0.300 s, "
        "measured 0.320 s (-6%)"
    )


def test_example_counts_reach_the_summary_per_device() -> None:
    counts = {"rows": 11, "truncated": 1, "dropped_overlong": 0, "dropped_unanswered": 0}
    history = [
        _eval(0, 4.0),
        {**_train(1, 0, 3.9, 1, 1), "examples": counts},
        _train(1, 1, 3.9, 1, 1),  # a device on plain text: no counts
        _eval(1, 3.8),
    ]
    summary = build_summary(history, config={})
    assert summary["rounds"][1]["examples"] == {"0": counts}
    assert summary["examples"] == {"0": counts}
    assert "examples" not in build_summary(history[2:], config={})


def test_an_async_run_reports_versions_and_refused_updates() -> None:
    history = [_eval(0, 4.0, unit="version"), _train(1, 0, 3.9, 10, 10), _eval(1, 3.8)]
    summary = build_summary(history, config={"federated.mode": "async"})
    assert summary["unit"] == "version"
    assert report_lines(summary)[:2] == [
        "version 0: eval loss 4.0000",
        "version 1: eval loss 3.8000, train loss 3.9000, 1/1 devices trained",
    ]
    assert judge(summary, rounds=3, max_failures=-1) == ["only 1 of 3 versions completed"]
    assert format_record(_eval(1, 3.8, unit="version"), rounds=3).startswith("version 1/3: ")
    refused = {"event": "refused", "device": "3", "version": 2, "reason": "staleness 5 > 4"}
    line = format_record(refused, rounds=3)
    assert line == "device 3: update of version 2 refused: staleness 5 > 4"
    assert build_summary(history, config={"federated.mode": "sync"}).get("unit") is None
