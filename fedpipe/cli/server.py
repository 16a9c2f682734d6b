"""``fedpipe server``: the StageServer, and with ``--superlink`` a Flower SuperLink beside it."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from fedpipe.auth.secret_files import create_secret_file, read_secret_file
from fedpipe.cli.main import EXIT_FAILED, config_from_args
from fedpipe.cli.preflight import ServerSetup, check_secret_needed, check_server
from fedpipe.cli.probes import split_address
from fedpipe.config import FedpipeConfig
from fedpipe.launch.processes import Certificates, start_superlink
from fedpipe.server.build import build_stage_server
from fedpipe.server.ray_replicas import ReplicaSet

__all__ = ["cmd_server"]

log = logging.getLogger("fedpipe")


def _server_secret(args: argparse.Namespace) -> str | None:
    """``--secret``, ``--secret-file`` (created with a new secret if missing) or FEDPIPE_SECRET."""
    if args.secret and args.secret_file:
        raise ValueError("give --secret or --secret-file, not both")
    if args.secret_file:
        path = Path(args.secret_file).expanduser()
        if not path.exists():
            create_secret_file(path)
            print(f"fedpipe: wrote a new secret to {path}", file=sys.stderr, flush=True)
        try:
            return read_secret_file(path)
        except ValueError as exc:
            raise ValueError(f"--secret-file: {exc}") from None
    return args.secret or os.environ.get("FEDPIPE_SECRET") or None


def _server_setup(args: argparse.Namespace, config: FedpipeConfig) -> Any:
    """Where the StageServer and the SuperLink listen, and their TLS files, from the flags."""
    host, port = config.server.host, config.server.port
    if args.stage_server:
        host, port = split_address(args.stage_server, "--stage-server")
    host, port = args.legacy_host or host, port if args.legacy_port is None else args.legacy_port
    superlink = args.superlink
    if superlink is not None:
        link_host, link_port = split_address(superlink, "--superlink")
        link_host = args.legacy_superlink_host or link_host
        if args.legacy_superlink_port is not None:
            link_port = int(args.legacy_superlink_port)
        superlink = f"{link_host}:{link_port}"
    ca, cert, key = args.legacy_tls or (args.tls_ca, args.tls_cert, args.tls_key)
    return ServerSetup(host, port, superlink, ca, cert, key, args.node_auth)


def cmd_server(args: argparse.Namespace) -> int:
    """`fedpipe server`: the StageServer, and a SuperLink with ``--superlink``."""
    tls = {"server.tls_cert": args.tls_cert, "server.tls_key": args.tls_key}
    replicas = {
        "server.replicas": args.replicas,
        "server.ray_address": args.ray_address,
        "server.replica_port": args.replica_port,
    }
    config = config_from_args(
        args,
        **{
            "model.name": args.model,
            "server.device": args.device,
            "server.weights": args.weights,
            **tls,
            **replicas,
        },
    )
    setup = _server_setup(args, config)
    if config.server.replicas > 1:
        config = _replica_config(config, setup)
    secret = _server_secret(args)
    check_secret_needed(config, setup.stage_host, secret)
    check_server(config, setup)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    if secret is None:
        log.warning("no secret: the StageServer accepts sessions without tokens (local use only)")
    # Handlers first: a SIGTERM or SIGHUP that arrives while the SuperLink starts still shuts
    # both down.
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    if config.server.replicas > 1:
        return _serve_replicas(args, config, setup, secret, stop)
    server = build_stage_server(
        config.with_overrides({"server.host": setup.stage_host}),
        secret=secret,
        port=setup.stage_port,
    ).start()
    _print_round_lines()
    superlink = None
    try:
        print(f"fedpipe: StageServer listening on {server.address}", file=sys.stderr, flush=True)
        if setup.superlink is not None and not stop.is_set():
            superlink = _start_superlink(args, setup)
        if args.port_file:  # written once everything serves: its presence means "ready"
            _write_ready(args.port_file, str(server.port))
        return _serve_until_stopped(stop, superlink)
    finally:
        if superlink is not None:
            superlink.stop()
        server.stop(grace=2.0)
        print("fedpipe: server stopped", file=sys.stderr, flush=True)


def _replica_config(config: FedpipeConfig, setup: Any) -> FedpipeConfig:
    """Replicas listen where --stage-server says: its host, ports from its port on (unless
    --replica-port), and on a Ray cluster all interfaces of the node Ray places each on."""
    flat: dict[str, Any] = {"server.host": setup.stage_host}
    if not config.server.replica_port and setup.stage_port:
        flat["server.replica_port"] = setup.stage_port
    return config.with_overrides(flat)


def _serve_replicas(
    args: argparse.Namespace,
    config: FedpipeConfig,
    setup: Any,
    secret: str | None,
    stop: threading.Event,
) -> int:
    """``--replicas N``: N StageServers as Ray actors; each one's address and resources said."""
    replicas = ReplicaSet(config, secret=secret, log_to_driver=True)
    superlink = None
    try:
        replicas.start()
        for info in replicas.replicas:
            print(f"fedpipe: {info.line()}", file=sys.stderr, flush=True)
        print(
            f"fedpipe: {config.server.replicas} StageServer replicas ready: "
            f"`fedpipe run --stage-server {replicas.stage_address}`",
            file=sys.stderr,
            flush=True,
        )
        if setup.superlink is not None and not stop.is_set():
            superlink = _start_superlink(args, setup)
        if args.port_file:
            _write_ready(args.port_file, replicas.stage_address)
        return _serve_until_stopped(stop, superlink)
    finally:
        if superlink is not None:
            superlink.stop()
        replicas.stop()
        print("fedpipe: replicas stopped", file=sys.stderr, flush=True)


