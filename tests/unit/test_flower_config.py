"""What fedpipe writes for Flower's engines, checked by Flower's own parsers (in-process).

The run/node config fedpipe renders for ``--run-config``/``--node-config``, and the app
project it writes for the toy app (harness.flower_toy), which `flwr run` validates.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from flwr.cli.config_utils import load_and_validate
from flwr.common.config import parse_config_args

from fedpipe.launch.engines import format_config_args, write_flower_app


@pytest.mark.parametrize(
    "value",
    [0, -3, 2.5, 1e-5, 1e20, True, False, "jetson nano", r"C:\dev\pi", "it's", 'say "hi"', ""],
)
def test_config_args_round_trip_through_flowers_parser(value: object) -> None:
    """What we render for --run-config/--node-config is what Flower parses back."""
    text = format_config_args({"key": value, "partition-id": 1, "nested": {"a-b": "x y"}})
    assert parse_config_args([text]) == {"key": value, "partition-id": 1, "nested.a-b": "x y"}


def test_config_args_refuse_what_flower_cannot_carry() -> None:
    with pytest.raises(ValueError, match="quote"):
        format_config_args({"k": 'it\'s "both"'})
    with pytest.raises(ValueError, match="key"):
        format_config_args({"bad key": 1})


def test_written_app_passes_flowers_validation(tmp_path: Path) -> None:
    """`flwr run` validates the project with the component modules importable (the harness
    is on sys.path)."""
    app = write_flower_app(
        tmp_path / "app",
        server_app="harness.flower_toy.server:app",
        client_app="harness.flower_toy.client:app",
        config={"num-server-rounds": 1, "round-timeout": 120.0},
        name="fedpipe-toy",
    )
    config, _ = load_and_validate(app / "pyproject.toml")
    components = config["tool"]["flwr"]["app"]["components"]
    assert components["serverapp"] == "harness.flower_toy.server:app"
    assert config["tool"]["flwr"]["app"]["config"]["round-timeout"] == 120.0
    assert "dependencies" not in config["project"]
    assert [p.name for p in app.iterdir()] == ["pyproject.toml"]
