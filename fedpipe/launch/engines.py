"""Flower's engines as managed processes: app projects, SuperLink, SuperNodes, `flwr run`.

fedpipe never vendors its apps into the bundle that `flwr run` uploads. `write_flower_app`
writes a project that holds only a `pyproject.toml` whose components point into an
*installed* package (``fedpipe.fl.server_app:server_app``); the SuperLink and SuperNodes
import it from their own environment, so data files and compiled protos come from
site-packages. `flwr run` checks statically that the component modules are importable
in its own environment and that the attribute is a plain top-level assignment
(``app = ServerApp()``; an annotated ``app: ServerApp = ...`` fails that check).

Simulation (`run_simulation_engine`) starts its own SuperLink in simulation mode on a
free port and runs `flwr run` against it, instead of the detached SuperLink on port
39091 that `flwr run` otherwise starts and leaves behind, and instead of
`flwr.simulation.run_simulation`, which gives apps an empty run config.

Ray's head node waits for each process it starts (GCS server, raylet, ...); on a small or
busy machine that wait can time out, and Flower's simulation engine then crashes while it
builds its Ray backend, before any ClientApp ran. `engine_start_failure` tells that failure
from a run's outcome and log and gives Ray's reason, and `stop_processes_under` stops what
such a start left behind, so a caller can try once more.

Every process gets a private ``FLWR_HOME``, no telemetry, no update check and no runtime
dependency installation (otherwise Flower runs `uv sync` and downloads CUDA torch).
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from fedpipe.launch.flowerconfig import ConfigValue, flat_items, format_config_args, toml_value
from fedpipe.launch.processes import (
    Certificates,
    ManagedProcess,
    ProcessStartError,
    flower_env,
    flower_executable,
    flower_processes_under,
    free_port,
    run_workdir,
    start_superlink,
    start_supernode,
    stop_all,
)

__all__ = [
    "Certificates",
    "ConfigValue",
    "FlowerRunError",
    "FlwrRunResult",
    "ManagedProcess",
    "ProcessStartError",
    "engine_start_failure",
    "flower_env",
    "flower_processes_under",
    "flwr_run",
    "format_config_args",
    "free_port",
    "run_simulation_engine",
    "start_superlink",
    "start_supernode",
    "stop_all",
    "stop_processes_under",
    "toml_value",
    "write_connection",
    "write_flower_app",
]

logger = logging.getLogger(__name__)

_RUN_ID = re.compile(r"Successfully started run (\d+)")
_CONNECTION = "fedpipe"
# Flower's simulation runtime, when building its Ray backend raised: it logs "An exception
# occured!! <the exception>" (its spelling), then raises "Simulation Runtime crashed."
_ENGINE_CRASHED = "Simulation Runtime crashed"
_ENGINE_EXCEPTION = re.compile(r"An exception occured!! (.+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class FlowerRunError(RuntimeError):
    """`flwr run` failed, timed out, or the run did not finish as completed."""


# --------------------------------------------------------------------------- TOML


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
        *(f"{key} = {toml_value(value)}" for key, value in flat_items(config)),
    ]
    (root / "pyproject.toml").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


# ---------------------------------------------------------------------- environment


@dataclass(frozen=True)
class FlwrRunResult:
    """What one `flwr run` left behind: its run id, final status (and the SuperLink's details
    of it, e.g. why it failed), output and timing."""

    run_id: int | None
    status: str
    returncode: int
    output: str
    log_path: Path
    wall_s: float
    details: str = ""

    @property
    def completed(self) -> bool:
        return self.status == "finished:completed"

    @property
    def first_exception(self) -> str | None:
        """The first exception raised in the run's log (its type and message, the last line of
        the first traceback), or None: what went wrong first, for a one-line report."""
        in_traceback = False
        for line in _ANSI.sub("", self.output).splitlines():
            if "Traceback (most recent call last):" in line:
                in_traceback = True
            elif in_traceback and line.strip() and not line[0].isspace():
                return line.strip()
        return None


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
    comes from `flwr ls`. On timeout or Ctrl-C the run is stopped on the SuperLink too. With
    ``check`` a run that did not finish as completed raises `FlowerRunError`.
    """
    root = run_workdir(workdir, "fedpipe-flwr-run-")
    home = root / "flwr-cli"
    write_connection(
        home, superlink=superlink, insecure=insecure, root_certificates=root_certificates
    )
    run_env = flower_env(home, env)
    args = [flower_executable("flwr"), "run", str(Path(app_dir).resolve()), _CONNECTION]
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
    if returncode in (-1, -2) and run_id is not None:
        _flwr_quiet(["stop", str(run_id), _CONNECTION], run_env)  # don't leave it running
    if returncode == -2:
        raise KeyboardInterrupt
    status, details = _run_status(run_id, run_env) if run_id is not None else ("not-started", "")
    result = FlwrRunResult(
        run_id, status, returncode, output, log_path, time.monotonic() - start, details
    )
    if check and (returncode != 0 or (stream and not result.completed)):
        tail = "\n".join(output.splitlines()[-40:])
        raise FlowerRunError(
            f"flwr run of {app_dir} on {superlink}: rc={returncode}, status={status!r}"
            f"{f' ({details})' if details else ''}, "
            f"after {result.wall_s:.1f} s (timeout {timeout_s:.0f} s); log {log_path}:\n{tail}"
        )
    return result


