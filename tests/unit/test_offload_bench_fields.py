"""The bench fields of server.offload and server.input_grad_first, from known inputs.

The device's wait for each input gradient (``fedpipe bench pipeline``) is read off a real
Tracer's uplink and downlink events; the stash figures (``fedpipe bench server``) come from a
real StashMeter holding real tensors.
"""

from __future__ import annotations

import gc

import pytest
import torch
from fedpipe_bench.pipeline import compared_schedule, input_grad_first_entry, input_grad_waits
from fedpipe_bench.server import ServerBenchSettings, offload_ratios, stash_figures

from fedpipe.server.stash import DEVICE, FETCHED, HOST, StashMeter
from fedpipe.trace import Tracer


def test_input_grad_waits_pair_each_output_grad_with_its_input_grad() -> None:
    tracer = Tracer()
    tracer.add("a0", "uplink", 0.0, 0.1)
    tracer.add("g1", "uplink", 1.0, 1.2)  # microbatch 1's gradient goes up first
    tracer.add("g0", "uplink", 1.5, 1.6)
    tracer.add("o0", "downlink", 0.3, 0.4)
    tracer.add("i0", "downlink", 1.8, 2.0)  # 0.5 s after g0 was sent
    tracer.add("i1", "downlink", 2.1, 2.25)  # 1.25 s after g1 was sent
    tracer.add("g0", "uplink", 3.0, 3.1)  # the next step's microbatch 0
    tracer.add("i0", "downlink", 3.2, 3.4)
    tracer.add("Sb0", "server", 1.6, 1.7)  # not a transfer
    waits = sorted(round(w, 6) for w in input_grad_waits(tracer))
    assert waits == [0.4, 0.5, 1.25]


def test_input_grad_waits_skip_a_gradient_still_on_its_way() -> None:
    tracer = Tracer()
    tracer.add("g0", "uplink", 0.0, 0.1)
    assert input_grad_waits(tracer) == []


def test_the_compared_schedule_is_1f1b_where_measured() -> None:
    assert compared_schedule(["sequential", "gpipe", "1f1b", "greedy"]) == "1f1b"
    assert compared_schedule(["sequential", "greedy"]) == "greedy"
    assert compared_schedule(["sequential"]) == "sequential"


def test_input_grad_first_entry_holds_both_runs_and_their_ratios() -> None:
    entry = input_grad_first_entry("1f1b", (0.2, 1.0), (0.15, 0.9))
    assert entry == {
        "schedule": "1f1b",
        "wait_s": {"off": 0.2, "on": 0.15},
        "step_s": {"off": 1.0, "on": 0.9},
        "wait_on_over_off": 0.75,
        "step_on_over_off": 0.9,
    }


def test_the_meter_counts_each_storage_once_where_it_is_until_its_holder_goes() -> None:
    meter = StashMeter()
    meter.enabled = True

    class Holder:
        pass

    x = torch.zeros(256)  # 1024 bytes
    views = [x[:10], x[10:]]  # one storage
    waiting, fetched, host = Holder(), Holder(), Holder()
    meter.hold(waiting, DEVICE, views)
    meter.hold(host, HOST, [torch.zeros(64)])  # 256 bytes
    meter.hold(fetched, FETCHED, [torch.zeros(128)])  # 512 bytes
    snap = meter.snapshot()
    assert snap["stash_bytes"] == 1024 + 512 and snap["offloaded_bytes"] == 256
    assert snap["peak_stash_bytes"] == 1536 and snap["peak_waiting_bytes"] == 1024
    del fetched
    gc.collect()
    assert meter.snapshot(reset=True)["peak_stash_bytes"] == 1536  # the peak stays until reset
    assert meter.snapshot()["peak_stash_bytes"] == 1024
    del waiting, host
    gc.collect()
    assert meter.snapshot()["stash_bytes"] == meter.snapshot()["offloaded_bytes"] == 0


def test_stash_figures_per_session_and_the_offload_ratios() -> None:
    stash = {"peak_stash_bytes": 4000, "peak_waiting_bytes": 3000, "peak_offloaded_bytes": 0}
    figures = stash_figures(stash, 4)
    assert figures["peak_stash_bytes_per_session"] == 1000
    assert figures["peak_waiting_bytes_per_session"] == 750
    assert stash_figures(None, 4)["peak_stash_bytes"] is None
    batched = {"mb_per_s": 10.0, "step_p50_s": 1.0, **figures}
    offload = {
        "mb_per_s": 9.0,
        "step_p50_s": 1.1,
        "peak_stash_bytes": 1000,
        "peak_waiting_bytes": 300,
    }
    ratios = offload_ratios(batched, offload)
    assert ratios == {
        "peak_stash_bytes": 0.25,
        "peak_waiting_bytes": 0.1,
        "mb_per_s": 0.9,
        "step_p50_s": 1.1,
    }


def test_offload_adds_a_column() -> None:
    assert ServerBenchSettings().columns == ("unbatched", "batched")
    assert ServerBenchSettings(offload=True).columns == ("unbatched", "batched", "offload")


@pytest.mark.parametrize("where", [DEVICE, HOST, FETCHED])
def test_an_idle_meter_counts_nothing(where: str) -> None:
    meter = StashMeter()  # off until a bench turns it on
    holder = torch.zeros(4)
    meter.hold(holder, where, [torch.zeros(16)])
    assert meter.snapshot()["stash_bytes"] == meter.snapshot()["offloaded_bytes"] == 0
