"""The StageServer under bad input: a clear status code, nothing lost, everyone else still served.

Every test talks to a real StageServer over loopback gRPC (port 0): raw protobuf messages for
what a well-behaved client would never send, and real ``DeviceTrainer`` rounds for the devices
that must keep training alongside.
"""

from __future__ import annotations

import functools
import queue
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from harness.batches import random_batches
from harness.close import FLOAT32_ATOL, FLOAT32_REL, assert_close_to_scale
from harness.stage import StreamKeys, stage_server
from harness.waits import wait_for

from fedpipe.auth.tokens import issue_token
from fedpipe.config import FedpipeConfig, PipelineConfig, ServerConfig, TrainConfig
from fedpipe.edge.trainer import DeviceTrainer, split_terms
from fedpipe.messages import Kind, StageMsg
from fedpipe.models import resolve_model
from fedpipe.proto import stage_pb2 as pb
from fedpipe.proto import stage_pb2_grpc as pb_grpc
from fedpipe.server.runtime import StageRuntime
from fedpipe.server.stage_server import StageServer
from fedpipe.wire.backend import SessionRequest
from fedpipe.wire.link_client import StageClient
from fedpipe.wire.serde import seal, split_to_proto

BATCH, SEQ, HIDDEN = 4, 16, 64  # tiny-llama's hidden size is 64
CONFIG = FedpipeConfig(
    pipeline=PipelineConfig(microbatches=2, schedule="gpipe", timeout_s=20.0),
    train=TrainConfig(batch_size=BATCH, seq_len=SEQ, lr=1e-2),
)
SECRET = "s3cret-for-tests-only"  # tokens need a secret of at least 16 bytes
RPC_TIMEOUT = 20.0
Batch = dict[str, torch.Tensor]


# -- fixtures and helpers ------------------------------------------------------------------------
KEYS = StreamKeys()  # the stream key of each session these tests open


SERVER_CONFIG = CONFIG  # for the `server` fixture (conftest.py)


@pytest.fixture(scope="module")
def channel(server: StageServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.address) as chan:
        yield chan


@pytest.fixture
def stub(channel: grpc.Channel) -> pb_grpc.StageLinkStub:
    return pb_grpc.StageLinkStub(channel)


def _batches(seed: int, n: int = 2) -> list[Batch]:
    return random_batches(n, BATCH, SEQ, seed=seed)


def _train(address: str, folder, device_id: str, batches: list[Batch], **kw) -> list[float]:  # type: ignore[no-untyped-def]
    """One round of a fresh device (same initial adapters every time); returns its step losses."""
    trainer = DeviceTrainer(CONFIG, device_id=device_id, folder=folder)
    with StageClient(address) as client:
        report = trainer.train_round(client, batches, **kw)
    return [step.loss for step in report.steps]


@functools.cache
def _split() -> pb.SplitSpec:
    """The split a device built from CONFIG sends (the server refuses sessions without it)."""
    return split_to_proto(split_terms(CONFIG, resolve_model("tiny-llama")))


def _open(stub: pb_grpc.StageLinkStub, device_id: str, **kw) -> str:  # type: ignore[no-untyped-def]
    kw.setdefault("split", _split())
    request = pb.OpenSessionRequest(device_id=device_id, learning_rate=1e-2, **kw)
    return KEYS.opened(stub.OpenSession(request, timeout=RPC_TIMEOUT))


def _tensor(shape: tuple[int, ...], *, data: bytes | None = None) -> pb.Tensor:
    n = 4 * int(torch.Size(shape).numel())
    return pb.Tensor(codec=pb.FP32, shape=shape, data=b"\0" * n if data is None else data)


def _message(
    kind: int, *, step: int = 0, microbatch: int = 0, tensor: pb.Tensor
) -> pb.StageMessage:
    return pb.StageMessage(step=step, microbatch=microbatch, kind=kind, tensor=tensor)


class _RawStream:
    """An Exchange stream driven by hand; the request side stays open until ``close()``."""

    def __init__(self, stub: pb_grpc.StageLinkStub, session_id: str) -> None:
        self._requests: queue.Queue[pb.StageMessage | None] = queue.Queue()
        self.call = stub.Exchange(
            iter(self._requests.get, None),
            metadata=KEYS.metadata(session_id),
            timeout=RPC_TIMEOUT,
        )

    def send(self, msg: pb.StageMessage) -> None:
        self._requests.put(seal(msg))

    def next(self) -> pb.StageMessage:
        return next(self.call)

    def close(self) -> None:
        self._requests.put(None)
        self.call.cancel()


