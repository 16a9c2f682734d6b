"""``fedpipe``: server | client | simulate | bench | run (see ``fedpipe COMMAND --help``)."""

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
    p.add_argument("--model", help="tiny-llama | tiny-gpt2 | small-llama | default | HF folder | .gguf")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")


# -- server -----------------------------------------------------------------------------------
def _cmd_server(args: argparse.Namespace) -> int:
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    config = _config(
        args, **{"model.name": args.model, "server.device": args.device, "server.host": args.host}
    )
    secret = args.secret or os.environ.get("FEDPIPE_SECRET") or None
    if secret is None:
        log.warning("no --secret: the StageServer accepts sessions without tokens (local use only)")
    from fedpipe.serving import build_stage_server

    port = args.port if args.port is not None else config.server.port
    server = build_stage_server(config, secret=secret, port=port).start()
    print(f"fedpipe: StageServer listening on {server.address}", file=sys.stderr, flush=True)
    if args.port_file:
        tmp = Path(str(args.port_file) + ".tmp")
        tmp.write_text(str(server.port))
        tmp.replace(args.port_file)
    superlink = None
    if args.superlink:
        from fedpipe.federated.engines import start_superlink

        superlink = start_superlink(
            host=args.superlink_host,
            port=args.superlink_port,
            certificates=tuple(args.tls) if args.tls else None,
            insecure=not args.tls,
            enable_node_auth=args.node_auth,
        )
        print(f"fedpipe: Flower SuperLink at {superlink.address}", file=sys.stderr, flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=2.0)
    if superlink is not None:
        superlink.stop()
    return 0


def _add_server(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("server", help="run the StageServer (and optionally a Flower SuperLink)")
    _add_common(p)
    p.add_argument("--host", help="address to bind (default 127.0.0.1; 0.0.0.0 for devices)")
    p.add_argument("--port", type=int, help="StageServer port (default 50051; 0 = any free)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="where the server stage runs")
    p.add_argument("--secret", help="shared secret with the ServerApp (or FEDPIPE_SECRET)")
    p.add_argument("--port-file", type=Path, help="write the bound port here once serving")
    p.add_argument("--cpu", type=int, help="pin the server process to this CPU")
    p.add_argument("--superlink", action="store_true", help="also start a Flower SuperLink")
    p.add_argument("--superlink-host", default="127.0.0.1")
    p.add_argument("--superlink-port", type=int, default=9092)
    p.add_argument("--tls", nargs=3, metavar=("CA", "CERT", "KEY"), help="SuperLink TLS files")
    p.add_argument("--node-auth", action="store_true", help="SuperLink: only registered SuperNodes")
    p.set_defaults(func=_cmd_server)


# -- bench ------------------------------------------------------------------------------------
def _cmd_bench_pipeline(args: argparse.Namespace) -> int:
    from fedpipe.bench.pipeline import BENCH_SCHEDULES, run_pipeline_bench
    from fedpipe.link import REFERENCE_LINKS

    model = {"small": "small-llama", None: None}.get(args.model, args.model)
    flags: dict[str, Any] = {"model.name": model or "small-llama"}
    if not args.set or not any(s.startswith("model.head_layers") for s in args.set):
        flags["model.head_layers"] = 2
        flags["model.tail_layers"] = 2
    flags.update({"train.batch_size": args.batch_size, "train.seq_len": args.seq_len})
    flags["pipeline.microbatches"] = args.microbatches
    flags["pipeline.uplink_codec"] = args.codec
    flags["pipeline.downlink_codec"] = args.codec
    config = _config(args, **flags)
    links = args.links.split(",") if args.links else list(REFERENCE_LINKS)
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
    print(f"model {report['model']} ({report['split']}), batch {report['batch']}, "
          f"M={report['microbatches']}, {report['pinning']}")
    print(f"{'link':>18} {'T_seq s':>8} {'T_pipe s':>9} {'T_bound s':>10} {'speedup':>8} "
          f"{'efficiency':>10} {'ceiling':>8}  best / bound term")
    for e in report["links"]:
        print(f"{e['link']:>18} {e['t_seq_s']:>8.3f} {e['t_pipe_s']:>9.3f} {e['t_bound_s']:>10.3f} "
              f"{e['speedup']:>8.2f} {e['efficiency']:>10.2f} {e['ceiling']:>8.2f}  "
              f"{e['best_schedule']} / {e['bound_term']}")


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench", required=True)
    q = bsub.add_parser("pipeline", help="schedules x reference links vs the pipeline bound")
    _add_common(q)
    q.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    q.add_argument("--links", help="comma-separated link names (default: the reference settings)")
    q.add_argument("--schedules", help="comma-separated schedules (default: all)")
    q.add_argument("--microbatches", type=int, default=8)
    q.add_argument("--batch-size", type=int, default=16)
    q.add_argument("--seq-len", type=int, default=128)
    q.add_argument("--codec", default="fp32", choices=["fp32", "bf16", "fp16", "int8"])
    q.add_argument("--steps", type=int, default=4, help="measured steps per schedule (median)")
    q.add_argument("--warmup", type=int, default=1)
    q.set_defaults(func=_cmd_bench_pipeline)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedpipe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_server(sub)
    _add_bench(sub)
    from fedpipe.federated.commands import add_federated_commands

    add_federated_commands(sub, _add_common, _config)
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
