"""`fedpipe simulate` starts Flower's simulation engine once more when it crashed starting.

Real simulations of the tiny model. A test harness (a ``sitecustomize`` on the
PYTHONPATH of the processes the run starts; not a fedpipe setting) makes the first N Ray head
starts fail where and as Ray's own start fails on a starved machine: the wait for the GCS
server's port file raises ``Timed out waiting for file <session>/gcs_server_port_<node id>``
after the GCS server process was started. It counts every Ray head start.

Checked: a first start that times out is retried exactly once, said in one line, and the run
then finishes with the same losses and checkpoints as a run whose Ray started at once, its
folder holding one attempt's records; a second timeout is not retried and fails the run; no
process of either attempt is left.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from fedpipe.config import load_config
from fedpipe.launch.engines import flower_processes_under
from fedpipe.launch.run import simulate

SMALL = {
    "model.name": "tiny-llama",
    "train.local_steps": 2,
    "train.seq_len": 64,
    "train.batch_size": 4,
    "pipeline.microbatches": 2,
    "federated.profiles": "loopback",
    "federated.num_devices": 2,
    "federated.rounds": 1,
}
RETRY_LINE = "fedpipe: Flower's simulation engine did not start (Timed out waiting for file "

# Patches ray._private.node.wait_for_persisted_port when Ray imports it (Ray is imported only
# by the simulation process and its workers, so nothing is loaded early).
_HARNESS = """
import importlib.abc, importlib.util, os, sys

_STARTS = os.environ.get("FEDPIPE_TEST_RAY_STARTS", "")
_FAILURES = int(os.environ.get("FEDPIPE_TEST_RAY_FAILURES", "0"))


def _count_start():
    n = 0
    while True:  # start-0, start-1, ...: one file per Ray head start, made atomically
        try:
            os.close(os.open(os.path.join(_STARTS, f"start-{n}"), os.O_CREAT | os.O_EXCL))
            return n
        except FileExistsError:
            n += 1


def _patch(node):
    real = node.wait_for_persisted_port

    def wait_for_persisted_port(session_dir, node_id, port_name, *args, **kwargs):
        if port_name == "gcs_server_port" and not args and not kwargs:  # a head node starts
            if _count_start() < _FAILURES:
                missing = os.path.join(session_dir, f"{port_name}_{node_id}")
                raise RuntimeError(f"Timed out waiting for file {missing}")
        return real(session_dir, node_id, port_name, *args, **kwargs)

    node.wait_for_persisted_port = wait_for_persisted_port


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "ray._private.node":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if _STARTS:
    sys.meta_path.insert(0, _Finder())
"""


def _simulate(runs: Path, name: str, *, ray_failures: int | None) -> dict[str, Any]:
    """Run ``name``; with ``ray_failures``, under the harness. Returns the summary, stderr,
    how many Ray head starts the harness saw, and what was left running."""
    harness = runs / f"harness-{name}"
    starts = harness / "starts"
    starts.mkdir(parents=True)
    (harness / "sitecustomize.py").write_text(_HARNESS)
    err = io.StringIO()
    with pytest.MonkeyPatch.context() as env, contextlib.redirect_stderr(err):
        if ray_failures is not None:
            path = os.pathsep.join(p for p in (str(harness), os.environ.get("PYTHONPATH")) if p)
            env.setenv("PYTHONPATH", path)
            env.setenv("FEDPIPE_TEST_RAY_STARTS", str(starts))
            env.setenv("FEDPIPE_TEST_RAY_FAILURES", str(ray_failures))
        summary = simulate(load_config(None, SMALL), name=name, runs_dir=runs, progress=True)
    end = time.monotonic() + 30
    while (left := flower_processes_under(runs / name)) and time.monotonic() < end:
        time.sleep(0.5)
    return {
        "summary": summary,
        "stderr": err.getvalue(),
        "ray_starts": len(list(starts.iterdir())),
        "left": left,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("runs")
    return {
        "base": base,
        "plain": _simulate(base, "plain", ray_failures=None),
        "retried": _simulate(base, "retried", ray_failures=1),
        "twice": _simulate(base, "twice", ray_failures=2),
    }


def _events(run: Path) -> list[tuple[str, int]]:
    """(event, round) of the run's records; waits for devices and progress records depend on
    timing (when a device's step lands against the ServerApp's poll), so not them."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line]
    return [(r["event"], r["round"]) for r in records if r["event"] not in ("waiting", "progress")]