def _stream_error(
    stub: pb_grpc.StageLinkStub, session_id: str, *msgs: pb.StageMessage
) -> grpc.RpcError:
    """Send ``msgs`` on a fresh stream of ``session_id``; return the error the stream ends with."""
    stream = _RawStream(stub, session_id)
    try:
        for msg in msgs:
            stream.send(msg)
        with pytest.raises(grpc.RpcError) as info:
            while True:
                stream.next()
        return info.value
    finally:
        stream.close()


def _session_of(runtime: StageRuntime, device_id: str):  # type: ignore[no-untyped-def]
    (info,) = [s for s in runtime.sessions() if s.device_id == device_id]
    return info


# -- health and unknown sessions -----------------------------------------------------------------
@pytest.mark.parametrize("service", ["", "fedpipe.proto.StageLink"])
def test_health_reports_serving(channel: grpc.Channel, service: str) -> None:
    reply = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=RPC_TIMEOUT
    )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_unknown_session_is_not_found(stub: pb_grpc.StageLinkStub) -> None:
    error = _stream_error(
        stub, "made-up-session", _message(pb.ACTIVATION, tensor=_tensor((1, 2, HIDDEN)))
    )
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert "unknown session made-up-…" in error.details()  # ids are logged by prefix only
    assert "open a new session" in error.details()

    with pytest.raises(grpc.RpcError) as info:
        stub.CloseSession(pb.CloseSessionRequest(session_id="made-up-session"), timeout=RPC_TIMEOUT)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "unknown session made-up-…" in info.value.details()


# -- bad messages end one stream, not the server ------------------------------------------------
def test_malformed_tensor_is_invalid_argument_and_the_device_recovers(
    server: StageServer, stub: pb_grpc.StageLinkStub, folder
) -> None:  # type: ignore[no-untyped-def]
    session_id = _open(stub, "bad-bytes")
    short = _tensor((2, SEQ, HIDDEN), data=b"\0" * 100)  # 2*16*64 fp32 values need 8192 bytes
    error = _stream_error(stub, session_id, _message(pb.ACTIVATION, tensor=short))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ACTIVATION tensor (step 0, microbatch 0)" in error.details()
    assert "data has 100 bytes, expected 8192 for shape (2, 16, 64) as fp32" in error.details()
    info = server.runtime.session(session_id)  # nothing half-done stays behind
    assert info.cache == {} and info.step == 0

    # The same device opens a new session (replacing the old one) and trains; so does another.
    losses = _train(server.address, folder, "bad-bytes", _batches(0, n=1))
    assert len(losses) == 1 and 0 < losses[0] < 10
    assert session_id not in {s.session_id for s in server.runtime.sessions()}
    assert len(_train(server.address, folder, "bystander", _batches(1, n=1))) == 1


def test_half_closed_stream_still_gets_its_replies(stub: pb_grpc.StageLinkStub) -> None:
    """A device that sends its last message and half-closes still receives the answers to it."""
    session_id = _open(stub, "half-closer")
    requests = [
        _message(pb.ACTIVATION, microbatch=m, tensor=_tensor((2, SEQ, HIDDEN))) for m in range(3)
    ]
    call = stub.Exchange(
        iter(map(seal, requests)), metadata=KEYS.metadata(session_id), timeout=RPC_TIMEOUT
    )
    replies = list(call)  # ends when the server ends the stream, after its replies
    assert [(r.kind, r.microbatch) for r in replies] == [(pb.OUTPUT, m) for m in range(3)]
    assert all(tuple(r.tensor.shape) == (2, SEQ, HIDDEN) for r in replies)


def test_wrong_hidden_size_names_the_numbers(
    server: StageServer, stub: pb_grpc.StageLinkStub
) -> None:
    session_id = _open(stub, "wide")
    error = _stream_error(stub, session_id, _message(pb.ACTIVATION, tensor=_tensor((2, SEQ, 65))))
    assert error.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
    assert "(*, *, 64)" in error.details() and "(2, 16, 65)" in error.details()
    assert server.runtime.session(session_id).cache == {}


