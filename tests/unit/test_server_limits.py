"""The StageServer's limits: validated settings that reach the runtime unchanged."""

from __future__ import annotations

import dataclasses

import pytest

from fedpipe.config import ServerConfig, load_config
from fedpipe.server.build import runtime_limits
from fedpipe.server.sessions import RuntimeLimits


def test_defaults_reach_the_runtime() -> None:
    limits = runtime_limits(ServerConfig())
    assert limits == RuntimeLimits()
    assert limits.max_learning_rate == 1e-2 and limits.session_idle_s == 120.0
    assert limits.max_pending_bytes == 256 * 2**20


def test_settings_are_set_by_name() -> None:
    config = load_config(None, {"server.max_pending": "8", "server.stream_idle_s": "5"})
    limits = runtime_limits(config.server)
    assert (limits.max_pending, limits.stream_idle_s) == (8, 5.0)
    names = {f.name for f in dataclasses.fields(ServerConfig)}
    limit_names = {f.name for f in dataclasses.fields(RuntimeLimits)} - {
        "max_pending_bytes",
        "memory_budget_bytes",
        "default_learning_rate",
    }
    assert limit_names <= names  # every runtime bound is a server.* setting


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("max_pending", 0, "server.max_pending must be >= 1"),
        ("max_streams", 0, "server.max_streams must be >= 1"),
        ("max_learning_rate", 0.0, "server.max_learning_rate must be > 0"),
        ("session_idle_s", -1.0, "server.session_idle_s must be > 0"),
        ("max_seq_len", -1, "server.max_seq_len must be >= 0"),
        ("max_weight_decay", -0.1, "server.max_weight_decay must be >= 0"),
    ],
)
def test_bad_limits_are_refused(key: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerConfig(**{key: value})  # type: ignore[arg-type]
