"""Chrome traces: readable event names, numeric pids with process-name metadata, and args."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedpipe.trace import Tracer, readable_name


def test_readable_names() -> None:
    assert readable_name("F3") == ("forward mb 3", 3)
    assert readable_name("Sf0") == ("server forward mb 0", 0)
    assert readable_name("Sb12") == ("server backward mb 12", 12)
    assert readable_name("a1") == ("activation mb 1", 1)
    assert readable_name("i2") == ("input grad mb 2", 2)
    assert readable_name("O") == ("optimizer step", None)
    assert readable_name("gc") == ("gc", None)


def test_written_trace_has_process_metadata_numeric_pid_and_args(tmp_path: Path) -> None:
    tracer = Tracer()
    tracer.add("F0", "device", 1.0, 1.5)
    tracer.add("a0", "uplink", 1.5, 1.7, {"bytes": 4096})
    tracer.add("Sf0", "server", 1.7, 2.0)
    path = tracer.write(tmp_path / "t.json", pid="device 3")
    events = json.loads(path.read_text())["traceEvents"]
    meta = [e for e in events if e["ph"] == "M"]
    assert meta[0] == {
        "name": "process_name",
        "ph": "M",
        "pid": 4,
        "tid": 0,
        "args": {"name": "device 3"},
    }
    assert [e["args"]["name"] for e in meta[1:]] == ["device", "uplink", "server"]
    spans = {e["name"]: e for e in events if e["ph"] == "X"}
    assert set(spans) == {"forward mb 0", "activation mb 0", "server forward mb 0"}
    assert all(isinstance(e["pid"], int) and e["pid"] == 4 for e in events)
    assert spans["activation mb 0"]["args"] == {"code": "a0", "microbatch": 0, "bytes": 4096}
    assert spans["forward mb 0"]["args"] == {"code": "F0", "microbatch": 0}
    assert spans["server forward mb 0"]["ts"] == pytest.approx(0.7e6)
    assert spans["forward mb 0"]["ts"] == 0
    numeric = tracer.to_chrome(pid=7, process_name="server")
    assert numeric["traceEvents"][0]["args"] == {"name": "server"}
    assert {e["pid"] for e in numeric["traceEvents"]} == {7}
