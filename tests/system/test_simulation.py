"""fedpipe simulate end to end on Flower's simulation engine (Ray), with the tiny model.

Every `simulate` call starts a private SuperLink, Ray and the ClientApp actors (about a minute
each on 2 cores), so the properties below share runs where they can: faults on different
partitions and rounds are independent, so one run carries a device that dies and one that
goes silent (``faulty``), and the three-round runs serve both the identical-runs and the
resume checks. Faults are injected by the test harness's ClientApp (harness.faults), which
wraps fedpipe's own. Properties of the federated loop checked:

- a device that dies mid-round is dropped from that round on both sides (its server-side
  adapter is discarded, not merged), the round completes, and the device is back next round;
  the failure is said on the console as it happens and recorded in summary.json, and
  TensorBoard reads the event files the run wrote;
- a round in which no device trained ends the run, and the run's exit status says so;
- a device that stops answering does not hold a round past its deadline, and is named as
  late while the round waits for it;
- while a round runs, its ``progress`` records hold each device's steps as the StageServer
  counts them;
- two identical runs give identical results (data, adapter init and aggregation do not depend
  on Flower's random node ids or on timing);
- a run stopped after round 2 and resumed (with no settings given again) gives the same
  round 3 as an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from harness.close import assert_states_close_to_scale
from harness.faults import DeviceFailure, Faults, device_dies_after, injected
from harness.processes import assert_no_flower_under
from harness.stage import stage_server
from safetensors.torch import load_file

from fedpipe.cli.run_args import report as _report
from fedpipe.config import FedpipeConfig, load_config
from fedpipe.launch.run import simulate
from fedpipe.models import resolve_model

SMALL = {
    "model.name": "tiny-llama",
    "train.local_steps": 2,
    "train.seq_len": 64,
    "train.batch_size": 4,
    "pipeline.microbatches": 2,
    "federated.profiles": "loopback",  # no emulated link delays or device slowdowns: fast
}
KILLED = (1, 1)  # (partition, round): dies after one step
SILENT = (2, 3, 60.0)  # (partition, round, seconds): stops answering, past the 20 s deadline


def _config(devices: int, rounds: int, **more: Any) -> FedpipeConfig:
    return load_config(
        None, {**SMALL, "federated.num_devices": devices, "federated.rounds": rounds, **more}
    )


def _by_round(summary: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {entry["round"]: entry for entry in summary["rounds"]}


def _train_partitions(run: Path, round_: int) -> set[int]:
    """Partitions whose Flower reply for ``round_`` arrived (metrics.jsonl ``train`` records)."""
    records = [
        json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line
    ]
    return {
        int(r["partition"]) for r in records if r.get("event") == "train" and r["round"] == round_
    }


def _last_progress(run: Path) -> dict[int, dict[int, tuple[int, str]]]:
    """Per round, the last ``progress`` record's (steps done, state) per partition."""
    last: dict[int, list[dict[str, Any]]] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") == "progress":
            last[rec["round"]] = rec["devices"]
    return {
        r: {d["partition"]: (d["steps_done"], d["state"]) for d in devices}
        for r, devices in last.items()
    }


def _checkpoint(run: Path, round_: int, side: str) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"round-{round_:04d}" / f"{side}.safetensors"))


def _average(
    states: list[dict[str, torch.Tensor]], weights: list[float]
) -> dict[str, torch.Tensor]:
    total = sum(weights)
    return {
        k: sum(s[k].double() * (w / total) for s, w in zip(states, weights, strict=True)).float()
        for k in states[0]
    }


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _replay_round_one(config: FedpipeConfig, kill_partition: int) -> tuple[dict, dict]:
    """Round 1 of a fresh run, replayed in this process on a private StageServer.

    Training depends only on (seed, partition, round), so each device's adapters after round 1
    can be recomputed here. Returns per partition the device adapters and the server-side
    adapter of its session (read from the server before the round is committed).
    """
    from fedpipe.fl.device_work import DeviceWork

    device_side, server_side = {}, {}
    with stage_server(config, grace=1.0) as server:
        for p in range(config.federated.num_devices):
            work = DeviceWork(
                config,
                device_id=f"replay-{p}",
                partition=p,
                num_partitions=config.federated.num_devices,
            )
            if p == kill_partition:
                with device_dies_after(1), pytest.raises(DeviceFailure):
                    work.train(server.address, round_=1, token="")
            else:
                work.train(server.address, round_=1, token="")
            device_side[p] = work.trainer.adapters()
        sessions = {s.device_id: s.session_id for s in server.runtime.sessions()}
        for p in range(config.federated.num_devices):
            server_side[p] = server.runtime.bank.state_dict(sessions[f"replay-{p}"])
    return device_side, server_side


