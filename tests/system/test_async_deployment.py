"""federated.mode = async in a real deployment: `fedpipe server --superlink`, three
`fedpipe client` processes (one emulated 50x slower in compute) and `fedpipe run --mode async`,
each process in its own home, over loopback.

The fast devices' updates are aggregated, two at a time, version after version, while the slow
device computes its first: the versions the run made before the slow device's first update came
hold only fast devices' updates, and the run completes every version.
"""

from __future__ import annotations

import json
from pathlib import Path

from harness.deploy import Deployment
from harness.processes import Started, kill_flower_under

SLOW = "bw=inf,rtt=0ms,slowdown=50"


def test_async_deployment_aggregates_fast_devices_while_the_slow_one_computes(
    tmp_path: Path, started: Started
) -> None:
    deployment = Deployment(started, tmp_path)

    def device(i: int) -> list[str]:
        flags = [
            "--stage-server", deployment.stage, "--partition-id", str(i),
            "--num-partitions", "3", "--workdir", str(tmp_path / f"node{i}"),
        ]  # fmt: skip
        return flags + (["--profile", SLOW] if i == 2 else [])

    try:
        deployment.start_server()
        deployment.start_devices(3, args=device)
        run = deployment.run(
            "run", "--mode", "async", "--set", "federated.buffer=2", "--timeout", "500",
            name="async", rounds=3, devices=3,
        )  # fmt: skip
        rc = run.wait(timeout=520)
        out = started.text("run")
        assert rc == 0, out[-6000:]
    finally:
        deployment.stop()
        kill_flower_under(tmp_path)

    folder = deployment.runs / "async"
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["ok"], summary.get("problems")
    assert summary["unit"] == "version"
    assert [e["round"] for e in summary["rounds"]] == [0, 1, 2, 3]
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    versions = [r for r in records if r.get("event") == "version"]
    assert [v["updates"] for v in versions] == [2, 2, 2]
    trained = {}  # version -> the partitions whose updates made it
    for r in records:
        if r.get("event") == "train":
            trained.setdefault(r["round"], []).append(r["partition"])
    first_slow = min((v for v, parts in trained.items() if 2 in parts), default=4)
    assert first_slow >= 2, trained  # version 1 at least was made while it computed
    for version in range(1, first_slow):
        assert sorted(trained[version]) == [0, 1], trained
    assert "version 3/3: eval loss" in out
