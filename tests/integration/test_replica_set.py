"""StageServer replicas as Ray actors: started on a local Ray of their own, reported, killed
and restarted by Ray at the same address, and stopped with no process left behind.

Each test starts a real local Ray (about 5 s alone, more on a busy machine) and real
StageServers (tiny-llama) in its actors; round control reaches them over gRPC, never through
Ray. Killing a replica (``ray.kill`` without ``no_restart``) ends its process; Ray restarts the
actor, which binds the same port, empty; the ServerApp's control finds it so at BeginRound
and loads the global adapter into it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from fedpipe.config import FedpipeConfig
from fedpipe.fl.replica_control import ReplicaControl
from fedpipe.server.ray_replicas import ReplicaSet, ReplicaStartError
from fedpipe.wire.control_client import StageControlClient

SECRET = "a-secret-for-replica-set-tests"
RAY_CURRENT = Path("/tmp/ray/ray_current_cluster")  # what `ray start` writes for address=auto


def _config(**more: object) -> FedpipeConfig:
    base = {"model.name": "tiny-llama", "server.replicas": 2, "server.device": "cpu"}
    return FedpipeConfig().with_overrides({**base, **more})


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _alive(pids: set[int]) -> list[str]:
    left = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{pid} ({proc.name()})")
        except psutil.NoSuchProcess:
            continue
    return left


def _wait_gone(pids: set[int], deadline_s: float = 30.0) -> list[str]:
    end = time.monotonic() + deadline_s
    while (left := _alive(pids)) and time.monotonic() < end:
        time.sleep(0.5)
    return left


def test_replicas_serve_come_back_at_their_address_and_leave_no_process() -> None:
    before, had_current = _descendants(), RAY_CURRENT.exists()
    replicas = ReplicaSet(_config(), secret=SECRET)
    started: set[int] = set()
    try:
        replicas.start()
        started = _descendants() - before  # Ray's head processes, workers, the replicas
        lines = [r.line() for r in replicas.replicas]
        first = list(replicas.replicas)
        env_address = os.environ.get("RAY_ADDRESS")
        control = ReplicaControl(
            replicas.addresses, SECRET, run_id="run", lora_scale=2.0, wait_s=60.0
        )
        control.reset_adapter()
        control.begin_round(1, "run", "separate")
        replicas.kill(1)  # Ray restarts it: same address, new process, no run adapter
        end = time.monotonic() + 120
        while (again := replicas.refresh(1)).pid == first[1].pid and time.monotonic() < end:
            time.sleep(0.5)
        started |= _descendants() - before
        control.begin_round(2, "run", "separate")
        live = list(control.round.live)
        reloaded = StageControlClient(again.address, SECRET, run_id="run/r1").get_adapter()
        control.close()
    finally:
        replicas.stop()
    assert len(lines) == 2 and all(f"replica {i}: 127.0.0.1:" in lines[i] for i in (0, 1))
    assert all("asked Ray for 1 CPU" in line for line in lines)
    assert again.address == first[1].address and again.pid != first[1].pid
    assert live == [0, 1]  # the restarted replica was loaded and begun
    assert all(reloaded[k].equal(v) for k, v in control.get_adapter().items())
    assert {first[0].pid, first[1].pid, again.pid} <= started
    # its own Ray: found through neither RAY_ADDRESS nor `ray start`'s file (Flower's
    # simulation engine, which starts its own, cannot join it by accident)
    assert env_address is None and RAY_CURRENT.exists() == had_current
    assert _wait_gone(started) == []


def test_replicas_that_cannot_start_are_said_in_one_line_and_leave_no_process() -> None:
    before = _descendants()
    with pytest.raises(ReplicaStartError) as no_gpu:
        ReplicaSet(_config(**{"server.device": "cuda"}), secret=SECRET).start()
    with pytest.raises(ReplicaStartError) as too_slow:  # not serving within the time given
        ReplicaSet(_config(**{"server.replica_start_s": 0.05}), secret=SECRET).start()
    assert "\n" not in str(no_gpu.value) and "\n" not in str(too_slow.value)
    assert "replica 0 of 2 cannot be placed: each asks Ray for 1 GPU" in str(no_gpu.value)
    assert "not serving after 0.05 s (server.replica_start_s)" in str(too_slow.value)
    assert _wait_gone(_descendants() - before) == []


def test_fedpipe_server_says_each_replica_and_stops_them_all(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    secret = tmp_path / "secret"
    command = [
        sys.executable, "-m", "fedpipe.cli", "server", "--model", "tiny-llama",
        "--replicas", "2", "--device", "cpu", "--stage-server", "127.0.0.1:0",
        "--secret-file", str(secret), "--port-file", str(ready),
    ]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: set[int] = set()
    try:
        end = time.monotonic() + 300
        while not ready.exists() and proc.poll() is None and time.monotonic() < end:
            seen |= {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
            time.sleep(0.5)
        assert ready.exists(), "fedpipe server --replicas 2 did not become ready"
        seen |= {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        addresses = ready.read_text().split(",")
        control = ReplicaControl(
            addresses, secret.read_text().strip(), run_id="run", lora_scale=2.0
        )
        control.reset_adapter()  # each replica answers signed round control
        control.begin_round(1, "run", "separate")
        live = list(control.round.live)
        control.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output[-2000:]
    assert live == [0, 1]
    for index, address in enumerate(addresses):
        assert f"fedpipe: replica {index}: {address} (node " in output
        assert "asked Ray for 1 CPU" in output
    assert f"`fedpipe run --stage-server {','.join(addresses)}`" in output
    assert "fedpipe: replicas stopped" in output
    assert _wait_gone(seen) == []
