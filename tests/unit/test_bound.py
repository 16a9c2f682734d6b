"""The pipeline bound: known values from synthetic components, both split modes, and that no
schedule of a small discrete-event simulation ever beats it."""

from __future__ import annotations

import random

import pytest

from fedpipe.edge.planner.bound import (
    Components,
    bound_terms,
    link_occupancy,
    pipeline_bound,
    relative_spread,
    sequential_model,
)


def _c(**kw: float | str) -> Components:
    base: dict[str, float | str] = dict(
        c_f=0.01,
        c_t=0.02,
        c_b=0.01,
        s_f=0.01,
        s_b=0.02,
        tau_up=0.001,
        tau_down=0.001,
        lat_up=0.0025,
        lat_down=0.0025,
    )
    return Components(**{**base, **kw})  # type: ignore[arg-type]


def test_device_bound_dominates_on_a_fast_link() -> None:
    bound, term = pipeline_bound(_c(), 8)
    assert term == "device"
    assert bound == pytest.approx(8 * (0.01 + 0.02 + 0.01))  # fill and drain hidden by 7 others


def test_device_row_counts_fill_and_drain_it_cannot_hide() -> None:
    """50 ms each way: the first tail waits a round trip, the last head backward another."""
    c = _c(lat_up=0.05, lat_down=0.05, c_opt=0.003)
    rtt_f = 0.051 + 0.01 + 0.051  # activation up, server forward, output down
    rtt_b = 0.051 + 0.02 + 0.051  # gradient up, server backward, gradient down
    fill, drain = rtt_f - 3 * 0.01, rtt_b - 3 * 0.01
    expected = 4 * 0.04 + fill + drain + 0.003
    assert bound_terms(c, 4)["device"] == pytest.approx(expected)
    assert pipeline_bound(c, 4) == (pytest.approx(expected), "device")


def test_uplink_bound_dominates_on_a_slow_uplink() -> None:
    c = _c(tau_up=0.1)
    bound, term = pipeline_bound(c, 8)
    assert term == "uplink"
    assert bound == pytest.approx(0.01 + 8 * 0.2 + 0.0025 + 0.02 + 0.0035 + 0.01)


def test_two_part_split_counts_two_transfers_not_four() -> None:
    """The server computes the loss: activation up and the head's gradient down, nothing else."""
    c = _c(split="two", c_t=0.0, s_f=0.0, s_b=0.03, tau_up=0.1, tau_down=5.0, tau_down_grad=0.001)
    assert c.transfers == (0.1, 0.001)  # the output-down occupancy never happens
    bound, term = pipeline_bound(c, 8)
    assert term == "uplink"
    # first forward, 8 activations, latency, server, gradient down, last backward
    assert bound == pytest.approx(0.01 + 8 * 0.1 + 0.0025 + 0.03 + 0.0035 + 0.01)
    assert sequential_model(c, 8) == pytest.approx(8 * (0.05 + 0.101 + 0.005))


def test_two_part_device_row_counts_the_larger_of_fill_and_drain() -> None:
    c = _c(split="two", c_t=0.0, s_f=0.0, s_b=0.03, lat_up=0.05, lat_down=0.05, c_b=0.005)
    rtt = 0.051 + 0.03 + 0.051
    idle = max(rtt - 3 * 0.01, rtt - 3 * 0.005)
    assert bound_terms(c, 4)["device"] == pytest.approx(4 * 0.015 + idle)


def test_latency_shows_in_the_critical_path_for_one_microbatch() -> None:
    c = _c(lat_up=0.5, lat_down=0.5)
    bound, _ = pipeline_bound(c, 1)
    assert bound >= 4 * 0.5
    assert bound_terms(c, 1)["critical-path"] == pytest.approx(bound)


def test_server_optimizer_counts_in_the_steady_state_row() -> None:
    c = _c(s_f=0.1, s_b=0.2, s_opt=0.5)
    assert bound_terms(c, 4)["server-steady"] == pytest.approx(4 * 0.3 + 0.5)


def test_gradients_in_another_codec_count_on_their_own() -> None:
    """int8 activations with bf16 gradients: the uplink row carries one of each per microbatch."""
    c = _c(tau_up=0.05, tau_up_grad=0.1)
    bound, term = pipeline_bound(c, 8)
    assert term == "uplink"
    assert bound >= 8 * (0.05 + 0.1)
    assert bound < pipeline_bound(_c(tau_up=0.1), 8)[0]  # cheaper than bf16 both ways
    assert "tau_up_grad" in c.as_dict() and "tau_down_grad" not in c.as_dict()


