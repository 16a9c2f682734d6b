"""A real deployment on loopback, driven only through the CLI.

``fedpipe server --superlink`` (StageServer + Flower SuperLink), two ``fedpipe client``
processes (one SuperNode each) and ``fedpipe run`` for two rounds of the tiny LLM; then
every process is stopped with SIGTERM, as a user would, and none may be left behind.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from fedpipe.launch.engines import flower_processes_under, free_port

pytestmark = pytest.mark.slow

FEDPIPE = [sys.executable, "-m", "fedpipe.cli"]
SMALL = [
    "--model", "tiny-llama",
    "--set", "train.local_steps=2",
    "--set", "train.seq_len=64",
    "--set", "train.batch_size=4",
    "--set", "train.eval_batches=2",
    "--set", "pipeline.microbatches=2",
]  # fmt: skip


class Started:
    """The processes this test started, each with its log file."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}

    def spawn(self, name: str, args: list[str], *, flwr_home: Path) -> subprocess.Popen[bytes]:
        env = dict(os.environ, FLWR_HOME=str(flwr_home), PYTHONUNBUFFERED="1")
        self.logs[name] = self.root / f"{name}.out"
        with self.logs[name].open("wb") as log:
            proc = subprocess.Popen(  # noqa: S603 - fixed argv
                [*FEDPIPE, *args], stdout=log, stderr=subprocess.STDOUT, env=env
            )
        self.procs[name] = proc
        return proc

    def text(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace")

    def wait_for(self, name: str, ready, timeout_s: float) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ready():
                return
            if self.procs[name].poll() is not None:
                raise AssertionError(f"{name} exited early:\n{self.text(name)[-4000:]}")
            time.sleep(0.3)
        tail = self.text(name)[-4000:]
        raise AssertionError(f"{name} not ready after {timeout_s:.0f} s:\n{tail}")

    def stop(self, names: list[str], grace_s: float = 30.0) -> dict[str, int | None]:
        """SIGTERM in this order (the processes stop their own Flower children), then SIGKILL."""
        names = [n for n in names if n in self.procs]
        tree: list[psutil.Process] = []
        for name in names:
            try:
                parent = psutil.Process(self.procs[name].pid)
                tree += [parent, *parent.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        for name in names:
            if self.procs[name].poll() is None:
                self.procs[name].send_signal(signal.SIGTERM)
        codes: dict[str, int | None] = {}
        for name in names:
            try:
                codes[name] = self.procs[name].wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                codes[name] = None
        _, alive = psutil.wait_procs(tree, timeout=5.0)
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return codes


def test_cli_deployment_two_devices_two_rounds(tmp_path: Path) -> None:
    started = Started(tmp_path)
    secret_file = tmp_path / "keys" / "secret"  # `fedpipe server` creates it
    port_file = tmp_path / "stage.port"
    link_port = free_port()
    superlink = f"127.0.0.1:{link_port}"
    t0 = time.monotonic()
    codes: dict[str, int | None] = {}
    try:
        started.spawn(
            "server",
            [
                "server", *SMALL, "--port", "0", "--port-file", str(port_file),
                "--secret-file", str(secret_file), "--superlink",
                "--superlink-port", str(link_port), "--superlink-dir", str(tmp_path / "superlink"),
            ],
            flwr_home=tmp_path / "home-server",
        )  # fmt: skip
        started.wait_for("server", port_file.exists, timeout_s=120)
        stage = f"127.0.0.1:{port_file.read_text().strip()}"
        out = started.text("server")
        assert f"StageServer listening on {stage}" in out
        assert f"Flower SuperLink at {superlink}" in out
        assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600

        for pid in (0, 1):
            started.spawn(
                f"client{pid}",
                [
                    "client", "--superlink", superlink, "--stage-server", stage,
                    "--partition-id", str(pid), "--num-partitions", "2",
                    "--workdir", str(tmp_path / f"node{pid}"),
                ],
                flwr_home=tmp_path / f"home-node{pid}",
            )  # fmt: skip
        for pid in (0, 1):
            name = f"client{pid}"
            started.wait_for(name, lambda n=name: "connected to" in started.text(n), timeout_s=120)
        ready_s = time.monotonic() - t0

        run = started.spawn(
            "run",
            [
                "run", *SMALL, "--superlink", superlink, "--stage-server", stage,
                "--secret-file", str(secret_file), "--name", "deployed",
                "--runs-dir", str(tmp_path / "runs"), "--rounds", "2", "--devices", "2",
                "--timeout", "300", "--no-progress",
            ],
            flwr_home=tmp_path / "home-run",
        )  # fmt: skip
        rc = run.wait(timeout=330)
        run_s = time.monotonic() - t0 - ready_s
        assert rc == 0, started.text("run")[-6000:]
    finally:
        stop_t = time.monotonic()
        codes = started.stop(["run", "client0", "client1", "server"])
        stop_s = time.monotonic() - stop_t
    print(f"deployment: ready {ready_s:.1f} s, 2 rounds {run_s:.1f} s, stop {stop_s:.1f} s")

    # every process ended on SIGTERM, cleanly, with nothing left behind
    assert codes == {"run": 0, "client0": 0, "client1": 0, "server": 0}, codes
    assert "server stopped" in started.text("server")
    deadline = time.monotonic() + 15
    while flower_processes_under(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert flower_processes_under(tmp_path) == []
    assert all(p.poll() is not None for p in started.procs.values())

    folder = tmp_path / "runs" / "deployed"
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["flower_run"]["status"] == "finished:completed"
    rounds = {entry["round"]: entry for entry in summary["rounds"]}
    assert sorted(rounds) == [0, 1, 2]
    for r in (0, 1, 2):
        assert rounds[r]["eval_loss"] > 0
    for r in (1, 2):
        assert rounds[r]["merged"] == 2
        assert rounds[r]["discarded"] == 0
        assert sorted(rounds[r]["step_times_s"]) == ["0", "1"]  # both partitions trained
    assert summary["config"]["federated.num_devices"] == 2
    assert summary["config"]["train.local_steps"] == 2
    assert (folder / "checkpoints" / "round-0002").is_dir()
    assert "round 2: eval loss" in started.text("run")
