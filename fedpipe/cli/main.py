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
import math
import shlex
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from fedpipe.cli.parser import build_parser
from fedpipe.config import FedpipeConfig, parse_overrides
from fedpipe.config.loading import load_given
from fedpipe.errors import FedpipeError
from fedpipe.launch.processes import ProcessStartError

__all__ = ["config_from_args", "describe_error", "given_from_args", "main"]

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
    return given_from_args(args, **flags)[0]


def given_from_args(args: argparse.Namespace, **flags: Any) -> tuple[FedpipeConfig, set[str]]:
    """:func:`config_from_args`, and the settings this command line gives: the flags (not
    None), ``--set`` and the ``--config`` file's keys (the file read once)."""
    overrides: dict[str, Any] = parse_overrides(getattr(args, "set", None) or [])
    overrides.update({k: v for k, v in flags.items() if v is not None})
    return load_given(getattr(args, "config", None), overrides)


# -- errors -------------------------------------------------------------------------------------
def describe_error(exc: BaseException) -> tuple[str, int]:
    """(one line for the user, exit status) for an exception that ended a command."""
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
    timeout = getattr(args, "timeout", None)
    if timeout is not None and not 0 < timeout < math.inf:
        print(
            f"fedpipe: error: --timeout must be a number of seconds > 0, got {timeout:g}",
            file=sys.stderr,
        )
        return EXIT_SETTINGS
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
