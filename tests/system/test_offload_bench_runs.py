"""The offload and input-gradient-first bench flags, each in one smoke run (real processes).

``fedpipe bench server --offload`` measures a third column with ``server.offload = "auto"``
and every column's stash; ``fedpipe bench pipeline --input-grad-first`` runs 1F1B against a
second server with ``server.input_grad_first = true``. Not timing tests: the fields exist,
are consistent, and show where the bytes waited.
"""

from __future__ import annotations

import json
import subprocess
import sys


def _bench(*args: str) -> tuple[dict, str]:
    done = subprocess.run(
        [sys.executable, "-m", "fedpipe.cli", "bench", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout), done.stderr


def test_bench_server_offload_column_keeps_the_stash_in_host_memory() -> None:
    report, _ = _bench("server", "--quick", "--devices", "2", "--offload")
    assert report["offload"] is True
    (row,) = report["rows"]
    assert set(row["order"]) == {"unbatched", "batched", "offload"}
    for column in ("unbatched", "batched"):
        figures = row[column]
        assert figures["peak_waiting_bytes"] > 0 and figures["peak_offloaded_bytes"] == 0
        assert figures["peak_stash_bytes_per_session"] == round(figures["peak_stash_bytes"] / 2)
    offload, batched = row["offload"], row["batched"]
    assert offload["peak_offloaded_bytes"] > 0
    # only the received inputs waited on the device: far less than the tapes beside them
    assert offload["peak_waiting_bytes"] < batched["peak_waiting_bytes"] / 2
    ratios = row["offload_over_batched"]
    assert ratios["peak_waiting_bytes"] == round(
        offload["peak_waiting_bytes"] / batched["peak_waiting_bytes"], 3
    )
    assert ratios["mb_per_s"] > 0


def test_bench_pipeline_input_grad_first_runs_both_servers_side_by_side() -> None:
    report, stderr = _bench(
        "pipeline",
        *("--model", "tiny-llama", "--links", "100mbit-5ms", "--schedules", "1f1b"),
        *("--steps", "2", "--warmup", "1", "--batch-size", "4", "--seq-len", "16"),
        *("--microbatches", "2", "--input-grad-first"),
    )
    assert report["input_grad_first"] is True
    assert "1f1b+input-grad-first" in stderr  # walked in the same round robin
    (entry,) = report["links"]
    assert set(entry["schedules"]) == {"1f1b"}  # the extra run is not a schedule of its own
    assert set(entry["input_grad_wait_s"]) == {"1f1b"}
    first = entry["input_grad_first"]
    assert first["schedule"] == "1f1b"
    assert first["wait_s"]["off"] == entry["input_grad_wait_s"]["1f1b"]
    assert first["step_s"]["off"] == entry["schedules"]["1f1b"]
    for side in ("off", "on"):
        # a round trip over the emulated link: at least its two one-way latencies (2.5 ms)
        assert first["wait_s"][side] >= 0.005 and first["step_s"][side] > 0
