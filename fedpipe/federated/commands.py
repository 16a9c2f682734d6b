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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedpipe.config import FedpipeConfig
from fedpipe.federated.engines import (
    FlowerRunError,
    FlwrRunResult,
    flower_env,
    flwr_run,
    run_simulation_engine,
    start_supernode,
    write_connection,
    write_flower_app,
)
from fedpipe.federated.local import RUN_DEFAULTS
from fedpipe.federated.report import LiveReport, report_lines
from fedpipe.federated.resume import ResumeRefused, resume_settings
from fedpipe.federated.runfolder import RunFolder
from fedpipe.federated.summary import finish_run, judge
from fedpipe.federated.tokens import new_secret

__all__ = ["add_federated_commands", "deploy_run", "simulate"]

SERVER_APP = "fedpipe.federated.apps:server_app"
CLIENT_APP = "fedpipe.federated.apps:client_app"


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
    """The settings this run goes with, recorded in the run folder (see fedpipe.federated.resume).

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
    all it should (see :func:`fedpipe.federated.summary.judge`); a timeout is one of them.
    """
    from fedpipe.models import resolve_model
    from fedpipe.serving import build_stage_server

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


def _cmd_simulate(args: argparse.Namespace, make_config: Callable[..., FedpipeConfig]) -> int:
    flags = {
        "model.name": args.model,
        "federated.rounds": args.rounds,
        "federated.num_devices": args.devices,
        "federated.profiles": args.profiles,
        "federated.strategy": args.strategy,
        "federated.data": args.data,
    }
    config = make_config(args, **flags)
    name = args.name or time.strftime("run-%Y%m%d-%H%M%S")
    # SIGTERM ends a simulation like Ctrl-C: the finally blocks stop the StageServer, the
    # SuperLink and Ray instead of leaving them behind.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        summary = simulate(
            config,
            name=name,
            runs_dir=args.runs_dir,
            resume=args.resume,
            timeout_s=args.timeout,
            explicit=_explicit_settings(args, flags),
        )
    except ResumeRefused as exc:
        print(f"fedpipe: {exc}", file=sys.stderr)
        return 2
    return _report(summary, args.runs_dir / name)


def _cmd_run(args: argparse.Namespace, make_config: Callable[..., FedpipeConfig]) -> int:
    flags = {
        "model.name": args.model,
        "federated.rounds": args.rounds,
        "federated.num_devices": args.devices,
        "federated.strategy": args.strategy,
    }
    config = make_config(args, **flags)
    overrides = {k for k, v in flags.items() if v is not None}
    overrides |= {item.partition("=")[0].strip() for item in args.set or []}
    name = args.name or time.strftime("run-%Y%m%d-%H%M%S")
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)  # stop the Flower run too
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
            root_certificates=args.root_certificates,
            progress=not args.no_progress,
            explicit=_explicit_settings(args, flags),
        )
    except ResumeRefused as exc:
        print(f"fedpipe: {exc}", file=sys.stderr)
        return 2
    except FlowerRunError as exc:
        print(f"fedpipe: run failed: {exc}", file=sys.stderr)
        return 1
    return _report(summary, args.runs_dir / name)


