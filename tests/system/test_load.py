"""32 emulated devices x 20 steps against one StageServer process on loopback.

Each device's replies (outputs, input gradients, and a final evaluation forward that depends on
its whole server-side adapter) hash equal to its solo run's: no microbatch lost, crossed or
reordered under load. The server's resident memory stays flat from step 5 on.
"""

from __future__ import annotations

from fedpipe_bench.load import run_load


def test_32_devices_20_steps_exact_and_flat_memory() -> None:
    report = run_load(devices=32, steps=20)
    assert report.mismatched == [] and report.exact
    # Flat: a few MB of allocator noise at most, never a per-step leak (20 steps x 32 devices).
    assert report.rss_growth_mb <= max(8.0, 0.10 * report.rss_mb_at_step5), report
    assert report.step_p50_s > 0 and report.step_p95_s >= report.step_p50_s