def _run_logged(
    args: Sequence[str], env: Mapping[str, str], log_path: Path, timeout_s: float
) -> tuple[int, str]:
    """Run a command to completion with output in ``log_path``.

    rc -1 means it timed out; -2 that this process was interrupted (Ctrl-C or SIGTERM turned
    into KeyboardInterrupt) and the command was killed.
    """
    with log_path.open("wb") as log:
        proc = subprocess.Popen(  # noqa: S603 - fixed argv, no shell
            list(args), stdout=log, stderr=subprocess.STDOUT, env=dict(env)
        )
        try:
            returncode = proc.wait(timeout=timeout_s)
        except (subprocess.TimeoutExpired, KeyboardInterrupt) as exc:
            proc.kill()
            proc.wait()
            returncode = -1 if isinstance(exc, subprocess.TimeoutExpired) else -2
    return returncode, log_path.read_text(encoding="utf-8", errors="replace")


def _flwr_quiet(args: Sequence[str], env: Mapping[str, str]) -> str:
    done = subprocess.run(  # noqa: S603 - fixed argv, no shell
        [flower_executable("flwr"), *args],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.stdout


def _run_status(run_id: int, env: Mapping[str, str]) -> tuple[str, str]:
    """The run's status text (``finished:completed``...) from `flwr ls`, or ``unknown``, and
    the SuperLink's details of it (why a run failed; often empty)."""
    args = ["ls", _CONNECTION, "--run-id", str(run_id), "--format", "json"]
    try:
        run = json.loads(_flwr_quiet(args, env))["runs"][0]
        return str(run["status"]), str(run.get("status-details") or "")
    except (json.JSONDecodeError, KeyError, IndexError, subprocess.TimeoutExpired):
        return "unknown", ""


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
    root = run_workdir(workdir, "fedpipe-simulation-")
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


def engine_start_failure(result: FlwrRunResult) -> str | None:
    """Why Flower's simulation engine could not start, or None when it started (or the run was
    stopped by our timeout, or completed).

    Read from the run's outcome and its log: Flower says its simulation runtime crashed, which
    it does when building its Ray backend (or starting its own threads) raised, never for a
    ClientApp's error (those become error replies), and names the exception, e.g. Ray's
    "Timed out waiting for file .../gcs_server_port_..." or "The current node timed out during
    startup" on a slow or busy machine.
    """
    if result.completed or result.returncode == -1 or _ENGINE_CRASHED not in result.output:
        return None
    found = _ENGINE_EXCEPTION.search(_ANSI.sub("", result.output))
    return found.group(1).strip() if found else "Flower's simulation runtime crashed"


def stop_processes_under(root: str | Path, *, grace_s: float = 10.0) -> list[int]:
    """SIGTERM every process whose ``FLWR_HOME`` lies under ``root``, SIGKILL what is left after
    ``grace_s``; return the PIDs found. Ray's processes can outlive a simulation engine that
    crashed while starting them, and no longer descend from the SuperLink."""
    found = []
    for pid in flower_processes_under(root):
        try:
            found.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    for proc in found:
        _quietly(proc.terminate)
    _, alive = psutil.wait_procs(found, timeout=grace_s)
    for proc in alive:
        logger.warning("pid %d ignored SIGTERM for %.0f s; killing it", proc.pid, grace_s)
        _quietly(proc.kill)
    psutil.wait_procs(alive, timeout=5.0)
    return [proc.pid for proc in found]


def _quietly(signal_it: Callable[[], None]) -> None:
    try:
        signal_it()
    except psutil.NoSuchProcess:
        pass
