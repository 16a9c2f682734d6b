"""Real Flower engines run the toy app (tests/integration/flower_toy) as processes.

Slow tier: each test starts Flower's own processes (SuperLink, SuperNodes, SuperExec,
Ray) and checks the aggregated arrays, the run/node config the apps saw, and that every
process started is gone afterwards.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from flwr.cli.config_utils import load_and_validate
from flwr.common.config import parse_config_args

from fedpipe.launch.engines import (
    ManagedProcess,
    flower_processes_under,
    flwr_run,
    format_config_args,
    run_simulation_engine,
    start_superlink,
    start_supernode,
    stop_all,
    write_flower_app,
)

TOY_ROOT = Path(__file__).resolve().parent  # holds the flower_toy package
DEFAULTS = {"num-server-rounds": 1, "min-nodes": 2, "increment": 1.0, "round-timeout": 120.0}


@pytest.fixture
def toy_env() -> dict[str, str]:
    """Environment whose processes import flower_toy from the source tree."""
    path = os.pathsep.join(p for p in [str(TOY_ROOT), os.environ.get("PYTHONPATH", "")] if p)
    return dict(os.environ, PYTHONPATH=path)


@pytest.fixture
def toy_app(tmp_path: Path) -> Path:
    return write_flower_app(
        tmp_path / "app",
        server_app="flower_toy.server:app",
        client_app="flower_toy.client:app",
        config={**DEFAULTS, "out-dir": str(tmp_path / "default-out")},
        name="fedpipe-toy",
    )


def _assert_gone(tmp_path: Path, started: list[ManagedProcess], deadline_s: float = 30) -> None:
    """Every process started here, and every Flower helper it spawned, has exited."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if not set(flower_processes_under(tmp_path)) and not any(p.alive() for p in started):
            return
        time.sleep(0.5)
    raise AssertionError(f"processes left behind: {sorted(set(flower_processes_under(tmp_path)))}")


def _result(out_dir: Path) -> dict:
    return json.loads((out_dir / "result.json").read_text())


@pytest.mark.parametrize(
    "value",
    [0, -3, 2.5, 1e-5, 1e20, True, False, "jetson nano", r"C:\dev\pi", "it's", 'say "hi"', ""],
)
def test_config_args_round_trip_through_flowers_parser(value: object) -> None:
    """What we render for --run-config/--node-config is what Flower parses back."""
    text = format_config_args({"key": value, "partition-id": 1, "nested": {"a-b": "x y"}})
    assert parse_config_args([text]) == {"key": value, "partition-id": 1, "nested.a-b": "x y"}


def test_config_args_refuse_what_flower_cannot_carry() -> None:
    with pytest.raises(ValueError, match="quote"):
        format_config_args({"k": 'it\'s "both"'})
    with pytest.raises(ValueError, match="key"):
        format_config_args({"bad key": 1})


def test_written_app_passes_flowers_validation(toy_app: Path, toy_env: dict[str, str]) -> None:
    """`flwr run` validates the project with the component modules on sys.path."""
    sys.path.insert(0, str(TOY_ROOT))
    try:
        config, _ = load_and_validate(toy_app / "pyproject.toml")
    finally:
        sys.path.remove(str(TOY_ROOT))
    assert config["tool"]["flwr"]["app"]["components"]["serverapp"] == "flower_toy.server:app"
    assert config["tool"]["flwr"]["app"]["config"]["round-timeout"] == 120.0
    assert "dependencies" not in config["project"]
    assert [p.name for p in toy_app.iterdir()] == ["pyproject.toml"]


@pytest.mark.slow
def test_simulation_engine_runs_toy_with_run_config(
    toy_app: Path, toy_env: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    start = time.monotonic()
    result = run_simulation_engine(
        toy_app,
        num_supernodes=4,
        run_config={"num-server-rounds": 2, "min-nodes": 4, "increment": 1.0, "out-dir": str(out)},
        timeout_s=300,
        workdir=tmp_path / "sim",
        env=toy_env,
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
    _assert_gone(tmp_path, [])


@pytest.mark.slow
def test_deployment_engine_superlink_and_two_supernodes(
    toy_app: Path, toy_env: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    started: list[ManagedProcess] = []
    start = time.monotonic()
    try:
        link = start_superlink(workdir=tmp_path / "superlink", env=toy_env)
        started.append(link)
        for pid, profile in enumerate(["jetson nano", r"C:\devices\pi"]):
            node = start_supernode(
                superlink=link.address,
                node_config={"partition-id": pid, "profile": profile},
                workdir=tmp_path / f"node{pid}",
                env=toy_env,
            )
            started.insert(0, node)  # nodes stop before their SuperLink
        ready = time.monotonic() - start
        result = flwr_run(
            toy_app,
            superlink=link.address,
            run_config={"num-server-rounds": 2, "increment": 0.5, "out-dir": str(out)},
            timeout_s=300,
            workdir=tmp_path / "run",
            env=toy_env,
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
    _assert_gone(tmp_path, started)


def test_an_interrupted_command_is_killed_not_left_running(tmp_path: Path) -> None:
    """Ctrl-C (or SIGTERM turned into KeyboardInterrupt) kills the child: rc -2, at once."""
    import os
    import signal
    import sys
    import threading

    from fedpipe.launch.engines import _run_logged

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGUSR1, interrupt)
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGUSR1)).start()
    started = time.monotonic()
    try:
        sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
        returncode, _ = _run_logged(sleeper, dict(os.environ), tmp_path / "log", 120)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert returncode == -2
    assert time.monotonic() - started < 30
