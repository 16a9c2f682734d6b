"""What ``fedpipe simulate`` and ``fedpipe run`` share: a ``--resume``'s settings, the run's
name, stopping like Ctrl-C, and the final report (the settings a command line gives:
:func:`fedpipe.cli.main.given_from_args`)."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import Any

from fedpipe.config import FedpipeConfig
from fedpipe.runs.folder import RunFolder
from fedpipe.runs.report import report_lines
from fedpipe.runs.resume import resume_settings

__all__ = ["as_resumed", "report", "run_name", "stop_like_ctrl_c"]


def report(summary: dict[str, Any], folder: Path) -> int:
    """Print the final report (stdout) and the verdict (stderr); the exit status."""
    for line in report_lines(summary):
        print(line)
    print(f"run folder {folder}")
    for problem in summary.get("problems", []):
        print(f"fedpipe: run failed: {problem}", file=sys.stderr)
    return 0 if summary.get("ok", True) else 1


def _raise_keyboard_interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def stop_like_ctrl_c() -> None:
    """SIGTERM and SIGHUP (a closed terminal) end a run like Ctrl-C: the finally blocks stop
    the StageServer, the SuperLink and Ray, and the Flower run, instead of leaving them behind."""
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    signal.signal(signal.SIGHUP, _raise_keyboard_interrupt)


def run_name(args: argparse.Namespace) -> str:
    return args.name or time.strftime("run-%Y%m%d-%H%M%S")


def as_resumed(
    args: argparse.Namespace, config: FedpipeConfig, explicit: set[str]
) -> FedpipeConfig:
    """The settings a ``--resume`` will run with, so that preflight checks those (the run
    folder's recorded settings, with this command line's on top); raises ResumeRefused."""
    if not args.resume:
        return config
    saved = RunFolder(args.runs_dir / run_name(args)).load_settings()
    return resume_settings(saved, config, explicit=explicit)[0] if saved else config
