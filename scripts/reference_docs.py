"""The docs' reference tables, generated from the code at build time.

- ``settings_reference()``: every setting of ``fedpipe.config.FedpipeConfig``, one table per
  section, with its type, its default (read from the dataclasses) and what it does (the comment
  on or above the field in ``fedpipe/config/<section>.py``, then :data:`NOTES`).
- ``cli_reference()``: every ``fedpipe`` command and option, walked from the real argparse
  parser (``fedpipe.cli.parser.build_parser``), ``fedpipe bench`` commands included.
- ``profiles_reference()``: every named device profile and link (``fedpipe.config.profiles``).
- ``layers_reference()``: the layers import-linter enforces (``pyproject.toml``), top to bottom,
  each package with the first line of its docstring; and the other contracts.

``scripts/mkdocs_hooks.py`` puts them where a page says ``<!-- fedpipe:settings -->``,
``<!-- fedpipe:cli -->``, ``<!-- fedpipe:profiles -->`` or ``<!-- fedpipe:layers -->``;
``python scripts/reference_docs.py settings|cli|profiles|layers`` prints them.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
import tomllib
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))  # render_bench_docs, beside this script

from render_bench_docs import escape_pipes  # noqa: E402

# What a setting does, where its field (fedpipe/config/<section>.py) carries no comment of its
# own, shares one with its neighbours, or needs a pointer to its guide; a note replaces the
# field's comment. Links are relative to docs/reference/.
NOTES: dict[str, str] = {
    "model.name": "the model both sides load: `tiny-llama`, `tiny-gpt2`, `small-llama` (random "
    "test models), `default` (SmolLM2-135M-Instruct, bundled), a Hugging Face folder or a "
    "`.gguf` file ([Models](../guides/models.md))",
    "model.head_layers": "blocks the device runs after the embeddings, before the server's",
    "model.tail_layers": "blocks the device runs after the server's, before the final norm, "
    "LM head and loss ([Devices on different cuts](../guides/cuts.md))",
    "model.lora_r": "LoRA rank of every adapter, on both sides",
    "model.lora_alpha": "LoRA alpha (the adapter's scale is alpha / r)",
    "model.seed": "seeds the LoRA initialisation, the held-out split, the partitions and the "
    "batch order",
    "pipeline.microbatches": "microbatches each step's batch is cut into (must divide into "
    "`train.batch_size`)",
    "pipeline.schedule": "the device's schedule: `sequential`, `gpipe`, `1f1b` or `greedy` "
    "([Schedules](../concepts/schedules.md))",
    "pipeline.uplink_codec": "codec of tensors the device sends up ([Compression]"
    "(../guides/compression.md))",
    "pipeline.downlink_codec": "codec of tensors the StageServer sends down",
    "pipeline.timeout_s": "seconds a device waits for one reply before the step fails",
    "pipeline.plan_codecs": "codecs the planner may choose among (a list or comma-separated; "
    "fp32 always one) ([Per-device planning](../guides/planning.md))",
    "pipeline.replan_drift": "re-plan when the link's RTT or a message's time either way moves "
    "by more than this fraction",
    "pipeline.memory_cap_mb": "the device's memory for its parameters plus stashed activations "
    "(0: no cap)",
    "train.batch_size": "sequences per local step",
    "train.seq_len": "tokens per sequence",
    "train.local_steps": "optimizer steps each device runs per round",
    "train.lr": "learning rate of the device's AdamW (the server side uses 1e-3 unless a device "
    "asks for another, within `server.max_learning_rate`)",
    "train.weight_decay": "weight decay of the device's AdamW",
    "train.eval_batches": "held-out batches per evaluation (`eval_batches x batch_size` blocks "
    "drawn evenly across the held-out documents)",
    "server.host": "address the StageServer listens on (`fedpipe server --stage-server` wins)",
    "server.port": "its port; 0 picks any free one",
    "server.device": "where the middle blocks compute: `auto` (CUDA when present), `cpu` or "
    "`cuda` ([A GPU on the server](../guides/gpu-server.md))",
    "server.max_message_mb": "largest gRPC message ([Limits](limits.md))",
    "server.max_sessions": "sessions held at once ([Limits](limits.md))",
    "server.max_pending_mb": "per session: the tensor megabytes of `max_pending`",
    "server.max_learning_rate": "highest server-side learning rate a device may ask for (0 "
    "asks for the default, 1e-3)",
    "server.threads": "torch threads of the server's compute; on a CPU server, give it the "
    "machine's cores",
    "server.batching": "several devices' ready microbatches in one call of the frozen stage; "
    "false: one message at a time with peft adapters ([Batching](../guides/batching.md))",
    "server.max_weight_decay": "highest server-side weight decay a device may ask for",
    "server.tls_client_ca": "mutual TLS: the StageServer admits only clients whose certificate "
    "this CA signed",
    "server.tls_client_cert": "the ServerApp's own client certificate for a mutual-TLS "
    "StageServer (control calls, evaluation)",
    "server.dtype": "the server stage's compute dtype: `auto` (bfloat16 on CUDA, float32 on a "
    "CPU), `float32` or `bfloat16` (opt-in on CPUs with native bf16)",
    "pipeline.plan": "`fixed`: the settings above; `auto`: each device measures its compute and "
    "link and picks its microbatches, schedule, codecs and cut ([Per-device planning]"
    "(../guides/planning.md))",
    "pipeline.device_trains": "false: frozen-device mode, the device's blocks train nothing "
    "and LoRA trains on the server only ([Frozen devices](../guides/frozen-devices.md))",
    "pipeline.recompute_head": "true: the head keeps no graph and its backward recomputes it "
    "([Device memory](../guides/device-memory.md))",
    "federated.profiles": "device profiles, link names or inline link specs, cycled over the "
    "devices ([Profiles and links](configuration.md#profiles-and-links))",
    "federated.aggregation": "how LoRA adapters are aggregated on both sides: `separate`, "
    "`exact`, `ffa` or `stack` ([Exact aggregation](../guides/exact-aggregation.md))",
    "federated.strategy": "the Flower strategy: `fedavg`, `fedprox`, `fedadam`, `fedyogi`, "
    "`fedadagrad` or `fedavgm`",
    "server.tls_key": "private key of `server.tls_cert` ([Security](../security.md))",
    "server.tls_client_key": "private key of `server.tls_client_cert`",
    "federated.rounds": "federated rounds",
    "federated.fraction_train": "fraction of the connected devices sampled each round",
    "federated.num_devices": "devices of the run (simulated devices, or SuperNodes a "
    "deployment waits for)",
    "federated.data": "a text or JSONL file or a folder; empty: the bundled public-domain "
    "corpus ([Data](../guides/data.md))",
    "federated.partition": "how the data is dealt to devices: `iid` (even shuffle), "
    "`by-source` (whole sources per device), `dirichlet` (skewed)",
    "federated.dirichlet_alpha": "concentration of the `dirichlet` partition (smaller: more "
    "skewed)",
    "federated.eval_fraction": "fraction of the documents held out for evaluation",
    "federated.proximal_mu": "FedProx's proximal term (with `strategy = fedprox`)",
    "federated.server_lr": "the server optimizer's learning rate of FedAdam, FedYogi, "
    "FedAdagrad and FedAvgM",
    "federated.min_devices": "start a round with the devices connected after "
    "`connect_wait_s` if there are at least this many; otherwise stop the run "
    "([Rounds and failures](../guides/rounds-and-failures.md))",
    "federated.connect_wait_s": "before a round, wait this long for `num_devices` devices to "
    "connect",
    "federated.round_deadline_s": "a round waits at most this long for replies; a device still "
    "out is a failure",
    "federated.straggler_s": "once one device has replied, wait at most this long for the rest "
    "(0: off)",
    "federated.report_every_s": "while a round waits, say this often for whom (late devices "
    "only) and, off a terminal, its progress; the least a device may go without a step before "
    "it is late ([Rounds and failures](../guides/rounds-and-failures.md))",
    "federated.max_failures": "stop the run (exit 1) once more devices than this have failed "
    "(-1: no limit)",
    "federated.mode": "`sync` rounds, or `async`: buffered asynchronous rounds where every free "
    "device works and each `buffer` replies make a new version; `rounds` counts versions "
    "([Asynchronous rounds](../guides/async-rounds.md))",
    "federated.buffer": "async: the replies each version aggregates, exactly (1..num_devices)",
    "federated.max_staleness": "async: a reply from more versions back than this is refused "
    "and counted (0..100)",
    "federated.staleness": "async: how a reply `s` versions stale weighs: `constant`, "
    "`poly:A` (1/(1+s)^A) or `hinge:A,B` (1 up to B, then 1/(1 + A (s - B)))",
    "federated.buffer_lr": "async: each version moves both sides by this times the weighted "
    "mean update (1: FedAvg's step)",
}


@dataclasses.dataclass(frozen=True)
class Setting:
    key: str  # section.name
    type: str
    default: Any
    doc: str


def field_comments(cls: type) -> dict[str, str]:
    """Per field of dataclass ``cls``: the comment on its line, else the block just above it."""
    source = textwrap.dedent(inspect.getsource(cls))
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    inline: dict[int, str] = {}
    for tok in tokens:
        if tok.type == tokenize.COMMENT:
            inline.setdefault(tok.start[0], tok.string.lstrip("#").strip())
    lines = source.splitlines()
    names = {f.name for f in dataclasses.fields(cls)}
    out: dict[str, str] = {}
    for number, line in enumerate(lines, start=1):
        name = line.strip().split(":", 1)[0]
        if name not in names or not line.startswith("    ") or line.startswith("     "):
            continue
        if number in inline and not lines[number - 1].lstrip().startswith("#"):
            out[name] = inline[number]
            continue
        above: list[str] = []
        i = number - 1
        while i >= 1 and lines[i - 1].lstrip().startswith("#"):
            above.insert(0, lines[i - 1].strip().lstrip("#").strip())
            i -= 1
        if above:
            out[name] = " ".join(above)
    return out


def _toml(value: Any) -> str:
    """A default as it is written in a TOML file."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def settings() -> list[tuple[str, str, list[Setting]]]:
    """``[(section, what the section is, its settings)]`` in the order of the dataclasses."""
    from fedpipe.config import FedpipeConfig  # the docs build imports fedpipe only here

    config = FedpipeConfig()
    flat = config.to_flat()  # a list setting's default as the string it is written as
    out = []
    for section in dataclasses.fields(config):
        obj = getattr(config, section.name)
        cls = type(obj)
        comments = field_comments(cls)
        hints = {f.name: f.type for f in dataclasses.fields(cls)}
        items = []
        for f in dataclasses.fields(cls):
            key = f"{section.name}.{f.name}"
            doc = NOTES.get(key) or comments.get(f.name, "")
            kind = hints[f.name]
            if str(kind).startswith("tuple["):  # a list setting: a TOML array or one string
                kind = "list or comma-separated str"
            items.append(Setting(key, str(kind), flat[key], doc))
        intro = inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].replace("\n", " ")
        out.append((section.name, intro, items))
    return out


