"""fedpipe's command line: every command's flags, one scheme for all of them.

The scheme, the same in every command:
- ``--config FILE`` and ``--set SECTION.KEY=VALUE`` give settings (``fedpipe/config.py``);
  ``--model`` is ``--set model.name=``.
- ``--superlink HOST:PORT`` is the Flower SuperLink's address and ``--stage-server HOST:PORT``
  the StageServer's: where to connect (client, run, register-node) or where to listen (server).
- ``--tls-ca``, ``--tls-cert``, ``--tls-key`` are TLS files for every link a command serves or
  connects to (the SuperLink and the StageServer alike).
- ``--secret-file``, ``--name``, ``--runs-dir``, ``--resume``, ``--timeout``, ``--devices``,
  ``--data`` mean the same wherever they appear.
Older spellings still work, hidden from ``--help``, and print a one-line notice.

Building the parser imports no torch: commands are named as ``"module:function"`` and
imported only when they run, so ``fedpipe --help`` answers at once.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedpipe import __version__
from fedpipe.config import FedpipeConfig

__all__ = ["build_parser"]

_D = FedpipeConfig()  # the defaults the help texts quote
_COMMANDS = "fedpipe.federated.commands"
_STRATEGIES = "fedavg | fedprox | fedadam | fedyogi | fedadagrad | fedavgm"


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option shows its default: the help's own ``(default: ...)`` where None would say
    nothing (``default: the setting model.name``), else ``none``, ``off`` or the value."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or text == argparse.SUPPRESS or not action.option_strings:
            return text
        if action.default is None:
            return f"{text} (default: none)"
        if action.default is False:
            return f"{text} (default: off)"
        return super()._get_help_string(action) or ""


class _Deprecated(argparse.Action):
    """An old spelling: stores its value like the option it stands for, prints a notice."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, use: str, **kw: Any) -> None:
        self.use = use
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kw)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(
            f"fedpipe: note: {option_string} is deprecated; use {self.use}",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, True if self.nargs == 0 else values)


def _deprecated(p: argparse.ArgumentParser, flag: str, use: str, **kw: Any) -> None:
    p.add_argument(flag, action=_Deprecated, use=use, **kw)


def _sub(sub: Any, name: str, func: str, help_: str) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        name, help=help_, description=help_, formatter_class=_Formatter
    )
    p.set_defaults(func=func)
    p.add_argument("-v", "--verbose", action="store_true", help="log progress; full tracebacks")
    return p


def _settings(p: argparse.ArgumentParser, model_default: str = "") -> None:
    p.add_argument("--config", type=Path, help="TOML settings file ([model], [pipeline], ...)")
    p.add_argument(
        "--set",
        action="append",
        metavar="SECTION.KEY=VALUE",
        help="override one setting (repeatable); wins over --config",
    )
    p.add_argument(
        "--model",
        help="tiny-llama | tiny-gpt2 | small-llama (random weights, for tests) | default "
        "(SmolLM2-135M-Instruct) | HF folder | .gguf file "
        f"(default: {model_default or 'the setting model.name = ' + _D.model.name})",
    )


def _superlink(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--superlink", default="127.0.0.1:8000", metavar="HOST:PORT", help="the Flower SuperLink"
    )


def _tls_ca(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tls-ca",
        metavar="FILE",
        help="CA certificate (PEM) of TLS servers: the SuperLink and the StageServer "
        "(default: plaintext)",
    )


def _run_folder(p: argparse.ArgumentParser) -> None:
    f = _D.federated
    p.add_argument("--rounds", type=int, help=f"federated.rounds (default: {f.rounds})")
    p.add_argument("--strategy", help=f"{_STRATEGIES} (default: {f.strategy})")
    p.add_argument("--name", help="run name: results go to RUNS_DIR/NAME (default: run-DATE-TIME)")
    p.add_argument("--runs-dir", type=Path, default=Path("runs"), help="folder of run folders")
    p.add_argument("--resume", action="store_true", help="continue after the last saved round")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the run stops")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")


