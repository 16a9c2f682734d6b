"""``fedpipe simulate``, ``client`` and ``run``: Flower's engines around fedpipe's apps.

Deployment: ``fedpipe server --superlink`` on the GPU host (StageServer + Flower SuperLink),
``fedpipe client`` on each device (a SuperNode), then ``fedpipe run`` on the server host
launches the app on that SuperLink; the ServerApp reads the secret file and writes the run
folder on the server host, where ``fedpipe run`` then writes the summary and plots.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from fedpipe.auth.tokens import new_secret
from fedpipe.config import FedpipeConfig
from fedpipe.fl.device_work import RUN_DEFAULTS
from fedpipe.launch.engines import (
    FlowerRunError,
    FlwrRunResult,
    flower_env,
    flwr_run,
    run_simulation_engine,
    start_supernode,
    write_connection,
    write_flower_app,
)
from fedpipe.runs.folder import RunFolder
from fedpipe.runs.report import LiveReport, report_lines
from fedpipe.runs.resume import ResumeRefused, resume_settings
from fedpipe.runs.summary import finish_run, judge

__all__ = ["deploy_run", "simulate"]

SERVER_APP = "fedpipe.fl.apps:server_app"
CLIENT_APP = "fedpipe.fl.apps:client_app"


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


def write_app(directory: Path, config: FedpipeConfig) -> Path:
    """The Flower app project for fedpipe's apps, with every setting as a run-config key."""
    return write_flower_app(
        directory,
        server_app=SERVER_APP,
        client_app=CLIENT_APP,
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
    faults: dict[str, int | float] | None = None,
    progress: bool = True,
    explicit: set[str] | None = None,
) -> dict[str, Any]:
    """Run ``config`` on Flower's simulation engine; returns the run's summary.

    Failures and a stop go to stderr as they happen; with ``progress`` also a line per
    round and whom a round waits for. On
    resume, ``explicit`` names the settings given anew (None: all of ``config``); the rest
    come from the run folder. The summary's ``ok`` and ``problems`` say whether the run did
    all it should (see :func:`fedpipe.runs.summary.judge`); a timeout is one of them.
    """
    from fedpipe.models import resolve_model
    from fedpipe.server.build import build_stage_server

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
        app = write_app(folder.path / "app", config)
        run_config: dict[str, Any] = {
            "run.dir": str(folder.path.resolve()),
            "run.resume": resume,
            "run.stage-address": server.address,
            "run.secret-file": str(secret_file.resolve()),
            "run.id": name,
        }
        for key, value in (faults or {}).items():
            run_config[f"faults.{key}"] = value
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


def _explicit_settings(args: argparse.Namespace, flags: dict[str, Any]) -> set[str]:
    """The settings this command line gives: flags, ``--set`` and a ``--config`` file's keys."""
    import tomllib

    from fedpipe.config import parse_overrides

    keys = {k for k, v in flags.items() if v is not None}
    keys |= set(parse_overrides(getattr(args, "set", None) or []))
    if getattr(args, "config", None) is not None:
        with open(args.config, "rb") as fh:
            data = tomllib.load(fh)
        keys |= {f"{s}.{k}" for s, t in data.items() if isinstance(t, dict) for k in t}
    return keys


def _report(summary: dict[str, Any], folder: Path) -> int:
    """Print the final report (stdout) and the verdict (stderr); the exit status."""
    for line in report_lines(summary):
        print(line)
    print(f"run folder {folder}")
    for problem in summary.get("problems", []):
        print(f"fedpipe: run failed: {problem}", file=sys.stderr)
    return 0 if summary.get("ok", True) else 1


def _raise_keyboard_interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def _stop_like_ctrl_c() -> None:
    """SIGTERM and SIGHUP (a closed terminal) end a run like Ctrl-C: the finally blocks stop
    the StageServer, the SuperLink and Ray, and the Flower run, instead of leaving them behind."""
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    signal.signal(signal.SIGHUP, _raise_keyboard_interrupt)


def _run_name(args: argparse.Namespace) -> str:
    return args.name or time.strftime("run-%Y%m%d-%H%M%S")


def _as_resumed(
    args: argparse.Namespace, config: FedpipeConfig, explicit: set[str]
) -> FedpipeConfig:
    """The settings a ``--resume`` will run with, so that preflight checks those (the run
    folder's recorded settings, with this command line's on top); raises ResumeRefused."""
    if not args.resume:
        return config
    saved = RunFolder(args.runs_dir / _run_name(args)).load_settings()
    return resume_settings(saved, config, explicit=explicit)[0] if saved else config


def _cmd_simulate(args: argparse.Namespace) -> int:
    from fedpipe.cli import config_from_args
    from fedpipe.cli.preflight import check_simulate

    flags = {
        "model.name": args.model,
        "federated.rounds": args.rounds,
        "federated.num_devices": args.devices,
        "federated.profiles": args.profiles,
        "federated.strategy": args.strategy,
        "federated.data": args.data,
    }
    config = config_from_args(args, **flags)
    name, explicit = _run_name(args), _explicit_settings(args, flags)
    try:
        check_simulate(_as_resumed(args, config, explicit))
        _stop_like_ctrl_c()
        summary = simulate(
            config,
            name=name,
            runs_dir=args.runs_dir,
            resume=args.resume,
            timeout_s=args.timeout,
            progress=not args.no_progress,
            explicit=explicit,
        )
    except ResumeRefused as exc:
        print(f"fedpipe: {exc}", file=sys.stderr)
        return 2
    return _report(summary, args.runs_dir / name)


