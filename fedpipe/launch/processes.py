"""Flower's SuperLink and SuperNodes as managed processes, and stopping what a run started.

Every process gets a private ``FLWR_HOME``, no telemetry, no update check and no runtime
dependency installation (otherwise Flower runs `uv sync` and downloads CUDA torch).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil

from fedpipe.launch.flowerconfig import format_config_args

__all__ = [
    "Certificates",
    "ManagedProcess",
    "ProcessStartError",
    "explain_failure",
    "flower_env",
    "flower_executable",
    "flower_processes_under",
    "free_port",
    "start_superlink",
    "start_supernode",
    "run_workdir",
    "stop_all",
]

logger = logging.getLogger(__name__)

_SUPERNODE_READY = re.compile(r"SuperNode ID: \d+")


class ProcessStartError(RuntimeError):
    """A Flower process exited or stayed unready; the message holds its log tail, ``reason``
    one line that says what to do (for the command line)."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message.splitlines()[0]


# (pattern in a Flower log, what it means for the user); the first match wins
_KNOWN_FAILURES: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(r"Failed to activate SuperNode"),
        "the SuperLink refused this SuperNode: register its public key there first "
        "(`fedpipe register-node KEY.pub --superlink HOST:PORT --tls-ca CA`), or check --auth-key",
    ),
    (
        re.compile(r"address already in use|Errno 98", re.IGNORECASE),
        "its port is already in use: choose another port or stop the process that holds it",
    ),
    (
        re.compile(r"enable-supernode-auth. flag requires encrypted TLS"),
        "node authentication needs TLS: give --tls-ca, --tls-cert and --tls-key",
    ),
    (
        re.compile(r"Connection attempt failed"),
        "it could not reach the SuperLink: check --superlink, that the SuperLink runs, and "
        "TLS (--tls-ca for a TLS SuperLink)",
    ),
    (
        re.compile(r"SSL|certificate", re.IGNORECASE),
        "TLS failed: check --tls-ca/--tls-cert/--tls-key (the CA must sign the certificate, "
        "issued for the host name devices use)",
    ),
)


def explain_failure(log_text: str) -> str:
    """What a Flower process's log says went wrong, in the user's terms ("" if unknown)."""
    for pattern, meaning in _KNOWN_FAILURES:
        if pattern.search(log_text):
            return meaning
    return ""


def free_port(host: str = "127.0.0.1") -> int:
    """Return a port that was free a moment ago (bind to 0, read it, release it).

    Flower rejects ``--port 0``, so the port is chosen here; another process could take
    it between this call and the server's bind. Callers retry start-up on that failure.
    """
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def flower_env(flwr_home: str | Path, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for a Flower process: private home, offline, no dependency installs.

    Flower starts helpers (`flower-superexec`, `flwr-serverapp`, `flwr-clientapp`,
    `flwr-simulation`) by bare name, so this interpreter's script folder leads ``PATH``.
    """
    merged = dict(os.environ if env is None else env)
    bin_dir = str(Path(sys.executable).parent)
    merged["PATH"] = os.pathsep.join([bin_dir, merged.get("PATH", "")])
    merged.update(
        FLWR_HOME=str(flwr_home),
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
        PYTHONUNBUFFERED="1",
    )
    # Ray forks in the simulation's ServerApp process while its streams are live: gRPC's fork
    # handlers off there, before Flower imports grpc (fedpipe/__init__.py says why)
    merged.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
    return merged


def flower_executable(name: str) -> str:
    """Find a Flower console script beside this interpreter first, then on ``PATH``."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found; install flwr in this environment")
    return found


def run_workdir(workdir: str | Path | None, prefix: str) -> Path:
    path = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix=prefix))
    path.mkdir(parents=True, exist_ok=True)
    return path


# ---------------------------------------------------------------------- processes


