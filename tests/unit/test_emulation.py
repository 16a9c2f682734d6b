"""fedpipe.emulation: profiles, specs, the FIFO link model, the delay line, the compute throttle.

Timing is checked exactly on a FakeClock; one short real-clock test only checks "not early".
"""

from __future__ import annotations

import math
import random
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedpipe.config import FedpipeConfig
from fedpipe.emulation import (
    DEVICE_PROFILES,
    REFERENCE_LINKS,
    Clock,
    ComputeThrottle,
    DelayLine,
    DelayLineClosed,
    DeviceProfile,
    DuplexLink,
    FakeClock,
    LinkDirection,
    LinkProfile,
    RealClock,
    Transfer,
    UnknownProfileError,
    get_device_profile,
    get_link,
    link_names,
    parse_device_profile,
    parse_device_profiles,
    parse_link,
    parse_links,
    split_specs,
)

MB = 1_000_000  # bytes; 1 MB at 8 Mbit/s (1e6 B/s) takes exactly 1 s


# -- profiles --------------------------------------------------------------------------------------


def test_reference_links_in_order_with_the_notes_settings() -> None:
    assert REFERENCE_LINKS == ("1gbit-5ms", "100mbit-5ms", "100mbit-100ms", "10up-25down-50ms")
    edge = get_link("10up-25down-50ms")
    assert (edge.up_mbps, edge.down_mbps, edge.rtt_s) == (10, 25, 0.05)
    assert edge.bytes_per_s("up") == 1.25e6
    assert edge.bytes_per_s("down") == 3.125e6
    assert edge.one_way_s == 0.025
    assert get_link("100mbit-100ms").rtt_s == pytest.approx(0.1)
    assert get_link("1gbit-5ms").bytes_per_s("up") == 125e6
    for name in REFERENCE_LINKS:
        assert get_link(name).jitter_s == 0.0  # benchmarks stay reproducible


def test_device_profiles_are_realistic_and_lookups_teach() -> None:
    assert set(DEVICE_PROFILES) >= {
        "phone-lte",
        "phone-5g",
        "rpi-wifi",
        "jetson-ethernet",
        "laptop-wifi",
        "loopback",
    }
    phone = get_device_profile("phone-lte")
    assert phone.compute_slowdown == 3.0
    assert phone.link.up_mbps < phone.link.down_mbps
    assert get_device_profile("rpi-wifi").compute_slowdown == 6.0
    assert get_device_profile("jetson-ethernet").link.rtt_s == 0.001
    loop = get_device_profile("loopback")
    assert loop.compute_slowdown == 1.0 and loop.link.is_unlimited
    assert get_link("phone-lte") is phone.link  # device links are named links too
    assert set(REFERENCE_LINKS) <= set(link_names())
    with pytest.raises(UnknownProfileError, match="phone-lte") as err:
        get_device_profile("toaster")
    assert isinstance(err.value, KeyError) and isinstance(err.value, ValueError)
    with pytest.raises(UnknownProfileError, match="100mbit-100ms.*parse_link"):
        get_link("dialup")


def test_unlimited_link_has_no_limits() -> None:
    link = LinkProfile.unlimited()
    assert link.name == "loopback" and link.is_unlimited
    assert link.bytes_per_s("up") is None and link.bytes_per_s("down") is None
    assert link.describe() == "unlimited (no emulation)"
    assert LinkDirection.from_profile(link, "up").is_passthrough


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"up_mbps": 0}, "up_mbps must be > 0.*math.inf"),
        ({"down_mbps": -1}, "down_mbps must be > 0"),
        ({"rtt_s": -0.1}, "rtt_s must be a finite number of seconds >= 0"),
        ({"jitter_s": math.inf}, "jitter_s"),
        ({"overhead_s": math.nan}, "overhead_s"),
        ({"name": " "}, "non-empty name"),
    ],
)
def test_link_profile_validation_teaches(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"name": "x", "up_mbps": 10, "down_mbps": 10, "rtt_s": 0.01}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        LinkProfile(**args)  # type: ignore[arg-type]


def test_device_profile_validation_and_direction_check() -> None:
    with pytest.raises(ValueError, match="compute_slowdown must be .* >= 1.0 \\(got 0.5\\)"):
        DeviceProfile("fast", LinkProfile.unlimited(), compute_slowdown=0.5)
    with pytest.raises(ValueError, match="'up' or 'down'"):
        get_link("1gbit-5ms").bytes_per_s("sideways")  # type: ignore[arg-type]


