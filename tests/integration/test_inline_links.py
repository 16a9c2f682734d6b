"""`fedpipe bench pipeline --links` takes inline link specs beside names (a real bench run)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_bench_pipeline_runs_an_inline_link_beside_a_named_one() -> None:
    args = [
        *("bench", "pipeline", "--model", "tiny-llama", "--json"),
        *("--set", "model.head_layers=1", "--set", "model.tail_layers=1"),
        *("--links", "up=1000,down=1000,rtt=2ms,100mbit-5ms", "--schedules", "sequential,gpipe"),
        *("--steps", "1", "--warmup", "0", "--batch-size", "4", "--seq-len", "16"),
        *("--microbatches", "2"),
    ]
    done = subprocess.run(
        [sys.executable, "-m", "fedpipe.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert [e["link"] for e in report["links"]] == ["up=1000,down=1000,rtt=2ms", "100mbit-5ms"]
    assert all(e["t_seq_s"] > 0 and e["t_pipe_s"] > 0 for e in report["links"])