class ManagedProcess:
    """A started Flower process with a log file, a readiness probe and a sure stop.

    Flower detaches some helpers into their own sessions (the SuperLink's SuperExec), so
    `stop` collects the whole descendant tree before signalling, not the process group.
    """

    def __init__(
        self,
        args: Sequence[str],
        *,
        name: str,
        log_path: Path,
        env: Mapping[str, str],
        address: str,
        ready_pattern: re.Pattern[str] | None = None,
        health_url: str | None = None,
        health_context: ssl.SSLContext | None = None,
    ) -> None:
        self.name = name
        self.args = list(args)
        self.log_path = log_path
        self.address = address
        self._ready_pattern = ready_pattern
        self._health_url = health_url
        self._health_context = health_context
        self._log = log_path.open("ab")
        self.popen = subprocess.Popen(  # noqa: S603 - fixed argv, no shell
            with_parent_death_signal(self.args),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=dict(env),
        )
        self._watchdog = _start_watchdog(self.pid)
        logger.info("[%s] started pid %d: %s", name, self.pid, " ".join(self.args))

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_text(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def wait_ready(self, timeout_s: float = 60.0) -> ManagedProcess:
        """Block until the process answers its probe; raise with the log tail if not."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise self._failure(f"exited with {self.popen.returncode}")
            if self._is_ready():
                return self
            time.sleep(0.2)
        raise self._failure(f"not ready after {timeout_s:.0f} s")

    def _is_ready(self) -> bool:
        if self._ready_pattern is not None and not self._ready_pattern.search(self.log_text()):
            return False
        if self._health_url is None:
            return True
        try:
            with urllib.request.urlopen(  # noqa: S310 - URL built from our own host:port
                self._health_url, timeout=1.0, context=self._health_context
            ) as response:
                return 200 <= response.status < 300
        except (urllib.error.URLError, OSError):
            return False

    def _failure(self, what: str) -> ProcessStartError:
        text = self.log_text()
        tail = "\n".join(text.splitlines()[-30:])
        meaning = explain_failure(text) or "see its log"
        reason = f"{self.name} {what}: {meaning} (log {self.log_path})"
        return ProcessStartError(
            f"{self.name} (pid {self.pid}) {what}; log {self.log_path}:\n{tail}", reason
        )

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def reap(self) -> None:
        """Collect the exit status, stop the watchdog, close the log (after the process ended)."""
        if self.popen.poll() is None:
            self.popen.wait(timeout=5.0)
        if self._watchdog is not None and self._watchdog.poll() is None:
            self._watchdog.terminate()
            self._watchdog.wait(timeout=5.0)
        self._log.close()

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process and its descendants, SIGKILL what is left after ``grace_s``."""
        stop_all([self], grace_s=grace_s)

    def __enter__(self) -> ManagedProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ManagedProcess({self.name!r}, pid={self.pid}, address={self.address!r})"


# Runs first in the child: prctl(PR_SET_PDEATHSIG, SIGTERM), so the kernel sends SIGTERM when
# the thread that started it exits (the setting survives exec), then exec the Flower program.
# A launcher and not a preexec_fn: a preexec_fn forces a plain fork() of a process whose gRPC
# threads are running, and gRPC's fork handlers then abort the child now and then.
_PDEATHSIG_LAUNCHER = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('fedpipe: the parent process ended before its Flower process started')\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def with_parent_death_signal(args: list[str]) -> list[str]:
    """``args`` started so that the process gets SIGTERM when fedpipe dies, even by SIGKILL.

    Only from the main thread, which lives as long as the process (the signal follows the
    starting thread); elsewhere, and off Linux, the watchdog alone covers it.
    """
    if not sys.platform.startswith("linux") or threading.current_thread() is not (
        threading.main_thread()
    ):
        return args
    return [sys.executable, "-c", _PDEATHSIG_LAUNCHER, str(os.getpid()), *args]


def _start_watchdog(pid: int) -> subprocess.Popen[bytes] | None:
    """Start `fedpipe.launch.watchdog` for ``pid``'s tree (None where psutil cannot tell)."""
    if not sys.platform.startswith("linux"):
        return None
    args = [sys.executable, "-m", "fedpipe.launch.watchdog", str(os.getpid()), str(pid)]
    return subprocess.Popen(  # noqa: S603 - fixed argv, no shell
        args,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        # not a Flower process: without FLWR_HOME, `flower_processes_under` never counts it
        env={k: v for k, v in os.environ.items() if k != "FLWR_HOME"},
        start_new_session=True,  # a terminal's Ctrl-C or hang-up does not reach it
    )


def flower_processes_under(root: str | Path) -> list[int]:
    """PIDs of live processes whose ``FLWR_HOME`` lies under ``root``.

    Every process fedpipe starts gets a private FLWR_HOME, and Flower's helpers (SuperExec,
    flwr-serverapp, flwr-clientapp, Ray workers) inherit it: this finds exactly what one run
    started, and none of another run's processes on the same machine.
    """
    found = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            home = proc.environ().get("FLWR_HOME", "")
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if home.startswith(str(root)) and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(proc.info["pid"])
    return found


def stop_all(processes: Sequence[ManagedProcess], *, grace_s: float = 10.0) -> None:
    """Stop several processes at once (signals first, then one shared grace period).

    Stopping SuperNodes before their SuperLink avoids their reconnect loop; pass them
    first. Zombies count as gone: they hold no resources and cannot be killed.
    """
    tree: list[psutil.Process] = []
    for proc in processes:
        tree += proc.descendants()  # before the parent dies and they are reparented
        try:
            tree.append(psutil.Process(proc.pid))
        except psutil.NoSuchProcess:
            pass
    for member in tree:
        _signal(member, signal.SIGTERM)
    _, alive = psutil.wait_procs(tree, timeout=grace_s)
    alive = [p for p in alive if _running(p)]
    for member in alive:
        logger.warning("pid %d ignored SIGTERM for %.0f s; killing it", member.pid, grace_s)
        _signal(member, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=5.0)
    for proc in processes:
        proc.reap()


def _signal(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except psutil.NoSuchProcess:
        pass


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ------------------------------------------------------------------ SuperLink/Node


@dataclass(frozen=True)
class Certificates:
    """Server TLS files (PEM paths) for a SuperLink: CA, certificate, private key."""

    ca_certfile: Path
    certfile: Path
    keyfile: Path


def start_superlink(
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    insecure: bool = True,
    certificates: Certificates | None = None,
    enable_node_auth: bool = False,
    simulation: bool = False,
    database: str | Path | None = None,
    workdir: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    ready_timeout_s: float = 60.0,
) -> ManagedProcess:
    """Start `flower-superlink` (Fleet, Control and Runtime APIs on one port); wait ready.

    Ready means ``GET /health`` answers 200. ``port=None`` picks a free one. Logs go to
    ``workdir/superlink.log``; ``FLWR_HOME`` is ``workdir/flwr-home`` unless ``env``
    sets one. ``simulation=True`` runs ClientApps on Ray inside the SuperLink host.
    State is in memory unless ``database`` names an SQLite file.
    """
    if not insecure and certificates is None:
        raise ValueError("a TLS SuperLink needs certificates (or pass insecure=True)")
    root = run_workdir(workdir, "fedpipe-superlink-")
    port = port or free_port(host)
    args = [flower_executable("flower-superlink"), "--host", host, "--port", str(port)]
    args += ["--disable-runtime-dependency-installation"]
    args += ["--database", str(database)] if database is not None else []
    args += ["--simulation"] if simulation else []
    args += ["--enable-supernode-auth"] if enable_node_auth else []
    if insecure:
        args.append("--insecure")
    else:
        assert certificates is not None
        args += ["--ssl-ca-certfile", str(certificates.ca_certfile)]
        args += ["--ssl-certfile", str(certificates.certfile)]
        args += ["--ssl-keyfile", str(certificates.keyfile)]
    context = None
    if not insecure and certificates is not None:
        context = ssl.create_default_context(cafile=str(certificates.ca_certfile))
    scheme = "http" if insecure else "https"
    address = f"{host}:{port}"
    proc = ManagedProcess(
        args,
        name=f"superlink {address}",
        log_path=root / "superlink.log",
        env=_home_env(env, root),
        address=address,
        health_url=f"{scheme}://{_connect_host(host)}:{port}/health",
        health_context=context,
    )
    return _ready_or_stopped(proc, ready_timeout_s)


def start_supernode(
    *,
    superlink: str,
    port: int | None = None,
    node_config: Mapping[str, Any] | None = None,
    insecure: bool = True,
    root_certificates: str | Path | None = None,
    auth_key: str | Path | None = None,
    workdir: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    ready_timeout_s: float = 60.0,
) -> ManagedProcess:
    """Start `flower-supernode` against ``superlink`` (host:port); wait until registered.

    Ready means the node logged ``SuperNode ID: <id>``, i.e. it registered and activated
    at the SuperLink. ``port`` is the node's own runtime API port (free one if None).
    ``node_config`` values are rendered as TOML (strings quoted) for ``--node-config``.
    ``auth_key`` is the node's private key when the SuperLink enforces node auth.
    """
    if not insecure and root_certificates is None:
        raise ValueError("a TLS SuperNode needs root_certificates (or pass insecure=True)")
    root = run_workdir(workdir, "fedpipe-supernode-")
    port = port or free_port()
    args = [flower_executable("flower-supernode"), "--superlink", superlink, "--port", str(port)]
    args += ["--insecure"] if insecure else ["--root-certificates", str(root_certificates)]
    args += ["--auth-supernode-private-key", str(auth_key)] if auth_key is not None else []
    if node_config:
        args += ["--node-config", format_config_args(node_config)]
    proc = ManagedProcess(
        args,
        name=f"supernode :{port}",
        log_path=root / f"supernode-{port}.log",
        env=_home_env(env, root),
        address=f"127.0.0.1:{port}",
        ready_pattern=_SUPERNODE_READY,
    )
    return _ready_or_stopped(proc, ready_timeout_s)


def _home_env(env: Mapping[str, str] | None, root: Path) -> dict[str, str]:
    base = os.environ if env is None else env
    return flower_env(base.get("FLWR_HOME") or root / "flwr-home", base)


def _connect_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def _ready_or_stopped(proc: ManagedProcess, timeout_s: float) -> ManagedProcess:
    try:
        return proc.wait_ready(timeout_s)
    except BaseException:
        proc.stop(grace_s=5.0)
        raise


# ------------------------------------------------------------------------ flwr run