def _cmd_run(args: argparse.Namespace) -> int:
    from fedpipe.cli import config_from_args
    from fedpipe.cli.preflight import RunTarget, check_run

    flags = {
        "model.name": args.model,
        "federated.rounds": args.rounds,
        "federated.num_devices": args.devices,
        "federated.strategy": args.strategy,
        "server.tls_ca": args.tls_ca,  # the ServerApp verifies the StageServer with it
    }
    config = config_from_args(args, **flags)
    superlink_ca = args.tls_ca or args.root_certificates
    name, explicit = _run_name(args), _explicit_settings(args, flags)
    try:
        checked = _as_resumed(args, config, explicit)
    except ResumeRefused as exc:
        print(f"fedpipe: {exc}", file=sys.stderr)
        return 2
    check_run(
        checked,
        RunTarget(
            superlink=args.superlink,
            stage_server=args.stage_server,
            secret_file=args.secret_file,
            superlink_ca=superlink_ca,
            stage_ca=config.server.tls_ca or None,
        ),
    )
    overrides = {k for k, v in flags.items() if v is not None}
    overrides |= {item.partition("=")[0].strip() for item in args.set or []}
    _stop_like_ctrl_c()  # stop the Flower run too
    try:
        summary = deploy_run(
            config,
            name=name,
            superlink=args.superlink,
            stage_address=args.stage_server,
            secret_file=args.secret_file,
            runs_dir=args.runs_dir,
            resume=args.resume,
            overrides=dict.fromkeys(sorted(overrides)),
            timeout_s=args.timeout,
            root_certificates=Path(superlink_ca) if superlink_ca else None,
            progress=not args.no_progress,
            explicit=explicit,
        )
    except ResumeRefused as exc:
        print(f"fedpipe: {exc}", file=sys.stderr)
        return 2
    except FlowerRunError as exc:
        print(f"fedpipe: run failed: {exc}", file=sys.stderr)
        return 1
    return _report(summary, args.runs_dir / name)


def _client_plan(args: argparse.Namespace) -> Any:
    from fedpipe.cli.preflight import ClientPlan

    return ClientPlan(
        superlink=args.superlink,
        stage_server=args.stage_server,
        partition_id=args.partition_id,
        num_partitions=args.num_partitions,
        profile=args.profile,
        data=args.data,
        supernode_port=args.supernode_port,
        superlink_ca=args.tls_ca or args.root_certificates,
        stage_ca=args.tls_ca or args.stage_ca,
        auth_key=args.auth_key,
        stage_cert=args.tls_cert,
        stage_key=args.tls_key,
        cut=args.cut,
    )


def _node_config(plan: Any) -> dict[str, Any]:
    """What the ClientApp reads from its SuperNode: partition, profile, data, StageServer."""
    node_config: dict[str, Any] = {
        "partition-id": plan.partition_id,
        "num-partitions": plan.num_partitions,
        "profile": plan.profile,
    }
    if plan.data:
        node_config["data"] = str(Path(plan.data).expanduser().resolve())
    if plan.cut:
        node_config["cut"] = plan.cut
    if plan.stage_server:
        node_config["stage-address"] = plan.stage_server
    if plan.stage_ca:
        node_config["stage-ca"] = str(Path(plan.stage_ca).expanduser().resolve())
    if plan.stage_cert:  # mutual TLS: this device's own certificate and key
        node_config["stage-cert"] = str(Path(plan.stage_cert).expanduser().resolve())
        node_config["stage-key"] = str(Path(plan.stage_key or "").expanduser().resolve())
    return node_config


def _cmd_client(args: argparse.Namespace) -> int:
    from fedpipe.cli.preflight import check_client

    plan = _client_plan(args)
    check_client(plan)
    # Handlers first: a SIGTERM during start-up still stops the SuperNode (start_supernode
    # stops it itself if it raises), and SIGTERM, SIGHUP or Ctrl-C later stop it and its
    # ClientApps. A SIGKILL is covered by the SuperNode's watchdog (processes.py).
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    node = start_supernode(
        superlink=plan.superlink,
        port=plan.supernode_port,
        node_config=_node_config(plan),
        insecure=plan.superlink_ca is None,
        root_certificates=plan.superlink_ca,
        auth_key=plan.auth_key,
        workdir=args.workdir,
    )
    print(
        f"fedpipe: SuperNode pid {node.pid} (port {node.address.rsplit(':', 1)[1]}) connected to "
        f"{plan.superlink} as partition {plan.partition_id}/{plan.num_partitions} "
        f"(log {node.log_path})",
        file=sys.stderr,
        flush=True,
    )
    rc = 0
    try:
        while not stop.wait(1.0):
            if not node.alive():
                print(
                    f"fedpipe: SuperNode exited (rc {node.popen.returncode}); log {node.log_path}",
                    file=sys.stderr,
                )
                rc = 1
                break
    finally:
        node.stop()
    return rc


def _cmd_register_node(args: argparse.Namespace) -> int:
    """``flwr supernode register`` against a SuperLink, with a private FLWR_HOME."""
    import subprocess
    import tempfile

    from fedpipe.cli.preflight import check_file

    key = check_file(args.public_key, "public_key", "public key")
    ca_arg = args.tls_ca or args.root_certificates
    ca = check_file(ca_arg, "--tls-ca", "CA certificate") if ca_arg else None
    with tempfile.TemporaryDirectory(prefix="fedpipe-flwr-") as home:
        write_connection(home, superlink=args.superlink, insecure=ca is None, root_certificates=ca)
        flwr = Path(sys.executable).parent / "flwr"
        done = subprocess.run(  # noqa: S603 - fixed argv
            [str(flwr) if flwr.exists() else "flwr", "supernode", "register", str(key), "fedpipe"],
            env=flower_env(home),
            capture_output=True,
            text=True,
            timeout=120,
        )
    print((done.stdout + done.stderr).strip(), file=sys.stderr)
    return done.returncode