def test_describe() -> None:
    assert get_link("phone-lte").describe() == "10/30 Mbit/s up/down, 60 ms RTT, 5 ms jitter"


# -- parse_link ------------------------------------------------------------------------------------


def test_parse_link_by_name() -> None:
    assert parse_link("100mbit-5ms") is get_link("100mbit-5ms")
    assert parse_link("  Phone-LTE ") is get_link("phone-lte")
    with pytest.raises(UnknownProfileError, match="choose one of"):
        parse_link("nope")


def test_parse_link_inline() -> None:
    link = parse_link("up=10,down=25,rtt=50ms,jitter=2ms")
    assert (link.up_mbps, link.down_mbps) == (10, 25)
    assert link.rtt_s == pytest.approx(0.05) and link.jitter_s == pytest.approx(0.002)
    assert link.overhead_s == 0.0
    assert link.name == "up=10,down=25,rtt=50ms,jitter=2ms"
    assert parse_link(link.name) == link  # the canonical name parses back to the same link


@pytest.mark.parametrize(
    ("spec", "up", "down", "rtt", "overhead"),
    [
        ("up=10Mbit/s, down=25 mbps, rtt=0.05s", 10, 25, 0.05, 0),
        ("bw=1gbps,rtt=5ms", 1000, 1000, 0.005, 0),
        ("bw=1Gbit/s,rtt=500us,overhead=1ms", 1000, 1000, 0.0005, 0.001),
        ("up=500kbps,down=inf", 0.5, math.inf, 0, 0),
        ("UP=1e2,Down=2.5E1,RTT=100MS", 100, 25, 0.1, 0),
    ],
)
def test_parse_link_units(spec: str, up: float, down: float, rtt: float, overhead: float) -> None:
    link = parse_link(spec)
    assert link.up_mbps == pytest.approx(up) and link.down_mbps == pytest.approx(down)
    assert link.rtt_s == pytest.approx(rtt) and link.overhead_s == pytest.approx(overhead)