def test_unknown_split_and_zero_microbatches_are_refused() -> None:
    with pytest.raises(ValueError, match="split"):
        _c(split="y")
    with pytest.raises(ValueError, match="at least one microbatch"):
        pipeline_bound(_c(), 0)


def test_link_occupancy_is_bytes_over_bandwidth() -> None:
    assert link_occupancy(1_000_000, 100.0) == pytest.approx(0.08)
    assert link_occupancy(1_000_000, float("inf")) == 0.0


def test_relative_spread_is_iqr_over_median() -> None:
    assert relative_spread([1.0, 1.0, 1.0, 1.0]) == 0.0
    assert relative_spread([1.0, 2.0]) == 0.0  # too few samples to say
    assert relative_spread([1.0, 1.0, 3.0, 3.0]) == pytest.approx(2.0 / 2.0)  # IQR 2, median 2


# -- a discrete-event simulation: any schedule it plays must take at least the bound ----------
def _simulate(c: Components, m: int, policy: str) -> float:
    """One step of a device (one core), FIFO up/down links and a FIFO server.

    ``policy``: ``"tail-first"`` runs a ready tail (or backward) before the next forward;
    ``"forwards-first"`` runs every forward first (GPipe-like); ``"sequential"`` stop-and-wait.
    """
    two = c.split == "two"
    up_free = server_free = down_free = 0.0
    ready: dict[tuple[str, int], float] = {}  # (op, mb) -> when its input arrives

    def round_trip(sent: float, tau_up: float, work: float, tau_down: float) -> float:
        nonlocal up_free, server_free, down_free
        start = max(sent, up_free)
        up_free = start + tau_up
        s_start = max(up_free + c.lat_up, server_free)
        server_free = s_start + work
        d_start = max(server_free, down_free)
        down_free = d_start + tau_down
        return down_free + c.lat_down

    act, out, grad_up, grad_down = (*c.transfers, 0.0, 0.0) if two else c.transfers
    if two:
        grad_down = c.transfers[1]
    t, next_f, done = 0.0, 0, 0
    todo = m * (2 if two else 3)
    while done < todo:
        due = sorted((at, op, mb) for (op, mb), at in ready.items())
        runnable = [d for d in due if d[0] <= t]
        if policy == "sequential" and due:
            runnable = [due[0]]
            t = max(t, due[0][0])
        if runnable and (policy != "forwards-first" or next_f == m):
            first = min(runnable, key=lambda d: (d[1] != "T", d[0]))  # tails first
            at, op, mb = first if policy == "tail-first" else runnable[0]
            del ready[(op, mb)]
            if op == "B":  # head backward
                t += c.c_b
            else:
                t += c.c_t
                ready[("B", mb)] = round_trip(t, grad_up, c.s_b, grad_down)
            done += 1
        elif next_f < m and (policy != "sequential" or not due):
            t += c.c_f
            if two:
                ready[("B", next_f)] = round_trip(t, act, c.s_f + c.s_b, grad_down)
            else:
                ready[("T", next_f)] = round_trip(t, act, c.s_f, out)
            next_f += 1
            done += 1
        else:
            t = min(d[0] for d in due)
    return max(t + c.c_opt, server_free + c.s_opt)


@pytest.mark.parametrize("split", ["u", "two"])
def test_no_simulated_schedule_beats_the_bound(split: str) -> None:
    rng = random.Random(0)
    reached = 0
    for _ in range(400):
        times = {k: rng.uniform(0.001, 0.1) for k in ("c_f", "c_t", "c_b", "s_f", "s_b")}
        links = {k: rng.choice([0.0, rng.uniform(0.0, 0.2)]) for k in ("tau_up", "tau_down")}
        lat = rng.choice([0.0, 0.0025, 0.05])
        c = Components(
            **times,
            **links,
            lat_up=lat,
            lat_down=lat,
            c_opt=rng.uniform(0, 0.02),
            s_opt=rng.uniform(0, 0.02),
            tau_up_grad=rng.uniform(0.0, 0.1),
            tau_down_grad=rng.uniform(0.0, 0.1),
            split=split,
        )
        if split == "two":
            c = Components(**{**c.__dict__, "c_t": 0.0})
        m = rng.randint(1, 8)
        bound = pipeline_bound(c, m)[0]
        simulated = [_simulate(c, m, p) for p in ("tail-first", "forwards-first", "sequential")]
        assert min(simulated) >= bound - 1e-9, (simulated, m, c)
        assert sequential_model(c, m) >= bound - 1e-9
        reached += min(simulated) <= bound * 1.01
    assert reached > 100  # the bound is tight, not merely low: a greedy schedule meets it often
