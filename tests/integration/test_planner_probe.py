"""The planner's measurements through a real StageServer on loopback gRPC (port 0).

ECHO probes the link on the session's own stream; the server answers them from its transport
thread. Link figures are checked only against what the emulator must add (it can delay, never
speed up), not against wall-clock limits.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from harness.stage import stage_server

from fedpipe.config import FedpipeConfig, PipelineConfig, TrainConfig
from fedpipe.edge.planner.measure import probe_link, time_codecs, time_device_ops
from fedpipe.edge.trainer import DeviceTrainer
from fedpipe.emulation import DeviceProfile, LinkProfile
from fedpipe.messages import Kind, StageMsg
from fedpipe.server.sessions import RuntimeLimits
from fedpipe.server.stage_server import StageServer
from fedpipe.wire.backend import SessionRequest
from fedpipe.wire.link_client import StageClient

BATCH, SEQ, HIDDEN = 4, 16, 64  # tiny-llama's hidden size is 64
CONFIG = FedpipeConfig(
    pipeline=PipelineConfig(microbatches=2, schedule="greedy", timeout_s=20.0),
    train=TrainConfig(batch_size=BATCH, seq_len=SEQ, lr=1e-2),
)


SERVER_CONFIG = CONFIG  # for the `server` fixture (conftest.py)


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def _session(client: StageClient, trainer: DeviceTrainer, link: LinkProfile | None = None):  # type: ignore[no-untyped-def]
    return client.open(
        SessionRequest(
            device_id=trainer.device_id,
            round=0,
            split=trainer.split,
            microbatch_size=BATCH,
            seq_len=SEQ,
            learning_rate=1e-3,
        ),
        link=link,
        timeout_s=20.0,
    )


def test_probe_sees_the_emulated_link(server: StageServer, folder) -> None:  # type: ignore[no-untyped-def]
    trainer = DeviceTrainer(CONFIG, device_id="prober", folder=folder)
    # A 16 KiB echo takes 262 ms on the 0.5 Mbit/s uplink: emulator lateness (a few ms) is noise.
    link = LinkProfile("slow-up", up_mbps=0.5, down_mbps=50.0, rtt_s=0.04)
    with StageClient(server.address) as client, _session(client, trainer, link) as session:
        figures = probe_link(session, (BATCH, SEQ, HIDDEN))
    assert figures.rtt_s >= 0.04, "the emulator adds its RTT to every round trip"
    assert figures.up_mbps <= 0.5 * 1.1, "no faster than the emulated uplink"
    assert figures.down_mbps > 10 * figures.up_mbps, "the 100x faster downlink shows"


def test_echo_leaves_training_untouched(server: StageServer, folder) -> None:  # type: ignore[no-untyped-def]
    """A session that probed first trains to the same loss as one that did not."""
    losses = []
    for name, probe in (("plain", False), ("probed", True)):
        trainer = DeviceTrainer(CONFIG, device_id=name, folder=folder)
        with StageClient(server.address) as client:
            session, runtime = trainer.connect(client, optimizer=None)
            with session:
                if probe:
                    probe_link(session, (BATCH // 2, SEQ, HIDDEN))  # its declared size
                losses.append(runtime.train_step(_batch(), step=0).loss)
                runtime.finish()
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_echo_asks_within_the_session_and_a_session_probes_a_bounded_number_of_times(
    server: StageServer, folder
) -> None:  # type: ignore[no-untyped-def]
    """A probe asks for at most the session's rows; a session probes at most ``max_echoes``
    times (one probe outstanding per stream: tests/integration/test_hostile_device.py)."""
    trainer = DeviceTrainer(CONFIG, device_id="greedy-prober", folder=folder)
    most = RuntimeLimits().max_echoes
    with StageClient(server.address) as client:
        with _session(client, trainer) as session:
            session.send(StageMsg(Kind.ECHO, 0, 0, tokens=BATCH + 1))
            with pytest.raises(Exception, match="ECHO may ask for 0 to 4"):
                session.receive(Kind.ECHO, 0, 0)
        with _session(client, trainer) as session:
            for mb in range(most):
                session.send(StageMsg(Kind.ECHO, 0, mb))
                session.receive(Kind.ECHO, 0, mb)
            session.send(StageMsg(Kind.ECHO, 0, most))
            with pytest.raises(Exception, match=f"a session may probe the link {most} times"):
                session.receive(Kind.ECHO, 0, most)
            assert grpc.StatusCode.INVALID_ARGUMENT.name in str(session._failure)


def test_device_ops_are_timed_without_changing_the_weights(folder) -> None:  # type: ignore[no-untyped-def]
    trainer = DeviceTrainer(CONFIG, device_id="timer", folder=folder)
    before = {k: v.clone() for k, v in trainer.adapters().items()}
    times, stash = time_device_ops(trainer.head, trainer.tail, _batch(), (1, 2, 4), repeats=2)
    assert set(times) == {1, 2, 4} and all(
        t.head_forward > 0 and t.tail > 0 for t in times.values()
    )
    assert stash[1] < stash[2] < stash[4], "a bigger microbatch stashes more"
    assert all(p.grad is None for p in trainer.parameters())
    after = trainer.adapters()
    assert all(torch.equal(before[k], after[k]) for k in before)
    nbytes, seconds = time_codecs((BATCH, SEQ, HIDDEN), ("fp32", "bf16", "int8"), (1, 4))
    assert nbytes["fp32", 4] > nbytes["bf16", 4] > nbytes["int8", 4] > nbytes["fp32", 1]
    assert set(seconds) == set(nbytes)


# -- pipeline.plan = "auto" --------------------------------------------------------------------
AUTO = CONFIG.with_overrides({"pipeline.plan": "auto", "train.batch_size": 4})


def _round(trainer: DeviceTrainer, address: str, seed: int, round_: int):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(3):
        ids = torch.randint(0, 256, (BATCH, SEQ), generator=gen)
        batches.append({"input_ids": ids, "labels": ids.clone()})
    with StageClient(address) as client:
        return trainer.train_round(client, batches, round_=round_)


def test_auto_plans_keeps_the_loss_and_replans_when_the_link_drifts(
    server: StageServer, folder
) -> None:  # type: ignore[no-untyped-def]
    fixed = _round(DeviceTrainer(CONFIG, device_id="fixed", folder=folder), server.address, 1, 0)
    near = DeviceProfile("near", LinkProfile("near", 100.0, 100.0, rtt_s=0.002))
    trainer = DeviceTrainer(AUTO, device_id="auto", folder=folder, profile=near)
    first = _round(trainer, server.address, 1, 0)
    # Lossless codecs only (the default): any plan gives the fixed plan's losses.
    assert [s.loss for s in first.steps] == pytest.approx([s.loss for s in fixed.steps], rel=1e-5)
    plan = first.plan
    assert plan["why"].startswith("first plan") and plan["codec"] == "fp32"
    assert BATCH % int(plan["microbatches"]) == 0 and float(plan["predicted_s"]) > 0
    assert float(plan["measured_s"]) > 0 and "link_rtt_s" in plan
    assert [s.microbatches for s in first.steps[2:]] == [plan["microbatches"]]

    same = _round(trainer, server.address, 2, 1)
    assert same.plan["why"] == plan["why"], "no drift: the plan stays"
    trainer.profile = DeviceProfile("far", LinkProfile("far", 100.0, 100.0, rtt_s=0.2))
    far = _round(trainer, server.address, 3, 2)
    assert far.plan["why"].startswith("re-planned: RTT"), far.plan["why"]


def test_calibration_rescales_every_size_by_what_the_run_took() -> None:
    from fedpipe.edge.planner.measure import calibrate
    from fedpipe.edge.planner.plan import LinkFigures, Measured, OpTimes
    from fedpipe.trace import Event

    figures = Measured(
        batch_size=4,
        device={2: OpTimes(0.1, 0.2, 0.1), 4: OpTimes(0.2, 0.4, 0.2)},
        server={2: (0.05, 0.1), 4: (0.1, 0.2)},
        link=LinkFigures(0.01, 100.0, 100.0),
        message_bytes={},
    )
    spans = {"F0": 0.15, "T0": 0.2, "B0": 0.1, "O": 0.01, "Sf0": 0.1, "Sb0": 0.1, "So": 0.02}
    events = [
        Event(name, "server" if name.startswith("S") else "device", 1.0, 1.0 + d)
        for name, d in spans.items()
    ]
    out = calibrate(figures, events, 2)
    assert out is not None
    assert out.device[4].head_forward == pytest.approx(0.3), "1.5x slower forward at both sizes"
    assert (out.device[4].tail, out.device[4].head_backward) == pytest.approx((0.4, 0.2))
    assert out.server[4] == pytest.approx((0.2, 0.2))
    assert out.c_opt == pytest.approx(0.01)
    assert calibrate(figures, [], 2) is None, "no steps ran: nothing to learn"


def test_auto_in_the_two_part_split_with_lossy_codecs_allowed(folder) -> None:  # type: ignore[no-untyped-def]
    """The server computes the loss: no tail on the device; codecs change from session 2."""
    cfg = AUTO.with_overrides(
        {"model.split": "two", "model.tail_layers": 0, "pipeline.plan_codecs": "bf16,int8"}
    )
    with stage_server(cfg, folder=folder) as served:
        trainer = DeviceTrainer(cfg, device_id="two", folder=folder)
        reports = [_round(trainer, served.address, seed, seed) for seed in (0, 1)]
    first, second = (r.plan for r in reports)
    assert first["cut"] == "two:1+0" and first["codec"] == "fp32", "the session opened fp32"
    if "next" in first:  # a lossy pair was better: the second session opened with it
        assert second["codec"] != "fp32" and f" {second['codec']}" in str(first["next"])
    assert second["gradient_codec"] != "int8", "gradients keep 16 bits"
    assert all(0 < s.loss < 10 for r in reports for s in r.steps)
