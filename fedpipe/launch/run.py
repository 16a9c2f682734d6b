"""Starting a run: ``simulate`` (every device on this machine, Flower's simulation engine) and
``deploy_run`` (devices on their own hosts, a deployment's SuperLink), each around a StageServer.

With ``server.replicas`` > 1 a simulation starts that many StageServer replicas on a local Ray
of their own (:class:`~fedpipe.server.ray_replicas.ReplicaSet`; Flower's simulation engine starts
another, in its SuperLink's process) and stops them after the run.

Deployment: ``fedpipe server --superlink`` on the GPU host (StageServer + Flower SuperLink),
``fedpipe client`` on each device (a SuperNode), then ``fedpipe run`` on the server host
launches the app on that SuperLink; the ServerApp reads the secret file and writes the run
folder on the server host, where ``fedpipe run`` then writes the summary and plots.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fedpipe.auth.secret_files import create_secret_file, read_secret_file
from fedpipe.config import FedpipeConfig
from fedpipe.config.flower_keys import RunSettings, run_config_of
from fedpipe.errors import one_line
from fedpipe.launch.engines import (
    FlwrRunResult,
    engine_start_failure,
    flwr_run,
    run_simulation_engine,
    stop_processes_under,
    write_flower_app,
)
from fedpipe.models import resolve_model
from fedpipe.runs.folder import RunFolder
from fedpipe.runs.report import LiveReport
from fedpipe.runs.resume import resume_settings
from fedpipe.runs.summary import finish_run, judge
from fedpipe.server.build import build_stage_server
from fedpipe.server.ray_replicas import ReplicaInfo, ReplicaSet

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
        config=nest(run_config_of(config)),
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
    round, each round's progress (steps done per device) and the devices it waits for that
    are late. On resume, ``explicit`` names the settings given anew (None: all of
    ``config``); the rest come from the run folder. The summary's ``ok`` and ``problems``
    say whether the run did all it should (see :func:`fedpipe.runs.summary.judge`); a
    timeout is one of them. When the simulation engine crashed starting (Ray timed out starting
    on a busy machine, or another failure of Ray's start), it is started once more (said in
    one line on stderr with Ray's reason, and in the summary's ``flower_run.retried_after``).

    ``client_app`` (``"package.module:attribute"``) chooses the ClientApp the simulated
    devices run, e.g. fedpipe's own (``fedpipe.fl.client_app:client_app``) called inside a
    ClientApp with your own Flower mods. The simulation's processes import it, so its
    module must be importable there (installed, or on ``PYTHONPATH``).
    """
    folder = RunFolder.open(runs_dir, name, resume=resume)
    config = _settle_settings(folder, config, resume=resume, explicit=explicit)
    resolve_model(config.model.name)  # convert once, before the devices start
    # The secret lives outside the run folder (people share run folders), in a private
    # folder of this run's own, and goes with it.
    secrets_dir = Path(tempfile.mkdtemp(prefix="fedpipe-secret-"))  # 0700
    secret_file = create_secret_file(secrets_dir / "secret")
    started = time.time()
    try:
        with _stage_servers(config, read_secret_file(secret_file)) as (address, replicas):
            _note_replicas(folder, replicas)
            app = write_app(folder.path / "app", config, client_app=client_app)
            run = RunSettings(
                dir=str(folder.path.resolve()),
                resume=resume,
                stage_address=address,
                secret_file=str(secret_file.resolve()),
                run_id=_run_instance(name),
            )
            run_config = nest(run.to_run_config())
            attempt = _SimulationAttempt(folder, app, config, run_config, progress=progress)
            result, retried = _simulate_with_one_retry(attempt, timeout_s)
    finally:
        shutil.rmtree(secrets_dir, ignore_errors=True)
    return _finish(folder, config, result, started, timeout_s, retried=retried, replicas=replicas)


