"""benchmarks/transport_bench.py: its stage-link figure comes through a real StageServer session.

Not a timing test: it checks that every timed message crossed a session the StageServer opened
(its streams answered them) and that the device's sessions counted the bytes of every message
both ways.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from fedpipe.models import load_config, resolve_model


def _bench() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "transport_bench.py"
    spec = importlib.util.spec_from_file_location("transport_bench", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_stage_figure_crosses_stage_server_sessions() -> None:
    bench = _bench()
    messages, trials = 3, 2
    result = bench.run(messages=messages, trials=trials, model="tiny-llama")
    hidden = int(load_config(resolve_model("tiny-llama")).hidden_size)
    assert result["shape"] == [bench.MICROBATCH, bench.SEQ_LEN, hidden]
    payload = bench.MICROBATCH * bench.SEQ_LEN * hidden * 4  # fp32
    # the server held one session per timed trial, and its streams answered every message
    assert result["server_sessions"] == trials
    assert result["server_echoes"] == trials * messages
    # the device's sessions counted each message's frame: the payload plus a small header
    for key in ("session_bytes_up", "session_bytes_down"):
        per_message = result[key] / (trials * messages)
        assert payload < per_message < payload + 256, (key, per_message)
    assert result["stage_mb_per_s"] > 0 and result["plain_grpc_mb_per_s"] > 0
    expected = result["stage_mb_per_s"] / result["plain_grpc_mb_per_s"]
    assert result["ratio"] == pytest.approx(expected, rel=1e-2)
