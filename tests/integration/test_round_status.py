"""RoundStatus: the StageServer's own count of each session's steps, over signed round control.

A real StageServer on loopback gRPC (port 0) with a secret; one device trains two steps of
round 1 with a real ``DeviceTrainer``, another opens its session and does nothing. What the
ServerApp's control client reads back, and what :class:`~fedpipe.fl.progress.StepWatch`
makes of it, are checked against that.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from harness.batches import random_batches

from fedpipe.auth.tokens import issue_token
from fedpipe.config import FedpipeConfig, PipelineConfig, TrainConfig
from fedpipe.edge.trainer import DeviceTrainer, split_terms
from fedpipe.fl.progress import StepWatch, by_device
from fedpipe.messages import Kind, StageMsg
from fedpipe.models import resolve_model
from fedpipe.proto import stage_pb2 as pb
from fedpipe.proto import stage_pb2_grpc as pb_grpc
from fedpipe.server.build import build_stage_server
from fedpipe.wire.backend import SessionRequest
from fedpipe.wire.control_client import StageControlClient
from fedpipe.wire.link_client import StageClient

BATCH, SEQ = 4, 16
CONFIG = FedpipeConfig(
    pipeline=PipelineConfig(microbatches=2, schedule="gpipe", timeout_s=20.0),
    train=TrainConfig(batch_size=BATCH, seq_len=SEQ, lr=1e-2),
)
SECRET = "a-secret-for-round-status-tests"


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    return random_batches(n, BATCH, SEQ, seed=5)


def _token(device_id: str) -> str:
    return issue_token(SECRET, run_id="run", round=1, device_id=device_id)


def test_round_status_counts_the_steps_each_session_completed() -> None:
    folder = resolve_model("tiny-llama")
    server = build_stage_server(CONFIG, secret=SECRET, port=0, folder=folder).start()
    control = StageControlClient(server.address, SECRET)
    try:
        control.reset_adapter()
        control.begin_round(1, "run")
        trainer = DeviceTrainer(CONFIG, device_id="1", folder=folder)
        with StageClient(server.address) as client:
            report = trainer.train_round(client, _batches(2), round_=1, token=_token("1"))
            assert len(report.steps) == 2
            with client.open(
                SessionRequest(
                    device_id="2",
                    token=_token("2"),
                    round=1,
                    split=split_terms(CONFIG, folder),
                    learning_rate=1e-3,
                ),
                timeout_s=20.0,
            ):
                status = control.round_status(1)
                assert status is not None
                sessions = by_device(status)
                watch = StepWatch(control.round_status, steps=2, grace_s=3600.0, connect_s=0.0)
                devices = watch.look(1, [1, 2, 3], {}, elapsed_s=10.0)
                after_reply = watch.look(1, [1, 2, 3], {1: "done"}, elapsed_s=10.0)
        assert control.round_status(0) == []  # no session of round 0
    finally:
        control.close()
        server.stop(grace=None)

    trained, idle = sessions["1"], sessions["2"]
    assert set(sessions) == {"1", "2"}
    assert (trained.steps_done, trained.closed) == (2, True)  # closed: waits for the commit
    assert trained.first_step_s_ago is not None and trained.last_step_s_ago is not None
    assert trained.opened_s_ago >= trained.first_step_s_ago >= trained.last_step_s_ago >= 0
    assert (idle.steps_done, idle.closed, idle.last_step_s_ago) == (0, False, None)
    # the device that trained owes no step; the one connected and the one not seen are starting
    assert devices is not None and after_reply is not None
    assert [(d.node_id, d.steps_done, d.state) for d in devices] == [
        (1, 2, "finished"),
        (2, 0, "starting"),
        (3, 0, "starting"),
    ]
    assert [(d.node_id, d.state) for d in after_reply] == [
        (1, "done"),
        (2, "starting"),
        (3, "starting"),
    ]


def test_round_status_is_signed_like_every_control_call() -> None:
    """Device ids and their progress are the run's: a caller without the secret learns nothing,
    and the ServerApp's client, refused, says it cannot tell (None) instead of failing the round."""
    server = build_stage_server(CONFIG, secret=SECRET, port=0).start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.StageControlStub(channel).RoundStatus(
                    pb.RoundStatusRequest(round=1), timeout=10
                )
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stranger = StageControlClient(server.address, "another-secret-of-16-bytes")
        assert stranger.round_status(1) is None
        stranger.close()
    finally:
        server.stop(grace=None)


def test_steps_with_no_microbatch_count_nothing_and_earn_no_merge() -> None:
    """A device that sends STEP_END without any microbatch gets STEP_DONE for each, but the
    server counts no step, row or token for it, and its session is not merged at the commit;
    the honest device's weight is the rows the server trained (steps x batch here)."""
    folder = resolve_model("tiny-llama")
    server = build_stage_server(CONFIG, secret=SECRET, port=0, folder=folder).start()
    control = StageControlClient(server.address, SECRET)
    try:
        control.reset_adapter()
        control.begin_round(1, "run")
        trainer = DeviceTrainer(CONFIG, device_id="1", folder=folder)
        with StageClient(server.address) as client:
            trainer.train_round(client, _batches(2), round_=1, token=_token("1"))
            with client.open(
                SessionRequest(
                    device_id="2",
                    token=_token("2"),
                    round=1,
                    split=split_terms(CONFIG, folder),
                    learning_rate=1e-3,
                ),
                timeout_s=20.0,
            ) as empty:
                for step in range(3):
                    empty.send(StageMsg(Kind.STEP_END, step))
                    assert empty.receive(Kind.STEP_DONE, step, 0).kind is Kind.STEP_DONE
                status = control.round_status(1)
            committed = control.commit_round(1, {"1": 2 * BATCH, "2": 3 * BATCH})
    finally:
        control.close()
        server.stop(grace=None)

    assert status is not None
    sessions = by_device(status)
    assert (sessions["2"].steps_done, sessions["2"].rows_done, sessions["2"].tokens_done) == (
        0,
        0,
        0,
    )
    assert (sessions["1"].steps_done, sessions["1"].rows_done) == (2, 2 * BATCH)
    assert sessions["1"].tokens_done == 2 * BATCH * SEQ
    assert committed.merged == 1  # the honest device only