def test_parse_link_name_key() -> None:
    assert parse_link("name=lab,bw=40,rtt=10ms").name == "lab"


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("up=10,rtt=5ms", "needs both directions' bandwidth"),
        ("up=10,down=10,rtt=50", "needs a unit; write e.g. rtt=50ms or rtt=50s"),
        ("up=10,down=10,rtt=5min", "unknown unit 'min'"),
        ("up=10MB/s,down=10", "bandwidth is in bits"),
        ("up=10,down=10,latency=5ms", "unknown key 'latency'; valid keys are up, down, bw"),
        ("up=10,down=10,up=20", "'up' is given twice"),
        ("bw=10,up=5,down=5", "either bw= or up=/down="),
        ("up=10,down=10,rtt", "'rtt' is not key=value"),
        ("up=fast,down=10", "not a number"),
        ("up=0,down=10", "up_mbps must be > 0"),
    ],
)
def test_parse_link_errors_teach(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_link(spec)


# -- clocks ----------------------------------------------------------------------------------------


def test_fake_clock() -> None:
    clock = FakeClock(start=5.0)
    assert isinstance(clock, Clock) and isinstance(RealClock(), Clock)
    assert clock.now() == 5.0
    assert clock.advance(1.5) == 6.5
    clock.sleep_until(6.0)  # in the past: no-op
    assert clock.now() == 6.5
    clock.sleep_until(10.0)
    assert clock.now() == 10.0
    clock.set(11.0)
    assert clock.now() == 11.0
    with pytest.raises(ValueError, match="backwards"):
        clock.set(1.0)
    with pytest.raises(ValueError, match="dt >= 0"):
        clock.advance(-1.0)


def test_real_clock_sleep_until_is_never_early() -> None:
    clock = RealClock()
    target = clock.now() + 0.01
    clock.sleep_until(target)
    assert clock.now() >= target


# -- LinkDirection: the FIFO wire model ------------------------------------------------------------


def _wire(
    mbit_s: float | None = 8.0, one_way: float = 0.0, *, overhead_s: float = 0.0
) -> LinkDirection:
    """8 Mbit/s = 1e6 bytes/s: 1 MB occupies the wire for exactly 1 s."""
    rate = None if mbit_s is None else mbit_s * 1e6 / 8
    return LinkDirection(rate, one_way, overhead_s=overhead_s)


def test_single_message_is_occupancy_plus_latency() -> None:
    wire = _wire(one_way=0.025, overhead_s=0.001)
    assert wire.schedule(MB // 2, sent_at=10.0) == pytest.approx(10.0 + 0.5 + 0.025 + 0.001)
    [rec] = wire.records()
    assert rec[:3] == (10.0, 10.0, 10.5) and rec.deliver == pytest.approx(10.526)
    assert isinstance(rec, Transfer)
    assert wire.latency_s == pytest.approx(0.026) and wire.occupancy_s(MB) == 1.0


def test_back_to_back_messages_queue_behind_each_other() -> None:
    wire = _wire(one_way=0.05)
    times = [wire.schedule(MB, sent_at=0.0) for _ in range(3)]
    assert times == pytest.approx([1.05, 2.05, 3.05])
    starts = [r.start for r in wire.records()]
    assert starts == pytest.approx([0.0, 1.0, 2.0])
    # Latency overlaps the next message's occupancy: a pipelined link, not stop-and-wait.
    assert wire.busy_until == pytest.approx(3.0)
    stats = wire.stats()
    assert (stats.messages, stats.bytes) == (3, 3 * MB)
    assert stats.busy_s == pytest.approx(3.0) and stats.queued_s == pytest.approx(0 + 1 + 2)


def test_idle_gap_resets_the_queue() -> None:
    wire = _wire(one_way=0.01)
    wire.schedule(MB, sent_at=0.0)  # busy until 1.0
    assert wire.schedule(MB, sent_at=5.0) == pytest.approx(6.01)
    assert wire.stats().queued_s == 0.0


def test_unlimited_bandwidth_is_pure_latency_and_zero_bytes_ok() -> None:
    wire = _wire(mbit_s=None, one_way=0.02)
    assert [wire.schedule(10 * MB, sent_at=1.0) for _ in range(2)] == pytest.approx([1.02, 1.02])
    assert _wire().schedule(0, sent_at=3.0) == 3.0
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        wire.schedule(-1, sent_at=0.0)


def test_asymmetric_up_and_down() -> None:
    link = DuplexLink.from_profile(get_link("10up-25down-50ms"))
    nbytes = 262_144  # 256 KiB, the prototype's message
    up = link.up.schedule(nbytes, sent_at=0.0)
    down = link.direction("down").schedule(nbytes, sent_at=0.0)
    assert up == pytest.approx(nbytes / 1.25e6 + 0.025)
    assert down == pytest.approx(nbytes / 3.125e6 + 0.025)
    # The directions are independent wires: a busy uplink does not delay the downlink.
    assert link.down.schedule(nbytes, sent_at=0.0) == pytest.approx(2 * nbytes / 3.125e6 + 0.025)


def test_overhead_is_latency_not_occupancy() -> None:
    wire = _wire(overhead_s=0.1)
    assert [wire.schedule(MB, sent_at=0.0) for _ in range(2)] == pytest.approx([1.1, 2.1])
    assert wire.stats().busy_s == pytest.approx(2.0)


def test_jitter_never_reorders_and_never_speeds_up() -> None:
    rng = random.Random(7)
    wire = LinkDirection(1e6, 0.01, jitter_s=0.05, rng=rng)
    sent = 0.0
    delivered = []
    for _ in range(500):
        sent += rng.uniform(0.0, 0.02)
        delivered.append(wire.schedule(rng.randrange(0, 20_000), sent_at=sent))
    assert delivered == sorted(delivered)
    for rec in wire.records():
        assert rec.deliver >= rec.end + 0.01 - 1e-12
    extras = [r.deliver - r.end - 0.01 for r in wire.records()]
    assert max(extras) > 0.02  # jitter did something


def test_jitter_is_reproducible_with_a_seed() -> None:
    def run(seed: int) -> list[float]:
        link = DuplexLink.from_profile(get_link("phone-lte"), seed=seed)
        return [link.up.schedule(1000, sent_at=i * 0.1) for i in range(20)]

    assert run(1) == run(1)
    assert run(1) != run(2)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0, 1), st.integers(0, 100_000)),
        min_size=1,
        max_size=40,
    ),
    st.floats(0, 0.1),
    st.floats(0, 0.05),
)
def test_wire_invariants(msgs: list[tuple[float, int]], one_way: float, jitter: float) -> None:
    wire = LinkDirection(1e6, one_way, jitter_s=jitter, rng=random.Random(0))
    sent = 0.0
    for gap, nbytes in msgs:
        sent += gap
        wire.schedule(nbytes, sent_at=sent)
    recs = wire.records()
    for prev, rec in zip(recs, recs[1:], strict=False):
        assert rec.start >= prev.end - 1e-9  # the wire carries one message at a time
        assert rec.deliver >= prev.deliver  # FIFO
    for rec in recs:
        assert rec.sent_at <= rec.start <= rec.end <= rec.deliver - one_way + 1e-9
    total = sum(n for _, n in msgs)
    assert wire.stats().busy_s == pytest.approx(total / 1e6)


