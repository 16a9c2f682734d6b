"""The per-device planner on synthetic figures whose best plan is known (no torch, no clock)."""

from __future__ import annotations

import math
import re
from itertools import product

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedpipe.edge.planner.bound import in_flight_cap, pipeline_bound, predict_step, sequential_model
from fedpipe.edge.planner.plan import (
    LinkFigures,
    Measured,
    OpTimes,
    Options,
    components,
    divisors,
    link_drift,
    plan_step,
)

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}
SEQ_HIDDEN = 128 * 256  # tokens x hidden of one sequence
DEFAULT_LINK = LinkFigures(0.01, 100.0, 100.0)


def figures(
    *,
    batch: int = 8,
    per_row: float = 0.01,
    fixed: float = 0.0,
    server_per_row: float = 0.005,
    link: LinkFigures = DEFAULT_LINK,
    budget: int = 0,
    codec_per_row: float = 0.0,
    server_fixed: float | None = None,
) -> Measured:
    """Compute linear in rows (plus ``fixed`` per microbatch), messages of 128 x 256 per row."""
    sizes = divisors(batch)
    device = {
        b: OpTimes(fixed + per_row * b, fixed + 2 * per_row * b, fixed + per_row * b) for b in sizes
    }
    s0 = fixed if server_fixed is None else server_fixed
    server = {b: (s0 + server_per_row * b, s0 + 2 * server_per_row * b) for b in sizes}
    nbytes = {(c, b): BYTES[c] * b * SEQ_HIDDEN + 100 for c in BYTES for b in sizes}
    cost = {(c, b): (codec_per_row * b if c != "fp32" else 0.0) for c in BYTES for b in sizes}
    return Measured(
        batch_size=batch,
        device=device,
        server=server,
        link=link,
        message_bytes=nbytes,
        codec_s=cost,
        stash_bytes={b: 1000 * b for b in sizes},
        memory_budget_bytes=budget,
        c_opt=0.002,
        s_opt=0.002,
    )


ALL = Options(microbatches=divisors(8))


def test_divisors() -> None:
    assert divisors(8) == (1, 2, 4, 8)
    assert divisors(6) == (1, 2, 3, 6)


def test_lossless_unless_lossy_codecs_are_allowed() -> None:
    slow = figures(link=LinkFigures(0.05, 10.0, 25.0))
    assert plan_step({"u:1+1": slow}, ALL).codec == "fp32"
    lossy = Options(microbatches=divisors(8), codecs=("fp32", "bf16", "int8"))
    plan = plan_step({"u:1+1": slow}, lossy)
    assert plan.codec == "int8", "on a 10 Mbit/s uplink the smallest activations win"
    assert plan.gradient_codec == "bf16", "gradients keep 16 bits"
    assert plan.predicted_s < plan_step({"u:1+1": slow}, ALL).predicted_s


def test_long_rtt_pipelines_many_microbatches() -> None:
    far = figures(link=LinkFigures(0.2, 1000.0, 1000.0))
    plan = plan_step({"u:1+1": far}, ALL)
    assert plan.schedule != "sequential" and plan.microbatches == 8
    seq = plan_step({"u:1+1": far}, Options(microbatches=divisors(8), schedules=("sequential",)))
    assert seq.microbatches == 1, "stop-and-wait pays the RTT per microbatch: one is best"
    assert plan.predicted_s < seq.predicted_s


def test_a_free_link_and_a_cost_per_microbatch_take_one_microbatch() -> None:
    # Nothing to overlap (a free link, an idle server): each microbatch only adds its overhead.
    local = figures(
        fixed=0.01, server_per_row=1e-6, server_fixed=0.0, link=LinkFigures(0.0, math.inf, math.inf)
    )
    assert plan_step({"u:1+1": local}, ALL).microbatches == 1
    # The same device beside a busy server: two microbatches overlap the two.
    busy = figures(fixed=0.01, server_fixed=0.0, link=LinkFigures(0.0, math.inf, math.inf))
    assert plan_step({"u:1+1": busy}, ALL).microbatches == 2


def test_the_prediction_is_the_shared_model() -> None:
    fig = figures(link=LinkFigures(0.1, 100.0, 100.0))
    plan = plan_step({"u:1+1": fig}, ALL)
    rows = fig.batch_size // plan.microbatches
    comp = components(fig, rows, plan.codec, plan.gradient_codec)
    expected = predict_step(comp, plan.microbatches, schedule=plan.schedule)
    assert (plan.predicted_s, plan.binding) == expected