# -- commands -----------------------------------------------------------------------------------
def _add_simulate(sub: Any) -> None:
    p = _sub(sub, "simulate", f"{_COMMANDS}:_cmd_simulate", "simulate devices on this machine")
    _settings(p)
    f = _D.federated
    p.add_argument("--devices", type=int, help=f"simulated devices (default: {f.num_devices})")
    p.add_argument(
        "--profiles", help=f"device profiles, cycled over the devices (default: {f.profiles})"
    )
    p.add_argument(
        "--data", help="text/JSONL file or folder (default: the bundled public-domain corpus)"
    )
    _run_folder(p)


def _add_run(sub: Any) -> None:
    p = _sub(sub, "run", f"{_COMMANDS}:_cmd_run", "launch a run on a deployment (server + clients)")
    _settings(p)
    _superlink(p)
    p.add_argument(
        "--stage-server", default="127.0.0.1:50051", metavar="HOST:PORT", help="the StageServer"
    )
    p.add_argument(
        "--secret-file",
        type=Path,
        help="the StageServer's secret file (default: none; tokens off)",
    )
    _tls_ca(p)
    _deprecated(p, "--root-certificates", "--tls-ca FILE", dest="root_certificates")
    p.add_argument(
        "--devices",
        type=int,
        help=f"connected SuperNodes the run waits for (default: {_D.federated.num_devices})",
    )
    _run_folder(p)


def _add_client(sub: Any) -> None:
    p = _sub(sub, "client", f"{_COMMANDS}:_cmd_client", "run one device (a Flower SuperNode)")
    _superlink(p)
    p.add_argument(
        "--stage-server",
        metavar="HOST:PORT",
        help="StageServer for this device (default: the run's --stage-server)",
    )
    p.add_argument("--partition-id", type=int, default=0, help="this device's partition")
    p.add_argument("--num-partitions", type=int, default=1, help="partitions of the data")
    p.add_argument(
        "--profile",
        default="loopback",
        help="emulated device profile (loopback emulates nothing; phone-lte, rpi-wifi, ...)",
    )
    p.add_argument(
        "--data", help="this device's own text (default: partition ID of the run's data)"
    )
    p.add_argument(
        "--cut",
        metavar="H+T",
        default="",
        help="this device's head+tail blocks, one the StageServer offers (model.cuts) "
        "(default: the run's model.head_layers+model.tail_layers)",
    )
    p.add_argument(
        "--supernode-port", type=int, help="this SuperNode's own port (default: a free one)"
    )
    _deprecated(p, "--port", "--supernode-port PORT", dest="supernode_port", type=int)
    _tls_ca(p)
    _deprecated(p, "--root-certificates", "--tls-ca FILE", dest="root_certificates")
    _deprecated(p, "--stage-ca", "--tls-ca FILE", dest="stage_ca")
    p.add_argument(
        "--tls-cert",
        metavar="FILE",
        help="this device's client certificate, for a StageServer that requires mutual TLS "
        "(server.tls_client_ca) (default: none)",
    )
    p.add_argument("--tls-key", metavar="FILE", help="private key of --tls-cert (default: none)")
    p.add_argument("--auth-key", help="private key for SuperNode authentication (default: none)")
    p.add_argument(
        "--workdir", type=Path, help="SuperNode log and FLWR_HOME (default: a temp folder)"
    )


