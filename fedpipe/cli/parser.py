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
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from fedpipe import __version__
from fedpipe.config import FedpipeConfig, list_text

__all__ = ["Formatter", "add_command", "add_settings", "build_parser"]

_D = FedpipeConfig()  # the defaults the help texts quote
_STRATEGIES = (
    "fedavg | fedprox | fedadam | fedyogi | fedadagrad | fedavgm | fedmedian | fedtrimmedavg | "
    "krum | multikrum"
)


class Formatter(argparse.ArgumentDefaultsHelpFormatter):
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


def add_command(sub: Any, name: str, func: str, help_: str) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        name, help=help_, description=help_, formatter_class=Formatter
    )
    p.set_defaults(func=func)
    p.add_argument("-v", "--verbose", action="store_true", help="log progress; full tracebacks")
    return p


def add_settings(p: argparse.ArgumentParser, model_default: str = "") -> None:
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
    p.add_argument(
        "--mode",
        choices=("sync", "async"),
        help=f"federated.mode: sync rounds or buffered async versions (default: {f.mode})",
    )
    p.add_argument("--name", help="run name: results go to RUNS_DIR/NAME (default: run-DATE-TIME)")
    p.add_argument("--runs-dir", type=Path, default=Path("runs"), help="folder of run folders")
    p.add_argument("--resume", action="store_true", help="continue after the last saved round")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the run stops")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")


# -- commands -----------------------------------------------------------------------------------
def _add_simulate(sub: Any) -> None:
    p = add_command(
        sub, "simulate", "fedpipe.cli.simulate:cmd_simulate", "simulate devices on this machine"
    )
    add_settings(p)
    f = _D.federated
    p.add_argument("--devices", type=int, help=f"simulated devices (default: {f.num_devices})")
    p.add_argument(
        "--profiles",
        help="device profiles, cycled over the devices "
        f"(default: {list_text('federated.profiles', f.profiles)})",
    )
    p.add_argument(
        "--data", help="text/JSONL file or folder (default: the bundled public-domain corpus)"
    )
    _run_folder(p)


def _add_run(sub: Any) -> None:
    p = add_command(
        sub, "run", "fedpipe.cli.run:cmd_run", "launch a run on a deployment (server + clients)"
    )
    add_settings(p)
    _superlink(p)
    p.add_argument(
        "--stage-server",
        default="127.0.0.1:50051",
        metavar="HOST:PORT[,HOST:PORT...]",
        help="the StageServer, or its replicas' addresses as `fedpipe server --replicas` "
        "prints them",
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
    p = add_command(
        sub, "client", "fedpipe.cli.client:cmd_client", "run one device (a Flower SuperNode)"
    )
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
        "--privacy",
        metavar="SPEC",
        default="",
        help="this device's own stage-link defences over the run's [privacy], e.g. "
        "'mechanism=token,activation_noise=0.1,gradient_noise=0.1' or 'decorrelation=0.5' "
        "or 'off' (default: the run's, or privacy.devices)",
    )
    p.add_argument(
        "--weights",
        metavar="W",
        default="",
        help="how this device stores its frozen embedding, block linears and LM head: fp32, "
        "bf16, int8 or int4, dequantized block by block; LoRA stays fp32 "
        "(default: the run's device.weights)",
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
    p = add_command(
        sub, "server", "fedpipe.cli.server:cmd_server", "run the StageServer (and a SuperLink)"
    )
    add_settings(p)
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
        "--weights",
        metavar="W",
        help="server.weights: how the server stores its blocks' frozen linears: fp32, bf16, "
        "int8 or int4, dequantized slab by slab; its LoRA adapters stay fp32 (default: fp32)",
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
        "--port-file",
        type=Path,
        help="write the StageServer's port here once all serves (with replicas: their "
        "addresses, comma-separated)",
    )
    p.add_argument("--cpu", type=int, help="pin the server process to this CPU (default: any)")
    p.add_argument(
        "--replicas",
        type=int,
        help=f"server.replicas: this many StageServers, each a Ray actor with the whole middle "
        f"(default: {s.replicas}: one, no Ray)",
    )
    p.add_argument(
        "--ray-address",
        metavar="HOST:PORT",
        help="server.ray_address: start the replicas on this Ray cluster (default: a local Ray)",
    )
    p.add_argument(
        "--replica-port",
        type=int,
        metavar="BASE",
        help="server.replica_port: replica i listens on BASE+i (default: the --stage-server "
        "port, else free ports; needed with --ray-address)",
    )
    _deprecated(p, "--host", "--stage-server HOST:PORT", dest="legacy_host")
    _deprecated(p, "--port", "--stage-server HOST:PORT", dest="legacy_port", type=int)
    _deprecated(p, "--superlink-host", "--superlink HOST:PORT", dest="legacy_superlink_host")
    _deprecated(p, "--superlink-port", "--superlink HOST:PORT", dest="legacy_superlink_port")
    _deprecated(p, "--superlink-dir", "--workdir DIR", dest="workdir", type=Path)
    _deprecated(p, "--tls", "--tls-ca CA --tls-cert CERT --tls-key KEY", dest="legacy_tls", nargs=3)


