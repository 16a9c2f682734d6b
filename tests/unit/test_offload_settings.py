"""server.offload and server.input_grad_first: off by default, checked, and handed to the
executor that ``fedpipe server`` builds."""

from __future__ import annotations

import pytest

from fedpipe.config import ServerConfig, load_config
from fedpipe.models import resolve_model
from fedpipe.server.build import build_runtime


def test_both_are_off_by_default() -> None:
    server = ServerConfig()
    assert server.offload == "off" and server.input_grad_first is False


def test_an_unknown_offload_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="server.offload must be off or auto, got 'on'"):
        ServerConfig(offload="on")


@pytest.mark.parametrize(("offload", "first"), [("off", False), ("auto", True)])
def test_the_settings_reach_the_executor(offload: str, first: bool) -> None:
    config = load_config(
        None, {"server.offload": offload, "server.input_grad_first": first, "server.device": "cpu"}
    )
    runtime, _ = build_runtime(config, folder=resolve_model("tiny-llama"))
    try:
        assert runtime.executor.stash.offload is (offload == "auto")
        assert runtime.executor.input_grad_first is first
    finally:
        runtime.stop()


def test_the_two_part_split_offloads_nothing() -> None:
    """In split mode "two" the server's loss stage runs each backward at once: nothing waits."""
    config = load_config(
        None, {"server.offload": "auto", "model.split": "two", "model.tail_layers": 0}
    )
    runtime, _ = build_runtime(config, folder=resolve_model("tiny-llama"))
    try:
        assert runtime.executor.stash.offload is False
    finally:
        runtime.stop()
