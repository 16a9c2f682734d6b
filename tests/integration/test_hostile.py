"""One hostile or broken device cannot poison, crash or starve a StageServer.

Every test talks to a real StageServer over loopback gRPC (port 0) with raw protobuf messages, as
an attacker would, and checks the documented status code, that nothing of the bad work stays on
the server, and that the other sessions' results stay exact.
"""

from __future__ import annotations

import base64
import logging
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from harness.stage import StreamKeys, hold_compute, stage_server
from harness.waits import wait_for

from fedpipe.config import FedpipeConfig, ModelConfig, PipelineConfig, ServerConfig, TrainConfig
from fedpipe.edge.trainer import split_terms
from fedpipe.models import resolve_model
from fedpipe.proto import stage_pb2 as pb
from fedpipe.proto import stage_pb2_grpc as pb_grpc
from fedpipe.server.stage_server import StageServer
from fedpipe.wire.channels import SESSION_HEADER, STREAM_KEY_HEADER
from fedpipe.wire.control_servicer import adapter_chunks, adapter_from_chunks
from fedpipe.wire.serde import seal, split_to_proto
from fedpipe.wire.tensors import labels_to_proto, tensor_to_proto

MB, SEQ, HIDDEN = 2, 16, 64  # tiny-llama: hidden 64, 512 positions, vocab 258
RPC_TIMEOUT = 20.0
BASE = FedpipeConfig(
    pipeline=PipelineConfig(microbatches=2, schedule="gpipe", timeout_s=20.0),
    train=TrainConfig(batch_size=4, seq_len=SEQ, lr=1e-2),
)
S = grpc.StatusCode


# -- helpers --------------------------------------------------------------------------------------
def _config(split: str = "u", **server: object) -> FedpipeConfig:
    model = ModelConfig(split=split, tail_layers=0 if split == "two" else 1)
    return FedpipeConfig(
        model=model, pipeline=BASE.pipeline, train=BASE.train, server=ServerConfig(**server)
    )


KEYS = StreamKeys()  # the stream key of each session these tests open


SERVER_CONFIG = _config()  # for the `server` fixture (conftest.py)


@pytest.fixture(scope="module")
def stub(server: StageServer) -> Iterator[pb_grpc.StageLinkStub]:
    with grpc.insecure_channel(server.address) as chan:
        yield pb_grpc.StageLinkStub(chan)


def _serving(folder, split: str = "u", **server: object) -> AbstractContextManager[StageServer]:  # type: ignore[no-untyped-def]
    """A StageServer of its own with these ``server.*`` limits, stopped when the block ends."""
    return stage_server(_config(split, **server), folder=folder)


def _split(mode: str = "u") -> pb.SplitSpec:
    """The split a device of ``_config(mode)`` sends (the server refuses a session without one)."""
    return split_to_proto(split_terms(_config(mode), resolve_model("tiny-llama")))


def _open(stub: pb_grpc.StageLinkStub, device_id: str, *, mode: str = "u", **kw: object) -> str:
    kw.setdefault("learning_rate", 1e-2)
    kw.setdefault("split", _split(mode))
    request = pb.OpenSessionRequest(device_id=device_id, **kw)  # type: ignore[arg-type]
    return KEYS.opened(stub.OpenSession(request, timeout=RPC_TIMEOUT))


