"""``fedpipe bench pipeline``: the run order, the solo components, the noise flag, and the JSON
contract of a real (small) run."""

from __future__ import annotations

import pytest
from fedpipe_bench.pipeline import (
    NOISE_THRESHOLD,
    PhasedChannel,
    noise_report,
    round_robin,
    solo_components,
)

from fedpipe.emulation import LinkProfile
from fedpipe.messages import Kind, StageMsg


def test_round_robin_runs_every_schedule_at_a_step_before_the_next_step() -> None:
    order = round_robin(["solo", "sequential", "greedy"], 2)
    assert order == [
        (0, "solo"),
        (0, "sequential"),
        (0, "greedy"),
        (1, "solo"),
        (1, "sequential"),
        (1, "greedy"),
    ]


class _Server:
    """A fake stage link: each ``wait_any`` lets the server answer one message it was sent."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.queue: list[StageMsg] = []
        self.replies: dict[tuple[Kind, int, int], StageMsg] = {}

    def send(self, msg: StageMsg) -> None:
        self.log.append(f"send {msg.kind.name} {msg.microbatch}")
        self.queue.append(msg)

    def ready(self, kind: Kind, step: int, microbatch: int) -> bool:
        return (kind, step, microbatch) in self.replies

    def receive(self, kind: Kind, step: int, microbatch: int) -> StageMsg:
        assert self.ready(kind, step, microbatch), "receive would block forever here"
        self.log.append(f"receive {kind.name} {microbatch}")
        return self.replies.pop((kind, step, microbatch))

    def wait_any(self, timeout: float) -> None:
        msg = self.queue.pop(0)
        self.log.append(f"compute {msg.kind.name} {msg.microbatch}")
        kind = {Kind.ACTIVATION: Kind.OUTPUT, Kind.OUTPUT_GRAD: Kind.INPUT_GRAD}[msg.kind]
        self.replies[(kind, msg.step, msg.microbatch)] = StageMsg(kind, msg.step, msg.microbatch)


def test_phased_channel_lets_the_server_compute_a_whole_phase_before_the_device_goes_on() -> None:
    server = _Server()
    channel = PhasedChannel(server, microbatches=3)
    for mb in range(3):  # the device's head forwards: nothing leaves yet
        channel.send(StageMsg(Kind.ACTIVATION, 0, mb))
    assert server.log == []
    channel.receive(Kind.OUTPUT, 0, 0)  # the burst goes out; the first reply waits for all three
    assert server.log == [
        *(f"send ACTIVATION {mb}" for mb in range(3)),
        *(f"compute ACTIVATION {mb}" for mb in range(3)),
        "receive OUTPUT 0",
    ]
    channel.send(StageMsg(Kind.OUTPUT_GRAD, 0, 0))
    channel.receive(Kind.OUTPUT, 0, 1)  # already there: the held gradient goes out, no wait
    assert server.log[-2:] == ["send OUTPUT_GRAD 0", "receive OUTPUT 1"]


def test_solo_components_take_transfers_from_the_link_model() -> None:
    samples = {"c_f": [0.01, 0.03, 0.02], "c_t": [0.02], "c_b": [0.01], "s_f": [], "s_b": [0.05]}
    link = LinkProfile("l", up_mbps=10.0, down_mbps=25.0, rtt_s=0.05, overhead_s=0.001)
    nbytes = {"a": 1_000_000, "o": 1_000_000, "g": 500_000, "i": 500_000}
    c = solo_components(samples, link, nbytes, "u")
    assert (c.c_f, c.c_t, c.s_f, c.s_b) == (0.02, 0.02, 0.0, 0.05)  # medians; none measured: 0
    assert c.tau_up == pytest.approx(0.8) and c.tau_down == pytest.approx(0.32)
    assert c.tau_up_grad == pytest.approx(0.4) and c.tau_down_grad == pytest.approx(0.16)
    assert c.lat_up == c.lat_down == pytest.approx(0.026)


def test_noise_report_flags_a_wide_spread() -> None:
    steady = [0.1, 0.1, 0.101, 0.1, 0.099, 0.1]
    quiet = noise_report({"c_f": steady}, [1.0, 1.02, 1.01])
    assert quiet["noisy"] is False
    jumpy = noise_report({"c_f": [0.1, 0.1, 0.2, 0.2, 0.1, 0.25]}, [1.0, 1.02])
    assert jumpy["noisy"] is True and jumpy["solo_spread"]["c_f"] > NOISE_THRESHOLD
    short = noise_report({"c_f": steady, "c_opt": [0.004, 0.006, 0.004, 0.009]}, [1.0, 1.01])
    assert short["noisy"] is False and short["solo_spread"]["c_opt"] > NOISE_THRESHOLD
    drifting = noise_report({"c_f": steady}, [1.0, 1.5])  # steps, not components, moved
    assert drifting["noisy"] is True and drifting["solo_step_spread"] == pytest.approx(0.5)