def _simulate(config: FedpipeConfig, **kwargs: Any) -> tuple[dict[str, Any], str]:
    """``simulate`` with what it said on stderr (also passed on, for the test's report)."""
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        summary = simulate(config, **kwargs)
    sys.stderr.write(said.getvalue())
    return summary, said.getvalue()


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run of 3 devices and 4 rounds: partition 1 dies in round 1 after one step,
    partition 2 stops answering in round 3 for 60 s; a round waits at most 20 s for the rest
    once a device has replied (federated.straggler_s)."""
    runs = tmp_path_factory.mktemp("faulty")
    config = _config(
        devices=3, rounds=4, **{"federated.straggler_s": 20, "federated.report_every_s": 5}
    )
    with injected(Faults(kill=(KILLED,), hang=(SILENT,))) as client_app:
        summary, err = _simulate(config, name="fault", runs_dir=runs, client_app=client_app)
    assert_no_flower_under(runs)
    return {"config": config, "summary": summary, "err": err, "run": runs / "fault"}


class TestOneRunWithADeadAndASilentDevice:
    """Both tests assert on the one ``faulty`` run (run on one worker together)."""

    def test_dead_device_is_dropped_and_comes_back(self, faulty: dict[str, Any]) -> None:
        summary, run, config = faulty["summary"], faulty["run"], faulty["config"]
        assert summary["flower_run"]["status"] == "finished:completed"
        assert summary["ok"] and summary["problems"] == []  # no failure limit was set
        rounds = _by_round(summary)
        assert sorted(rounds) == [0, 1, 2, 3, 4]
        for r in rounds:
            assert math.isfinite(rounds[r]["eval_loss"]), rounds[r]
        # round 1: partition 1 died after one step; its server session trained but was dropped
        assert rounds[1]["merged"] == 2 and rounds[1]["discarded"] >= 1, rounds[1]
        assert rounds[1]["devices_failed"] == 1 and rounds[1]["devices_trained"] == 2
        assert _train_partitions(run, 1) == {0, 2}
        # round 2: the device is back
        assert rounds[2]["merged"] == 3 and rounds[2]["discarded"] == 0, rounds[2]
        assert rounds[2]["devices_failed"] == 0 and rounds[2]["devices_trained"] == 3
        assert _train_partitions(run, 2) == {0, 1, 2}

        # The failure: said on the console as it happened, with the device, round and reason ...
        err = faulty["err"]
        assert (
            "fedpipe: device partition 1 (loopback) failed in round 1: DeviceFailure: device "
        ) in err
        assert "vanished in round 1 (injected)" in err
        assert "round 1/4: eval loss" in err and "2/3 devices trained, 1 failed" in err
        # While each round ran, the StageServer's step counts: the last record of a round holds
        # each device's final count, and the console (not a terminal here) said the round's
        # progress as a plain line. The dead device trained one step; whether the server applied
        # it depends on whether its STEP_END arrived before the device dropped its stream.
        last = _last_progress(run)
        assert last[2] == {0: (2, "done"), 1: (2, "done"), 2: (2, "done")}
        assert last[1][0] == last[1][2] == (2, "done")
        assert last[1][1][1] == "failed" and last[1][1][0] in (0, 1)
        assert re.search(r"fedpipe: round 1/4: \d+/6 steps, \d+ s; ", err), err
        # ... and recorded in summary.json (with the silent device's, in round 3)
        written = json.loads((run / "summary.json").read_text())
        assert [(f["device"], f["round"]) for f in written["failures"]] == [
            ("partition 1 (loopback)", 1),
            ("partition 2 (loopback)", 3),
        ]
        assert "DeviceFailure" in written["failures"][0]["reason"]
        assert _report(written, run) == 0
        _check_tensorboard(run)
        for r in (1, 2, 3, 4):
            assert (run / "checkpoints" / f"round-{r:04d}").is_dir()

        # No trace of the dead device: both sides' global adapters after round 1 are the weighted
        # averages of only the two finished devices' adapters (num-examples: 8 each).
        devices, servers = _replay_round_one(config, kill_partition=KILLED[0])
        weights = [8.0, 8.0]
        got_server, got_device = _checkpoint(run, 1, "server"), _checkpoint(run, 1, "device")
        want_server = _average([servers[0], servers[2]], weights)
        want_device = _average([devices[0], devices[2]], weights)
        assert_states_close_to_scale(got_server, want_server, rel=0, atol=1e-6, msg="server")
        assert_states_close_to_scale(got_device, want_device, rel=0, atol=1e-6, msg="device")
        # ... and the dead device's one trained step would have shown: it is far from the tolerance
        with_dead = _average([servers[0], servers[1], servers[2]], [8.0, 4.0, 8.0])
        assert _max_diff(got_server, with_dead) > 1e-4

    def test_a_silent_device_does_not_hold_the_round_past_its_deadline(
        self,
        faulty: dict[str, Any],
    ) -> None:
        """Partition 2 stops answering in round 3 for 60 s; once the other devices have replied,
        the round waits at most 20 s for the rest (federated.straggler_s)."""
        summary = faulty["summary"]
        rounds = _by_round(summary)
        assert sorted(rounds) == [0, 1, 2, 3, 4] and summary["ok"], summary["problems"]
        # round 3 went on without it (its reply would have come after 60 s) ...
        silent = [f for f in summary["failures"] if f["round"] == SILENT[1]]
        assert silent == [
            {
                "device": "partition 2 (loopback)",
                "round": 3,
                "reason": "no reply within 20 s of the first reply (federated.straggler_s)",
                "partition": 2,
            }
        ]
        assert rounds[3]["devices_trained"] == 2 and rounds[3]["merged"] == 2
        # ... and the next round was not held up
        assert rounds[4]["devices_trained"] >= 1 and math.isfinite(rounds[4]["eval_loss"])
        # while it waited, it said for whom and why: not the devices that trained
        err = faulty["err"]
        late = "round 3: waiting for partition 2 (loopback): not connected to the StageServer "
        assert late in err
        assert "round 3: waiting for partition 0" not in err
        assert "round 3: waiting for partition 1" not in err
        progress = _last_progress(faulty["run"])[3]
        assert progress == {0: (2, "done"), 1: (2, "done"), 2: (0, "failed")}


def _check_tensorboard(run: Path) -> None:
    """TensorBoard's own reader finds the run's scalars: losses, devices, failures."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    summary = json.loads((run / "summary.json").read_text())
    evals = {e["round"]: e["eval_loss"] for e in summary["rounds"]}
    assert [(e.step, e.value) for e in acc.Scalars("eval/loss")] == [
        (r, pytest.approx(loss)) for r, loss in sorted(evals.items())
    ]
    failed = [(e.step, e.value) for e in acc.Scalars("round/devices_failed")]
    assert failed == [(1, 1), (2, 0), (3, 1), (4, 0)]
    assert [(e.step, e.value) for e in acc.Scalars("failures/total")] == [(1, 1), (3, 2)]
    for p in (0, 1, 2):
        assert f"device/p{p}-loopback/step_time_s" in tags
        assert f"device/p{p}-loopback/bytes_up" in tags
    assert [e.step for e in acc.Scalars("device/p1-loopback/bytes_up")] == [2, 3, 4]