def _refusal(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def _values(seed: int, shape: tuple[int, ...] = (MB, SEQ, HIDDEN)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _msg(kind: int, *, mb: int = 0, step: int = 0, tensor: torch.Tensor | None = None, **kw):  # type: ignore[no-untyped-def]
    out = pb.StageMessage(kind=kind, step=step, microbatch=mb, **kw)
    if tensor is not None:
        out.tensor.CopyFrom(tensor_to_proto(tensor, "fp32"))
    return out


def _raw_tensor(shape: tuple[int, ...]) -> pb.Tensor:
    n = 4 * int(torch.Size(shape).numel())
    return pb.Tensor(codec=pb.FP32, shape=shape, data=b"\0" * n)


class _Stream:
    """An Exchange stream driven by hand; the request side stays open until ``close()``."""

    def __init__(self, stub: pb_grpc.StageLinkStub, session_id: str) -> None:
        self._requests: queue.Queue[pb.StageMessage | None] = queue.Queue()
        self.call = stub.Exchange(
            iter(self._requests.get, None),
            metadata=KEYS.metadata(session_id),
            timeout=RPC_TIMEOUT,
        )

    def send(self, *msgs: pb.StageMessage) -> None:
        for msg in msgs:
            self._requests.put(seal(msg))  # a hostile device computes checksums too

    def next(self) -> pb.StageMessage:
        return next(self.call)

    def error(self) -> grpc.RpcError:
        """Read until the stream ends with an error; return it."""
        return _refusal(lambda: [self.next() for _ in range(10_000)])

    def close(self) -> None:
        self._requests.put(None)
        self.call.cancel()


def _stream_error(stub: pb_grpc.StageLinkStub, session_id: str, *msgs: pb.StageMessage):  # type: ignore[no-untyped-def]
    stream = _Stream(stub, session_id)
    try:
        stream.send(*msgs)
        return stream.error()
    finally:
        stream.close()


def _step(stream: _Stream, seed: int, *, step: int = 0, microbatches: int = 2) -> None:
    """One full training step (U-shaped split) of deterministic activations and gradients."""
    for m in range(microbatches):
        stream.send(_msg(pb.ACTIVATION, mb=m, step=step, tensor=_values(seed + m)))
    for m in range(microbatches):
        assert (stream.next().kind, m) == (pb.OUTPUT, m)
    for m in range(microbatches):
        stream.send(_msg(pb.OUTPUT_GRAD, mb=m, step=step, tensor=_values(seed + 100 + m)))
    for m in range(microbatches):
        assert (stream.next().kind, m) == (pb.INPUT_GRAD, m)
    stream.send(_msg(pb.STEP_END, step=step))
    assert stream.next().kind == pb.STEP_DONE


def _load(control: pb_grpc.StageControlStub, state: dict[str, torch.Tensor] | None = None):  # type: ignore[no-untyped-def]
    """LoadAdapter as the ServerApp sends it (None: reset, as a run starts)."""
    return control.LoadAdapter(adapter_chunks(state), timeout=RPC_TIMEOUT)


def _get(control: pb_grpc.StageControlStub) -> dict[str, torch.Tensor]:
    pieces = control.GetAdapter(pb.AdapterRequest(), timeout=RPC_TIMEOUT)
    state = adapter_from_chunks(next(pieces), pieces, max_bytes=2**40)
    assert state is not None
    return state


def _adapter(server: StageServer, session_id: str) -> dict[str, torch.Tensor]:
    return server.runtime.bank.state_dict(session_id)


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


# -- 1. bad values and shapes --------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_tensor_is_invalid_argument(
    server: StageServer, stub: pb_grpc.StageLinkStub, bad: float
) -> None:
    session_id = _open(stub, "nan-sender")
    x = _values(0)
    x[1, 3, 7] = bad
    error = _stream_error(stub, session_id, _msg(pb.ACTIVATION, tensor=x))
    assert error.code() == S.INVALID_ARGUMENT
    assert "1 of 2048 values are NaN or Inf" in error.details()
    assert server.runtime.session(session_id).cache == {}


@pytest.mark.parametrize(
    ("declared", "shape", "message"),
    [
        ({}, (0, 2**40, HIDDEN), "1 <= batch <= 64"),  # zero rows, a huge claimed length
        ({}, (MB, 513, HIDDEN), "1 <= tokens <= 512"),  # past the model's positions
        ({"microbatch_size": 2, "seq_len": 8}, (3, 8, HIDDEN), "1 <= batch <= 2"),
        ({"microbatch_size": 2, "seq_len": 8}, (2, 9, HIDDEN), "1 <= tokens <= 8"),
        ({}, (MB, SEQ, HIDDEN, 1), "expected (*, *, 64)"),
    ],
    ids=["zero-dim", "past-positions", "batch-over-declared", "seq-over-declared", "rank-4"],
)
def test_shapes_outside_the_declaration_are_invalid_argument(
    server: StageServer,
    stub: pb_grpc.StageLinkStub,
    declared: dict[str, int],
    shape: tuple[int, ...],
    message: str,
) -> None:
    session_id = _open(stub, "shaper", **declared)
    tensor = pb.Tensor(codec=pb.FP32, shape=shape)  # refused before its (absent) data is read
    error = _stream_error(stub, session_id, pb.StageMessage(kind=pb.ACTIVATION, tensor=tensor))
    assert error.code() == S.INVALID_ARGUMENT, error.details()
    assert f"shape {shape}" in error.details() and message in error.details()


@pytest.mark.parametrize(
    ("request_kw", "message"),
    [
        ({"learning_rate": 1e30}, "learning rate 1e+30 refused: the server allows (0, 0.01]"),
        ({"learning_rate": float("nan")}, "learning rate nan refused"),
        ({"weight_decay": 5.0}, "weight decay 5 refused: the server allows [0, 0.1]"),
        ({"weight_decay": -1.0}, "weight decay -1 refused"),
        ({"seq_len": 513}, "seq_len 513 refused: the server allows 1 to 512"),
        ({"microbatch_size": 65}, "microbatch_size 65 refused: the server allows 1 to 64"),
        ({"microbatch_size": -1}, "microbatch_size -1 refused"),
    ],
    ids=["huge-lr", "nan-lr", "huge-wd", "negative-wd", "long-seq", "big-batch", "neg-batch"],
)
def test_open_session_outside_the_server_bounds_is_invalid_argument(
    stub: pb_grpc.StageLinkStub, request_kw: dict[str, float], message: str
) -> None:
    error = _refusal(lambda: _open(stub, "greedy", **request_kw))
    assert error.code() == S.INVALID_ARGUMENT
    assert message in error.details(), error.details()


def test_learning_rate_at_the_limit_is_accepted(stub: pb_grpc.StageLinkStub) -> None:
    assert _open(stub, "at-limit", learning_rate=1e-2, weight_decay=0.1)


@pytest.mark.parametrize(
    ("msg", "message"),
    [
        (
            pb.StageMessage(kind=pb.OUTPUT),
            "OUTPUT (step 0, microbatch 0) is not a device-to-server",
        ),
        (pb.StageMessage(kind=pb.ACTIVATION), "carries no tensor"),
        (
            pb.StageMessage(
                kind=pb.ACTIVATION, tensor=_raw_tensor((MB, SEQ, HIDDEN)), loss_scale=2
            ),
            "loss_scale 2.0 is outside [0, 1]",
        ),
    ],
    ids=["server-kind", "no-tensor", "loss-scale"],
)
def test_malformed_messages_are_invalid_argument(
    stub: pb_grpc.StageLinkStub, msg: pb.StageMessage, message: str
) -> None:
    error = _stream_error(stub, _open(stub, "malformed"), msg)
    assert error.code() == S.INVALID_ARGUMENT
    assert message in error.details(), error.details()


def test_labels_outside_the_vocabulary_are_invalid_argument(folder) -> None:  # type: ignore[no-untyped-def]
    with _serving(folder, split="two") as two:
        vocab = two.split.vocab_size
        with grpc.insecure_channel(two.address) as chan:
            stub = pb_grpc.StageLinkStub(chan)
            for bad in (vocab, -1, -101):
                labels = torch.zeros(MB, SEQ, dtype=torch.long)
                labels[1, 2] = bad
                msg = _msg(pb.ACTIVATION, tensor=_values(1), loss_scale=0.01)
                msg.labels.CopyFrom(labels_to_proto(labels))
                error = _stream_error(stub, _open(stub, "labeller", mode="two"), msg)
                assert error.code() == S.INVALID_ARGUMENT
                assert (
                    f"1 labels outside [0, {vocab}) and not -100 (first: {bad})" in error.details()
                )
            # -100 and the last token id are fine.
            labels = torch.full((MB, SEQ), -100, dtype=torch.long)
            labels[0, 1] = vocab - 1
            msg = _msg(pb.ACTIVATION, tensor=_values(1), loss_scale=0.01)
            msg.labels.CopyFrom(labels_to_proto(labels))
            stream = _Stream(stub, _open(stub, "labeller", mode="two"))
            try:
                stream.send(msg)
                assert stream.next().kind == pb.INPUT_GRAD
            finally:
                stream.close()


def test_overflowing_gradient_is_refused_and_leaves_nothing(
    server: StageServer, stub: pb_grpc.StageLinkStub
) -> None:
    """Finite but huge values that overflow in the backward never reach the device or adapter."""
    session_id = _open(stub, "overflow")
    stream = _Stream(stub, session_id)
    try:
        stream.send(_msg(pb.ACTIVATION, tensor=_values(2)))
        assert stream.next().kind == pb.OUTPUT
        stream.send(_msg(pb.OUTPUT_GRAD, tensor=torch.full((MB, SEQ, HIDDEN), 3e38)))
        error = stream.error()
    finally:
        stream.close()
    assert error.code() == S.INVALID_ARGUMENT
    assert "would hold NaN or Inf" in error.details()
    info = server.runtime.session(session_id)
    assert info.cache == {} and all(
        p.grad is None for p in info.optimizer.param_groups[0]["params"]
    )


def test_commit_never_merges_a_non_finite_adapter(folder, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    with _serving(folder) as server, grpc.insecure_channel(server.address) as chan:
        _commit_with_a_poisoned_adapter(server, chan, caplog)


def _commit_with_a_poisoned_adapter(
    server: StageServer, chan: grpc.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    runtime = server.runtime
    stub, control = pb_grpc.StageLinkStub(chan), pb_grpc.StageControlStub(chan)
    # A run starts as the ServerApp starts one: the adapter (re)set, then the round begun.
    _load(control)
    control.BeginRound(pb.BeginRoundRequest(round=7, run_id="hostile"), timeout=RPC_TIMEOUT)
    ids = {d: _open(stub, d, round=7) for d in ("healthy", "poisoned")}
    for seed, session_id in enumerate(ids.values()):
        stream = _Stream(stub, session_id)
        try:
            _step(stream, seed)
        finally:
            stream.close()
    healthy = _adapter(server, ids["healthy"])
    # A session's adapter goes bad however it happened (e.g. a learning rate within bounds that
    # still diverged); the commit must notice.
    with torch.no_grad():
        runtime.bank.parameters(ids["poisoned"])[0][0, 0] = float("nan")
    request = pb.CommitRoundRequest(
        round=7,
        finished=[pb.DeviceWeight(device_id=d, weight=1.0) for d in ("healthy", "poisoned")],
    )
    with caplog.at_level(logging.WARNING, logger="fedpipe.server.runtime"):
        reply = control.CommitRound(request, timeout=RPC_TIMEOUT)
    assert (reply.merged, reply.discarded) == (1, 1)
    assert list(reply.dropped) == ["poisoned"]
    assert "1 of" in reply.dropped_reason[0] and "are NaN or Inf" in reply.dropped_reason[0]
    assert "[poisoned] round 7: adapter not merged" in caplog.text
    merged = _get(control)
    _assert_equal(merged, healthy)

    # 4. A retried commit gets the same reply and changes nothing.
    again = control.CommitRound(request, timeout=RPC_TIMEOUT)
    assert again == reply
    _assert_equal(runtime.global_state(), healthy)


def test_device_side_decode_refuses_non_finite_replies() -> None:
    from fedpipe.errors import TensorFormatError
    from fedpipe.wire.serde import msg_from_proto

    reply = _msg(pb.OUTPUT, tensor=torch.tensor([[[1.0, float("nan")]]]))
    with pytest.raises(TensorFormatError, match="1 of 2 values are NaN or Inf"):
        msg_from_proto(reply)


# -- 2. a failed step leaves nothing -------------------------------------------------------------
@pytest.mark.parametrize("failure", ["bad-message", "replaced-stream", "vanished"])
def test_step_after_a_failed_one_equals_a_clean_step(
    server: StageServer, stub: pb_grpc.StageLinkStub, failure: str
) -> None:
    clean = _open(stub, f"clean-{failure}")
    stream = _Stream(stub, clean)
    try:
        _step(stream, seed=10)
    finally:
        stream.close()

    failed = _open(stub, f"failed-{failure}")
    first = _Stream(stub, failed)
    # Half a step: both forwards and one backward, so the adapter holds a gradient.
    for m in range(2):
        first.send(_msg(pb.ACTIVATION, mb=m, tensor=_values(10 + m)))
    assert [first.next().kind for _ in range(2)] == [pb.OUTPUT] * 2
    first.send(_msg(pb.OUTPUT_GRAD, mb=0, tensor=_values(110)))
    assert first.next().kind == pb.INPUT_GRAD
    if failure == "bad-message":
        bad = _values(111)
        bad[0, 0, 0] = float("nan")
        first.send(_msg(pb.OUTPUT_GRAD, mb=1, tensor=bad))
        assert first.error().code() == S.INVALID_ARGUMENT
    elif failure == "vanished":
        first.close()
    second = _Stream(stub, failed)  # the device retries the step on a new stream
    try:
        if failure == "replaced-stream":
            assert first.error().code() == S.ABORTED  # the old stream ends at once...
            first.close()  # ...and its end does not touch the new one
        _step(second, seed=10)
    finally:
        second.close()
        first.close()
    _assert_equal(_adapter(server, failed), _adapter(server, clean))
    assert server.runtime.session(failed).steps_done == 1


@pytest.mark.parametrize("presented", ["none", "wrong", "another-session's"])
def test_a_stream_needs_the_session_key_not_just_its_id(
    server: StageServer, stub: pb_grpc.StageLinkStub, presented: str
) -> None:
    """A client that knows a session's id but not its stream key cannot open a stream of it:
    UNAUTHENTICATED, and the device's own stream goes on untouched (it is not replaced), so its
    step completes as if nobody had tried."""
    victim = _open(stub, f"victim-{presented}")
    other = _open(stub, f"other-{presented}")
    key = {"none": "", "wrong": "x" * 32, "another-session's": KEYS.metadata(other)[1][1]}
    own = _Stream(stub, victim)
    try:
        own.send(_msg(pb.ACTIVATION, mb=0, tensor=_values(1)))
        assert own.next().kind == pb.OUTPUT
        thief = stub.Exchange(
            iter([seal(_msg(pb.ACTIVATION, mb=1, tensor=_values(2)))]),
            metadata=((SESSION_HEADER, victim), (STREAM_KEY_HEADER, key[presented])),
            timeout=RPC_TIMEOUT,
        )
        refused = _refusal(lambda: list(thief))
        assert refused.code() == S.UNAUTHENTICATED, refused.details()
        assert "stream key does not match" in refused.details()
        own.send(_msg(pb.ACTIVATION, mb=1, tensor=_values(2)))
        assert own.next().kind == pb.OUTPUT  # still the device's stream
        for m in range(2):
            own.send(_msg(pb.OUTPUT_GRAD, mb=m, tensor=_values(10 + m)))
            assert own.next().kind == pb.INPUT_GRAD
        own.send(_msg(pb.STEP_END))
        assert own.next().kind == pb.STEP_DONE
    finally:
        own.close()
    assert server.runtime.session(victim).steps_done == 1
    assert server.runtime.session(victim).streams_opened == 1


# -- 3. no client can starve the others ----------------------------------------------------------
def test_session_ids_are_distinct_192_bit_values_without_structure(
    stub: pb_grpc.StageLinkStub,
) -> None:
    """64 session ids, each opened by one device (a new one replaces the last): every id is 24
    bytes (192 bits), none repeats, and together they look like independent uniform bits: every
    bit position takes both values (a counter, a clock or a shared prefix leaves positions
    fixed), the share of ones is within 5 standard deviations of a half, and any two ids differ
    in at least 48 of 192 bits (random pairs differ in 96 +- 7; the chance that a pair of
    random ids differs in 48 or fewer is below 1e-11). Each bound fails a true random
    source with probability below 1e-6."""
    ids = [_open(stub, "one-device") for _ in range(64)]
    assert len(set(ids)) == len(ids)
    raw = []
    for session_id in ids:
        assert "one-device" not in session_id
        value = base64.urlsafe_b64decode(session_id + "=" * (-len(session_id) % 4))
        assert len(value) == 24, session_id
        raw.append(int.from_bytes(value, "big"))
    bits = 192
    for position in range(bits):
        assert len({(v >> position) & 1 for v in raw}) == 2, f"bit {position} never changes"
    ones, total = sum(v.bit_count() for v in raw), bits * len(raw)
    assert abs(ones - total / 2) <= 5 * (total / 4) ** 0.5, (ones, total)
    closest = min((a ^ b).bit_count() for i, a in enumerate(raw) for b in raw[i + 1 :])
    assert closest >= 48, closest


def test_queued_work_past_the_bound_is_resource_exhausted(folder) -> None:  # type: ignore[no-untyped-def]
    gate = threading.Event()
    with (
        _serving(folder, max_pending=4) as small,
        hold_compute(small.runtime, gate, timeout=RPC_TIMEOUT),  # the worker held
    ):
        with grpc.insecure_channel(small.address) as chan:
            stub = pb_grpc.StageLinkStub(chan)
            flooder = _open(stub, "flooder")
            evals = [
                _msg(pb.ACTIVATION, mb=m, tensor=_values(m), forward_only=True) for m in range(6)
            ]
            error = _stream_error(stub, flooder, *evals)
            assert error.code() == S.RESOURCE_EXHAUSTED
            assert "4 messages queued or unread, its limit (server.max_pending = 4)" in (
                error.details()
            )
            gate.set()
            # The flood is forgotten; the device, and anyone else, trains normally.
            for device in ("flooder", "bystander"):
                stream = _Stream(stub, _open(stub, device))
                try:
                    _step(stream, seed=3)
                finally:
                    stream.close()


def test_worker_serves_sessions_round_robin(folder) -> None:  # type: ignore[no-untyped-def]
    calls: list[list[str]] = []  # per compute call, the session of each message in it
    gate = threading.Event()
    with (
        _serving(folder, max_pending=64) as fair,
        hold_compute(fair.runtime, gate, timeout=RPC_TIMEOUT, calls=calls),
    ):
        with grpc.insecure_channel(fair.address) as chan:
            stub = pb_grpc.StageLinkStub(chan)
            flooder, normal = _open(stub, "flood"), _open(stub, "normal")
            flood, calm = _Stream(stub, flooder), _Stream(stub, normal)
            flood.send(
                *[
                    _msg(pb.ACTIVATION, mb=m, tensor=_values(m), forward_only=True)
                    for m in range(30)
                ]
            )
            # The held worker has taken one call's worth of the flood (at most a quantum).
            held = fair.runtime.policy.quantum
            wait_for(lambda: fair.runtime.pending(flooder) >= 30 - held, "the flood to be queued")
            calm.send(
                *[_msg(pb.ACTIVATION, mb=m, tensor=_values(m), forward_only=True) for m in range(3)]
            )
            wait_for(lambda: fair.runtime.pending(normal) == 3, "the normal session's work")
            gate.set()
            assert [calm.next().microbatch for _ in range(3)] == [0, 1, 2]
            assert [flood.next().microbatch for _ in range(30)] == list(range(30))
            flood.close()
            calm.close()
    # The held call took the first of the flood: what had arrived, at most a quantum (1 or 2,
    # with the load on the machine). After it the sessions take turns of at most two queued
    # messages each, the flood first (it was in the ring before the normal session):
    # F F N N, then F F N. The normal work is done within the held call + 7 computed.
    # First-come, first-served would compute it after all 30 of the flood (positions 30-32).
    order = [session for call in calls for session in call]
    held = len(calls[0])
    assert calls[0] == [flooder] * held and 1 <= held <= fair.runtime.policy.quantum, calls
    positions = [i for i, session in enumerate(order) if session == normal]
    assert positions[-1] <= held + 6, order
    runs = "".join("N" if s == normal else "F" for s in order[: positions[-1] + 1])
    assert "FFF" not in runs.lstrip("F") and "NNN" not in runs, runs
    assert order.count(flooder) == 30 and order.count(normal) == 3


def test_idle_streams_past_the_cap_are_refused_and_health_answers(folder) -> None:  # type: ignore[no-untyped-def]
    """Idle streams past server.max_streams are RESOURCE_EXHAUSTED; health and others go on.

    Without the cap, a few hundred idle streams took every gRPC thread and health checks hung.
    """
    cap, total = 8, 40
    streams: list[_Stream] = []
    with (
        _serving(folder, max_sessions=total + 1, max_streams=cap) as busy,
        grpc.insecure_channel(busy.address) as chan,
    ):
        try:
            stub = pb_grpc.StageLinkStub(chan)
            sessions = [_open(stub, f"idle-{i}") for i in range(total)]
            streams = [_Stream(stub, s) for s in sessions[:cap]]
            wait_for(lambda: busy._host.link.slots.live == cap, f"{cap} live streams")
            streams += [_Stream(stub, s) for s in sessions[cap:]]
            for stream in streams[cap:]:
                error = stream.error()
                assert error.code() == S.RESOURCE_EXHAUSTED, error.details()
                assert "serves 8 streams at once (server.max_streams)" in error.details()
            health = health_pb2_grpc.HealthStub(chan).Check(
                health_pb2.HealthCheckRequest(service="fedpipe.proto.StageLink"), timeout=5
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            streams[0].close()  # a slot frees up; a device uses it
            wait_for(lambda: busy._host.link.slots.live < cap, "a free stream slot")
            stream = _Stream(stub, _open(stub, "worker"))
            try:
                _step(stream, seed=4)
            finally:
                stream.close()
        finally:
            for stream in streams:
                stream.close()


def test_idle_stream_and_session_expire_with_a_log_line(
    folder, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    with _serving(folder, stream_idle_s=0.3, session_idle_s=1.0) as idle:
        with grpc.insecure_channel(idle.address) as chan, caplog.at_level(logging.INFO):
            stub = pb_grpc.StageLinkStub(chan)
            session_id = _open(stub, "sleeper")
            stream = _Stream(stub, session_id)
            try:
                error = stream.error()  # nothing sent: the server ends the stream
            finally:
                stream.close()
            assert error.code() == S.DEADLINE_EXCEEDED
            assert "over server.stream_idle_s = 0.3" in error.details()
            wait_for(lambda: not idle.runtime.sessions(), "the idle session to be dropped")
            assert "[sleeper] session" in caplog.text and "dropped: idle for" in caplog.text
            assert "s (server.session_idle_s = 1)" in caplog.text
            error = _stream_error(stub, session_id, _msg(pb.STEP_END))
            assert error.code() == S.NOT_FOUND


_KILLED_DEVICE = textwrap.dedent(
    """
    import sys, time, torch
    from fedpipe.messages import Kind, StageMsg
    from fedpipe.config import FedpipeConfig, ModelConfig
    from fedpipe.edge.trainer import split_terms
    from fedpipe.models import resolve_model
    from fedpipe.wire.backend import SessionRequest
    from fedpipe.wire.link_client import StageClient
    config = FedpipeConfig(model=ModelConfig(tail_layers=1))
    split = split_terms(config, resolve_model("tiny-llama"))
    client = StageClient(sys.argv[1])
    request = SessionRequest(device_id="killed", round=0, learning_rate=1e-2, split=split)
    session = client.open(request)
    session.send(StageMsg(Kind.ACTIVATION, 0, 0, tensor=torch.randn(2, 16, 64)))
    session.receive(Kind.OUTPUT, 0, 0)
    print("mid-step", flush=True)
    time.sleep(600)
    """
)


def test_device_killed_mid_step_frees_its_session(folder) -> None:  # type: ignore[no-untyped-def]
    deadline = 2.0
    with _serving(folder, session_idle_s=deadline) as victim_server:
        device = subprocess.Popen(
            [sys.executable, "-c", _KILLED_DEVICE, victim_server.address],
            stdout=subprocess.PIPE,
            env=dict(os.environ),
            text=True,
        )
        try:
            assert device.stdout is not None
            assert device.stdout.readline().strip() == "mid-step"
            (info,) = victim_server.runtime.sessions()
            assert sorted(info.cache) == [0]
            device.send_signal(signal.SIGKILL)
            device.wait(timeout=10)
            wait_for(lambda: not info.cache, "the killed device's step to be undone")
            wait_for(lambda: not victim_server.runtime.sessions(), "its session", deadline + 5)
            assert info.session_id not in victim_server.runtime.bank.names()
        finally:
            if device.poll() is None:
                os.kill(device.pid, signal.SIGKILL)
                device.wait(timeout=10)


# -- 4. control calls ----------------------------------------------------------------------------
def test_load_adapter_refuses_non_finite_values(server: StageServer) -> None:

    with grpc.insecure_channel(server.address) as chan:
        control = pb_grpc.StageControlStub(chan)
        _load(control)  # a run has begun
        before = _get(control)
        bad = {k: v.clone() for k, v in before.items()}
        next(iter(bad.values())).view(-1)[0] = float("inf")
        error = _refusal(lambda: _load(control, bad))
        assert error.code() == S.INVALID_ARGUMENT
        assert "values of" in error.details() and "are NaN or Inf" in error.details()
        after = _get(control)
    _assert_equal(after, before)


def test_get_adapter_waits_for_a_merge_in_progress(server: StageServer) -> None:
    """GetAdapter/LoadAdapter take the lock merges hold, so they never see half a merge."""
    from concurrent.futures import ThreadPoolExecutor

    with grpc.insecure_channel(server.address) as chan, ThreadPoolExecutor(2) as pool:
        control = pb_grpc.StageControlStub(chan)
        _load(control)  # a run has begun
        with server.runtime._bank_lock:  # what CommitRound holds while it merges
            get = pool.submit(_get, control)
            load = pool.submit(_load, control)
            time.sleep(0.5)
            assert not get.done() and not load.done()
        assert get.result(timeout=RPC_TIMEOUT)
        load.result(timeout=RPC_TIMEOUT)
