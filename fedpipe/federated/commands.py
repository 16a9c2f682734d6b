"""``fedpipe simulate`` and ``fedpipe client``: Flower's engines around fedpipe's apps."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedpipe.config import FedpipeConfig
from fedpipe.federated.engines import run_simulation_engine, start_supernode, write_flower_app
from fedpipe.federated.local import RUN_DEFAULTS
from fedpipe.federated.runfolder import RunFolder
from fedpipe.federated.summary import finish_run
from fedpipe.federated.tokens import new_secret

__all__ = ["add_federated_commands", "simulate"]

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
    bar_steps = tqdm(desc="server steps", unit="step", position=1, file=sys.stderr)
    seen_steps = 0
    while not stop.wait(1.0):
        done = sum(1 for r in folder.history() if r.get("event") == "eval" and r.get("round", 0) > 0)
        bar_rounds.update(max(0, min(done, rounds) - bar_rounds.n))
        steps = sum(s.steps_done for s in runtime.sessions())
        if steps > seen_steps:
            bar_steps.update(steps - seen_steps)
        seen_steps = steps
    bar_rounds.close()
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
    summary = finish_run(folder, config=config.to_flat())
    summary["total_wall_s"] = time.time() - started
    summary["flower_run"] = {"run_id": result.run_id, "status": result.status}
    folder.write_summary(summary)
    return summary


def _cmd_simulate(args: argparse.Namespace, make_config: Callable[..., FedpipeConfig]) -> int:
    config = make_config(
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
    name = args.name or time.strftime("run-%Y%m%d-%H%M%S")
    summary = simulate(config, name=name, runs_dir=args.runs_dir, resume=args.resume, timeout_s=args.timeout)
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
            f"({summary['eval_loss_drop_pct']:.1f}% lower); run folder {args.runs_dir / name}"
        )
    return 0


def _cmd_client(args: argparse.Namespace, make_config: Callable[..., FedpipeConfig]) -> int:
    node_config: dict[str, Any] = {"partition-id": args.partition_id, "num-partitions": args.num_partitions}
    if args.profile:
        node_config["profile"] = args.profile
    if args.data:
        node_config["data"] = str(Path(args.data).resolve())
    if args.stage_server:
        node_config["stage-address"] = args.stage_server
    root = Path(args.root_certificates).read_bytes() if args.root_certificates else None
    node = start_supernode(
        superlink=args.superlink,
        port=args.port,
        node_config=node_config,
        insecure=root is None,
        root_certificates=args.root_certificates if root else None,
        auth_key=args.auth_key,
    )
    print(f"fedpipe: SuperNode pid {node.pid} connected to {args.superlink} (log {node.log_path})", file=sys.stderr)
    try:
        while node.alive():
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        node.stop()
    return 0


def add_federated_commands(
    sub: argparse._SubParsersAction,
    add_common: Callable[[argparse.ArgumentParser], None],
    make_config: Callable[..., FedpipeConfig],
) -> None:
    p = sub.add_parser("simulate", help="simulate devices with Flower's simulation engine")
    add_common(p)
    p.add_argument("--rounds", type=int)
    p.add_argument("--devices", type=int, help="number of simulated devices")
    p.add_argument("--profiles", help="device profiles, cycled over devices (e.g. phone-lte,rpi-wifi)")
    p.add_argument("--strategy", help="fedavg | fedprox | fedadam | fedyogi | fedadagrad | fedavgm")
    p.add_argument("--data", help="text file or folder (default: the bundled public-domain corpus)")
    p.add_argument("--name", help="run name: results go to RUNS_DIR/NAME")
    p.add_argument("--runs-dir", type=Path, default=Path("runs"))
    p.add_argument("--resume", action="store_true", help="continue after the last complete round")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the run is stopped")
    p.set_defaults(func=lambda a: _cmd_simulate(a, make_config))

    c = sub.add_parser("client", help="run a Flower SuperNode for one device")
    c.add_argument("--superlink", default="127.0.0.1:9092", help="SuperLink address")
    c.add_argument("--stage-server", help="StageServer address (host:port) for this device")
    c.add_argument("--partition-id", type=int, default=0)
    c.add_argument("--num-partitions", type=int, default=1)
    c.add_argument("--profile", help="device profile (phone-lte, rpi-wifi, jetson-ethernet, ...)")
    c.add_argument("--data", help="this device's text (file or folder)")
    c.add_argument("--port", type=int, help="this SuperNode's own port (default: a free one)")
    c.add_argument("--root-certificates", help="CA certificate of a TLS SuperLink")
    c.add_argument("--auth-key", help="private key for SuperNode authentication")
    c.add_argument("-v", "--verbose", action="store_true")
    c.set_defaults(func=lambda a: _cmd_client(a, make_config))


