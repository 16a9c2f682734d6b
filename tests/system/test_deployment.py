"""A real deployment on loopback, driven only through the CLI.

``fedpipe server --superlink`` (StageServer + Flower SuperLink), two ``fedpipe client``
processes (one SuperNode each) and ``fedpipe run`` for two rounds of the tiny LLM; then
every process is stopped with SIGTERM, as a user would, and none may be left behind.
"""

from __future__ import annotations

import json
import stat
import time
from pathlib import Path

from harness.deploy import Deployment
from harness.processes import Started, assert_no_flower_under


def test_cli_deployment_two_devices_two_rounds(tmp_path: Path, started: Started) -> None:
    deployment = Deployment(started, tmp_path)
    t0 = time.monotonic()
    codes: dict[str, int | None] = {}
    try:
        stage = deployment.start_server()
        out = started.text("server")
        assert f"StageServer listening on {stage}" in out
        assert f"Flower SuperLink at {deployment.superlink}" in out
        assert stat.S_IMODE(deployment.secret_file.stat().st_mode) == 0o600
        deployment.start_devices(2)
        ready_s = time.monotonic() - t0
        run = deployment.run(
            "run", "--timeout", "300", "--no-progress", name="deployed", rounds=2, devices=2
        )
        rc = run.wait(timeout=330)
        run_s = time.monotonic() - t0 - ready_s
        assert rc == 0, started.text("run")[-6000:]
    finally:
        stop_t = time.monotonic()
        codes = deployment.stop()
        stop_s = time.monotonic() - stop_t
    print(f"deployment: ready {ready_s:.1f} s, 2 rounds {run_s:.1f} s, stop {stop_s:.1f} s")

    # every process ended on SIGTERM, cleanly, with nothing left behind
    assert codes == {"run": 0, "client0": 0, "client1": 0, "server": 0}, codes
    assert "server stopped" in started.text("server")
    assert_no_flower_under(tmp_path, within_s=15)
    assert all(p.poll() is not None for p in started.procs.values())

    folder = deployment.runs / "deployed"
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