def test_records_are_bounded_and_clearable() -> None:
    wire = LinkDirection(None, 0.0, max_records=3)
    for i in range(5):
        wire.schedule(1, sent_at=float(i))
    assert [r.sent_at for r in wire.records()] == [2.0, 3.0, 4.0]
    wire.clear_records()
    assert wire.records() == [] and wire.stats().messages == 5
    wire.reset_stats()
    assert wire.stats().messages == 0


def test_link_direction_validation() -> None:
    with pytest.raises(ValueError, match="pass None for unlimited"):
        LinkDirection(0.0, 0.0)
    with pytest.raises(ValueError, match="one_way_s must be finite seconds >= 0"):
        LinkDirection(1.0, -0.01)
    assert LinkDirection(math.inf, 0.0).is_passthrough


# -- DelayLine -------------------------------------------------------------------------------------


def _sync_line(
    wire: LinkDirection, clock: FakeClock
) -> tuple[DelayLine[int], list[tuple[float, int]]]:
    got: list[tuple[float, int]] = []
    line: DelayLine[int] = DelayLine(
        wire, clock, lambda item: got.append((clock.now(), item)), threaded=False
    )
    return line, got


def test_delay_line_poll_delivers_what_is_due() -> None:
    clock = FakeClock()
    line, got = _sync_line(_wire(one_way=0.05), clock)
    assert line.put(1, MB) == pytest.approx(1.05)
    assert line.put(2, MB) == pytest.approx(2.05)
    assert line.pending() == 2 and line.next_delivery_at() == pytest.approx(1.05)
    assert line.poll() == 0
    clock.advance(1.05)
    assert line.poll() == 1 and got == [(pytest.approx(1.05), 1)]
    clock.advance(5.0)
    assert line.poll() == 1 and [i for _, i in got] == [1, 2]
    assert line.pending() == 0 and line.next_delivery_at() is None
    assert line.stats().delivered == 2


def test_delay_line_close_drains_in_order_on_the_clock() -> None:
    clock = FakeClock()
    wire = LinkDirection(1e6, 0.01, jitter_s=0.02, rng=random.Random(3))
    line, got = _sync_line(wire, clock)
    for i in range(50):
        line.put(i, 10_000)
    line.close()
    assert [i for _, i in got] == list(range(50))
    assert [t for t, _ in got] == pytest.approx([r.deliver for r in wire.records()])
    assert line.stats().late_max_s == 0.0
    with pytest.raises(DelayLineClosed, match="closed"):
        line.put(99, 1)
    line.close()  # idempotent


def test_delay_line_close_drop() -> None:
    clock = FakeClock()
    line, got = _sync_line(_wire(one_way=0.05), clock)
    for i in range(3):
        line.put(i, 1)
    line.close(drop=True)
    assert got == [] and line.pending() == 0 and line.stats().dropped == 3
    with pytest.raises(RuntimeError, match="threaded=False"):
        DelayLine(_wire(), clock, print).poll()


def test_delay_line_passthrough_delivers_inline_without_a_thread() -> None:
    clock = FakeClock()
    got: list[str] = []
    line: DelayLine[str] = DelayLine(LinkDirection(None, 0.0), clock, got.append)
    caller = threading.get_ident()
    seen: list[int] = []
    line2: DelayLine[str] = DelayLine(
        LinkDirection(None, 0.0), clock, lambda _: seen.append(threading.get_ident())
    )
    line.put("a", 100)
    line2.put("b", 100)
    assert got == ["a"] and seen == [caller] and line.pending() == 0
    assert line._thread is None  # no thread was ever started
    line.close()
    line2.close()


