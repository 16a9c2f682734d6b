"""``fedpipe simulate``: every device on this machine, on Flower's simulation engine."""

from __future__ import annotations

import argparse
import sys

from fedpipe.cli.main import given_from_args
from fedpipe.cli.preflight import check_simulate
from fedpipe.cli.run_args import as_resumed, report, run_name, stop_like_ctrl_c
from fedpipe.launch.run import simulate
from fedpipe.runs.resume import ResumeRefused

__all__ = ["cmd_simulate"]


def cmd_simulate(args: argparse.Namespace) -> int:
    flags = {
        "model.name": args.model,
        "federated.rounds": args.rounds,
        "federated.num_devices": args.devices,
        "federated.profiles": args.profiles,
        "federated.strategy": args.strategy,
        "federated.mode": args.mode,
        "federated.data": args.data,
    }
    config, explicit = given_from_args(args, **flags)
    name = run_name(args)
    try:
        check_simulate(as_resumed(args, config, explicit))
        stop_like_ctrl_c()
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
    return report(summary, args.runs_dir / name)