def _add_server(sub: Any) -> None:
    p = _sub(sub, "server", "fedpipe.cli:cmd_server", "run the StageServer (and a SuperLink)")
    _settings(p)
    s = _D.server
    p.add_argument(
        "--stage-server",
        metavar="HOST:PORT",
        help=f"where the StageServer listens; port 0 = any free (default: server.host:"
        f"server.port = {s.host}:{s.port}; 0.0.0.0:{s.port} for remote devices)",
    )
    p.add_argument(
        "--superlink",
        nargs="?",
        const="127.0.0.1:8000",
        metavar="HOST:PORT",
        help="also start a Flower SuperLink listening here (default: none; alone: "
        "127.0.0.1:8000; 0.0.0.0:8000 for remote devices)",
    )
    p.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], help="server.device (default: auto)"
    )
    p.add_argument(
        "--secret-file",
        type=Path,
        help="secret shared with `fedpipe run` (created if missing; default: FEDPIPE_SECRET, "
        "else none: sessions need no token)",
    )
    p.add_argument("--secret", help=argparse.SUPPRESS)  # visible in `ps`: prefer the file
    _tls_ca(p)
    p.add_argument(
        "--tls-cert", metavar="FILE", help="serve TLS with this certificate (default: none)"
    )
    p.add_argument("--tls-key", metavar="FILE", help="private key of --tls-cert (default: none)")
    p.add_argument("--node-auth", action="store_true", help="SuperLink: only registered devices")
    p.add_argument(
        "--superlink-database", type=Path, help="SQLite file for the SuperLink (default: memory)"
    )
    p.add_argument(
        "--workdir", type=Path, help="SuperLink log and FLWR_HOME (default: a temp folder)"
    )
    p.add_argument(
        "--port-file", type=Path, help="write the StageServer's port here once all serves"
    )
    p.add_argument("--cpu", type=int, help="pin the server process to this CPU (default: any)")
    _deprecated(p, "--host", "--stage-server HOST:PORT", dest="legacy_host")
    _deprecated(p, "--port", "--stage-server HOST:PORT", dest="legacy_port", type=int)
    _deprecated(p, "--superlink-host", "--superlink HOST:PORT", dest="legacy_superlink_host")
    _deprecated(p, "--superlink-port", "--superlink HOST:PORT", dest="legacy_superlink_port")
    _deprecated(p, "--superlink-dir", "--workdir DIR", dest="workdir", type=Path)
    _deprecated(p, "--tls", "--tls-ca CA --tls-cert CERT --tls-key KEY", dest="legacy_tls", nargs=3)


def _add_register(sub: Any) -> None:
    p = _sub(
        sub,
        "register-node",
        f"{_COMMANDS}:_cmd_register_node",
        "register a device's public key at a SuperLink started with --node-auth",
    )
    p.add_argument("public_key", help="the device's ECDSA SECP384R1 public key (OpenSSH .pub)")
    _superlink(p)
    _tls_ca(p)
    _deprecated(p, "--root-certificates", "--tls-ca FILE", dest="root_certificates")


def _add_bench(sub: Any) -> None:
    p = sub.add_parser("bench", help="benchmarks", formatter_class=_Formatter)
    bsub = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    q = _sub(bsub, "pipeline", "fedpipe.cli:cmd_bench_pipeline", "schedules x links vs the bound")
    _settings(q, model_default="small-llama, split 2 + 2 (fewer for smaller models)")
    q.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    q.add_argument(
        "--links",
        help="comma-separated link names or inline specs, e.g. 1gbit-5ms,up=10,down=25,rtt=50ms "
        "(default: the reference links)",
    )
    q.add_argument("--schedules", help="comma-separated schedules (default: all)")
    q.add_argument("--microbatches", type=int, default=8, help="microbatches per step")
    q.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    q.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    codecs = ["fp32", "bf16", "fp16", "int8", "int4", "int2"]
    q.add_argument("--codec", default="fp32", choices=codecs, help="activation codec")
    q.add_argument("--gradient-codec", choices=codecs, help="codec of gradients (default: --codec)")
    q.add_argument("--steps", type=int, default=4, help="measured steps per schedule (median)")
    q.add_argument("--warmup", type=int, default=1, help="unmeasured steps first")
    qb = _sub(bsub, "quality", "fedpipe.cli:cmd_bench_quality", "held-out loss vs centralized")
    qb.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    qb.add_argument("--quick", action="store_true", help="a tiny random model (CI, seconds)")
    qb.add_argument("--runs", help="comma-separated run names (default: all but noniid-stack)")
    qb.add_argument(
        "--seeds", type=int, default=1, help="train each run N times (model.seed + 0..N-1)"
    )
    qb.add_argument(
        "--set",
        action="append",
        metavar="SECTION.KEY=VALUE",
        help="override one setting of every run (repeatable), e.g. federated.rounds=5",
    )
    pl = _sub(
        bsub, "plan", "fedpipe.cli:cmd_bench_plan", "the planner's predicted vs measured step"
    )
    _settings(pl, model_default="small-llama, split 2 + 2 (fewer for smaller models)")
    pl.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    pl.add_argument("--links", help="comma-separated links (default: the reference links)")
    pl.add_argument("--microbatches", type=int, default=8, help="microbatches of the first step")
    pl.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    pl.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    pl.add_argument("--codecs", default="fp32", help="codecs the planner may pick (fp32 always)")
    pl.add_argument("--steps", type=int, default=4, help="measured steps per session (median)")
    pl.add_argument("--warmup", type=int, default=1, help="unmeasured steps after planning")
    pl.add_argument("--sessions", type=int, default=2, help="sessions per link (rounds)")
    r = _sub(bsub, "memory", "fedpipe.cli:cmd_bench_memory", "device memory vs the whole model")
    _settings(r, model_default="default (SmolLM2-135M-Instruct)")
    v = _sub(
        bsub, "privacy", "fedpipe.cli:cmd_bench_privacy", "attacks on the stage link vs defences"
    )
    v.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    v.add_argument("--quick", action="store_true", help="tiny model, one cut, one defence (CI)")
    _add_bench_server(bsub)