def _add_register(sub: Any) -> None:
    p = add_command(
        sub,
        "register-node",
        "fedpipe.cli.register:cmd_register_node",
        "register a device's public key at a SuperLink started with --node-auth",
    )
    p.add_argument("public_key", help="the device's ECDSA SECP384R1 public key (OpenSSH .pub)")
    _superlink(p)
    _tls_ca(p)
    _deprecated(p, "--root-certificates", "--tls-ca FILE", dest="root_certificates")


def _add_bench(sub: Any) -> None:
    """``fedpipe bench``: each benchmark registers its own command (entry points of the group
    ``fedpipe.bench``); the product imports none of them."""
    p = sub.add_parser("bench", help="benchmarks", formatter_class=Formatter)
    bsub = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    found = entry_points(group="fedpipe.bench")
    for ep in sorted(found, key=lambda e: e.name):
        ep.load()(bsub)
    if not found:
        p.epilog = (
            "no benchmark is installed: they live in the repository's benchmarks/ folder; "
            "install a checkout with `bash scripts/setup.sh`"
        )


def _add_certs(sub: Any) -> None:
    p = add_command(
        sub,
        "certs",
        "fedpipe.cli.certs:cmd_certs",
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


def _add_export(sub: Any) -> None:
    p = add_command(
        sub,
        "export",
        "fedpipe.cli.export:cmd_export",
        "write a run's fine-tuned model: a PEFT LoRA adapter or a merged Hugging Face model",
    )
    p.add_argument("run", type=Path, metavar="RUN_FOLDER", help="the run's folder (runs/NAME)")
    p.add_argument("--round", type=int, help="the checkpoint's round (default: the last saved)")
    p.add_argument("--out", type=Path, required=True, help="the folder to write (new or empty)")
    p.add_argument(
        "--format",
        choices=("peft", "merged"),
        default="peft",
        help="peft: adapter_config.json + adapter_model.safetensors over the base model; "
        "merged: the whole model with the adapters (and exact/stack's base changes) merged in",
    )
    p.add_argument(
        "--model",
        help="the base model, if not where the run found it (default: the run's model.name); "
        "its fingerprint must be the run's",
    )


def _add_generate(sub: Any) -> None:
    p = add_command(
        sub,
        "generate",
        "fedpipe.cli.generate:cmd_generate",
        "answer a prompt with a base model and a fine-tuned adapter, streaming the tokens",
    )
    p.add_argument("prompt", help="the prompt (with --chat: the user's turn)")
    p.add_argument(
        "--model",
        help="the base model: tiny-llama | default | HF folder | .gguf file (default: the "
        "--run's model, or the --adapter's base_model_name_or_path)",
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument("--adapter", type=Path, help="a PEFT adapter folder (fedpipe export)")
    source.add_argument("--run", type=Path, metavar="RUN_FOLDER", help="a run's checkpoint")
    p.add_argument("--round", type=int, help="with --run: the round (default: the last saved)")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampling")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's p (sampling only)")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed")


def _add_eval(sub: Any) -> None:
    p = add_command(
        sub,
        "eval",
        "fedpipe.cli.eval:cmd_eval",
        "score a run's model against its base on held-out examples: answer loss, exact match "
        "and containment of greedy answers (writes RUN_FOLDER/eval.json)",
    )
    p.add_argument("run", type=Path, metavar="RUN_FOLDER", help="the run's folder (runs/NAME)")
    p.add_argument(
        "--data",
        type=Path,
        required=True,
        help="held-out examples: JSONL in the training formats (prompt/completion, messages)",
    )
    p.add_argument(
        "--round",
        type=int,
        help="the checkpoint's round (default: the last saved; writes eval-round-N.json)",
    )
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate at most")
    p.add_argument("--limit", type=int, help="score the first N records only")
    p.add_argument(
        "--model",
        help="the base model, if not where the run found it (default: the run's model.name); "
        "its fingerprint must be the run's",
    )


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; imports nothing heavy."""
    parser = argparse.ArgumentParser(
        prog="fedpipe",
        description="Federated split learning of LLMs: devices hold the first and last "
        "blocks, a GPU server the middle, microbatches pipelined over gRPC, rounds run by "
        "Flower. See `fedpipe COMMAND --help`.",
        formatter_class=Formatter,
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
    _add_export(sub)
    _add_generate(sub)
    _add_eval(sub)
    return parser
