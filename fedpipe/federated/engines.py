"""Flower's engines as managed processes: app projects, SuperLink, SuperNodes, `flwr run`.

fedpipe never vendors its apps into the bundle that `flwr run` uploads. `write_flower_app`
writes a project that holds only a `pyproject.toml` whose components point into an
*installed* package (``fedpipe.federated.apps:server_app``); the SuperLink and SuperNodes
import it from their own environment, so data files and compiled protos come from
site-packages. `flwr run` checks statically that the component modules are importable
in its own environment and that the attribute is a plain top-level assignment
(``app = ServerApp()``; an annotated ``app: ServerApp = ...`` fails that check).

Simulation (`run_simulation_engine`) starts its own SuperLink in simulation mode on a
free port and runs `flwr run` against it, instead of the detached SuperLink on port
39091 that `flwr run` otherwise starts and leaves behind, and instead of
`flwr.simulation.run_simulation`, which gives apps an empty run config.

Every process gets a private ``FLWR_HOME``, no telemetry, no update check and no runtime
dependency installation (otherwise Flower runs `uv sync` and downloads CUDA torch).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil

__all__ = [
    "FlowerRunError",
    "FlwrRunResult",
    "ManagedProcess",
    "ProcessStartError",
    "flower_env",
    "flower_processes_under",
    "flwr_run",
    "format_config_args",
    "free_port",
    "run_simulation_engine",
    "start_superlink",
    "start_supernode",
    "stop_all",
    "write_flower_app",
]

logger = logging.getLogger(__name__)

ConfigValue = bool | int | float | str
_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
_SUPERNODE_READY = re.compile(r"SuperNode ID: \d+")
_RUN_ID = re.compile(r"Successfully started run (\d+)")
_CONNECTION = "fedpipe"


class ProcessStartError(RuntimeError):
    """A Flower process exited or stayed unready; the message holds its log tail."""


class FlowerRunError(RuntimeError):
    """`flwr run` failed, timed out, or the run did not finish as completed."""


# --------------------------------------------------------------------------- TOML


def toml_value(value: ConfigValue) -> str:
    """Render one scalar as TOML that also survives Flower's ``k=v`` command-line parser.

    Flower splits ``--run-config``/``--node-config`` with a regex that ends a quoted
    string at the next quote of the same kind, so strings use a TOML literal string
    ('...', backslashes kept as-is) unless they contain a single quote.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        if "\n" in value or "\r" in value:
            raise ValueError(f"config strings cannot hold newlines: {value!r}")
        if "'" not in value:
            return f"'{value}'"
        if '"' not in value and "\\" not in value:
            return f'"{value}"'
        raise ValueError(
            f"config string {value!r} holds both quote kinds (or ' and a backslash); "
            "Flower's k=v parser cannot carry it: pass a path to a file instead"
        )
    raise TypeError(f"config values must be bool, int, float or str, got {type(value).__name__}")


def _flat_items(config: Mapping[str, Any], prefix: str = "") -> list[tuple[str, ConfigValue]]:
    """Flatten nested dicts into dotted keys, as Flower flattens run configs."""
    items: list[tuple[str, ConfigValue]] = []
    for key, value in config.items():
        if not _BARE_KEY.match(key):
            raise ValueError(f"config key {key!r} must match [A-Za-z0-9_-]+")
        if isinstance(value, Mapping):
            items += _flat_items(value, f"{prefix}{key}.")
        else:
            items.append((f"{prefix}{key}", value))
    return items


def format_config_args(config: Mapping[str, Any]) -> str:
    """Render a config as Flower's space-separated ``k=v`` string (TOML values)."""
    return " ".join(f"{key}={toml_value(value)}" for key, value in _flat_items(config))