def _add_bench_server(bsub: Any) -> None:
    s = _sub(bsub, "server", "fedpipe.cli:cmd_bench_server", "N devices vs one StageServer")
    s.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    s.add_argument(
        "--model",
        help="tiny-llama | small-llama | SmolLM2 (default: small-llama; tiny-llama with --quick)",
    )
    s.add_argument("--devices", help="comma-separated N (default: 1,2,4,8,16,32; 1,2,4 --real)")
    s.add_argument("--steps", type=int, help="measured steps per device (default: 3; 2 --quick)")
    s.add_argument("--warmup", type=int, default=1, help="unmeasured steps first")
    s.add_argument("--quick", action="store_true", help="CI size: tiny-llama, N 1,2,4, 2 steps")
    s.add_argument("--real", action="store_true", help="real head/tail stages, not generators")
    s.add_argument("--link", help="each device's link (default: 100mbit-5ms; loopback --quick)")
    s.add_argument(
        "--server-threads",
        type=int,
        help="torch threads of the server (default: one per core, the load generator shares them;"
        " fewer pins the load generator to the first core and the server to the next ones)",
    )
    s.add_argument("--microbatches", type=int, default=2, help="microbatches per device step")
    s.add_argument("--microbatch-size", type=int, default=2, help="sequences per microbatch")
    s.add_argument("--seq-len", type=int, help="tokens per sequence (default: 128; 16 --quick)")


def _add_certs(sub: Any) -> None:
    p = _sub(
        sub,
        "certs",
        "fedpipe.federated.certs:cmd_certs",
        "make test certificates for TLS and mutual TLS on the stage link",
    )
    p.add_argument("--out", type=Path, required=True, help="folder for the PEM files")
    p.add_argument(
        "--host",
        action="append",
        help="a name or IP devices use to reach the StageServer (repeatable; loopback is "
        "always in)",
    )
    p.add_argument(
        "--client",
        action="append",
        help="a client certificate to make (repeatable; default: serverapp, device-0, device-1)",
    )
    p.add_argument("--days", type=int, default=30, help="validity in days")


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; imports nothing heavy."""
    parser = argparse.ArgumentParser(
        prog="fedpipe",
        description="Federated split learning of LLMs: devices hold the first and last "
        "blocks, a GPU server the middle, microbatches pipelined over gRPC, rounds run by "
        "Flower. See `fedpipe COMMAND --help`.",
        formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=f"fedpipe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_simulate(sub)
    _add_server(sub)
    _add_client(sub)
    _add_run(sub)
    _add_register(sub)
    _add_bench(sub)
    _add_certs(sub)
    return parser