def test_a_round_without_a_trained_device_fails_the_run(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    with injected(Faults(kill=((0, 1),))) as client_app:
        summary = simulate(
            _config(devices=1, rounds=3), name="nobody", runs_dir=tmp_path, client_app=client_app
        )
    assert_no_flower_under(tmp_path)
    run = tmp_path / "nobody"
    assert not summary["ok"]
    assert summary["stopped"]["reason"] == "round 1: no device trained (1 failed)"
    assert [e["round"] for e in summary["rounds"] if "eval_loss" in e] == [0]  # no round 2, 3
    assert _report(summary, run) == 1  # the CLI's exit status
    err = capfd.readouterr().err
    assert "fedpipe: device partition 0 (loopback) failed in round 1: DeviceFailure" in err
    assert "fedpipe: run stopped: round 1: no device trained (1 failed)" in err
    assert "fedpipe: run failed: stopped early: round 1: no device trained (1 failed)" in err
    written = json.loads((run / "summary.json").read_text())
    assert written["ok"] is False and written["failures"][0]["round"] == 1


@pytest.fixture(scope="module")
def three_round_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run A: 3 rounds at once. Run B: the same, stopped after round 2, then resumed to 3.

    A and B's first call run at the same time (two engines, each with its own SuperLink and
    StageServer): they are independent, and identical results must not depend on timing.
    """
    runs = tmp_path_factory.mktemp("runs")
    resolve_model("tiny-llama")  # the model cache, converted before the two runs start
    with ThreadPoolExecutor(2) as pool:
        first = [
            pool.submit(
                simulate, _config(devices=2, rounds=r), name=n, runs_dir=runs, progress=False
            )
            for n, r in (("a", 3), ("b", 2))
        ]
        a, b2 = (f.result() for f in first)
    # Resumed as `fedpipe simulate --name b --resume --rounds 3` would: only the rounds are
    # given again; the devices (default 4) and the small settings come from the run folder.
    b3 = simulate(
        load_config(None, {"federated.rounds": 3}),
        name="b",
        runs_dir=runs,
        resume=True,
        progress=False,
        explicit={"federated.rounds"},
    )
    assert_no_flower_under(runs)
    return {"runs": runs, "a": a, "b2": b2, "b3": b3}


class TestThreeRoundRuns:
    """Both tests assert on the ``three_round_runs`` (run on one worker together)."""

    def test_identical_runs_give_identical_losses(self, three_round_runs: dict[str, Any]) -> None:
        a, b2 = _by_round(three_round_runs["a"]), _by_round(three_round_runs["b2"])
        assert three_round_runs["b2"]["flower_run"]["status"] == "finished:completed"
        assert sorted(b2) == [0, 1, 2]
        for r in (0, 1, 2):
            assert b2[r]["eval_loss"] == a[r]["eval_loss"], (r, a[r], b2[r])
            if r:
                assert b2[r]["train_loss"] == a[r]["train_loss"], (r, a[r], b2[r])
        runs = three_round_runs["runs"]
        for r in (1, 2):
            for side in ("device", "server"):
                assert (
                    _max_diff(_checkpoint(runs / "a", r, side), _checkpoint(runs / "b", r, side))
                    == 0.0
                )

    def test_resume_continues_from_the_last_checkpoint(
        self, three_round_runs: dict[str, Any]
    ) -> None:
        runs = three_round_runs["runs"]
        a, b3 = three_round_runs["a"], three_round_runs["b3"]
        assert a["flower_run"]["status"] == "finished:completed"
        assert b3["flower_run"]["status"] == "finished:completed"
        assert b3["config"] == {**a["config"], "federated.rounds": 3}  # the saved settings
        a_rounds, b_rounds = _by_round(a), _by_round(b3)
        assert sorted(b_rounds) == [0, 1, 2, 3]
        # the resumed call trained round 3 only: one train record per device for every round
        history = [
            json.loads(line)
            for line in (runs / "b" / "metrics.jsonl").read_text().splitlines()
            if line
        ]
        trains = sorted(
            (rec["round"], rec["partition"]) for rec in history if rec.get("event") == "train"
        )
        assert trains == [(r, p) for r in (1, 2, 3) for p in (0, 1)]
        evals = [rec["round"] for rec in history if rec.get("event") == "eval"]
        assert evals == [0, 1, 2, 3]
        assert b_rounds[3]["merged"] == 2
        # exactly the uninterrupted run's round 3 (FedAvg keeps no server-side state to lose)
        assert b_rounds[3]["eval_loss"] == a_rounds[3]["eval_loss"]
        assert b_rounds[3]["train_loss"] == a_rounds[3]["train_loss"]
        for side in ("device", "server"):
            got, want = _checkpoint(runs / "a", 3, side), _checkpoint(runs / "b", 3, side)
            assert _max_diff(got, want) == 0.0


def test_timeout_ends_the_run_with_a_summary(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The only device stops answering; --timeout (here 45 s) ends the run, with a summary."""
    with injected(Faults(hang=((0, 1, 600.0),))) as client_app:
        summary = simulate(
            _config(devices=1, rounds=2),
            name="late",
            runs_dir=tmp_path,
            timeout_s=45,
            client_app=client_app,
        )
    assert_no_flower_under(tmp_path)
    problems = summary["problems"]  # all of them in the message: the why of another ending
    assert not summary["ok"]
    assert problems[0] == "the run reached --timeout (45 s) and was stopped", problems
    written = json.loads((tmp_path / "late" / "summary.json").read_text())
    assert written["problems"] == summary["problems"]
    assert _report(written, tmp_path / "late") == 1
    err = capfd.readouterr().err
    assert "fedpipe: run failed: the run reached --timeout (45 s) and was stopped" in err
