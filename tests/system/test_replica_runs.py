"""``fedpipe simulate --set server.replicas=2``: the demo's shape on tiny-llama, end to end,
with one StageServer replica killed mid-round.

The CLI runs as a process of its own: it starts two replicas as Ray actors on a local Ray of
their own, Flower's simulation engine (another Ray, in its SuperLink's process) and the
devices. While round 2 trains, the test SIGKILLs the process of a replica that serves a device
still stepping (``replicas.json`` names the replicas' PIDs, the ``routes`` record each
device's replica). Only that replica's devices fail round 2, each named with the reason; Ray
restarts the replica, the ServerApp loads the global adapter into it, every round completes,
the CLI exits 0 and no process it started is left.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from fedpipe.fl.replica_control import ReplicaControl

ROOT = Path(__file__).resolve().parents[2]
LOCAL_STEPS = 20  # the demo's 6, stretched: round 2 lasts long enough to kill a replica in it


def _records(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written
    return out


def _victim(run: Path, round_: int) -> int | None:
    """A replica serving a device of ``round_`` that has stepped but not finished, if any:
    replica 0 while one of its devices has yet to finish (the round's evaluation runs on the
    first replica, so losing it is the harder case), else another."""
    records = _records(run)
    routes = next(
        (r["replicas"] for r in records if r.get("event") == "routes" and r["round"] == round_),
        None,
    )
    if routes is None:
        return None
    steps: dict[str, int] = {}
    for rec in records:
        if rec.get("event") == "progress" and rec["round"] == round_:
            for device in rec["devices"]:
                node = str(device["node_id"])
                steps[node] = max(steps.get(node, 0), int(device["steps_done"]))
    stepping = {
        int(routes[n]) for n, done in steps.items() if n in routes and 1 <= done < LOCAL_STEPS
    }
    if 0 in stepping:
        return 0
    if any(int(k) == 0 and steps.get(n, 0) < LOCAL_STEPS for n, k in routes.items()):
        return None  # replica 0 still has a device to step: wait for it
    return min(stepping) if stepping else None


class _Watch(threading.Thread):
    """Collects every process under ``pid`` while it runs; kills a replica in round 2."""

    def __init__(self, proc: subprocess.Popen[str], run: Path) -> None:
        super().__init__(daemon=True)
        self.proc, self.run_dir = proc, run
        self.seen: set[int] = set()
        self.gcs: set[int] = set()  # Ray's GCS servers: one per Ray instance
        self.killed: dict[str, Any] = {}

    def run(self) -> None:
        root = psutil.Process(self.proc.pid)
        while self.proc.poll() is None:
            try:
                children = root.children(recursive=True)
                self.seen |= {p.pid for p in children}
                self.gcs |= {p.pid for p in children if _name(p) == "gcs_server"}
            except psutil.NoSuchProcess:
                break
            if not self.killed and (victim := _victim(self.run_dir, 2)) is not None:
                replicas = json.loads((self.run_dir / "replicas.json").read_text())
                pid = int(replicas[victim]["pid"])
                os.kill(pid, signal.SIGKILL)
                self.killed = {"replica": victim, "pid": pid}
            time.sleep(0.3)


def _name(proc: psutil.Process) -> str:
    try:
        return str(proc.name())
    except psutil.Error:
        return ""


def _alive(pids: set[int]) -> list[str]:
    left = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{pid} {proc.name()}")
        except psutil.NoSuchProcess:
            continue
    return left


def test_replicas_run_the_demo_shape_and_survive_a_replica_killed_mid_round(
    tmp_path: Path,
) -> None:
    runs, name = tmp_path / "runs", "replicas"
    command = [
        sys.executable, "-m", "fedpipe.cli", "simulate",
        "--config", str(ROOT / "examples" / "demo.toml"),
        "--model", "tiny-llama",
        "--set", "model.head_layers=1", "--set", "model.tail_layers=1",
        "--set", f"train.local_steps={LOCAL_STEPS}",
        "--set", "server.replicas=2",
        "--runs-dir", str(runs), "--name", name, "--no-progress", "--timeout", "900",
    ]  # fmt: skip
    proc = subprocess.Popen(
        command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    watch = _Watch(proc, runs / name)
    watch.start()
    output, _ = proc.communicate(timeout=1200)
    watch.join(timeout=10)
    assert proc.returncode == 0, output[-3000:]
    summary = json.loads((runs / name / "summary.json").read_text())
    records = _records(runs / name)

    assert summary["ok"], summary["problems"]
    assert watch.killed, "no device of round 2 was seen stepping: nothing was killed"
    victim = watch.killed["replica"]
    assert output.count("fedpipe: replica ") >= 2  # each replica's address and resources
    rounds = {r["round"]: r for r in summary["rounds"]}
    assert all("eval_loss" in rounds[r] for r in (1, 2, 3))
    assert rounds[1]["devices_trained"] == rounds[3]["devices_trained"] == 4
    assert len(rounds[1]["sessions_per_replica"]) == 2
    # round 2: the killed replica's devices failed, named, and no other device
    routes = {r["round"]: r["replicas"] for r in records if r.get("event") == "routes"}
    on_victim = {node for node, k in routes[2].items() if k == victim}
    failed = [f for f in records if f.get("event") == "failure" and f["round"] == 2]
    assert failed and {str(f["node_id"]) for f in failed} <= on_victim
    assert all(f["reason"] and f["device"].startswith("partition") for f in failed)
    assert rounds[2]["devices_trained"] == 4 - len(failed)
    assert not [f for f in records if f.get("event") == "failure" and f["round"] != 2]
    # round 3: every device assigned again, the restarted replica among the candidates
    assert set(routes[3]) == set(routes[2])
    # two Ray instances (the replicas' and Flower's simulation engine's): neither joined the other
    assert len(watch.gcs) >= 2
    # nothing the run started is left: Ray's processes (both), replicas, Flower's
    assert watch.killed["pid"] in watch.seen
    end = time.monotonic() + 30
    while (left := _alive(watch.seen)) and time.monotonic() < end:
        time.sleep(0.5)
    assert left == []


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_for(path: Path, procs: list[subprocess.Popen[str]], deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while not path.exists() and all(p.poll() is None for p in procs) and time.monotonic() < end:
        time.sleep(0.5)
    assert path.exists(), f"{path.name} never came"


def test_fedpipe_server_puts_replicas_on_a_ray_cluster_and_leaves_it_as_it_was() -> None:
    """``--ray-address``: a Ray cluster of one node started with ``ray start`` (its files in a
    private folder, so no other Ray on this machine finds it); the replicas listen on all
    interfaces at ``--replica-port`` + i and are reached at the node's address."""
    temp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # Ray's socket paths must be short
    port, base = _free_port(), _free_port()
    cluster = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
            f"--port={port}", f"--temp-dir={temp}", "--num-cpus=2",
            "--include-dashboard=false", "--object-store-memory=100000000",
        ],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    server: subprocess.Popen[str] | None = None
    seen: set[int] = set()
    try:
        _wait_for(temp / "ray_current_cluster", [cluster], 120)
        ready, secret = temp / "ready", temp / "secret"
        server = subprocess.Popen(
            [
                sys.executable, "-m", "fedpipe.cli", "server", "--model", "tiny-llama",
                "--replicas", "2", "--device", "cpu", "--ray-address", f"127.0.0.1:{port}",
                "--replica-port", str(base), "--secret-file", str(secret),
                "--port-file", str(ready),
            ],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        _wait_for(ready, [cluster, server], 300)
        addresses = ready.read_text().split(",")
        control = ReplicaControl(addresses, secret.read_text().strip(), run_id="run", lora_scale=2)
        control.reset_adapter()
        control.begin_round(1, "run", "separate")
        live = list(control.round.live)
        control.close()
        seen = {p.pid for p in psutil.Process(cluster.pid).children(recursive=True)}
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            output, _ = server.communicate(timeout=120)
        cluster.send_signal(signal.SIGTERM)
        cluster.wait(timeout=60)
        shutil.rmtree(temp, ignore_errors=True)
    node = addresses[0].rpartition(":")[0]
    assert [a.rpartition(":")[2] for a in addresses] == [str(base), str(base + 1)]
    assert node not in ("127.0.0.1", "0.0.0.0") and addresses[1].startswith(node)
    assert live == [0, 1]
    assert "fedpipe: replica 0: " in output and "bound to 0.0.0.0" in output
    assert server.returncode == 0
    end = time.monotonic() + 30
    while (left := _alive(seen)) and time.monotonic() < end:
        time.sleep(0.5)
    assert left == []
