"""fedpipe's entry point: parse, check, run one command, and turn failures into one line.

Every command checks its settings first (`fedpipe.cli.preflight`) and only then starts servers or
Flower processes. Whatever goes wrong reaches `main` as an exception and leaves as one line on
stderr with an exit status: 2 for settings to change, 1 for a failure while running, 130 for
Ctrl-C (with the command that resumes a run). ``-v`` adds the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import shlex
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from fedpipe.cli.parser import build_parser
from fedpipe.config import FedpipeConfig, load_config, parse_overrides

__all__ = ["config_from_args", "describe_error", "main"]

log = logging.getLogger("fedpipe")

EXIT_SETTINGS = 2  # a setting to change: nothing was started
EXIT_FAILED = 1  # something failed while running
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as shells report it


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def config_from_args(args: argparse.Namespace, **flags: Any) -> FedpipeConfig:
    """Defaults, then ``--config``, then ``--set``, then the command's own flags (not None)."""
    overrides: dict[str, Any] = parse_overrides(getattr(args, "set", None) or [])
    overrides.update({k: v for k, v in flags.items() if v is not None})
    return load_config(getattr(args, "config", None), overrides)


# -- errors -------------------------------------------------------------------------------------
def describe_error(exc: BaseException) -> tuple[str, int]:
    """(one line for the user, exit status) for an exception that ended a command."""
    from fedpipe.errors import FedpipeError
    from fedpipe.launch.processes import ProcessStartError

    if isinstance(exc, ProcessStartError):
        return exc.reason, EXIT_FAILED
    if isinstance(exc, FedpipeError) and not isinstance(exc, ValueError):
        return _first_line(exc), EXIT_FAILED
    if isinstance(exc, ValueError | FileNotFoundError | IsADirectoryError | PermissionError):
        return _first_line(exc), EXIT_SETTINGS
    if isinstance(exc, OSError):
        return _first_line(exc), EXIT_FAILED
    rpc = _rpc_line(exc)
    if rpc:
        return rpc, EXIT_FAILED
    text = _first_line(exc)
    if "Failed to bind" in text:  # grpc's bind failure is a RuntimeError
        return f"{text}: the port is in use; choose another", EXIT_SETTINGS
    if type(exc).__name__ == "FlowerRunError":
        return text, EXIT_FAILED
    return f"{type(exc).__name__}: {text} (run with -v for the traceback)", EXIT_FAILED


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    more = " (more with -v)" if len(lines) > 1 else ""
    return lines[0].rstrip(":") + more


def _rpc_line(exc: BaseException) -> str:
    code, details = getattr(exc, "code", None), getattr(exc, "details", None)
    if not (callable(code) and callable(details)) or "grpc" not in type(exc).__module__:
        return ""
    return f"gRPC {code().name}: {details()}"


def _interrupted(args: argparse.Namespace, argv: list[str]) -> str:
    """Where an interrupted run stopped, and the exact command that resumes it."""
    name, runs_dir = getattr(args, "name", None), getattr(args, "runs_dir", None)
    if name is None or runs_dir is None:
        return "fedpipe: interrupted"
    checkpoints = sorted((Path(runs_dir) / name / "checkpoints").glob("round-[0-9]*"))
    again = list(argv)
    if "--name" not in again:
        again += ["--name", name]
    if not checkpoints:
        return (
            f"fedpipe: interrupted before any round was saved in {Path(runs_dir) / name}; "
            f"start again with: fedpipe {shlex.join(again)}"
        )
    if "--resume" not in again:
        again.append("--resume")
    last = checkpoints[-1]
    return (
        f"fedpipe: interrupted after round {int(last.name.split('-')[1])} (saved in {last}); "
        f"resume with: fedpipe {shlex.join(again)}"
    )