@contextmanager
def _stage_servers(config: FedpipeConfig, secret: str) -> Iterator[tuple[str, list[ReplicaInfo]]]:
    """The run's StageServer on a free port, or its replicas (``server.replicas`` > 1) on a
    local Ray of their own: yields the run's ``run.stage-address`` and the replicas."""
    if config.server.replicas > 1:
        replicas = ReplicaSet(config, secret=secret).start()
        try:
            yield replicas.stage_address, replicas.replicas
        finally:
            replicas.stop()
        return
    server = build_stage_server(config, secret=secret, port=0).start()
    try:
        yield server.address, []
    finally:
        server.stop(grace=1.0)


def _note_replicas(folder: RunFolder, replicas: list[ReplicaInfo]) -> None:
    """Each replica in one line on stderr, and in the run folder's ``replicas.json``."""
    if not replicas:
        return
    for info in replicas:
        print(f"fedpipe: {info.line()}", file=sys.stderr, flush=True)
    (folder.path / "replicas.json").write_text(json.dumps([asdict(r) for r in replicas], indent=2))


@dataclass(frozen=True)
class _SimulationAttempt:
    """One start of Flower's simulation engine for a run, with its live console lines."""

    folder: RunFolder
    app: Path
    config: FedpipeConfig
    run_config: dict[str, Any]
    progress: bool

    def __call__(self, workdir: Path, timeout_s: float) -> FlwrRunResult:
        live = _live_report(self.folder, self.config, progress=self.progress)
        try:
            live.start()
            return run_simulation_engine(
                self.app,
                num_supernodes=self.config.federated.num_devices,
                run_config=self.run_config,
                cpus_per_client=1,
                timeout_s=timeout_s,
                workdir=workdir,
                check=False,
            )
        finally:
            live.stop()


def _simulate_with_one_retry(
    attempt: _SimulationAttempt, timeout_s: float
) -> tuple[FlwrRunResult, FlwrRunResult | None]:
    """Run the simulation; once more if its engine crashed starting, before the run trained a
    round.

    Returns the result that counts and the failed first one (None when there was no retry).
    Before the second start, the first one's processes are stopped and the records its
    ServerApp wrote before any round (its start and round-0 evaluation) are taken back, so the
    run folder is as it was; both attempts share ``timeout_s``.
    """
    folder, deadline = attempt.folder, time.monotonic() + timeout_s
    mark = _FolderMark.of(folder)
    first = attempt(folder.path / "flower", timeout_s)
    reason = engine_start_failure(first)
    if reason is None or mark.round_written(folder):
        return first, None
    print(
        f"fedpipe: Flower's simulation engine did not start ({one_line(reason, 240)}); starting it "
        f"once more (first attempt's log: {first.log_path})",
        file=sys.stderr,
        flush=True,
    )
    stop_processes_under(folder.path / "flower")
    mark.restore(folder)
    return attempt(folder.path / "flower-retry", max(deadline - time.monotonic(), 1.0)), first


@dataclass(frozen=True)
class _FolderMark:
    """What a run folder held before an attempt: enough to tell whether the attempt wrote a
    round, and to take back what it wrote before one."""

    metrics_bytes: int
    board_files: frozenset[Path]
    checkpoints: frozenset[str]

    @classmethod
    def of(cls, folder: RunFolder) -> _FolderMark:
        metrics = folder.metrics_path
        return cls(
            metrics.stat().st_size if metrics.exists() else 0,
            frozenset(_files(folder.path / "tensorboard")),
            frozenset(p.name for p in folder.checkpoints_dir.glob("round-*")),
        )

    def _new_records(self, folder: RunFolder) -> list[dict[str, Any]]:
        if not folder.metrics_path.exists():
            return []
        with folder.metrics_path.open("rb") as f:
            f.seek(self.metrics_bytes)
            lines = f.read().splitlines()
        records = []
        for line in lines:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a record cut short when its writer died: not a round
        return records

    def round_written(self, folder: RunFolder) -> bool:
        """Whether the attempt got further than its start and the evaluation before training."""
        if {p.name for p in folder.checkpoints_dir.glob("round-*")} - self.checkpoints:
            return True
        records = self._new_records(folder)
        start = next((r.get("round") for r in records if r.get("event") == "start"), None)
        return not all(_before_a_round(r, start) for r in records)

    def restore(self, folder: RunFolder) -> None:
        """Drop the metrics records and TensorBoard files written since the mark."""
        if folder.metrics_path.exists():
            os.truncate(folder.metrics_path, self.metrics_bytes)
        for path in set(_files(folder.path / "tensorboard")) - self.board_files:
            path.unlink()


