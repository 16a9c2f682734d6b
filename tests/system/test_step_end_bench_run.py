"""``fedpipe bench pipeline`` reports each link's step end from a real run's per-step trace."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_bench_pipeline_reports_the_step_end_share_of_every_schedule() -> None:
    args = [
        *("bench", "pipeline", "--model", "tiny-llama", "--json"),
        *("--links", "100mbit-5ms", "--schedules", "sequential,greedy"),
        *("--steps", "2", "--warmup", "1", "--batch-size", "4", "--seq-len", "16"),
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
    (entry,) = json.loads(done.stdout)["links"]
    end = entry["step_end_s"]
    assert end["device_s"] > 0 and end["server_s"] > 0  # both optimizers ran and were traced
    assert entry["step_end_share"] == pytest.approx(
        (end["device_s"] + end["server_s"]) / entry["t_pipe_s"], rel=0.05
    )
    assert 0 < entry["step_end_share"] < 1
    by_schedule = entry["step_end_by_schedule"]
    assert set(by_schedule) == {"sequential", "greedy", "sequential-whole"}
    assert by_schedule[entry["best_schedule"]] == entry["step_end_share"]
