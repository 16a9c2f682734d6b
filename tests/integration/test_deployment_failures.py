"""A device killed in a real deployment: reported, and the next round is not stalled.

``fedpipe server --superlink``, two ``fedpipe client`` processes and ``fedpipe run`` for three
rounds, as in test_deployment. After round 1 one device's SuperNode is killed with SIGKILL.
Flower keeps the node in its list until its heartbeats run out; the round it is sent to goes
on without it once the other device has replied and ``federated.straggler_s`` has passed, the
failure is printed with the device's name, later rounds start with the device that is left
after ``federated.connect_wait_s``, and the run completes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
from test_deployment import SMALL, Started

from fedpipe.launch.engines import flower_processes_under, free_port

pytestmark = pytest.mark.slow


def _kill_left_behind(root: Path) -> None:
    """What outlived its parent (a killed SuperNode's ClientApp), stopped by its own PID."""
    for pid in flower_processes_under(root):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_killed_device_does_not_stall_the_next_round(tmp_path: Path) -> None:
    started = Started(tmp_path)
    secret_file = tmp_path / "keys" / "secret"
    port_file = tmp_path / "stage.port"
    link_port = free_port()
    superlink = f"127.0.0.1:{link_port}"
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
        run = started.spawn(
            "run",
            [
                "run", *SMALL, "--superlink", superlink, "--stage-server", stage,
                "--secret-file", str(secret_file), "--name", "killed",
                "--runs-dir", str(tmp_path / "runs"), "--rounds", "3", "--devices", "2",
                "--set", "federated.straggler_s=15", "--set", "federated.report_every_s=5",
                "--set", "federated.connect_wait_s=10",
                "--timeout", "500",
            ],
            flwr_home=tmp_path / "home-run",
        )  # fmt: skip
        started.wait_for("run", lambda: "round 1/3: eval loss" in started.text("run"), 300)
        supernode = re.search(r"SuperNode pid (\d+)", started.text("client1"))
        assert supernode, started.text("client1")
        os.kill(int(supernode.group(1)), signal.SIGKILL)  # the device dies
        rc = run.wait(timeout=520)
        out = started.text("run")
        assert rc == 0, out[-6000:]
    finally:
        started.stop(["run", "client0", "client1", "server"])
        deadline = time.monotonic() + 15
        while flower_processes_under(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.5)
        _kill_left_behind(tmp_path)

    summary = json.loads((tmp_path / "runs" / "killed" / "summary.json").read_text())
    rounds = {entry["round"]: entry for entry in summary["rounds"]}
    assert sorted(rounds) == [0, 1, 2, 3] and summary["ok"], summary.get("problems")
    assert rounds[1]["devices_trained"] == 2
    assert rounds[2]["devices_trained"] == 1 and rounds[2]["devices_failed"] == 1
    assert rounds[3]["devices_trained"] == 1  # the dead node failed again, or was gone
    first = summary["failures"][0]
    assert (first["device"], first["round"]) == ("partition 1 (loopback)", 2), first
    assert "fedpipe: device partition 1 (loopback) failed in round 2: " in out
    assert "round 3/3: eval loss" in out
