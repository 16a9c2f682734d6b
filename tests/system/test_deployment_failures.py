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
from pathlib import Path

from harness.deploy import Deployment
from harness.processes import Started, kill_flower_under


def test_killed_device_does_not_stall_the_next_round(tmp_path: Path, started: Started) -> None:
    deployment = Deployment(started, tmp_path)
    try:
        deployment.start_server()
        deployment.start_devices(2)
        run = deployment.run(
            "run",
            "--set", "federated.straggler_s=15", "--set", "federated.report_every_s=5",
            "--set", "federated.connect_wait_s=10", "--timeout", "500",
            name="killed", rounds=3, devices=2,
        )  # fmt: skip
        started.wait_for_text("run", "round 1/3: eval loss", 300)
        supernode = re.search(r"SuperNode pid (\d+)", started.text("client1"))
        assert supernode, started.text("client1")
        os.kill(int(supernode.group(1)), signal.SIGKILL)  # the device dies
        rc = run.wait(timeout=520)
        out = started.text("run")
        assert rc == 0, out[-6000:]
    finally:
        deployment.stop()
        # what outlived its parent (a killed SuperNode's ClientApp) is stopped by its own PID
        kill_flower_under(tmp_path)

    summary = json.loads((deployment.runs / "killed" / "summary.json").read_text())
    rounds = {entry["round"]: entry for entry in summary["rounds"]}
    assert sorted(rounds) == [0, 1, 2, 3] and summary["ok"], summary.get("problems")
    assert rounds[1]["devices_trained"] == 2
    assert rounds[2]["devices_trained"] == 1 and rounds[2]["devices_failed"] == 1
    assert rounds[3]["devices_trained"] == 1  # the dead node failed again, or was gone
    first = summary["failures"][0]
    assert (first["device"], first["round"]) == ("partition 1 (loopback)", 2), first
    assert "fedpipe: device partition 1 (loopback) failed in round 2: " in out
    assert "round 3/3: eval loss" in out