# -- server -------------------------------------------------------------------------------------
def _server_secret(args: argparse.Namespace) -> str | None:
    """``--secret``, ``--secret-file`` (created with a new secret if missing) or FEDPIPE_SECRET."""
    if args.secret and args.secret_file:
        raise ValueError("give --secret or --secret-file, not both")
    if args.secret_file:
        path = Path(args.secret_file).expanduser()
        if not path.exists():
            from fedpipe.auth.tokens import new_secret

            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch(mode=0o600)
            path.write_text(new_secret())
            print(f"fedpipe: wrote a new secret to {path}", file=sys.stderr, flush=True)
        secret = path.read_text().strip()
        if not secret:
            raise ValueError(f"--secret-file: {path} is empty; delete it to get a new secret")
        return secret
    return args.secret or os.environ.get("FEDPIPE_SECRET") or None


def _server_plan(args: argparse.Namespace, config: FedpipeConfig) -> Any:
    """Where the StageServer and the SuperLink listen, and their TLS files, from the flags."""
    from fedpipe.cli.preflight import ServerPlan, split_address

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
    return ServerPlan(host, port, superlink, ca, cert, key, args.node_auth)


def cmd_server(args: argparse.Namespace) -> int:
    """`fedpipe server`: the StageServer, and a SuperLink with ``--superlink``."""
    from fedpipe.cli.preflight import check_server

    tls = {"server.tls_cert": args.tls_cert, "server.tls_key": args.tls_key}
    config = config_from_args(
        args, **{"model.name": args.model, "server.device": args.device, **tls}
    )
    plan = _server_plan(args, config)
    check_server(config, plan)
    secret = _server_secret(args)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    if secret is None:
        log.warning("no secret: the StageServer accepts sessions without tokens (local use only)")
    # Handlers first: a SIGTERM or SIGHUP that arrives while the SuperLink starts still shuts
    # both down.
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    from fedpipe.server.build import build_stage_server

    server = build_stage_server(
        config.with_overrides({"server.host": plan.stage_host}), secret=secret, port=plan.stage_port
    ).start()
    _print_round_lines()
    superlink = None
    try:
        print(f"fedpipe: StageServer listening on {server.address}", file=sys.stderr, flush=True)
        if plan.superlink is not None and not stop.is_set():
            superlink = _start_superlink(args, plan)
        if args.port_file:  # written once everything serves: its presence means "ready"
            tmp = Path(str(args.port_file) + ".tmp")
            tmp.write_text(str(server.port))
            tmp.replace(args.port_file)
        return _serve_until_stopped(stop, superlink)
    finally:
        if superlink is not None:
            superlink.stop()
        server.stop(grace=2.0)
        print("fedpipe: server stopped", file=sys.stderr, flush=True)


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


def _start_superlink(args: argparse.Namespace, plan: Any) -> Any:
    from fedpipe.cli.preflight import split_address
    from fedpipe.launch.processes import Certificates, start_superlink

    host, port = split_address(plan.superlink, "--superlink")
    certificates = None
    if plan.tls_cert:
        certificates = Certificates(Path(plan.tls_ca), Path(plan.tls_cert), Path(plan.tls_key))
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


# -- main ---------------------------------------------------------------------------------------
def _command(ref: str) -> Any:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit status (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    verbose = bool(getattr(args, "verbose", False))
    _setup_logging(verbose)
    if hasattr(args, "name") and hasattr(args, "runs_dir") and args.name is None:
        if args.resume:
            print(
                "fedpipe: error: --resume needs --name NAME, the run to continue "
                f"(its folder is {args.runs_dir}/NAME)",
                file=sys.stderr,
            )
            return EXIT_SETTINGS
        args.name = time.strftime("run-%Y%m%d-%H%M%S")  # known here, for the resume hint
    try:
        if hasattr(args, "set"):  # settings first, before the command's heavy imports
            config_from_args(args)
        return int(_command(args.func)(args) or 0)
    except KeyboardInterrupt:
        print(_interrupted(args, argv), file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if verbose:
            traceback.print_exc()
        line, code = describe_error(exc)
        print(f"fedpipe: error: {line}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