def test_memory_budget_caps_live_microbatches() -> None:
    far = LinkFigures(0.2, 1000.0, 1000.0)
    # One live microbatch of 1 row stashes 1000 bytes: 2500 bytes hold two of them.
    plan = plan_step({"u:1+1": figures(link=far, budget=2500)}, ALL)
    rows = 8 // plan.microbatches
    live = in_flight_cap(plan.schedule, plan.microbatches, plan.max_in_flight or None)
    assert live * 1000 * rows <= 2500
    free = plan_step({"u:1+1": figures(link=far)}, ALL)
    assert plan.predicted_s > free.predicted_s, "the cap costs time at 200 ms RTT"


def test_nothing_fits_says_what_to_change() -> None:
    with pytest.raises(ValueError, match="memory_cap_mb"):
        plan_step({"u:1+1": figures(budget=10)}, ALL)


def test_the_cut_with_the_shorter_step_wins() -> None:
    slow_device = figures(per_row=0.05)
    fast_device = figures(per_row=0.01)
    plan = plan_step({"u:2+2": slow_device, "u:1+1": fast_device}, ALL)
    assert plan.cut == "u:1+1"


def test_link_drift() -> None:
    base, mb = LinkFigures(0.05, 10.0, 25.0), 1_000_000  # 0.8 s up, 0.32 s down
    assert link_drift(base, LinkFigures(0.06, 10.0, 25.0), 0.25, mb) is None
    why = link_drift(base, LinkFigures(0.05, 5.0, 25.0), 0.25, mb)
    assert why is not None and "uplink 800.0 -> 1600.0 ms (+100%)" in why
    assert "RTT" not in why and "downlink" not in why
    why = link_drift(base, LinkFigures(0.2, 10.0, 25.0), 0.25, mb)
    assert why is not None and why.startswith("RTT 50.0 -> 200.0 ms (+300%)")
    # A rate seen on tiny messages swings widely, but moves no time that matters.
    assert link_drift(base, LinkFigures(0.05, 1000.0, 2.5), 0.25, 1000) is None


def test_predict_step_is_the_bound_and_the_sequential_model() -> None:
    comp = components(figures(), 2, "fp32", "fp32")
    assert predict_step(comp, 4, schedule="sequential")[0] == sequential_model(comp, 4)
    assert predict_step(comp, 4, schedule="greedy") == pipeline_bound(comp, 4)
    capped, term = predict_step(comp, 4, schedule="greedy", max_in_flight=1)
    assert term == "in-flight" and capped > pipeline_bound(comp, 4)[0]


@settings(max_examples=40, deadline=None)
@given(
    per_row=st.floats(0.001, 0.05),
    server_per_row=st.floats(0.001, 0.05),
    rtt=st.floats(0.0, 0.3),
    up=st.floats(1.0, 1000.0),
    down=st.floats(1.0, 1000.0),
    fixed=st.floats(0.0, 0.02),
)
def test_the_plan_is_the_brute_force_minimum(
    per_row: float, server_per_row: float, rtt: float, up: float, down: float, fixed: float
) -> None:
    fig = figures(
        per_row=per_row,
        server_per_row=server_per_row,
        fixed=fixed,
        link=LinkFigures(rtt, up, down),
        codec_per_row=0.001,
    )
    options = Options(microbatches=divisors(8), codecs=("fp32", "bf16", "int8"))
    plan = plan_step({"u:1+1": fig}, options)
    best = min(
        predict_step(components(fig, 8 // m, a, g), m, schedule=s)[0]
        for m, s, a, g in product(divisors(8), options.schedules, options.codecs, ("fp32", "bf16"))
    )
    assert plan.predicted_s == pytest.approx(best)


def test_plan_settings_validate_and_keep_fp32() -> None:
    from fedpipe.config import FedpipeConfig

    base = FedpipeConfig()
    assert base.pipeline.plan == "fixed" and base.pipeline.codec_choices == ("fp32",)
    lossy = base.with_overrides({"pipeline.plan": "auto", "pipeline.plan_codecs": "int8,bf16"})
    assert lossy.pipeline.codec_choices == ("fp32", "int8", "bf16")
    for key, value, message in (
        ("pipeline.plan", "best", "pipeline.plan must be fixed or auto"),
        ("pipeline.plan_codecs", "fp32,fp8", "pipeline.plan_codecs 'fp32,fp8': unknown ['fp8']"),
        ("pipeline.replan_drift", 0, "pipeline.replan_drift must be > 0"),
        ("pipeline.memory_cap_mb", -1, "pipeline.memory_cap_mb must be >= 0"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            base.with_overrides({key: value})