def _write_ready(path: Path, text: str) -> None:
    """Written once everything serves: its presence means "ready"."""
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


class _RoundLines(logging.Filter):
    """Only the StageServer's round lines: begun, committed (merged, discarded, dropped)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage().startswith("round ")


def _print_round_lines() -> None:
    """`fedpipe server` prints a line as each round begins and is committed; with -v they are
    in the INFO log already."""
    server_log = logging.getLogger("fedpipe.server.stage_server")
    if server_log.getEffectiveLevel() <= logging.INFO:
        return
    rounds = logging.StreamHandler(sys.stderr)
    rounds.setFormatter(logging.Formatter("fedpipe: %(message)s"))
    rounds.addFilter(_RoundLines())
    warnings = logging.StreamHandler(sys.stderr)
    warnings.setLevel(logging.WARNING)
    warnings.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    server_log.setLevel(logging.INFO)
    server_log.propagate = False  # its own handlers: round lines and warnings, as before
    server_log.addHandler(rounds)
    server_log.addHandler(warnings)


def _start_superlink(args: argparse.Namespace, setup: Any) -> Any:

    host, port = split_address(setup.superlink, "--superlink")
    certificates = None
    if setup.tls_cert:
        certificates = Certificates(Path(setup.tls_ca), Path(setup.tls_cert), Path(setup.tls_key))
    superlink = start_superlink(
        host=host,
        port=port or None,  # 0 = any free port
        certificates=certificates,
        insecure=certificates is None,
        enable_node_auth=args.node_auth,
        database=args.superlink_database,
        workdir=args.workdir,
    )
    print(
        f"fedpipe: Flower SuperLink at {superlink.address} "
        f"({'TLS' if certificates else 'insecure'}{', node auth' if args.node_auth else ''}; "
        f"pid {superlink.pid}, log {superlink.log_path})",
        file=sys.stderr,
        flush=True,
    )
    return superlink


def _serve_until_stopped(stop: threading.Event, superlink: Any) -> int:
    while not stop.wait(1.0):
        if superlink is not None and not superlink.alive():
            print(
                f"fedpipe: the SuperLink exited (rc {superlink.popen.returncode}); "
                f"log {superlink.log_path}",
                file=sys.stderr,
            )
            return EXIT_FAILED
    return 0