@pytest.mark.parametrize(
    ("msg", "message"),
    [
        (
            _message(pb.OUTPUT_GRAD, microbatch=3, tensor=_tensor((2, SEQ, HIDDEN))),
            "OUTPUT_GRAD for step 0 microbatch 3 without its ACTIVATION",
        ),
        (
            _message(pb.ACTIVATION, step=5, tensor=_tensor((2, SEQ, HIDDEN))),
            "message for step 5, but session .* is at step 0",
        ),
    ],
    ids=["grad-before-activation", "wrong-step"],
)
def test_out_of_order_is_failed_precondition(
    server: StageServer, stub: pb_grpc.StageLinkStub, msg: pb.StageMessage, message: str
) -> None:
    session_id = _open(stub, "out-of-order")
    error = _stream_error(stub, session_id, msg)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert re.search(message, error.details()), error.details()
    assert server.runtime.session(session_id).cache == {}


def test_oversized_message_is_resource_exhausted(folder) -> None:  # type: ignore[no-untyped-def]
    config = FedpipeConfig(
        pipeline=CONFIG.pipeline, train=CONFIG.train, server=ServerConfig(max_message_mb=0.5)
    )
    with stage_server(config, folder=folder) as small:
        with grpc.insecure_channel(small.address) as chan:
            stub = pb_grpc.StageLinkStub(chan)  # the client's own limit is gRPC's default
            session_id = _open(stub, "big")
            huge = _tensor((1, 4096, HIDDEN))  # 1 MiB of fp32
            error = _stream_error(stub, session_id, _message(pb.ACTIVATION, tensor=huge))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert small.runtime.session(session_id).cache == {}
        assert len(_train(small.address, folder, "big", _batches(2, n=1))) == 1


# -- devices that vanish, devices that share ----------------------------------------------------
def test_vanished_device_leaves_nothing_and_others_train_on(server: StageServer, folder) -> None:  # type: ignore[no-untyped-def]
    runtime = server.runtime
    batches = _batches(3, n=3)
    alone = _train(server.address, folder, "alone", batches)

    with ThreadPoolExecutor(1) as pool, StageClient(server.address) as client:
        session = client.open(
            SessionRequest(
                device_id="vanisher", round=0, learning_rate=1e-2, split=split_terms(CONFIG, folder)
            ),
            timeout_s=RPC_TIMEOUT,
        )
        activation = torch.randn(2, SEQ, HIDDEN)
        for mb in range(2):
            session.send(StageMsg(Kind.ACTIVATION, 0, mb, tensor=activation))
        session.receive(Kind.OUTPUT, 0, 1)  # the server holds both microbatches' graphs now
        info = runtime.session(session.session_id)
        assert sorted(info.cache) == [0, 1]
        survivor = pool.submit(_train, server.address, folder, "survivor", batches)
        wait_for(
            lambda: any(s.device_id == "survivor" for s in runtime.sessions()),
            "the second device's session",
        )
        session.abort()  # mid-step, while the survivor trains
        wait_for(lambda: not info.cache, "the vanished device's partial step to be dropped")
        assert info.step == 0 and info.steps_done == 0
        together = survivor.result(timeout=60)
    assert together == pytest.approx(alone, rel=1e-5)
    assert _session_of(runtime, "survivor").steps_done == len(batches)