def _before_a_round(record: dict[str, Any], start_round: object) -> bool:
    """A record a ServerApp writes before its first round trained: its start, waits for
    devices, the evaluation of the round it starts from, and progress with no step done."""
    event = record.get("event")
    if event == "progress":
        return not any(d.get("steps_done") for d in record.get("devices", ()))
    return event in ("start", "waiting") or (event == "eval" and record.get("round") == start_round)


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()] if root.is_dir() else []


def _live_report(folder: RunFolder, config: FedpipeConfig, *, progress: bool) -> LiveReport:
    """The run's lines on stderr: a live progress line per round on a terminal, elsewhere a
    plain one at most every ``federated.report_every_s``; only failures and a stop without
    ``progress``."""
    fed = config.federated
    return LiveReport(
        folder.metrics_path, rounds=fed.rounds, quiet=not progress, every_s=fed.report_every_s
    )


def _finish(
    folder: RunFolder,
    config: FedpipeConfig,
    result: FlwrRunResult,
    started: float,
    timeout_s: float,
    *,
    retried: FlwrRunResult | None = None,
    replicas: list[ReplicaInfo] | None = None,
) -> dict[str, Any]:
    """The summary with the run's verdict (``ok``, ``problems``), written and returned.

    ``retried``: a first start of the simulation engine that crashed starting;
    ``replicas``: the StageServer replicas the run had (where they served, what they asked
    Ray for).
    """
    summary = finish_run(folder, config=config.to_flat())
    if replicas:
        summary["replicas"] = [asdict(r) for r in replicas]
    summary["total_wall_s"] = time.time() - started
    summary["flower_run"] = {
        "run_id": result.run_id,
        "status": result.status,
        "details": result.details,
        "log": str(result.log_path),
    }
    if retried is not None:
        summary["flower_run"]["retried_after"] = {
            "run_id": retried.run_id,
            "status": retried.status,
            "reason": engine_start_failure(retried),
            "log": str(retried.log_path),
        }
    fed = config.federated
    problems = judge(summary, rounds=fed.rounds, max_failures=fed.max_failures)
    if result.returncode == -1:
        problems.insert(0, f"the run reached --timeout ({timeout_s:g} s) and was stopped")
    elif not result.completed:
        why = f": {one_line(result.details, 160)}" if result.details else ""
        if (first := result.first_exception) is not None:
            why += f"; first exception in its log: {one_line(first, 200)}"
        problems.insert(
            0,
            f"Flower's run ended as {result.status!r} (flwr rc {result.returncode}){why}; "
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
    run = RunSettings(
        dir=str(folder.path.resolve()),
        resume=resume,
        stage_address=stage_address,
        secret_file=str(secret_file.expanduser().resolve()) if secret_file else "",
        run_id=_run_instance(name),
    )
    run_config = run.to_run_config()
    flat = config.to_flat()
    for key in overrides or {}:
        run_config[key] = flat[key]  # typed as the app's defaults are
    app = write_app(folder.path / "app", config)
    # flwr wants an absolute path in its connection config
    ca_file = root_certificates.expanduser().resolve() if root_certificates else None
    live = _live_report(folder, config, progress=progress)
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


def _run_instance(name: str) -> str:
    """The id tokens and round control carry: the run's name and a random suffix, so that no
    token of an earlier attempt at a run (or another run of the same name) is valid in this one."""
    return f"{name}.{secrets.token_hex(6)}"