def settings_reference() -> str:
    """Markdown: one table per section, every setting with its type, default and meaning."""
    parts = []
    for section, intro, items in settings():
        parts.append(f"### `[{section}]`\n\n{intro}\n")
        lines = ["| setting | type | default | what it does |", "|---|---|---|---|"]
        for s in items:
            doc = escape_pipes(s.doc)
            lines.append(f"| `{s.key}` | {s.type} | `{_toml(s.default)}` | {doc} |")
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)


def _option_help(formatter: argparse.HelpFormatter, action: argparse.Action) -> str:
    text = formatter._get_help_string(action) or ""  # noqa: SLF001 - the help --help prints
    if "%(" in text:
        text = text % {**vars(action), "prog": "", "default": action.default}
    return text


def _option_name(action: argparse.Action) -> str:
    """``--tls-ca FILE``, ``-v, --verbose``, ``--superlink [HOST:PORT]``, in code spans."""
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    if action.nargs == 0:
        return ", ".join(f"`{o}`" for o in action.option_strings)
    metavar = action.metavar
    if metavar is None and action.choices is not None:
        metavar = "{" + ",".join(map(str, action.choices)) + "}"
    metavar = metavar or action.dest.upper()
    if isinstance(metavar, tuple):
        metavar = " ".join(metavar)
    if action.nargs == "?":
        metavar = f"[{metavar}]"
    return ", ".join(f"`{o} {metavar}`" for o in action.option_strings)


