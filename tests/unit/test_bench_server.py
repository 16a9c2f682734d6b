"""``fedpipe bench server``: the N* model, the window and server accounting on synthetic traces,
the probe on a real StageRuntime, and the batching switch on this build."""

from __future__ import annotations

import importlib.util
import math
import os
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fedpipe_bench.load import LoadShape
from fedpipe_bench.server import (
    ServerBenchSettings,
    _runtime_settings,
    column_figures,
    cpu_share,
    knee,
    measurement_window,
    n_star_model,
    predicted_mb_per_s,
)
from fedpipe_bench.server_probe import ComputeProbe, window_stats

from fedpipe.messages import Kind, StageMsg
from fedpipe.wire.backend import SessionRequest

CONTRACT = {"mb_per_s", "tokens_per_s", "step_p50_s", "step_p95_s", "busy", "mean_batch"}


def test_n_star_is_the_device_cycle_over_the_server_demand() -> None:
    # A device alone steps every 0.9 s, of which the server computes 0.15 s: 6 devices fill it.
    assert n_star_model(0.9, 0.15) == pytest.approx(6.0)
    # Below N* throughput grows with N; above it the server caps it at 1/s steps per second.
    m = 2
    assert predicted_mb_per_s(3, 0.9, 0.15, m) == pytest.approx(m * 3 / 0.9)
    assert predicted_mb_per_s(6, 0.9, 0.15, m) == pytest.approx(m / 0.15)
    assert predicted_mb_per_s(32, 0.9, 0.15, m) == pytest.approx(m / 0.15)
    with pytest.raises(ValueError, match="positive times"):
        n_star_model(0.9, 0.0)


def test_knee_is_the_first_n_within_ten_percent_of_the_best() -> None:
    assert knee([1, 2, 4, 8, 16], [1.0, 2.0, 3.7, 4.0, 3.9]) == 4
    assert knee([1, 2, 4], [3.0, 2.0, 1.0]) == 1


def test_window_stats_clip_busy_time_and_count_messages_per_call() -> None:
    calls = [
        (0.0, 1.0, 1, 32),  # half inside the window
        (1.0, 3.0, 2, 64),  # a batched call of two messages
        (2.5, 4.0, 0, 0),  # an optimizer step: busy, no batch
        (5.0, 6.0, 4, 128),  # half inside, began inside: counts as a batch of 4
        (7.0, 8.0, 8, 256),  # outside
    ]
    stats = window_stats(calls, 0.5, 5.5)
    assert stats["busy_s"] == pytest.approx(0.5 + 2.0 + 1.5 + 0.5)
    assert stats["busy"] == pytest.approx(4.5 / 5.0)
    assert stats["mean_batch"] == pytest.approx((2 + 4) / 2)  # the first call began before
    assert (stats["calls"], stats["messages"]) == (2, 6)
    assert window_stats([], 0.0, 1.0)["mean_batch"] == 1.0  # nothing computed, nothing batched
    with pytest.raises(ValueError, match="end after it starts"):
        window_stats(calls, 2.0, 2.0)


def test_window_is_where_every_device_is_past_warmup_and_none_is_done() -> None:
    a = [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0), (3.0, 4.0)]
    b = [(0.2, 1.5), (1.5, 2.5), (2.5, 3.5), (3.5, 4.5)]
    start, end, steps = measurement_window([a, b], warmup=1)
    assert (start, end) == (1.5, 4.0)
    assert steps == 5  # a's steps ending at 2, 3, 4 and b's at 2.5, 3.5; not b's at 4.5
    # One measured step each that do not overlap: the whole measured span instead.
    start, end, steps = measurement_window([[(0.0, 1.0)], [(2.0, 3.0)]], warmup=0)
    assert (start, end, steps) == (0.0, 3.0, 2)


def test_column_figures_hold_the_contract_from_spans_and_calls() -> None:
    settings = ServerBenchSettings(warmup=1, shape=LoadShape(2, 2, 128, 256), link="loopback")
    spans = [[(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)], [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)]]
    calls = [(1.0 + 0.1 * i, 1.05 + 0.1 * i, 1, 256) for i in range(20)]  # 1 s busy, batch 1
    figures = column_figures(spans, calls, settings, server_cpu=0.5, loadgen_cpu=0.05)
    assert CONTRACT <= figures.keys()
    assert figures["mb_per_s"] == pytest.approx(4 * 2 / 2.0)  # 4 steps of 2 mb in [1, 3]
    assert figures["tokens_per_s"] == pytest.approx(4.0 * 256)
    assert figures["busy"] == pytest.approx(0.5) and figures["mean_batch"] == 1.0
    assert figures["server_s_per_step"] == pytest.approx(1.0 / 4)
    assert figures["step_p50_s"] == figures["step_p95_s"] == 1.0


