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
from fedpipe.federated.runfolder import RunFolder
from fedpipe.federated.summary import finish_run
from fedpipe.federated.tokens import new_secret

__all__ = ["deploy_run", "simulate"]

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


def _progress(folder: RunFolder, runtime: Any, rounds: int, stop: threading.Event) -> None:
    """Round and step progress bars on stderr, fed by metrics.jsonl and the server's sessions."""
    from tqdm import tqdm

    bar_rounds = tqdm(total=rounds, desc="rounds", position=0, file=sys.stderr)
    bar_steps = None
    if runtime is not None:  # in deployment the StageServer lives in another process
        bar_steps = tqdm(desc="server steps", unit="step", position=1, file=sys.stderr)
    seen_steps = 0
    while not stop.wait(1.0):
        done = sum(
            1 for r in folder.history() if r.get("event") == "eval" and r.get("round", 0) > 0
        )
        bar_rounds.update(max(0, min(done, rounds) - bar_rounds.n))
        if bar_steps is not None:
            steps = sum(s.steps_done for s in runtime.sessions())
            if steps > seen_steps:
                bar_steps.update(steps - seen_steps)
            seen_steps = steps
    bar_rounds.close()
    if bar_steps is not None:
        bar_steps.close()


def simulate(
    config: FedpipeConfig,
    *,
    name: str,
    runs_dir: Path = Path("runs"),
    resume: bool = False,
    timeout_s: float = 3600.0,
    faults: dict[str, int] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run ``config`` on Flower's simulation engine; returns the run's summary."""
    from fedpipe.models import resolve_model
    from fedpipe.serving import build_stage_server

    folder = RunFolder.open(runs_dir, name, resume=resume)
    resolve_model(config.model.name)  # convert once, before the devices start
    secret_file = folder.path / ".secret"
    if not secret_file.exists():
        secret_file.write_text(new_secret())
        secret_file.chmod(0o600)
    server = build_stage_server(config, secret=secret_file.read_text().strip(), port=0).start()
    stop = threading.Event()
    watcher = threading.Thread(
        target=_progress, args=(folder, server.runtime, config.federated.rounds, stop), daemon=True
    )
    try:
        if progress:
            watcher.start()
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
        started = time.time()
        result = run_simulation_engine(
            app,
            num_supernodes=config.federated.num_devices,
            run_config=nest(run_config),
            cpus_per_client=1,
            timeout_s=timeout_s,
            workdir=folder.path / "flower",
        )
    finally:
        stop.set()
        if watcher.is_alive():
            watcher.join(timeout=5)
        server.stop(grace=1.0)
    return _finish(folder, config, result, started)


def _finish(
    folder: RunFolder, config: FedpipeConfig, result: FlwrRunResult, started: float
) -> dict[str, Any]:
    summary = finish_run(folder, config=config.to_flat())
    summary["total_wall_s"] = time.time() - started
    summary["flower_run"] = {"run_id": result.run_id, "status": result.status}
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
) -> dict[str, Any]:
    """Launch ``config`` on a deployment (SuperLink, SuperNodes, StageServer); return the summary.

    Run on the server host: the ServerApp (started by the SuperLink there) reads
    ``secret_file`` and writes ``runs_dir/name``; this process then builds the summary and
    plots from that folder. ``overrides`` (dotted keys) are passed as run config too, though
    the written app already holds the whole ``config``. The ServerApp waits for
    ``federated.num_devices`` connected SuperNodes.
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
    stop = threading.Event()
    watcher = threading.Thread(
        target=_progress, args=(folder, None, config.federated.rounds, stop), daemon=True
    )
    started = time.time()
    try:
        if progress:
            watcher.start()
        result = flwr_run(
            app,
            superlink=superlink,
            run_config=nest(run_config),
            timeout_s=timeout_s,
            insecure=root_certificates is None,
            root_certificates=ca_file,
            workdir=folder.path / "flower",
        )
    finally:
        stop.set()
        if watcher.is_alive():
            watcher.join(timeout=5)
    return _finish(folder, config, result, started)


def _print_summary(summary: dict[str, Any], folder: Path) -> None:
    for entry in summary["rounds"]:
        loss = entry.get("eval_loss")
        train = entry.get("train_loss")
        print(
            f"round {entry['round']}: eval loss {loss if loss is None else round(loss, 4)}"
            + (f", train loss {train:.4f}" if train is not None else "")
        )
    if "eval_loss_drop_pct" in summary:
        print(
            f"held-out loss {summary['first_eval_loss']:.4f} -> {summary['last_eval_loss']:.4f} "
            f"({summary['eval_loss_drop_pct']:.1f}% lower); run folder {folder}"
        )


def _raise_keyboard_interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def _stop_like_ctrl_c() -> None:
    """SIGTERM and SIGHUP (a closed terminal) end a run like Ctrl-C: the finally blocks stop
    the StageServer, the SuperLink and Ray, and the Flower run, instead of leaving them behind."""
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    signal.signal(signal.SIGHUP, _raise_keyboard_interrupt)


def _cmd_simulate(args: argparse.Namespace) -> int:
    from fedpipe.cli import config_from_args
    from fedpipe.preflight import check_simulate

    config = config_from_args(
        args,
        **{
            "model.name": args.model,
            "federated.rounds": args.rounds,
            "federated.num_devices": args.devices,
            "federated.profiles": args.profiles,
            "federated.strategy": args.strategy,
            "federated.data": args.data,
        },
    )
    check_simulate(config)
    _stop_like_ctrl_c()
    summary = simulate(
        config,
        name=args.name,
        runs_dir=args.runs_dir,
        resume=args.resume,
        timeout_s=args.timeout,
        progress=not args.no_progress,
    )
    _print_summary(summary, args.runs_dir / args.name)
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from fedpipe.cli import config_from_args
    from fedpipe.preflight import RunTarget, check_run

    flags = {
        "model.name": args.model,
        "federated.rounds": args.rounds,
        "federated.num_devices": args.devices,
        "federated.strategy": args.strategy,
        "server.tls_ca": args.tls_ca,  # the ServerApp verifies the StageServer with it
    }
    config = config_from_args(args, **flags)
    superlink_ca = args.tls_ca or args.root_certificates
    check_run(
        config,
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
            name=args.name,
            superlink=args.superlink,
            stage_address=args.stage_server,
            secret_file=args.secret_file,
            runs_dir=args.runs_dir,
            resume=args.resume,
            overrides=dict.fromkeys(sorted(overrides)),
            timeout_s=args.timeout,
            root_certificates=Path(superlink_ca) if superlink_ca else None,
            progress=not args.no_progress,
        )
    except FlowerRunError as exc:
        print(f"fedpipe: run failed: {exc}", file=sys.stderr)
        return 1
    _print_summary(summary, args.runs_dir / args.name)
    return 0


def _client_plan(args: argparse.Namespace) -> Any:
    from fedpipe.preflight import ClientPlan

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
    if plan.stage_server:
        node_config["stage-address"] = plan.stage_server
    if plan.stage_ca:
        node_config["stage-ca"] = str(Path(plan.stage_ca).expanduser().resolve())
    if plan.stage_cert:  # mutual TLS: this device's own certificate and key
        node_config["stage-cert"] = str(Path(plan.stage_cert).expanduser().resolve())
        node_config["stage-key"] = str(Path(plan.stage_key or "").expanduser().resolve())
    return node_config


def _cmd_client(args: argparse.Namespace) -> int:
    from fedpipe.preflight import check_client

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

    from fedpipe.preflight import check_file

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
