"""Devices that share nothing with the server host, as if on other machines, over loopback.

The server side (``fedpipe server --superlink`` and ``fedpipe run``) keeps its secret, run
folder and homes in one folder; each device (``fedpipe client``, a SuperNode and the
ClientApps it starts) gets its own HOME, FLWR_HOME, model cache, temp and work folders and
is told only the SuperLink's address, its partition and its own TLS files. The stage link
runs mutual TLS with certificates from ``fedpipe certs``; each device holds only the CA and
its own certificate. The devices learn the stage address and their tokens from their round
messages.

That no device reads the master secret is shown two ways. Where the test may make mount
namespaces (root, with `unshare`), each device runs in its own, in which the server's whole
folder is covered by an empty, mode-000 tmpfs: as on another machine, the server's files do
not exist for it (the test checks by trying), while the server side reads its secret, mode
000 too. In every case, each device process starts with an audit hook (a ``sitecustomize`` on
its PYTHONPATH) that refuses and records any open of a file in the secret's folder; the test
checks that the hook was active in the ClientApp processes and recorded nothing, and that the
secret appears in no file a device wrote.

It is also the suite's deployment driven only through the CLI, as a user runs one:
``fedpipe server --superlink``, two ``fedpipe client`` and ``fedpipe run`` for two rounds; then
every process is stopped with SIGTERM, each exits 0, and none is left behind. (Plaintext
deployments run in test_deployment_failures and in the StageServer restart below.)
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness.certs import fedpipe_certs
from harness.deploy import SMALL, Deployment
from harness.processes import Started, assert_no_flower_under
from safetensors.torch import load_file

AS_ROOT = os.geteuid() == 0
_MOUNT_OVER = 'mount -t tmpfs -o mode=000,size=64k fedpipe-elsewhere "$0" && exec "$@"'
WORKTREE = str(Path(__file__).resolve().parents[2])

# Installed in every device process: refuse and record opens of the server's secret folder.
_AUDIT_HOOK = """
import os, sys
_forbidden = os.environ.get("FEDPIPE_TEST_FORBIDDEN", "")
_log = os.environ.get("FEDPIPE_TEST_AUDIT_LOG", "")
if _forbidden and _log:
    _fd = os.open(_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with open("/proc/self/cmdline", "rb") as _f:
        _cmd = _f.read().replace(b"\\0", b" ")[:300]
    os.write(_fd, b"hook " + str(os.getpid()).encode() + b" " + _cmd + b"\\n")

    def _hook(event, args):
        if event != "open" or not args or isinstance(args[0], int):
            return
        path = os.path.abspath(os.fsdecode(args[0]))
        if path.startswith(_forbidden):
            os.write(_fd, ("OPENED " + path + " pid " + str(os.getpid()) + "\\n").encode())
            raise PermissionError("a device process opened a server-host secret: " + path)

    sys.addaudithook(_hook)
"""


@pytest.fixture
def device_roots() -> Iterator[list[Path]]:
    """Two device folders, outside the server's."""
    base = Path(tempfile.mkdtemp(prefix="fedpipe-devices-"))
    roots = [base / f"device{i}" for i in (0, 1)]
    try:
        for root in roots:
            for sub in ("home", "flwr", "work", "tmp", "site", "tls"):
                (root / sub).mkdir(parents=True)
            (root / "site" / "sitecustomize.py").write_text(_AUDIT_HOOK)
        yield roots
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _elsewhere(server_host: Path) -> list[str]:
    """A command prefix that runs a process where ``server_host`` is an empty, closed folder.

    A private mount namespace with a mode-000 tmpfs over the server's folder; [] where the
    test cannot make one (not root, no `unshare`), leaving the audit hook as the check.
    """
    if not AS_ROOT or shutil.which("unshare") is None:
        return []
    prefix = ["unshare", "--mount", "--propagation", "private", "sh", "-c", _MOUNT_OVER]
    probe = subprocess.run(  # noqa: S603 - fixed argv
        [*prefix, str(server_host), "true"], capture_output=True, timeout=30
    )
    return [*prefix, str(server_host)] if probe.returncode == 0 else []


def _device_env(root: Path, forbidden: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FEDPIPE_", "PYTEST"))}
    env.update(
        HOME=str(root / "home"),
        FLWR_HOME=str(root / "flwr"),
        TMPDIR=str(root / "tmp"),
        PYTHONPATH=os.pathsep.join([str(root / "site"), WORKTREE]),
        PYTHONUNBUFFERED="1",
        FEDPIPE_TEST_FORBIDDEN=str(forbidden),
        FEDPIPE_TEST_AUDIT_LOG=str(root / "audit.log"),
    )
    return env


def test_devices_on_other_hosts_train_two_rounds(
    tmp_path: Path, device_roots: list[Path], started: Started
) -> None:
    host = tmp_path / "server-host"  # everything the server side has; 0700
    host.mkdir(mode=0o700)
    certs = host / "certs"
    fedpipe_certs(certs)
    for i, root in enumerate(device_roots):  # each device gets the CA and its own cert only
        for src, dst in (("ca.pem", "ca.pem"), (f"device-{i}.pem", "me.pem")):
            shutil.copy(certs / src, root / "tls" / dst)
        shutil.copy(certs / f"device-{i}.key", root / "tls" / "me.key")
    tls = [
        "--set", f"server.tls_cert={certs / 'server.pem'}",
        "--set", f"server.tls_key={certs / 'server.key'}",
        "--set", f"server.tls_ca={certs / 'ca.pem'}",
        "--set", f"server.tls_client_ca={certs / 'ca.pem'}",
        "--set", f"server.tls_client_cert={certs / 'serverapp.pem'}",
        "--set", f"server.tls_client_key={certs / 'serverapp.key'}",
    ]  # fmt: skip
    deployment = Deployment(started, host)  # the server side keeps its homes on its host
    secret_file = deployment.secret_file
    codes: dict[str, int | None] = {}
    t0 = time.monotonic()
    try:
        stage = deployment.start_server(*tls)
        out = started.text("server")
        assert "is plaintext" not in out
        assert f"StageServer listening on {stage}" in out
        assert f"Flower SuperLink at {deployment.superlink}" in out
        assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
        elsewhere = _elsewhere(host)
        if elsewhere:
            secret_file.chmod(0o000)  # the server side (root) still reads it
            refused = subprocess.run(  # noqa: S603 - fixed argv
                [*elsewhere, sys.executable, "-c", f"open({str(secret_file)!r}).read()"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert refused.returncode != 0 and "FileNotFoundError" in refused.stderr
        print(f"devices in their own mount namespace: {bool(elsewhere)}")
        deployment.start_devices(
            2,
            args=lambda i: [
                "--partition-id", str(i), "--num-partitions", "2",
                "--workdir", str(device_roots[i] / "work"),
                "--stage-ca", str(device_roots[i] / "tls" / "ca.pem"),
                "--tls-cert", str(device_roots[i] / "tls" / "me.pem"),
                "--tls-key", str(device_roots[i] / "tls" / "me.key"),
            ],
            env=lambda i: _device_env(device_roots[i], secret_file.parent),
            prefix=elsewhere,
        )  # fmt: skip
        run = deployment.run(
            "run", *tls, "--timeout", "400", "--no-progress", name="multihost", rounds=2, devices=2
        )
        rc = run.wait(timeout=430)
        assert rc == 0, started.text("run")[-6000:]
    finally:
        codes = deployment.stop()
        if secret_file.exists():
            secret_file.chmod(0o600)
    print(f"multi-host deployment (TLS + mTLS, 2 rounds): {time.monotonic() - t0:.1f} s")
    # every process ended on SIGTERM, cleanly, with nothing left behind
    assert codes == {"run": 0, "client0": 0, "client1": 0, "server": 0}, codes
    assert "server stopped" in started.text("server")
    for root in (tmp_path, device_roots[0].parent):
        assert_no_flower_under(root, within_s=15)
    assert all(p.poll() is not None for p in started.procs.values())
    _check_rounds(deployment.runs / "multihost")
    assert "round 2: eval loss" in started.text("run")
    _check_devices_kept_out(device_roots, secret_file)


def _check_rounds(folder: Path) -> None:
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["flower_run"]["status"] == "finished:completed"
    rounds = {entry["round"]: entry for entry in summary["rounds"]}
    assert sorted(rounds) == [0, 1, 2]
    for r in (0, 1, 2):
        assert rounds[r]["eval_loss"] > 0
    for r in (1, 2):
        assert rounds[r]["merged"] == 2 and rounds[r]["discarded"] == 0
        assert sorted(rounds[r]["step_times_s"]) == ["0", "1"]  # both partitions trained
    # the run's settings are the command line's
    assert summary["config"]["federated.num_devices"] == 2
    assert summary["config"]["train.local_steps"] == 2
    assert (folder / "checkpoints" / "round-0002").is_dir()


def _check_devices_kept_out(roots: list[Path], secret_file: Path) -> None:
    secret = secret_file.read_bytes().strip()
    assert len(secret) >= 16
    for root in roots:
        audit = (root / "audit.log").read_text()
        assert "OPENED" not in audit, audit
        # the hook ran in the SuperNode and in the ClientApps it started, one per round
        assert audit.count("flwr-clientapp") >= 2, audit
        for path in root.rglob("*"):
            if path.is_file() and not stat.S_ISLNK(path.lstat().st_mode):
                assert secret not in path.read_bytes(), f"the secret is in {path}"


@pytest.mark.timeout(1500)  # three deployment runs in a row, and a restart
def test_stage_server_killed_mid_round_and_the_run_resumed(tmp_path: Path) -> None:
    """SIGKILL the StageServer in round 2; the run stops; a new one + `run --resume` finish it
    with exactly the losses and checkpoints of an uninterrupted run of the same settings (run
    afterwards on the same SuperLink, devices and StageServer)."""
    from fedpipe.launch.processes import start_superlink

    started = Started(tmp_path)
    secret_file = tmp_path / "keys" / "secret"
    port_file = tmp_path / "stage.port"
    link = start_superlink(workdir=tmp_path / "superlink")
    stage_args = ["server", *SMALL, "-v", "--secret-file", str(secret_file)]
    run_args = [
        "run", *SMALL, "--superlink", link.address, "--secret-file", str(secret_file),
        "--runs-dir", str(tmp_path / "runs"), "--rounds", "2",
        "--devices", "2", "--timeout", "300", "--no-progress",
    ]  # fmt: skip
    try:
        started.spawn(
            "stage1", [*stage_args, "--port", "0", "--port-file", str(port_file)],
            flwr_home=tmp_path / "home-stage",
        )  # fmt: skip
        started.wait_for("stage1", port_file.exists, timeout_s=120)
        port = port_file.read_text().strip()
        for i in (0, 1):
            started.spawn(
                f"client{i}",
                ["client", "--superlink", link.address, "--partition-id", str(i),
                 "--num-partitions", "2", "--workdir", str(tmp_path / f"node{i}")],
                flwr_home=tmp_path / f"home-node{i}",
            )  # fmt: skip
            started.wait_for(
                f"client{i}", lambda n=f"client{i}": "connected to" in started.text(n), 120
            )
        stage = f"127.0.0.1:{port}"
        restarted = [*run_args, "--name", "restarted", "--stage-server", stage]
        started.spawn("run1", restarted, flwr_home=tmp_path / "h1")
        started.wait_for("stage1", lambda: "opened for round 2" in started.text("stage1"), 300)
        started.procs["stage1"].kill()  # mid-round 2: sessions and the round's adapters are lost
        started.procs["stage1"].wait()
        port_file.unlink()
        started.spawn(
            "stage2", [*stage_args, "--port", port, "--port-file", str(port_file)],
            flwr_home=tmp_path / "home-stage",
        )  # fmt: skip
        started.wait_for("stage2", port_file.exists, timeout_s=120)
        assert started.procs["run1"].wait(timeout=330) != 0  # the run stops, it does not go on
        print("the interrupted run ended with:", started.text("run1")[-1500:])
        run2 = started.spawn("run2", [*restarted, "--resume"], flwr_home=tmp_path / "h2")
        assert run2.wait(timeout=330) == 0, started.text("run2")[-6000:]
        straight = [*run_args, "--name", "straight", "--stage-server", stage]
        run3 = started.spawn("run3", straight, flwr_home=tmp_path / "h3")
        assert run3.wait(timeout=330) == 0, started.text("run3")[-6000:]
    finally:
        started.stop(["run1", "run2", "run3", "client0", "client1", "stage2", "stage1"])
        link.stop()
    runs = tmp_path / "runs"
    summary = json.loads((runs / "restarted" / "summary.json").read_text())
    rounds = {entry["round"]: entry for entry in summary["rounds"]}
    assert sorted(rounds) == [0, 1, 2]
    assert rounds[2]["merged"] == 2 and rounds[2]["eval_loss"] > 0
    evals = [r for r in _history(runs / "restarted") if r.get("event") == "eval"]
    assert [r["round"] for r in evals] == [0, 1, 2]  # each round evaluated once, in order
    # exactly what the uninterrupted run gives: every loss, and both sides' adapters
    uninterrupted = json.loads((runs / "straight" / "summary.json").read_text())
    losses = {(e["round"], e.get("eval_loss"), e.get("train_loss")) for e in summary["rounds"]}
    assert losses == {
        (e["round"], e.get("eval_loss"), e.get("train_loss")) for e in uninterrupted["rounds"]
    }
    for side in ("device", "server"):
        got = load_file(
            str(runs / "restarted" / "checkpoints" / "round-0002" / f"{side}.safetensors")
        )
        want = load_file(
            str(runs / "straight" / "checkpoints" / "round-0002" / f"{side}.safetensors")
        )
        assert got.keys() == want.keys() and all(got[k].equal(want[k]) for k in got), side


def _history(folder: Path) -> list[dict[str, object]]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]