def test_batching_switch_degrades_to_unbatched_where_the_runtime_lacks_it() -> None:
    settings, available = _runtime_settings(True)
    if importlib.util.find_spec("fedpipe.server.batch_policy") is None:
        assert (settings, available) == ({}, False)
    else:  # after the batched runtime is merged: one setting turns it on and off
        assert available and settings == {"server.batching": True}
        assert _runtime_settings(False)[0] == {"server.batching": False}


def _runtime() -> Any:
    from fedpipe.config import load_config
    from fedpipe.server.build import build_runtime

    runtime, _ = build_runtime(load_config(None, {"model.name": "tiny-llama"}))
    return runtime


def _drive(handle: Any, msg: StageMsg) -> StageMsg:
    handle.submit(msg)
    reply = handle.next_reply(timeout=60)
    assert isinstance(reply, StageMsg), reply
    return reply


def test_probe_times_every_compute_call_of_a_real_runtime() -> None:
    runtime = _runtime()
    probe = ComputeProbe(runtime).install()
    try:
        session = runtime.open(
            SessionRequest(device_id="d0", round=0, microbatch_size=2, seq_len=8)
        )
        handle = runtime.attach(session)
        x = torch.randn(2, 8, runtime.hidden_size)
        for mb in range(2):
            _drive(handle, StageMsg(Kind.ACTIVATION, 0, mb, tensor=x))
        for mb in range(2):
            _drive(handle, StageMsg(Kind.OUTPUT_GRAD, 0, mb, tensor=x * 1e-3))
        _drive(handle, StageMsg(Kind.STEP_END, 0))
        snap = probe.snapshot()
    finally:
        runtime.stop()
    calls = snap["calls"]
    assert [c[2] for c in calls] == [1, 1, 1, 1, 0]  # one message a call; the step: none
    assert [c[3] for c in calls] == [16, 16, 16, 16, 0]  # rows x tokens
    assert all(end >= start for start, end, *_ in calls)
    stats = window_stats(calls, calls[0][0], calls[-1][1])
    assert stats["mean_batch"] == 1.0 and 0 < stats["busy"] <= 1.0
    assert probe.snapshot()["calls"] == []  # a snapshot takes the records


class _BatchedExecutor:
    """The shape a batched executor's call may take: several sessions' messages in one list."""

    def compute_batch(self, work: list[tuple[object, StageMsg]]) -> list[StageMsg]:
        return [msg for _, msg in work]


def test_probe_counts_the_messages_of_one_batched_call() -> None:
    runtime = SimpleNamespace(executor=_BatchedExecutor())
    probe = ComputeProbe(runtime).install()
    x = torch.zeros(2, 4, 8)
    work = [(None, StageMsg(Kind.ACTIVATION, 0, mb, tensor=x)) for mb in range(3)]
    runtime.executor.compute_batch(work)
    runtime.executor.compute_batch([(None, StageMsg(Kind.OUTPUT_GRAD, 0, 0, tensor=x))])
    calls = probe.snapshot()["calls"]
    assert [(c[2], c[3]) for c in calls] == [(3, 24), (1, 8)]
    assert window_stats(calls, calls[0][0], calls[-1][1] + 1e-9)["mean_batch"] == 2.0
    assert math.isfinite(calls[0][1] - calls[0][0])


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--devices", "1,x"], "--devices: expected comma-separated whole numbers, got '1,x'"),
        (["--devices", "0"], "--devices must be numbers >= 1, got [0]"),
        (["--link", "bogus"], "unknown link 'bogus'"),
    ],
)
def test_bad_flags_fail_before_any_server_starts(
    flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from fedpipe.cli.main import EXIT_SETTINGS, main

    assert main(["bench", "server", "--quick", *flags]) == EXIT_SETTINGS
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedpipe: error: ") and says in err[0], err


def test_a_server_starved_of_its_core_is_noticed() -> None:
    def column(busy: float, cpu: float) -> dict[str, float]:
        return {"busy": busy, "server_cpu": cpu}

    quiet = [{"batched": column(0.9, 1.0), "unbatched": column(0.5, 0.55)}]
    assert cpu_share(quiet) == pytest.approx(1.1)
    loaded = [*quiet, {"batched": column(0.98, 0.3), "unbatched": column(0.98, 0.9)}]
    assert cpu_share(loaded) == pytest.approx(0.3 / 0.98)


def test_a_server_with_a_thread_per_core_gets_every_core_and_pins_nothing() -> None:
    """--server-threads N on an N-core machine: the server runs on all N cores (it once got
    cores[1:1+N], i.e. one core for two threads) and the load generator is left unpinned."""
    from fedpipe_bench.server import _pin

    before = os.sched_getaffinity(0)
    cpus = sorted(before)
    try:
        server_cpus, pinning = _pin(max(len(cpus), 1))
        assert server_cpus == cpus
        assert pinning["loadgen_cpus"] == cpus
        assert os.sched_getaffinity(0) == before
    finally:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(max(len(cpus), 1))
