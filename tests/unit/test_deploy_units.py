"""The systemd units in server/ and clients/ start what the deploy guide says, and stay true
to the command line: each unit's ExecStart, expanded from its example environment file as
systemd expands it, is a command line fedpipe's own parser accepts, every variable it names is
set in that file (and every one set there is used), and the settings file it names loads."""

from __future__ import annotations

import configparser
import re
import shlex
from pathlib import Path

import pytest

from fedpipe.cli.parser import build_parser
from fedpipe.config import load_config

ROOT = Path(__file__).resolve().parents[2]
INSTALLED = "/opt/fedpipe"  # where the units expect this repository, .venv and all

UNITS = {
    "server": (ROOT / "server" / "fedpipe-server.service", ROOT / "server" / "server.env"),
    "client": (ROOT / "clients" / "fedpipe-client.service", ROOT / "clients" / "client.env"),
}


def _environment(path: Path) -> dict[str, str]:
    """An EnvironmentFile's assignments (comments and blank lines skipped)."""
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep and re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), f"{path.name}: {line!r}"
            env[key] = value
    return env


def _exec_start(unit: Path) -> str:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    parser.read(unit)
    assert parser["Service"]["EnvironmentFile"].startswith("/etc/fedpipe/")
    return parser["Service"]["ExecStart"]


def _expand(command: str, env: dict[str, str]) -> tuple[list[str], set[str]]:
    """ExecStart as systemd runs it: ``${VAR}`` is one word, a word that is ``$VAR`` alone is
    split on whitespace (empty: no word). The variables named are returned beside it."""
    used: set[str] = set()

    def value(name: str) -> str:
        assert name in env, f"ExecStart names ${name}, which the environment file does not set"
        used.add(name)
        return env[name]

    argv: list[str] = []
    for word in shlex.split(command):
        if whole := re.fullmatch(r"\$([A-Z_][A-Z0-9_]*)", word):
            argv += value(whole.group(1)).split()
        else:
            argv.append(re.sub(r"\$\{([A-Z_][A-Z0-9_]*)\}", lambda m: value(m.group(1)), word))
    return argv, used


@pytest.mark.parametrize("side", sorted(UNITS))
def test_a_units_command_line_is_one_fedpipe_parses(side: str) -> None:
    unit, env_file = UNITS[side]
    env = _environment(env_file)
    argv, used = _expand(_exec_start(unit), env)
    assert argv[0] == f"{INSTALLED}/.venv/bin/fedpipe" and argv[1] == side
    assert used == set(env), f"{env_file.name} sets {sorted(set(env) - used)}, never used"
    args = build_parser().parse_args(argv[1:])
    assert args.command == side
    if side == "server":
        assert args.secret_file and args.superlink and args.stage_server
        config = Path(str(args.config).replace(INSTALLED, str(ROOT), 1))
        assert config.is_file(), f"{unit.name} names {args.config}, not in this repository"
        load_config(config)  # the settings it names are valid ones
    else:
        assert args.superlink and args.data and args.partition_id < args.num_partitions


def test_the_example_options_in_the_comments_parse_too() -> None:
    """The commented ``--tls-ca ...`` lines of each environment file are options that exist."""
    for side, (_, env_file) in UNITS.items():
        lines = [ln for ln in env_file.read_text().splitlines() if ln.startswith("#   --")]
        assert lines, f"{env_file.name} shows no example options"
        required = (
            ["--superlink", "h:1", "--stage-server", "h:2", "--secret-file", "s"]
            if side == "server"
            else ["--superlink", "h:1"]
        )
        for line in lines:
            build_parser().parse_args([side, *required, *line.lstrip("# ").split()])


def test_the_example_settings_of_both_sides_agree_on_the_model() -> None:
    """``fedpipe run --config clients/device.toml`` against ``server/stage_server.toml``: the
    model and its cut are the same on both sides, as the StageServer requires."""
    server = load_config(ROOT / "server" / "stage_server.toml").model
    device = load_config(ROOT / "clients" / "device.toml").model
    for field in ("name", "head_layers", "tail_layers", "split", "lora_r", "lora_alpha"):
        assert getattr(device, field) == getattr(server, field), field
