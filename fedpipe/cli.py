"""fedpipe: split-learning pipelines over gRPC with Flower rounds (see fedpipe COMMAND --help)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from fedpipe.config import FedpipeConfig, load_config, parse_overrides

__all__ = ["main"]

log = logging.getLogger("fedpipe")


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _config(args: argparse.Namespace, **flags: Any) -> FedpipeConfig:
    overrides: dict[str, Any] = parse_overrides(args.set or [])
    overrides.update({k: v for k, v in flags.items() if v is not None})
    return load_config(args.config, overrides)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="TOML settings file ([model], [pipeline], ...)")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a setting")
    p.add_argument(
        "--model", help="tiny-llama | tiny-gpt2 | small-llama | default | HF folder | .gguf"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")


# -- server -----------------------------------------------------------------------------------
def _server_secret(args: argparse.Namespace) -> str | None:
    """``--secret``, ``--secret-file`` (created with a new secret if missing) or FEDPIPE_SECRET."""
    if args.secret and args.secret_file:
        raise ValueError("give --secret or --secret-file, not both")
    if args.secret_file:
        path = Path(args.secret_file).expanduser()
        if not path.exists():
            from fedpipe.federated.tokens import new_secret

            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch(mode=0o600)
            path.write_text(new_secret())
            print(f"fedpipe: wrote a new secret to {path}", file=sys.stderr, flush=True)
        secret = path.read_text().strip()
        if not secret:
            raise ValueError(f"secret file {path} is empty")
        return secret
    return args.secret or os.environ.get("FEDPIPE_SECRET") or None


def _cmd_server(args: argparse.Namespace) -> int:
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    config = _config(
        args, **{"model.name": args.model, "server.device": args.device, "server.host": args.host}
    )
    secret = _server_secret(args)
    if secret is None:
        log.warning("no secret: the StageServer accepts sessions without tokens (local use only)")
    # Handlers first: a SIGTERM that arrives while the SuperLink starts still shuts both down.
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    from fedpipe.serving import build_stage_server

    port = args.port if args.port is not None else config.server.port
    server = build_stage_server(config, secret=secret, port=port).start()
    superlink = None
    rc = 0
    try:
        print(f"fedpipe: StageServer listening on {server.address}", file=sys.stderr, flush=True)
        if args.superlink:
            from fedpipe.federated.processes import Certificates, start_superlink

            certificates = Certificates(*(Path(p) for p in args.tls)) if args.tls else None
            superlink = start_superlink(
                host=args.superlink_host,
                port=args.superlink_port or None,  # 0 = any free port
                certificates=certificates,
                insecure=certificates is None,
                enable_node_auth=args.node_auth,
                database=args.superlink_database,
                workdir=args.superlink_dir,
            )
            print(
                f"fedpipe: Flower SuperLink at {superlink.address} "
                f"({'TLS' if certificates else 'insecure'}"
                f"{', node auth' if args.node_auth else ''}; "
                f"pid {superlink.pid}, log {superlink.log_path})",
                file=sys.stderr,
                flush=True,
            )
        if args.port_file:  # written once everything serves: its presence means "ready"
            tmp = Path(str(args.port_file) + ".tmp")
            tmp.write_text(str(server.port))
            tmp.replace(args.port_file)
        while not stop.wait(1.0):
            if superlink is not None and not superlink.alive():
                log.error(
                    "the SuperLink exited (rc %s); see %s",
                    superlink.popen.returncode,
                    superlink.log_path,
                )
                rc = 1
                break
    finally:
        if superlink is not None:
            superlink.stop()
        server.stop(grace=2.0)
        print("fedpipe: server stopped", file=sys.stderr, flush=True)
    return rc


def _add_server(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("server", help="run the StageServer (and optionally a Flower SuperLink)")
    _add_common(p)
    p.add_argument("--host", help="address to bind (default 127.0.0.1; 0.0.0.0 for devices)")
    p.add_argument("--port", type=int, help="StageServer port (default 50051; 0 = any free)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="where the server stage runs")
    p.add_argument("--secret", help="shared secret with the ServerApp (or FEDPIPE_SECRET)")
    p.add_argument(
        "--secret-file",
        type=Path,
        help="read the secret from this file (created with a fresh secret if missing); "
        "pass the same path to `fedpipe run --secret-file`",
    )
    p.add_argument(
        "--port-file", type=Path, help="write the StageServer's port here once all is serving"
    )
    p.add_argument("--cpu", type=int, help="pin the server process to this CPU")
    p.add_argument("--superlink", action="store_true", help="also start a Flower SuperLink")
    p.add_argument("--superlink-host", default="127.0.0.1", help="0.0.0.0 for remote SuperNodes")
    p.add_argument(
        "--superlink-port",
        type=int,
        default=8000,
        help="SuperLink port (Flower's default 8000; 0 = any free)",
    )
    p.add_argument(
        "--superlink-dir",
        type=Path,
        help="SuperLink log and FLWR_HOME folder (default: a temp folder)",
    )
    p.add_argument(
        "--superlink-database",
        type=Path,
        help="SQLite file for the SuperLink's state (default: memory)",
    )
    p.add_argument(
        "--tls", nargs=3, metavar=("CA", "CERT", "KEY"), help="SuperLink TLS files (PEM)"
    )
    p.add_argument("--node-auth", action="store_true", help="SuperLink: only registered SuperNodes")
    p.set_defaults(func=_cmd_server)


# -- bench ------------------------------------------------------------------------------------
def _cmd_bench_pipeline(args: argparse.Namespace) -> int:
    from fedpipe.bench.pipeline import BENCH_SCHEDULES, run_pipeline_bench
    from fedpipe.link import REFERENCE_LINKS, split_specs

    model = {"small": "small-llama", None: None}.get(args.model, args.model)
    flags: dict[str, Any] = {"model.name": model or "small-llama"}
    if not args.set or not any(s.startswith("model.head_layers") for s in args.set):
        flags["model.head_layers"] = 2
        flags["model.tail_layers"] = 2
    flags.update({"train.batch_size": args.batch_size, "train.seq_len": args.seq_len})
    flags["pipeline.microbatches"] = args.microbatches
    flags["pipeline.uplink_codec"] = args.codec
    flags["pipeline.downlink_codec"] = args.codec
    flags["pipeline.gradient_codec"] = args.gradient_codec
    config = _config(args, **flags)
    links = split_specs(args.links) if args.links else list(REFERENCE_LINKS)
    schedules = args.schedules.split(",") if args.schedules else list(BENCH_SCHEDULES)
    report = run_pipeline_bench(
        config, links=links, schedules=schedules, steps=args.steps, warmup=args.warmup
    )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_bench_table(report)
    return 0


def _print_bench_table(report: dict[str, Any]) -> None:
    print(
        f"model {report['model']} ({report['split']}), batch {report['batch']}, "
        f"M={report['microbatches']}, {report['pinning']}"
    )
    print(
        f"{'link':>18} {'T_seq s':>8} {'T_whole s':>9} {'T_pipe s':>9} {'T_bound s':>10} "
        f"{'in-run':>7} {'speedup':>8} {'efficiency':>10} {'ceiling':>8}  best / bound term"
    )
    for e in report["links"]:
        print(
            f"{e['link']:>18} {e['t_seq_s']:>8.3f} {e['t_seq_whole_s']:>9.3f} "
            f"{e['t_pipe_s']:>9.3f} {e['t_bound_s']:>10.3f} {e['t_bound_inrun_s']:>7.3f} "
            f"{e['speedup']:>8.2f} {e['efficiency']:>10.2f} {e['ceiling']:>8.2f}  "
            f"{e['best_schedule']} / {e['bound_term']}" + ("  (noisy)" if e["noisy"] else "")
        )


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench", required=True)
    q = bsub.add_parser("pipeline", help="schedules x reference links vs the pipeline bound")
    _add_common(q)
    q.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    q.add_argument(
        "--links",
        help="comma-separated link names or inline specs such as up=10,down=25,rtt=50ms "
        "(default: the reference settings)",
    )
    q.add_argument("--schedules", help="comma-separated schedules (default: all)")
    q.add_argument("--microbatches", type=int, default=8)
    q.add_argument("--batch-size", type=int, default=16)
    q.add_argument("--seq-len", type=int, default=128)
    q.add_argument("--codec", default="fp32", choices=["fp32", "bf16", "fp16", "int8"])
    q.add_argument(
        "--gradient-codec",
        choices=["fp32", "bf16", "fp16", "int8"],
        help="codec of gradients (default: --codec)",
    )
    q.add_argument("--steps", type=int, default=4, help="measured steps per schedule (median)")
    q.add_argument("--warmup", type=int, default=1)
    q.set_defaults(func=_cmd_bench_pipeline)
    r = bsub.add_parser("memory", help="device-side memory vs the whole model")
    _add_common(r)
    r.set_defaults(func=_cmd_bench_memory)


def _cmd_bench_memory(args: argparse.Namespace) -> int:
    from fedpipe.models import load_config as load_hf_config
    from fedpipe.models import resolve_model
    from fedpipe.split import device_memory_report, plan_split

    config = _config(args, **{"model.name": args.model or "default"})
    folder = resolve_model(config.model.name)
    plan = plan_split(
        load_hf_config(folder),
        head_layers=config.model.head_layers,
        tail_layers=config.model.tail_layers,
        mode=config.model.split,  # type: ignore[arg-type]
    )
    report = device_memory_report(folder, plan)
    print(json.dumps({"model": config.model.name, **report}, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedpipe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_server(sub)
    _add_bench(sub)
    from fedpipe.federated.commands import add_federated_commands

    add_federated_commands(sub, _add_common, _config)
    from fedpipe.federated.certs import add_certs_command

    add_certs_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(getattr(args, "verbose", False))
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"fedpipe: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
