"""Starting a run: ``simulate`` (every device on this machine, Flower's simulation engine) and
``deploy_run`` (devices on their own hosts, a deployment's SuperLink), each around a StageServer.

Deployment: ``fedpipe server --superlink`` on the GPU host (StageServer + Flower SuperLink),
``fedpipe client`` on each device (a SuperNode), then ``fedpipe run`` on the server host
launches the app on that SuperLink; the ServerApp reads the secret file and writes the run
folder on the server host, where ``fedpipe run`` then writes the summary and plots.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from fedpipe.auth.tokens import new_secret
from fedpipe.config import FedpipeConfig
from fedpipe.fl.device_work import RUN_DEFAULTS
from fedpipe.launch.engines import FlwrRunResult, flwr_run, run_simulation_engine, write_flower_app
from fedpipe.models import resolve_model
from fedpipe.runs.folder import RunFolder
from fedpipe.runs.report import LiveReport
from fedpipe.runs.resume import resume_settings
from fedpipe.runs.summary import finish_run, judge
from fedpipe.server.build import build_stage_server

__all__ = ["CLIENT_APP", "SERVER_APP", "deploy_run", "nest", "simulate", "write_app"]

SERVER_APP = "fedpipe.fl.server_app:server_app"
CLIENT_APP = "fedpipe.fl.client_app:client_app"


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"model.name": x}`` -> ``{"model": {"name": x}}`` (Flower flattens it back)."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def write_app(directory: Path, config: FedpipeConfig, *, client_app: str = CLIENT_APP) -> Path:
    """The Flower app project for fedpipe's apps, with every setting as a run-config key.

    ``client_app`` (``"package.module:attribute"``) names the ClientApp the devices run:
    fedpipe's own by default.
    """
    return write_flower_app(
        directory,
        server_app=SERVER_APP,
        client_app=client_app,
        config=nest({**config.to_flat(), **RUN_DEFAULTS}),
    )


def _settle_settings(
    folder: RunFolder, config: FedpipeConfig, *, resume: bool, explicit: set[str] | None
) -> FedpipeConfig:
    """The settings this run goes with, recorded in the run folder (see fedpipe.runs.resume).

    A fresh run records ``config``; a resumed one starts from what the folder recorded, takes
    the ``explicit`` settings from ``config``, refuses changes it cannot continue with
    (:class:`ResumeRefused`) and says the others on stderr.
    """
    if resume:
        config, notes = resume_settings(folder.load_settings(), config, explicit=explicit)
        for note in notes:
            print(f"fedpipe: {note}", file=sys.stderr)
    folder.save_settings(config.to_flat())
    return config


def simulate(
    config: FedpipeConfig,
    *,
    name: str,
    runs_dir: Path = Path("runs"),
    resume: bool = False,
    timeout_s: float = 3600.0,
    progress: bool = True,
    explicit: set[str] | None = None,
    client_app: str = CLIENT_APP,
) -> dict[str, Any]:
    """Run ``config`` on Flower's simulation engine; returns the run's summary.

    Failures and a stop go to stderr as they happen; with ``progress`` also a line per
    round and whom a round waits for. On
    resume, ``explicit`` names the settings given anew (None: all of ``config``); the rest
    come from the run folder. The summary's ``ok`` and ``problems`` say whether the run did
    all it should (see :func:`fedpipe.runs.summary.judge`); a timeout is one of them.

    ``client_app`` (``"package.module:attribute"``) chooses the ClientApp the simulated
    devices run, e.g. fedpipe's own (``fedpipe.fl.client_app:client_app``) called inside a
    ClientApp with your own Flower mods. The simulation's processes import it, so its
    module must be importable there (installed, or on ``PYTHONPATH``).
    """
    folder = RunFolder.open(runs_dir, name, resume=resume)
    config = _settle_settings(folder, config, resume=resume, explicit=explicit)
    resolve_model(config.model.name)  # convert once, before the devices start
    secret_file = folder.path / ".secret"
    if not secret_file.exists():
        secret_file.write_text(new_secret())
        secret_file.chmod(0o600)
    server = build_stage_server(config, secret=secret_file.read_text().strip(), port=0).start()
    live = LiveReport(folder.metrics_path, rounds=config.federated.rounds, quiet=not progress)
    started = time.time()
    try:
        live.start()
        app = write_app(folder.path / "app", config, client_app=client_app)
        run_config: dict[str, Any] = {
            "run.dir": str(folder.path.resolve()),
            "run.resume": resume,
            "run.stage-address": server.address,
            "run.secret-file": str(secret_file.resolve()),
            "run.id": name,
        }
        result = run_simulation_engine(
            app,
            num_supernodes=config.federated.num_devices,
            run_config=nest(run_config),
            cpus_per_client=1,
            timeout_s=timeout_s,
            workdir=folder.path / "flower",
            check=False,
        )
    finally:
        live.stop()
        server.stop(grace=1.0)
    return _finish(folder, config, result, started, timeout_s)


def _finish(
    folder: RunFolder,
    config: FedpipeConfig,
    result: FlwrRunResult,
    started: float,
    timeout_s: float,
) -> dict[str, Any]:
    """The summary with the run's verdict (``ok``, ``problems``), written and returned."""
    summary = finish_run(folder, config=config.to_flat())
    summary["total_wall_s"] = time.time() - started
    summary["flower_run"] = {
        "run_id": result.run_id,
        "status": result.status,
        "log": str(result.log_path),
    }
    fed = config.federated
    problems = judge(summary, rounds=fed.rounds, max_failures=fed.max_failures)
    if result.returncode == -1:
        problems.insert(0, f"the run reached --timeout ({timeout_s:g} s) and was stopped")
    elif not result.completed:
        problems.insert(
            0,
            f"Flower's run ended as {result.status!r} (flwr rc {result.returncode}); "
            f"its log: {result.log_path}",
        )
    summary["problems"], summary["ok"] = problems, not problems
    folder.write_summary(summary)
    return summary


