"""`fedpipe client` and `fedpipe server` take their Flower processes down however they end.

Each test starts the real command as a process, records the PIDs of its whole tree once the
Flower process is up, ends the command (SIGKILL, or SIGHUP), and then waits a bounded time
for every recorded PID to be gone. Processes are found by PID (psutil), never by name.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from harness.processes import FEDPIPE, Started, assert_gone, kill_all, process_tree
from harness.waits import wait_for

from fedpipe.launch.processes import free_port, start_superlink


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGHUP])
def test_client_takes_its_supernode_down(
    tmp_path: Path, started: Started, how: signal.Signals
) -> None:
    link = start_superlink(workdir=tmp_path / "superlink")
    tree: list[psutil.Process] = []
    client = None
    try:
        client = started.spawn(
            "client",
            ["client", "--superlink", link.address, "--workdir", str(tmp_path / "node")],
            flwr_home=tmp_path / "home-node",
        )
        started.wait_for_text("client", "connected to", timeout_s=120)
        tree = process_tree(client.pid)
        names = " ".join(" ".join(p.cmdline()) for p in tree[1:])
        assert "flower-supernode" in names, names
        client.send_signal(how)
        rc = client.wait(timeout=60)
        assert rc == (-signal.SIGKILL if how == signal.SIGKILL else 0)
        assert_gone(tree)
    finally:
        kill_all(tree)
        link.stop()


def test_server_takes_its_superlink_down_on_sigkill(tmp_path: Path, started: Started) -> None:
    port_file = tmp_path / "stage.port"
    tree: list[psutil.Process] = []
    server = started.spawn(
        "server",
        [
            "server", "--stage-server", "127.0.0.1:0", "--port-file", str(port_file),
            "--superlink", f"127.0.0.1:{free_port()}", "--workdir", str(tmp_path / "link"),
        ],
        flwr_home=tmp_path / "home-server",
    )  # fmt: skip
    try:
        started.wait_for_text("server", "Flower SuperLink at", timeout_s=120)
        tree = process_tree(server.pid)
        names = " ".join(" ".join(p.cmdline()) for p in tree[1:])
        assert "flower-superlink" in names, names
        server.kill()
        server.wait(timeout=30)
        assert_gone(tree)
    finally:
        kill_all(tree)


def test_a_bench_server_dies_with_a_bench_killed_by_sigkill(tmp_path: Path) -> None:
    """A benchmark's StageServer child must not outlive a bench that was SIGKILLed."""
    script = (
        "import time\n"
        "from fedpipe_bench.load import ServerProcess\n"
        "server = ServerProcess()\n"
        "print(server.proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    bench = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert bench.stdout is not None
        server_pid = int(bench.stdout.readline())
        assert psutil.pid_exists(server_pid)
        server = psutil.Process(server_pid)
        bench.send_signal(signal.SIGKILL)
        bench.wait(timeout=30)
        assert_gone([server])  # the bench's server did not outlive it
    finally:
        bench.kill()
        bench.wait(timeout=30)


def test_bench_server_leaves_no_server_behind_when_killed(tmp_path: Path) -> None:
    """`fedpipe bench server` killed by SIGKILL mid-run: both of its StageServers go too."""
    bench = subprocess.Popen(
        [*FEDPIPE, "bench", "server", "--quick", "--json"],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "bench.log").open("wb"),
    )
    try:

        def two_servers() -> bool:
            assert bench.poll() is None, (tmp_path / "bench.log").read_text()[-2000:]
            return len(psutil.Process(bench.pid).children()) >= 2

        wait_for(two_servers, "the bench to start its two servers", timeout=300, interval=0.2)
        servers = psutil.Process(bench.pid).children()
        bench.send_signal(signal.SIGKILL)
        bench.wait(timeout=30)
        assert_gone(servers)  # neither server outlived the bench
    finally:
        bench.kill()
        bench.wait(timeout=30)