def write_flower_app(
    directory: str | Path,
    *,
    server_app: str,
    client_app: str,
    config: Mapping[str, Any],
    name: str = "fedpipe-app",
    version: str = "0.1.0",
    publisher: str = "fedpipe",
) -> Path:
    """Write a Flower app project (only ``pyproject.toml``) whose components are installed.

    ``server_app``/``client_app`` are ``"package.module:attribute"`` references resolved
    in the processes' environment; ``config`` becomes ``[tool.flwr.app.config]`` (the
    keys a run may override). There are no ``[project].dependencies``, so nothing is
    installed at run time, and no ``[tool.flwr.federations]``.
    """
    for ref in (server_app, client_app):
        if ref.count(":") != 1 or not all(ref.split(":")):
            raise ValueError(f"component {ref!r} must look like 'package.module:attribute'")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    lines = [
        "[project]",
        f"name = {toml_value(name)}",
        f"version = {toml_value(version)}",
        "",
        "[tool.flwr.app]",
        f"publisher = {toml_value(publisher)}",
        "",
        "[tool.flwr.app.components]",
        f"serverapp = {toml_value(server_app)}",
        f"clientapp = {toml_value(client_app)}",
        "",
        "[tool.flwr.app.config]",
        *(f"{key} = {toml_value(value)}" for key, value in _flat_items(config)),
    ]
    (root / "pyproject.toml").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


# ---------------------------------------------------------------------- environment


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
    return merged