def test_threaded_delay_line_delivers_everything_in_order_on_close() -> None:
    clock = FakeClock()  # the worker's sleep_until jumps the fake clock: no real waiting
    got: list[int] = []
    wire = LinkDirection(1e6, 0.05, jitter_s=0.01, rng=random.Random(1))
    with DelayLine(wire, clock, got.append, name="up") as line:
        for i in range(200):
            line.put(i, 5_000)
    assert got == list(range(200))
    assert line.stats().delivered == 200 and line.pending() == 0


def test_threaded_delay_line_reports_a_failed_consumer() -> None:
    clock = FakeClock()

    def deliver(item: int) -> None:
        if item == 1:
            raise OSError("consumer gone")

    line: DelayLine[int] = DelayLine(_wire(one_way=0.01), clock, deliver, name="down")
    for i in range(3):
        line.put(i, 1)
    with pytest.raises(DelayLineClosed, match="consumer gone") as err:
        line.close(timeout=10)
    assert isinstance(err.value.__cause__, OSError)
    assert line.stats().delivered == 2 and line.stats().dropped == 1


def test_real_clock_delay_line_is_never_early() -> None:
    """Short real-time check: 20 ms latency is delivered no earlier than 20 ms (tolerant above)."""
    clock = RealClock()
    got: list[tuple[float, int]] = []
    line: DelayLine[int] = DelayLine(
        LinkDirection(None, 0.02), clock, lambda i: got.append((clock.now(), i))
    )
    sent = [(clock.now(), line.put(i, 1000)) for i in range(3)]
    line.close(timeout=10)
    assert [i for _, i in got] == [0, 1, 2]
    for (sent_at, due), (arrived, _) in zip(sent, got, strict=True):
        assert arrived >= due >= sent_at + 0.02
        assert arrived - sent_at < 2.0  # generous: the machine is shared


def test_real_clock_close_drop_is_prompt() -> None:
    got: list[int] = []
    line: DelayLine[int] = DelayLine(LinkDirection(None, 30.0), RealClock(), got.append)
    line.put(1, 1)
    start = time.monotonic()
    line.close(drop=True, timeout=10)
    assert got == [] and time.monotonic() - start < 5.0


# -- ComputeThrottle -------------------------------------------------------------------------------


def test_throttle_stretches_compute_on_a_fake_clock() -> None:
    clock = FakeClock()
    throttle = ComputeThrottle(3.0, clock)
    with throttle.run():
        clock.advance(0.1)  # the "compute"
    assert clock.now() == pytest.approx(0.3)  # 0.1 compute + 0.2 added
    stats = throttle.stats()
    assert stats.calls == 1
    assert stats.compute_s == pytest.approx(0.1) and stats.added_s == pytest.approx(0.2)
    assert stats.emulated_s == pytest.approx(0.3)


def test_throttle_with_injected_timer() -> None:
    clock = FakeClock()
    ticks = iter([1.0, 1.25])
    throttle = ComputeThrottle(2.0, clock, timer=lambda: next(ticks))
    with throttle.run():
        pass
    assert clock.now() == pytest.approx(0.25)
    assert throttle.pad(0.5) == pytest.approx(0.5)
    assert throttle.stats().compute_s == pytest.approx(0.75)


def test_throttle_noop_and_errors() -> None:
    clock = FakeClock()
    throttle = ComputeThrottle(1.0, clock)
    with throttle.run():
        clock.advance(1.0)
    assert clock.now() == 1.0 and throttle.stats().added_s == 0.0
    slow = ComputeThrottle(4.0, clock)
    with pytest.raises(KeyError), slow.run():
        clock.advance(1.0)
        raise KeyError("boom")
    assert clock.now() == 2.0 and slow.stats().calls == 0  # no delay added on an error
    with pytest.raises(ValueError, match=">= 1.0 \\(got 0.9\\)"):
        ComputeThrottle(0.9)


# -- one parser for every place that takes a link or a profile -------------------------------------


