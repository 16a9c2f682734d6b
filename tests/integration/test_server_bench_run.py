"""``fedpipe bench server --json --quick``: a real StageServer process per column, real gRPC
load devices, and the JSON contract other tools read (DESIGN.md)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

COLUMN_KEYS = {"mb_per_s", "tokens_per_s", "step_p50_s", "step_p95_s", "busy", "mean_batch"}


@pytest.mark.slow
def test_quick_run_prints_the_contract_for_every_n() -> None:
    cmd = [sys.executable, "-m", "fedpipe.cli", "bench", "server", "--json", "--quick"]
    done = subprocess.run(
        [*cmd, "--devices", "1,3"], capture_output=True, text=True, timeout=900, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)  # stdout is one JSON object; progress went to stderr
    assert "N=  3" in done.stderr
    assert [row["devices"] for row in report["rows"]] == [1, 3]
    for row in report["rows"]:
        for column in ("batched", "unbatched"):
            figures = row[column]
            assert COLUMN_KEYS <= figures.keys()
            for key in COLUMN_KEYS:
                assert math.isfinite(figures[key]) and figures[key] > 0, (column, key, figures)
            assert figures["busy"] <= 1.0 and figures["step_p95_s"] >= figures["step_p50_s"]
            assert figures["mean_batch"] >= 1.0
    assert math.isfinite(report["n_star"]) and report["n_star"] > 0
    pinning = report["pinning"]
    assert {"server_cpus", "server_threads", "loadgen_cpus", "machine_cpus"} <= pinning.keys()
    assert isinstance(report["batching_available"], bool) and isinstance(report["noisy"], bool)
    assert all(row["batched_over_unbatched"] > 0 for row in report["rows"])
    assert report["loadgen_cpu_max"] >= 0 and len(report["load_average"]["start"]) == 3
