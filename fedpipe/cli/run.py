"""``fedpipe run``: launch a run on a deployment (StageServer, SuperLink, SuperNodes)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fedpipe.cli.main import given_from_args
from fedpipe.cli.preflight import RunTarget, check_run
from fedpipe.cli.run_args import as_resumed, report, run_name, stop_like_ctrl_c
from fedpipe.launch.engines import FlowerRunError
from fedpipe.launch.run import deploy_run
from fedpipe.runs.resume import ResumeRefused

__all__ = ["cmd_run"]


def cmd_run(args: argparse.Namespace) -> int:
    flags = {
        "model.name": args.model,
        "federated.rounds": args.rounds,
        "federated.num_devices": args.devices,
        "federated.strategy": args.strategy,
        "federated.mode": args.mode,
        "server.tls_ca": args.tls_ca,  # the ServerApp verifies the StageServer with it
    }
    config, explicit = given_from_args(args, **flags)
    superlink_ca = args.tls_ca or args.root_certificates
    name = run_name(args)
    try:
        checked = as_resumed(args, config, explicit)
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
    stop_like_ctrl_c()  # stop the Flower run too
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
    return report(summary, args.runs_dir / name)