def _executable(name: str) -> str:
    """Find a Flower console script beside this interpreter first, then on ``PATH``."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found; install flwr in this environment")
    return found


def _workdir(workdir: str | Path | None, prefix: str) -> Path:
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
            self.args, stdout=self._log, stderr=subprocess.STDOUT, env=dict(env)
        )
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
                raise ProcessStartError(self._failure(f"exited with {self.popen.returncode}"))
            if self._is_ready():
                return self
            time.sleep(0.2)
        raise ProcessStartError(self._failure(f"not ready after {timeout_s:.0f} s"))

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

    def _failure(self, what: str) -> str:
        tail = "\n".join(self.log_text().splitlines()[-30:])
        return f"{self.name} (pid {self.pid}) {what}; log {self.log_path}:\n{tail}"

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def reap(self) -> None:
        """Collect the exit status and close the log handle (after the process ended)."""
        if self.popen.poll() is None:
            self.popen.wait(timeout=5.0)
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
    root = _workdir(workdir, "fedpipe-superlink-")
    port = port or free_port(host)
    args = [_executable("flower-superlink"), "--host", host, "--port", str(port)]
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
    root = _workdir(workdir, "fedpipe-supernode-")
    port = port or free_port()
    args = [_executable("flower-supernode"), "--superlink", superlink, "--port", str(port)]
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


@dataclass(frozen=True)
class FlwrRunResult:
    """What one `flwr run` left behind: its run id, final status, output and timing."""

    run_id: int | None
    status: str
    returncode: int
    output: str
    log_path: Path
    wall_s: float

    @property
    def completed(self) -> bool:
        return self.status == "finished:completed"


def write_connection(
    flwr_home: str | Path,
    *,
    superlink: str,
    insecure: bool = True,
    root_certificates: str | Path | None = None,
    name: str = _CONNECTION,
) -> Path:
    """Write ``$FLWR_HOME/config.toml`` with one SuperLink connection, made the default."""
    home = Path(flwr_home)
    home.mkdir(parents=True, exist_ok=True)
    lines = ["[superlink]", f"default = {toml_value(name)}", "", f"[superlink.{name}]"]
    lines.append(f"address = {toml_value(superlink)}")
    lines.append(f"insecure = {toml_value(insecure)}")
    if root_certificates is not None:
        lines.append(f"root-certificates = {toml_value(str(root_certificates))}")
    path = home / "config.toml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def flwr_run(
    app_dir: str | Path,
    *,
    superlink: str,
    run_config: Mapping[str, Any] | None = None,
    federation_config: Mapping[str, Any] | None = None,
    stream: bool = True,
    timeout_s: float = 600.0,
    insecure: bool = True,
    root_certificates: str | Path | None = None,
    workdir: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    check: bool = True,
) -> FlwrRunResult:
    """Run the app in ``app_dir`` on the SuperLink at ``superlink`` and wait for it.

    The connection lives in a private ``FLWR_HOME`` (``workdir/flwr-cli``). With
    ``stream`` the command follows the run's logs until it ends; the final status then
    comes from `flwr ls`. On timeout the run is stopped on the SuperLink too. With
    ``check`` a run that did not finish as completed raises `FlowerRunError`.
    """
    root = _workdir(workdir, "fedpipe-flwr-run-")
    home = root / "flwr-cli"
    write_connection(
        home, superlink=superlink, insecure=insecure, root_certificates=root_certificates
    )
    run_env = flower_env(home, env)
    args = [_executable("flwr"), "run", str(Path(app_dir).resolve()), _CONNECTION]
    args += ["--stream"] if stream else []
    if run_config:
        args += ["--run-config", format_config_args(run_config)]
    if federation_config:
        args += ["--federation-config", format_config_args(federation_config)]
    log_path = root / "flwr-run.log"
    start = time.monotonic()
    returncode, output = _run_logged(args, run_env, log_path, timeout_s)
    match = _RUN_ID.search(output)
    run_id = int(match.group(1)) if match else None
    if returncode == -1 and run_id is not None:
        _flwr_quiet(["stop", str(run_id), _CONNECTION], run_env)
    status = _run_status(run_id, run_env) if run_id is not None else "not-started"
    result = FlwrRunResult(run_id, status, returncode, output, log_path, time.monotonic() - start)
    if check and (returncode != 0 or (stream and not result.completed)):
        tail = "\n".join(output.splitlines()[-40:])
        raise FlowerRunError(
            f"flwr run of {app_dir} on {superlink}: rc={returncode}, status={status!r}, "
            f"after {result.wall_s:.1f} s (timeout {timeout_s:.0f} s); log {log_path}:\n{tail}"
        )
    return result


def _run_logged(
    args: Sequence[str], env: Mapping[str, str], log_path: Path, timeout_s: float
) -> tuple[int, str]:
    """Run a command to completion with output in ``log_path``; rc -1 means timed out."""
    with log_path.open("wb") as log:
        proc = subprocess.Popen(  # noqa: S603 - fixed argv, no shell
            list(args), stdout=log, stderr=subprocess.STDOUT, env=dict(env)
        )
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            returncode = -1
    return returncode, log_path.read_text(encoding="utf-8", errors="replace")


def _flwr_quiet(args: Sequence[str], env: Mapping[str, str]) -> str:
    done = subprocess.run(  # noqa: S603 - fixed argv, no shell
        [_executable("flwr"), *args], env=dict(env), capture_output=True, text=True, timeout=60
    )
    return done.stdout


def _run_status(run_id: int, env: Mapping[str, str]) -> str:
    """The run's status text (``finished:completed``...) from `flwr ls`, or ``unknown``."""
    args = ["ls", _CONNECTION, "--run-id", str(run_id), "--format", "json"]
    try:
        payload = json.loads(_flwr_quiet(args, env))
        return str(payload["runs"][0]["status"])
    except (json.JSONDecodeError, KeyError, IndexError, subprocess.TimeoutExpired):
        return "unknown"


def run_simulation_engine(
    app_dir: str | Path,
    *,
    num_supernodes: int,
    run_config: Mapping[str, Any] | None = None,
    cpus_per_client: float = 1,
    timeout_s: float = 600.0,
    workdir: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    check: bool = True,
) -> FlwrRunResult:
    """Run the app on Flower's simulation engine (Ray) and stop everything afterwards.

    Starts a private simulation SuperLink on a free loopback port, runs `flwr run
    --stream` with this federation size and run config, then stops the SuperLink and
    all its helpers. Nodes see ``node_config = {"partition-id", "num-partitions"}``.
    """
    root = _workdir(workdir, "fedpipe-simulation-")
    federation = {"num-supernodes": num_supernodes, "client-resources-num-cpus": cpus_per_client}
    link = start_superlink(simulation=True, workdir=root / "superlink", env=env)
    try:
        return flwr_run(
            app_dir,
            superlink=link.address,
            run_config=run_config,
            federation_config=federation,
            timeout_s=timeout_s,
            workdir=root,
            env=env,
            check=check,
        )
    finally:
        link.stop()