def test_concurrent_sessions_and_commit_round(server: StageServer, folder) -> None:  # type: ignore[no-untyped-def]
    runtime = server.runtime
    runtime.commit_round(0, {})  # discard what earlier tests left in round 0
    assert runtime.bank.names() == []
    devices = ["d0", "d1", "d2"]
    with ThreadPoolExecutor(len(devices)) as pool:
        runs = [
            pool.submit(_train, server.address, folder, d, _batches(10 + i), round_=1)
            for i, d in enumerate(devices)
        ]
        results = [run.result(timeout=60) for run in runs]
    assert all(len(losses) == 2 for losses in results)
    sessions = {d: _session_of(runtime, d) for d in devices}
    assert len({s.session_id for s in sessions.values()}) == 3
    assert all(s.steps_done == 2 for s in sessions.values())
    assert sorted(runtime.bank.names()) == sorted(s.session_id for s in sessions.values())
    states = {d: runtime.bank.state_dict(s.session_id) for d, s in sessions.items()}
    key = next(iter(states["d0"]))
    assert not torch.equal(states["d0"][key], states["d1"][key]), "sessions share an adapter"

    result = runtime.commit_round(1, {"d0": 1.0, "d1": 3.0})
    assert (result.merged, result.discarded, result.dropped) == (2, 1, {})
    assert runtime.bank.names() == [] and runtime.sessions() == []
    merged = runtime.bank.global_state()
    assert set(merged) == set(states["d0"])
    for name, value in merged.items():
        expected = 0.25 * states["d0"][name] + 0.75 * states["d1"][name]
        assert_close_to_scale(value, expected, rel=FLOAT32_REL, atol=FLOAT32_ATOL, msg=name)


# -- session tokens ------------------------------------------------------------------------------
def test_tokens_gate_sessions_to_the_current_round(folder) -> None:  # type: ignore[no-untyped-def]
    with stage_server(CONFIG, secret=SECRET, folder=folder) as secure:
        with grpc.insecure_channel(secure.address) as chan:
            _check_tokens(pb_grpc.StageLinkStub(chan), secure.address)
        token = issue_token(SECRET, run_id="run", round=1, device_id="t3")
        losses = _train(secure.address, folder, "t3", _batches(4, n=1), round_=1, token=token)
        assert len(losses) == 1


def _refused(stub: pb_grpc.StageLinkStub, device_id: str, message: str, **kw) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as info:
        _open(stub, device_id, **kw)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value.details()
    assert message in info.value.details()


def _check_tokens(stub: pb_grpc.StageLinkStub, address: str) -> None:
    from fedpipe.wire.control_client import StageControlClient

    def token(round_: int, device_id: str = "t1", secret: str = SECRET, run: str = "run") -> str:
        return issue_token(secret, run_id=run, round=round_, device_id=device_id)

    _refused(stub, "t1", "no run has begun on this StageServer", token=token(0))
    control = StageControlClient(address, SECRET)
    control.reset_adapter()
    control.begin_round(0, "run")
    _refused(stub, "t1", "malformed session token")
    _refused(stub, "t1", "MAC does not match", token=token(0, secret="another-secret-16b"))
    _refused(stub, "t1", "token is for device 't2', not 't1'", token=token(0, "t2"))
    _refused(stub, "t1", "token is for run 'other', this StageServer", token=token(0, run="other"))
    once = token(0)
    assert _open(stub, "t1", token=once)
    _refused(stub, "t1", "this session token for device 't1' in round 0 was already", token=once)
    _refused(stub, "t1", "a session token for device 't1' in round 0 was already", token=token(0))
    _refused(stub, "t1", "token is for round 1, this is round 0", token=token(1))
    _refused(
        stub, "t1", "session for round 1, but the server is in round 0", token=token(1), round=1
    )

    with pytest.raises(grpc.RpcError) as info:
        StageControlClient(address, "another-secret-16b").begin_round(1, "run")
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "MAC does not match" in info.value.details()
    control.begin_round(1, "run")
    assert _open(stub, "t1", token=token(1), round=1)
    _refused(stub, "t1", "session for round 0, but the server is in round 1", token=token(0))
    control.close()


def test_control_reset_restores_the_initial_server_adapter() -> None:
    """A new run on a long-lived StageServer starts from the initial adapter, not the last run's."""
    from fedpipe.config import load_config
    from fedpipe.wire.control_client import StageControlClient

    secret = "a-control-secret-for-tests"
    with stage_server(load_config(None, {"model.name": "tiny-llama"}), secret=secret) as server:
        control = StageControlClient(server.address, secret)
        control.reset_adapter()  # a fresh StageServer serves adapters once a run set one
        initial = control.get_adapter()
        changed = {k: v + 1.0 for k, v in initial.items()}
        control.load_adapter(changed)
        assert all(torch.equal(control.get_adapter()[k], changed[k]) for k in initial)
        control.reset_adapter()
        assert all(torch.equal(control.get_adapter()[k], initial[k]) for k in initial)
        control.close()