class TestThreeRuns:
    """A plain run, one whose first Ray start times out, one whose two do: the tests share
    them (one worker runs them together)."""

    def test_a_ray_start_that_timed_out_is_retried_exactly_once(self, runs: dict[str, Any]) -> None:
        retried = runs["retried"]
        summary = retried["summary"]
        assert retried["ray_starts"] == 2
        assert retried["stderr"].count(RETRY_LINE) == 1, retried["stderr"]
        assert summary["ok"], summary["problems"]
        assert summary["flower_run"]["status"] == "finished:completed"
        first = summary["flower_run"]["retried_after"]
        assert first["status"] == "finished:failed"
        assert first["reason"].startswith("Timed out waiting for file "), first
        assert first["reason"].split("/")[-1].startswith("gcs_server_port_")
        first_log = Path(first["log"]).read_text()
        assert "Timed out waiting for file" in first_log and "gcs_server_port_" in first_log
        assert f"first attempt's log: {first['log']}" in retried["stderr"]
        assert retried["left"] == []
        assert runs["plain"]["stderr"].count(RETRY_LINE) == 0
        assert "retried_after" not in runs["plain"]["summary"]["flower_run"]

    def test_the_retried_run_equals_a_run_whose_ray_started_at_once(
        self, runs: dict[str, Any]
    ) -> None:
        """Same losses and checkpoints, and the folder holds one attempt's records: the first
        attempt's start and round-0 evaluation were taken back, its TensorBoard file removed."""
        base = runs["base"]
        plain, retried = runs["plain"]["summary"], runs["retried"]["summary"]
        pick = ("round", "eval_loss", "train_loss", "merged", "discarded", "devices_trained")
        assert [{k: e.get(k) for k in pick} for e in retried["rounds"]] == [
            {k: e.get(k) for k in pick} for e in plain["rounds"]
        ]
        for side in ("device", "server"):
            a = load_file(
                str(base / "plain" / "checkpoints" / "round-0001" / f"{side}.safetensors")
            )
            b = load_file(
                str(base / "retried" / "checkpoints" / "round-0001" / f"{side}.safetensors")
            )
            assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a), side
        events = _events(base / "retried")
        assert events == _events(base / "plain")
        assert events.count(("start", 0)) == 1 and events.count(("eval", 0)) == 1
        board = [p for p in (base / "retried" / "tensorboard").rglob("*") if p.is_file()]
        assert len(board) == 1, board
        # the console said round 0 twice (once per attempt), then the round
        assert runs["retried"]["stderr"].count("round 1/1: eval loss") == 1

    def test_a_second_ray_timeout_is_not_retried(self, runs: dict[str, Any]) -> None:
        twice = runs["twice"]
        summary = twice["summary"]
        assert twice["ray_starts"] == 2  # the first start and one retry, no third
        assert twice["stderr"].count(RETRY_LINE) == 1
        assert not summary["ok"]
        assert summary["flower_run"]["status"] == "finished:failed"
        assert summary["problems"][0].startswith("Flower's run ended as 'finished:failed'")
        # the line says why: the SuperLink's details and the log's first exception (Ray's)
        assert summary["flower_run"]["details"].startswith("Simulation failed with exception")
        assert (
            "; first exception in its log: RuntimeError: Timed out waiting for file "
            in (summary["problems"][0])
        )
        assert "Timed out waiting for file" in Path(summary["flower_run"]["log"]).read_text()
        assert twice["left"] == []
