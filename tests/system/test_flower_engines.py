"""Real Flower engines run the toy app (harness.flower_toy) as processes.

Each test starts Flower's own processes (SuperLink, SuperNodes, SuperExec, Ray) and checks
the aggregated arrays, the run/node config the apps saw, and that every process started is
gone afterwards.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from harness.processes import assert_no_flower_under

from fedpipe.launch.engines import (
    ManagedProcess,
    flwr_run,
    run_simulation_engine,
    start_superlink,
    start_supernode,
    stop_all,
    write_flower_app,
)

DEFAULTS = {"num-server-rounds": 1, "min-nodes": 2, "increment": 1.0, "round-timeout": 120.0}


@pytest.fixture
def toy_app(tmp_path: Path) -> Path:
    return write_flower_app(
        tmp_path / "app",
        server_app="harness.flower_toy.server:app",
        client_app="harness.flower_toy.client:app",
        config={**DEFAULTS, "out-dir": str(tmp_path / "default-out")},
        name="fedpipe-toy",
    )


def _result(out_dir: Path) -> dict:
    return json.loads((out_dir / "result.json").read_text())


def test_simulation_engine_runs_toy_with_run_config(toy_app: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    start = time.monotonic()
    result = run_simulation_engine(
        toy_app,
        num_supernodes=4,
        run_config={"num-server-rounds": 2, "min-nodes": 4, "increment": 1.0, "out-dir": str(out)},
        timeout_s=300,
        workdir=tmp_path / "sim",
    )
    print(f"simulation engine, 4 nodes x 2 rounds: {time.monotonic() - start:.1f} s")
    assert result.completed
    summary = _result(out)
    assert summary["arrays"][0] == pytest.approx([2.0] * 3)  # float32 weighted mean
    assert summary["arrays"][1] == pytest.approx([2.0])
    # weighted by num-examples = 10 * (pid + 1): (0*10 + 1*20 + 2*30 + 3*40) / 100
    assert summary["train_metrics"]["2"]["partition-id"] == pytest.approx(2.0)
    assert summary["run_config"]["out-dir"] == str(out)  # the override reached the apps
    node = json.loads((out / "node-3.json").read_text())
    assert node["node_config"] == {"partition-id": 3, "num-partitions": 4}
    assert_no_flower_under(tmp_path)


def test_deployment_engine_superlink_and_two_supernodes(toy_app: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    started: list[ManagedProcess] = []
    start = time.monotonic()
    try:
        link = start_superlink(workdir=tmp_path / "superlink")
        started.append(link)
        for pid, profile in enumerate(["jetson nano", r"C:\devices\pi"]):
            node = start_supernode(
                superlink=link.address,
                node_config={"partition-id": pid, "profile": profile},
                workdir=tmp_path / f"node{pid}",
            )
            started.insert(0, node)  # nodes stop before their SuperLink
        ready = time.monotonic() - start
        result = flwr_run(
            toy_app,
            superlink=link.address,
            run_config={"num-server-rounds": 2, "increment": 0.5, "out-dir": str(out)},
            timeout_s=300,
            workdir=tmp_path / "run",
        )
        run_s = time.monotonic() - start - ready
    finally:
        stop_start = time.monotonic()
        stop_all(started)
        stop_s = time.monotonic() - stop_start
    print(f"deployment: ready {ready:.1f} s, 2 rounds {run_s:.1f} s, stop {stop_s:.1f} s")
    assert result.completed
    summary = _result(out)
    assert summary["arrays"][0] == pytest.approx([1.0] * 3)
    assert summary["arrays"][1] == pytest.approx([1.0])
    assert summary["train_metrics"]["1"]["partition-id"] == pytest.approx(20 / 30)
    seen = json.loads((out / "node-1.json").read_text())
    assert seen["node_config"] == {"partition-id": 1, "profile": r"C:\devices\pi"}
    assert json.loads((out / "node-0.json").read_text())["node_config"]["profile"] == "jetson nano"
    assert_no_flower_under(tmp_path)
    assert not any(p.alive() for p in started)