def _commands(
    parser: argparse.ArgumentParser, prefix: str
) -> list[tuple[str, argparse.ArgumentParser]]:
    """``[(command path, its parser)]`` depth first, leaves only."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]  # noqa: SLF001
    if not subs:
        return [(prefix, parser)]
    out = []
    for name, child in subs[0].choices.items():
        out += _commands(child, f"{prefix} {name}")
    return out


def cli_reference() -> str:
    """Markdown: every command, its usage and a table of its options with their defaults."""
    from fedpipe.cli.parser import build_parser  # imports no torch

    parts = []
    for path, parser in _commands(build_parser(), "fedpipe"):
        formatter = parser._get_formatter()  # noqa: SLF001
        usage = parser.format_usage().strip()
        parts.append(f"### `{path}`\n\n{parser.description or ''}\n\n```text\n{usage}\n```\n")
        rows = ["| option | what it does |", "|---|---|"]
        for action in parser._actions:  # noqa: SLF001
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):  # noqa: SLF001
                continue
            doc = escape_pipes(_option_help(formatter, action))
            rows.append(f"| {_option_name(action)} | {doc} |")
        parts.append("\n".join(rows) + "\n")
    return "\n".join(parts)


def _mbps(value: float) -> str:
    return "unlimited" if value == float("inf") else f"{value:g}"


def _link_cells(link: Any) -> list[str]:
    return [
        _mbps(link.up_mbps),
        _mbps(link.down_mbps),
        f"{link.rtt_s * 1e3:g} ms",
        f"{link.jitter_s * 1e3:g} ms" if link.jitter_s else "–",
    ]


def profiles_reference() -> str:
    """Markdown: the built-in device profiles, then the other named links."""
    from fedpipe.config import profiles  # the docs build imports fedpipe only here

    rows = ["| device profile | up Mbit/s | down Mbit/s | RTT | jitter | compute slowdown |"]
    rows.append("|---|---|---|---|---|---|")
    for name in profiles.device_profile_names():
        device = profiles.get_device_profile(name)
        cells = _link_cells(device.link) + [f"{device.compute_slowdown:g}x"]
        rows.append(f"| `{name}` | " + " | ".join(cells) + " |")
    links = ["| link | up Mbit/s | down Mbit/s | RTT | jitter |", "|---|---|---|---|---|"]
    for name in profiles.link_names():
        if name not in profiles.device_profile_names():
            links.append(f"| `{name}` | " + " | ".join(_link_cells(profiles.get_link(name))) + " |")
    return "\n".join(rows) + "\n\n" + "\n".join(links) + "\n"


_ROLE = re.compile(r":\w+:`~?([^`]+)`")  # :mod:`~fedpipe.x.y` -> `fedpipe.x.y`


def _first_paragraph(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    text = _ROLE.sub(r"`\1`", doc.split("\n\n")[0].replace("\n", " ")).replace("``", "`")
    return escape_pipes(text)


def _summary(module: str) -> str:
    """What a package holds: its docstring's first paragraph, else its modules' first lines."""
    path = REPO_ROOT.joinpath(*module.split("."))
    if (path / "__init__.py").is_file():
        return _first_paragraph(path / "__init__.py")
    if path.is_dir():  # a namespace package: list its modules
        parts = [f"`{m.stem}`: {_first_paragraph(m)}" for m in sorted(path.glob("[!_]*.py"))]
        return "<br>".join(parts)
    return _first_paragraph(path.with_suffix(".py")) if path.with_suffix(".py").is_file() else ""


def layers_reference(pyproject: Path = REPO_ROOT / "pyproject.toml") -> str:
    """Markdown: the enforced layers, top to bottom, then every other import contract."""
    linter = tomllib.loads(pyproject.read_text())["tool"]["importlinter"]
    contracts = linter["contracts"]
    layered = next(c for c in contracts if c["type"] == "layers")
    rows = ["| layer | package | what it holds |", "|---|---|---|"]
    for number, layer in enumerate(layered["layers"], start=1):
        for package in (p.strip() for p in layer.split("|")):
            rows.append(f"| {number} | `{package}` | {_summary(package)} |")
    others = ["| contract | kind |", "|---|---|"]
    others += [f"| {c['name']} | `{c['type']}` |" for c in contracts if c is not layered]
    return "\n".join(rows) + "\n\n" + "\n".join(others) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("what", choices=["settings", "cli", "profiles", "layers"])
    args = parser.parse_args(argv)
    make = {
        "settings": settings_reference,
        "cli": cli_reference,
        "profiles": profiles_reference,
        "layers": layers_reference,
    }
    print(make[args.what]())
    return 0


if __name__ == "__main__":
    sys.exit(main())