@pytest.mark.parametrize(
    ("text", "entries"),
    [
        ("phone-lte,rpi-wifi", ["phone-lte", "rpi-wifi"]),
        (
            "phone-lte, up=10,down=25,rtt=50ms ,rpi-wifi",
            ["phone-lte", "up=10,down=25,rtt=50ms", "rpi-wifi"],
        ),
        ("up=10,down=25,up=5,down=5,rtt=1ms", ["up=10,down=25", "up=5,down=5,rtt=1ms"]),
        ("up=10,down=25;bw=40,rtt=9ms", ["up=10,down=25", "bw=40,rtt=9ms"]),
        ("up=1,down=2,slowdown=3,loopback,", ["up=1,down=2,slowdown=3", "loopback"]),
        ("", []),
    ],
)
def test_split_specs_keeps_inline_specs_together(text: str, entries: list[str]) -> None:
    assert split_specs(text) == entries


def test_parse_device_profile_names_links_and_inline_specs() -> None:
    assert parse_device_profile("phone-lte") is get_device_profile("phone-lte")
    edge = parse_device_profile("10up-25down-50ms")  # a link name: a device as fast as the host
    assert edge.link is get_link("10up-25down-50ms") and edge.compute_slowdown == 1.0
    inline = parse_device_profile("up=10,down=25,rtt=50ms,slowdown=2")
    assert inline.link == parse_link("up=10,down=25,rtt=50ms")
    assert inline.compute_slowdown == 2.0 and inline.name == "up=10,down=25,rtt=50ms,slowdown=2"
    assert parse_device_profile("name=lab,bw=40,rtt=10ms,slowdown=4").name == "lab"
    assert [p.name for p in parse_device_profiles("loopback,bw=5,rtt=1ms")] == [
        "loopback",
        "up=5,down=5,rtt=1ms",
    ]
    assert [link.up_mbps for link in parse_links("100mbit-5ms,up=7,down=9")] == [100, 7]


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("phone-lt", r"unknown device profile 'phone-lt' \(did you mean 'phone-lte'\?\).*rpi-wifi"),
        ("toaster", r"a link \(1gbit-5ms.*inline spec such as 'up=10,down=25,rtt=50ms,slowdown=2'"),
        ("up=10,down=25,slowdown=fast", "slowdown='fast' is not a number"),
        ("up=10,down=25,slowdown=0.5", "compute_slowdown must be a finite number >= 1.0"),
        ("up=10,dwn=25", "unknown key 'dwn'.*name, and for a device, slowdown"),
    ],
)
def test_parse_device_profile_errors_teach(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_device_profile(spec)


def test_a_link_name_typo_suggests_and_lists_the_names() -> None:
    with pytest.raises(UnknownProfileError, match=r"did you mean '100mbit-5ms'.*1gbit-5ms"):
        parse_links("100mbit-5s")


def test_profiles_setting_accepts_inline_specs_and_refuses_typos() -> None:
    from fedpipe.config import FederatedConfig
    from fedpipe.fl.device_work import _profile

    config = FedpipeConfig(federated=FederatedConfig(profiles="phone-lte,up=10,down=25,rtt=50ms"))
    assert _profile(config, 0, None) is get_device_profile("phone-lte")
    assert _profile(config, 1, None).link == parse_link("up=10,down=25,rtt=50ms")
    assert _profile(config, 1, "bw=3,rtt=2ms,slowdown=2").compute_slowdown == 2.0  # node config
    with pytest.raises(ValueError, match="federated.profiles: unknown device profile 'rpi-wfi'"):
        FederatedConfig(profiles="phone-lte,rpi-wfi")


def test_the_emulator_takes_a_link_name_or_spec() -> None:
    duplex = DuplexLink.from_profile("up=8,down=16,rtt=100ms", seed=0)
    assert duplex.up.bytes_per_s == 1e6 and duplex.down.bytes_per_s == 2e6
    assert DuplexLink.from_profile("phone-lte").profile is get_link("phone-lte")


def test_bench_pipeline_refuses_a_bad_link_before_starting(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from fedpipe.cli.main import main

    assert main(["bench", "pipeline", "--model", "tiny-llama", "--links", "up=10,dwn=25"]) == 2
    assert "unknown key 'dwn'; valid keys are up, down, bw" in capsys.readouterr().err