def _cmd_client(args: argparse.Namespace, make_config: Callable[..., FedpipeConfig]) -> int:
    node_config: dict[str, Any] = {
        "partition-id": args.partition_id,
        "num-partitions": args.num_partitions,
    }
    if args.profile:
        node_config["profile"] = args.profile
    if args.data:
        node_config["data"] = str(Path(args.data).resolve())
    if args.stage_server:
        node_config["stage-address"] = args.stage_server
    if args.stage_ca:
        node_config["stage-ca"] = str(Path(args.stage_ca).resolve())
    # Handlers first: a SIGTERM during start-up still stops the SuperNode (start_supernode
    # stops it itself if it raises), and SIGTERM later stops it and its ClientApps.
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    node = start_supernode(
        superlink=args.superlink,
        port=args.port,
        node_config=node_config,
        insecure=args.root_certificates is None,
        root_certificates=args.root_certificates,
        auth_key=args.auth_key,
        workdir=args.workdir,
    )
    print(
        f"fedpipe: SuperNode pid {node.pid} (port {node.address.rsplit(':', 1)[1]}) connected to "
        f"{args.superlink} as partition {args.partition_id}/{args.num_partitions} "
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

    key = Path(args.public_key).expanduser().resolve()
    if not key.is_file():
        raise FileNotFoundError(f"public key {key} not found")
    ca = Path(args.root_certificates).expanduser().resolve() if args.root_certificates else None
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


def add_federated_commands(
    sub: argparse._SubParsersAction,
    add_common: Callable[[argparse.ArgumentParser], None],
    make_config: Callable[..., FedpipeConfig],
) -> None:
    p = sub.add_parser("simulate", help="simulate devices with Flower's simulation engine")
    add_common(p)
    p.add_argument("--rounds", type=int)
    p.add_argument("--devices", type=int, help="number of simulated devices")
    p.add_argument(
        "--profiles", help="device profiles, cycled over devices (e.g. phone-lte,rpi-wifi)"
    )
    p.add_argument("--strategy", help="fedavg | fedprox | fedadam | fedyogi | fedadagrad | fedavgm")
    p.add_argument("--data", help="text file or folder (default: the bundled public-domain corpus)")
    p.add_argument("--name", help="run name: results go to RUNS_DIR/NAME")
    p.add_argument("--runs-dir", type=Path, default=Path("runs"))
    p.add_argument("--resume", action="store_true", help="continue after the last complete round")
    p.add_argument(
        "--timeout", type=float, default=3600.0, help="seconds before the run is stopped"
    )
    p.set_defaults(func=lambda a: _cmd_simulate(a, make_config))

    c = sub.add_parser("client", help="run a Flower SuperNode for one device")
    c.add_argument("--superlink", default="127.0.0.1:8000", help="SuperLink address (host:port)")
    c.add_argument("--stage-server", help="StageServer address (host:port) for this device")
    c.add_argument("--stage-ca", help="CA certificate of a TLS StageServer (server.tls_ca)")
    c.add_argument("--partition-id", type=int, default=0)
    c.add_argument("--num-partitions", type=int, default=1)
    c.add_argument(
        "--profile",
        default="loopback",
        help="emulated device profile (default loopback: emulate nothing, use the real link; "
        "phone-lte, rpi-wifi, jetson-ethernet, ... to emulate one)",
    )
    c.add_argument("--data", help="this device's text (file or folder)")
    c.add_argument("--port", type=int, help="this SuperNode's own port (default: a free one)")
    c.add_argument("--root-certificates", help="CA certificate of a TLS SuperLink")
    c.add_argument("--auth-key", help="private key for SuperNode authentication")
    c.add_argument(
        "--workdir", type=Path, help="SuperNode log and FLWR_HOME folder (default: a temp folder)"
    )
    c.add_argument("-v", "--verbose", action="store_true")
    c.set_defaults(func=lambda a: _cmd_client(a, make_config))

    r = sub.add_parser(
        "run", help="launch a run on a deployment (fedpipe server --superlink + fedpipe client)"
    )
    add_common(r)
    r.add_argument("--superlink", default="127.0.0.1:8000", help="SuperLink address (host:port)")
    r.add_argument(
        "--stage-server",
        default="127.0.0.1:50051",
        help="StageServer address the ServerApp (and devices) use",
    )
    r.add_argument(
        "--secret-file", type=Path, help="the StageServer's secret file (a path on the server host)"
    )
    r.add_argument("--root-certificates", type=Path, help="CA certificate of a TLS SuperLink")
    r.add_argument("--rounds", type=int)
    r.add_argument(
        "--devices", type=int, help="connected SuperNodes the run waits for (federated.num_devices)"
    )
    r.add_argument("--strategy", help="fedavg | fedprox | fedadam | fedyogi | fedadagrad | fedavgm")
    r.add_argument("--name", help="run name: results go to RUNS_DIR/NAME")
    r.add_argument("--runs-dir", type=Path, default=Path("runs"))
    r.add_argument("--resume", action="store_true", help="continue after the last complete round")
    r.add_argument(
        "--timeout", type=float, default=3600.0, help="seconds before the run is stopped"
    )
    r.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    r.set_defaults(func=lambda a: _cmd_run(a, make_config))

    g = sub.add_parser(
        "register-node", help="register a device's public key at a SuperLink with --node-auth"
    )
    g.add_argument("public_key", help="the device's ECDSA SECP384R1 public key (OpenSSH .pub)")
    g.add_argument("--superlink", default="127.0.0.1:8000", help="SuperLink address (host:port)")
    g.add_argument("--root-certificates", help="CA certificate of a TLS SuperLink")
    g.add_argument("-v", "--verbose", action="store_true")
    g.set_defaults(func=_cmd_register_node)