def deploy_run(
    config: FedpipeConfig,
    *,
    name: str,
    superlink: str,
    stage_address: str,
    secret_file: Path | None,
    runs_dir: Path = Path("runs"),
    resume: bool = False,
    overrides: dict[str, Any] | None = None,
    timeout_s: float = 3600.0,
    root_certificates: Path | None = None,
    progress: bool = True,
    explicit: set[str] | None = None,
) -> dict[str, Any]:
    """Launch ``config`` on a deployment (SuperLink, SuperNodes, StageServer); return the summary.

    Run on the server host: the ServerApp (started by the SuperLink there) reads
    ``secret_file`` and writes ``runs_dir/name``; this process prints its records live and
    then builds the summary and plots from that folder. ``overrides`` (dotted keys) are
    passed as run config too, though the written app already holds the whole ``config``.
    Rounds start once ``federated.num_devices`` SuperNodes are connected, or after
    ``federated.connect_wait_s`` with at least ``federated.min_devices``.
    """
    if secret_file is not None and not secret_file.expanduser().is_file():
        raise FileNotFoundError(
            f"secret file {secret_file} not found (the StageServer's --secret-file)"
        )
    if secret_file is None:
        print(
            "fedpipe: no --secret-file: devices get no session tokens, so this works only "
            "with a StageServer started without a secret",
            file=sys.stderr,
        )
    folder = RunFolder.open(runs_dir, name, resume=resume)
    config = _settle_settings(folder, config, resume=resume, explicit=explicit)
    run_config: dict[str, Any] = {
        "run.dir": str(folder.path.resolve()),
        "run.resume": resume,
        "run.stage-address": stage_address,
        "run.secret-file": str(secret_file.expanduser().resolve()) if secret_file else "",
        "run.id": name,
    }
    flat = config.to_flat()
    for key in overrides or {}:
        run_config[key] = flat[key]  # typed as the app's defaults are
    app = write_app(folder.path / "app", config)
    # flwr wants an absolute path in its connection config
    ca_file = root_certificates.expanduser().resolve() if root_certificates else None
    live = LiveReport(folder.metrics_path, rounds=config.federated.rounds, quiet=not progress)
    started = time.time()
    try:
        live.start()
        result = flwr_run(
            app,
            superlink=superlink,
            run_config=nest(run_config),
            timeout_s=timeout_s,
            insecure=root_certificates is None,
            root_certificates=ca_file,
            workdir=folder.path / "flower",
            check=False,
        )
    finally:
        live.stop()
    return _finish(folder, config, result, started, timeout_s)
