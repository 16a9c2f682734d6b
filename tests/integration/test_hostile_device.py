"""A device with a valid session cannot starve or exhaust the StageServer (issue: hostile device).

Streams that never read their replies, link probes used as a memory bomb, and many small
sessions all meet bounds the server enforces itself: streams it ends are cancelled, each device
holds a few streams at most, and one server-wide byte budget bounds what devices make it hold.
Every test runs a real StageServer over loopback gRPC; the memory test runs it in its own
process (``fedpipe server``) and reads that process's resident memory.
"""

from __future__ import annotations

import math
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from harness.stage import StreamKeys
from harness.waits import wait_for

from fedpipe.config import FedpipeConfig, PipelineConfig, ServerConfig, TrainConfig
from fedpipe.edge.trainer import split_terms
from fedpipe.models import resolve_model
from fedpipe.proto import stage_pb2 as pb
from fedpipe.proto import stage_pb2_grpc as pb_grpc
from fedpipe.server.build import build_stage_server
from fedpipe.server.stage_server import StageServer
from fedpipe.wire.channels import EXCHANGE_METHOD
from fedpipe.wire.control_servicer import adapter_chunks
from fedpipe.wire.serde import seal, split_to_proto
from fedpipe.wire.tensors import tensor_to_proto

MB, SEQ, HIDDEN = 2, 16, 64  # tiny-llama: hidden 64, 512 positions
RPC_TIMEOUT = 20.0
S = grpc.StatusCode
BASE = FedpipeConfig(
    pipeline=PipelineConfig(microbatches=2, schedule="gpipe", timeout_s=20.0),
    train=TrainConfig(batch_size=4, seq_len=SEQ, lr=1e-2),
)
# A client that never reads: no BDP probing, so its receive window stays at gRPC's default and a
# reply larger than that blocks the server's send until the stream is cancelled.
_NO_BDP = [("grpc.http2.bdp_probe", 0)]
KEYS = StreamKeys()  # the stream key of each session these tests open


def _config(**server: object) -> FedpipeConfig:
    return FedpipeConfig(pipeline=BASE.pipeline, train=BASE.train, server=ServerConfig(**server))


def _serve(folder: Path, **server: object) -> StageServer:
    return build_stage_server(_config(**server), port=0, folder=folder).start()


def _open(stub: pb_grpc.StageLinkStub, device_id: str, **kw: object) -> str:
    split = split_to_proto(split_terms(BASE, resolve_model("tiny-llama")))
    request = pb.OpenSessionRequest(device_id=device_id, learning_rate=1e-2, split=split, **kw)  # type: ignore[arg-type]
    return KEYS.opened(stub.OpenSession(request, timeout=RPC_TIMEOUT))


def _values(seed: int, shape: tuple[int, ...] = (MB, SEQ, HIDDEN)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _msg(kind: int, *, mb: int = 0, step: int = 0, tensor: torch.Tensor | None = None, **kw):  # type: ignore[no-untyped-def]
    out = pb.StageMessage(kind=kind, step=step, microbatch=mb, **kw)
    if tensor is not None:
        out.tensor.CopyFrom(tensor_to_proto(tensor, "fp32"))
    return out


class _Reader:
    """A stream driven by hand that reads its replies (an honest device)."""

    def __init__(self, chan: grpc.Channel, session_id: str) -> None:
        self._requests: queue.Queue[bytes | None] = queue.Queue()
        self.call = chan.stream_stream(EXCHANGE_METHOD)(
            iter(self._requests.get, None),
            metadata=KEYS.metadata(session_id),
            timeout=RPC_TIMEOUT * 3,
        )

    def send(self, *msgs: pb.StageMessage) -> None:
        for msg in msgs:
            self._requests.put(seal(msg).SerializeToString())

    def next(self) -> pb.StageMessage:
        return pb.StageMessage.FromString(next(self.call))

    def close(self) -> None:
        self._requests.put(None)
        self.call.cancel()


class _NeverReads:
    """A stream on a connection of its own that sends and never reads what comes back."""

    def __init__(self, address: str, session_id: str, *msgs: pb.StageMessage) -> None:
        self.chan = grpc.insecure_channel(address, options=_NO_BDP)
        frames: queue.Queue[bytes | None] = queue.Queue()
        for msg in msgs:
            frames.put(seal(msg).SerializeToString())
        self.call = self.chan.stream_stream(EXCHANGE_METHOD)(
            iter(frames.get, None), metadata=KEYS.metadata(session_id)
        )
        self.frames = frames

    def close(self) -> None:
        self.frames.put(None)
        self.call.cancel()
        self.chan.close()


def _step(stream: _Reader, seed: int) -> None:
    """One training step of deterministic activations and gradients (U-shaped split)."""
    for m in range(2):
        stream.send(_msg(pb.ACTIVATION, mb=m, tensor=_values(seed + m)))
    assert [stream.next().kind for _ in range(2)] == [pb.OUTPUT] * 2
    for m in range(2):
        stream.send(_msg(pb.OUTPUT_GRAD, mb=m, tensor=_values(seed + 100 + m)))
    assert [stream.next().kind for _ in range(2)] == [pb.INPUT_GRAD] * 2
    stream.send(_msg(pb.STEP_END))
    assert stream.next().kind == pb.STEP_DONE


def _trained_adapter(server: StageServer, device_id: str, seed: int) -> dict[str, torch.Tensor]:
    """A device's adapter after one step with ``seed``'s values, trained over gRPC."""
    with grpc.insecure_channel(server.address) as chan:
        stub = pb_grpc.StageLinkStub(chan)
        session_id = _open(stub, device_id)
        stream = _Reader(chan, session_id)
        try:
            _step(stream, seed)
        finally:
            stream.close()
        return {k: v.clone() for k, v in server.runtime.bank.state_dict(session_id).items()}


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as chan:
        reply = health_pb2_grpc.HealthStub(chan).Check(
            health_pb2.HealthCheckRequest(service="fedpipe.proto.StageLink"), timeout=5
        )
    return reply.status == health_pb2.HealthCheckResponse.SERVING


# -- streams that never read ----------------------------------------------------------------------
def test_streams_that_never_read_are_cut_off_and_cannot_starve_other_devices(
    folder: Path,
) -> None:
    """70 never-reading streams of one session, each waiting on a reply larger than gRPC's window:
    the device never holds more than server.max_device_streams of them, the others are refused,
    health answers, another device trains exactly as on a quiet server, and every stalled stream
    is gone within the idle deadline (plus the cancel grace and a reaper pass)."""
    quiet = _serve(folder)
    try:
        expected = _trained_adapter(quiet, "honest", seed=7)
    finally:
        quiet.stop(grace=None)
    idle_s, cap = 2.0, 4
    server = _serve(folder, stream_idle_s=idle_s, max_streams=16, max_device_streams=cap)
    slots = server._host.link.slots
    bad: list[_NeverReads] = []
    try:
        with grpc.insecure_channel(server.address) as chan:
            session_id = _open(pb_grpc.StageLinkStub(chan), "hostile", microbatch_size=64)
        big = _msg(pb.ECHO, tokens=64)  # an 8 MiB reply: 64 x 512 x 64 fp32
        refused, most = 0, 0
        for _ in range(70):
            bad.append(_NeverReads(server.address, session_id, big))
            most = max(most, server.runtime.streams.open_by_device().get("hostile", 0))
        assert most <= cap  # never more than the device's cap at once
        wait_for(lambda: slots.live <= cap, "the refused streams to end", timeout=10)
        for stream in bad:
            code = stream.call.code() if stream.call.done() else None
            refused += code == S.RESOURCE_EXHAUSTED
        assert refused > 0  # past the cap, the device's streams were refused
        assert _serving(server.address)
        got = _trained_adapter(server, "honest", seed=7)
        assert got.keys() == expected.keys()
        for name in got:
            assert torch.equal(got[name], expected[name]), name
        deadline = idle_s + 2.0 + 2.0  # idle, the grace before a cancel, a reaper pass
        wait_for(lambda: slots.live == 0, "every stalled stream to end", timeout=deadline + 5)
        assert server.runtime.streams.open_by_device() == {}
    finally:
        for stream in bad:
            stream.close()
        server.stop(grace=None)


def test_a_replaced_stream_that_reads_gets_aborted_not_cancelled(folder: Path) -> None:
    """The cancel is a backstop: a device that reads learns why its old stream ended."""
    server = _serve(folder)
    try:
        with grpc.insecure_channel(server.address) as chan:
            session_id = _open(pb_grpc.StageLinkStub(chan), "reconnecting")
            first = _Reader(chan, session_id)
            first.send(_msg(pb.ACTIVATION, tensor=_values(1), forward_only=True))
            assert first.next().kind == pb.OUTPUT
            second = _Reader(chan, session_id)
            try:
                second.send(_msg(pb.ACTIVATION, tensor=_values(1), forward_only=True))
                assert second.next().kind == pb.OUTPUT
                with pytest.raises(grpc.RpcError) as info:
                    first.next()
                assert info.value.code() == S.ABORTED, info.value.details()
                assert "was replaced by stream 2" in info.value.details()
            finally:
                first.close()
                second.close()
    finally:
        server.stop(grace=None)


# -- link probes and the server-wide budget -------------------------------------------------------
def _stage_server_process(tmp_path: Path, *sets: str) -> tuple[subprocess.Popen[bytes], str]:
    port_file = tmp_path / "port"
    args = [sys.executable, "-m", "fedpipe.cli", "server", "--model", "tiny-llama"]
    args += ["--stage-server", "127.0.0.1:0", "--port-file", str(port_file)]
    for item in sets:
        args += ["--set", item]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: port_file.exists() or proc.poll() is not None, "the StageServer", timeout=90)
    assert proc.poll() is None, "fedpipe server exited"
    return proc, f"127.0.0.1:{port_file.read_text().strip()}"


def test_link_probes_cannot_grow_the_server_past_a_bound(tmp_path: Path) -> None:
    """The probe bomb that grew a StageServer by 3.4 GiB: a session with 39 never-reading streams
    of 64 maximal ECHOs each. Now the server process grows by at most 256 MiB, and a device
    trains beside it."""
    proc, address = _stage_server_process(tmp_path, "server.stream_idle_s=2")
    server = psutil.Process(proc.pid)
    bad: list[_NeverReads] = []
    try:
        with grpc.insecure_channel(address) as chan:
            stub = pb_grpc.StageLinkStub(chan)
            session_id = _open(stub, "prober", microbatch_size=64)
            time.sleep(1.0)
            before = server.memory_info().rss
            peak = before
            for _ in range(39):
                bad.append(_NeverReads(address, session_id, *[_msg(pb.ECHO, tokens=64)] * 64))
                peak = max(peak, server.memory_info().rss)
            for _ in range(40):  # 8 s, as long as the bomb took to reach 3.4 GiB
                time.sleep(0.2)
                peak = max(peak, server.memory_info().rss)
            grew = (peak - before) / 2**20
            assert grew < 256, f"the StageServer grew by {grew:.0f} MiB"
            honest = _open(stub, "honest")
            stream = _Reader(chan, honest)
            try:
                _step(stream, seed=3)
            finally:
                stream.close()
    finally:
        for stream in bad:
            stream.close()
        proc.terminate()
        proc.wait(timeout=30)


def test_a_link_probes_reply_counts_like_any_reply(folder: Path) -> None:
    """A probe's reply holds a pending slot and its bytes until the transport takes it, in the
    session's limits and the server's budget; a probe sent while the last one's reply still
    waits is refused (it would also pass server.max_pending_mb here: 8 MiB each, 12 MiB
    allowed), and the stream, which never reads, is cut off with everything given back."""
    server = _serve(folder, max_pending_mb=12, stream_idle_s=30)
    stream = None
    try:
        with grpc.insecure_channel(server.address) as chan:
            session_id = _open(pb_grpc.StageLinkStub(chan), "prober", microbatch_size=64)
            probe = _msg(pb.ECHO, tokens=64)
            stream = _NeverReads(server.address, session_id, probe)
            slots = server._host.link.slots
            info = server.runtime.session(session_id)
            # Each probe goes once the server has taken the last reply off the stream, as a
            # prober that reads would send it (sent all at once, the second could arrive before
            # the first reply is taken and be refused as a probe ahead of its reply, a race).
            # The first reply is taken and stuck in the transport (8 MiB into a 64 KiB window).
            wait_for(lambda: info.echoes == 1, "the first probe to be answered", timeout=15)
            wait_for(lambda: not info.stream.echo_out, "its reply to be taken", timeout=15)
            stream.frames.put(seal(probe).SerializeToString())
            # The second's reply waits behind it, unread, holding its slot and bytes ...
            wait_for(lambda: info.echoes == 2, "the second probe to be answered", timeout=15)
            assert info.stream.echo_out and info.stream.pending_bytes == 8 * 2**20
            assert server.runtime.budget.used >= 8 * 2**20
            # ... so the third is refused; the stream, stuck on the first, is cancelled after the
            # grace and gives everything back.
            stream.frames.put(seal(probe).SerializeToString())
            wait_for(lambda: slots.live == 0, "the stream to be cut off", timeout=15)
            wait_for(lambda: server.runtime.budget.used == 0, "the probes' bytes to be given back")
            assert server.runtime.session(session_id).echoes == 2
            assert server.runtime.budget.peak <= 2 * 8 * 2**20 + 2**20  # two replies at most
    finally:
        if stream is not None:
            stream.close()
        server.stop(grace=None)


def test_a_message_past_the_servers_budget_is_refused_naming_it(folder: Path) -> None:
    """server.memory_budget_mb bounds all devices together; a draw past it is refused."""
    server = _serve(folder, memory_budget_mb=0.05)  # 52 KiB: one 8 KiB activation fits, 64 KiB not
    try:
        with grpc.insecure_channel(server.address) as chan:
            stub = pb_grpc.StageLinkStub(chan)
            stream = _Reader(chan, _open(stub, "big-sender", microbatch_size=64))
            try:
                stream.send(_msg(pb.ACTIVATION, tensor=_values(0, (16, SEQ, HIDDEN))))
                with pytest.raises(grpc.RpcError) as info:
                    stream.next()
            finally:
                stream.close()
        assert info.value.code() == S.RESOURCE_EXHAUSTED
        assert "server.memory_budget_mb" in info.value.details()
        wait_for(lambda: server.runtime.budget.used == 0, "the budget to be given back")
        honest = _trained_adapter(server, "small-sender", seed=5)  # small messages still pass
        assert honest
    finally:
        server.stop(grace=None)


def test_a_parked_delta_cache_goes_when_its_session_is_dropped(folder: Path) -> None:
    """A delta cache held for a session that never opens its stream is freed, budget and all."""
    server = _serve(folder, session_idle_s=0.5)
    try:
        with grpc.insecure_channel(server.address) as chan:
            stub = pb_grpc.StageLinkStub(chan)
            _open(stub, "parker", delta_cache_bytes=2**20, uplink_codec=pb.INT8)
            assert server.runtime.budget.used == 2**20
            assert len(server._stream_options) == 1
            wait_for(lambda: not server.runtime.sessions(), "the idle session to be dropped")
            assert server.runtime.budget.used == 0
            assert server._stream_options == {}
    finally:
        server.stop(grace=None)


# -- refusals the status table promises -----------------------------------------------------------
def test_sessions_past_max_sessions_are_resource_exhausted(folder: Path) -> None:
    server = _serve(folder, max_sessions=2)
    try:
        with grpc.insecure_channel(server.address) as chan:
            stub = pb_grpc.StageLinkStub(chan)
            _open(stub, "a")
            _open(stub, "b")
            with pytest.raises(grpc.RpcError) as info:
                _open(stub, "c")
            assert info.value.code() == S.RESOURCE_EXHAUSTED
            assert "server.max_sessions = 2" in info.value.details()
            assert {s.device_id for s in server.runtime.sessions()} == {"a", "b"}
    finally:
        server.stop(grace=None)


def test_bytes_past_max_pending_mb_are_resource_exhausted(folder: Path) -> None:
    server = _serve(folder, max_pending_mb=0.01)  # 10 KiB: one 8 KiB activation, not two
    try:
        with grpc.insecure_channel(server.address) as chan:
            stub = pb_grpc.StageLinkStub(chan)
            stream = _Reader(chan, _open(stub, "eager"))
            release = threading.Event()
            compute = server.runtime.executor.compute_batch

            def held(work):  # type: ignore[no-untyped-def]
                release.wait(RPC_TIMEOUT)  # queued bytes stay queued meanwhile
                return compute(work)

            server.runtime.executor.compute_batch = held  # type: ignore[method-assign]
            try:
                stream.send(*[_msg(pb.ACTIVATION, mb=m, tensor=_values(m)) for m in range(3)])
                with pytest.raises(grpc.RpcError) as info:
                    for _ in range(3):
                        stream.next()
            finally:
                release.set()
                stream.close()
        assert info.value.code() == S.RESOURCE_EXHAUSTED
        assert "passes its limit (server.max_pending_mb = " in info.value.details()
    finally:
        server.stop(grace=None)


@pytest.mark.parametrize("weight", [math.nan, math.inf, -1.0], ids=["nan", "inf", "negative"])
def test_a_non_finite_or_negative_aggregation_weight_is_refused(
    folder: Path, weight: float
) -> None:
    server = _serve(folder)
    try:
        with grpc.insecure_channel(server.address) as chan:
            control = pb_grpc.StageControlStub(chan)
            control.LoadAdapter(adapter_chunks(None), timeout=RPC_TIMEOUT)
            control.BeginRound(pb.BeginRoundRequest(round=1, run_id="r"), timeout=RPC_TIMEOUT)
            request = pb.CommitRoundRequest(
                round=1, finished=[pb.DeviceWeight(device_id="d", weight=weight)]
            )
            with pytest.raises(grpc.RpcError) as info:
                control.CommitRound(request, timeout=RPC_TIMEOUT)
        assert info.value.code() == S.INVALID_ARGUMENT
        assert "aggregation weights must be finite and >= 0" in info.value.details()
    finally:
        server.stop(grace=None)


def test_an_unknown_uplink_codec_is_refused_before_a_session_opens(folder: Path) -> None:
    server = _serve(folder)
    try:
        with grpc.insecure_channel(server.address) as chan:
            with pytest.raises(grpc.RpcError) as info:
                _open(pb_grpc.StageLinkStub(chan), "odd", uplink_codec=99, delta_cache_bytes=2**20)
        assert info.value.code() == S.INVALID_ARGUMENT
        assert "uplink_codec 99" in info.value.details()
        assert server.runtime.sessions() == []  # no orphaned session (and no token burned)
    finally:
        server.stop(grace=None)


# -- who may serve without a secret ---------------------------------------------------------------
def test_a_server_others_can_reach_needs_a_secret_or_an_explicit_opt_out(folder: Path) -> None:
    reachable = _config(host="0.0.0.0")
    with pytest.raises(ValueError, match="server.allow_unauthenticated = true"):
        build_stage_server(reachable, port=0, folder=folder)
    server = build_stage_server(reachable, port=0, folder=folder, secret="s" * 32).start()
    server.stop(grace=None)
    opted = _config(host="0.0.0.0", allow_unauthenticated=True)
    build_stage_server(opted, port=0, folder=folder).start().stop(grace=None)
    build_stage_server(_config(), port=0, folder=folder).start().stop(grace=None)  # loopback


@pytest.fixture(autouse=True)
def _no_stray_children() -> Iterator[None]:
    yield
    stray = [c for c in psutil.Process(os.getpid()).children(recursive=True) if c.is_running()]
    assert not [c for c in stray if c.status() != psutil.STATUS_ZOMBIE], stray


# -- round control: adapters of any size, calls bound to their server and run ---------------------
def test_an_adapter_past_every_message_limit_moves_in_pieces() -> None:
    """GetAdapter and LoadAdapter stream the adapter: exact aggregation's dense base deltas of
    small-llama's server blocks (6 MiB) pass server.max_message_mb (here 1) and gRPC's default
    4 MiB receive limit, both ways, intact."""
    from fedpipe.config import ModelConfig
    from fedpipe.wire.control_client import StageControlClient

    config = FedpipeConfig(
        model=ModelConfig(name="small-llama", head_layers=1, tail_layers=1),
        server=ServerConfig(max_message_mb=1),
    )
    server = build_stage_server(config, port=0).start()
    try:
        control = StageControlClient(server.address, "")
        try:
            control.reset_adapter()
            control.begin_round(1, "big")
            state = control.get_adapter()
            deltas = {}  # one dense delta per adapted layer, shaped as its weight
            for key, a in state.items():
                if key.endswith(".lora_A.weight"):
                    layer = key.removesuffix(".lora_A.weight")
                    b = state[f"{layer}.lora_B.weight"]
                    deltas[f"{layer}.base_delta"] = torch.randn(b.shape[0], a.shape[1]) * 1e-3
            big = {**state, **deltas}
            assert sum(v.numel() * 4 for v in big.values()) > 5 * 2**20
            control.load_adapter(big)
            back = control.get_adapter()
            assert back.keys() == big.keys()
            for key in big:
                assert torch.equal(back[key], big[key]), key
        finally:
            control.close()
    finally:
        server.stop(grace=None)


def test_a_control_call_is_refused_by_a_sibling_server_and_in_another_run(folder: Path) -> None:
    """Two StageServers share the secret: a call signed for one is refused by the other; a
    CommitRound signed in another run than the server's is refused."""
    from fedpipe.auth.calls import sign_call

    secret = "s" * 32
    one = build_stage_server(_config(), port=0, folder=folder, secret=secret).start()
    two = build_stage_server(_config(), port=0, folder=folder, secret=secret).start()
    try:
        with grpc.insecure_channel(one.address) as a, grpc.insecure_channel(two.address) as b:
            request = pb.BeginRoundRequest(round=1, run_id="r1")
            body = request.SerializeToString(deterministic=True)
            method = "/fedpipe.proto.StageControl/BeginRound"
            one_id = pb_grpc.StageControlStub(a).Hello(pb.HelloRequest()).server_id
            assert one_id != pb_grpc.StageControlStub(b).Hello(pb.HelloRequest()).server_id
            metadata = sign_call(secret, method, body, server_id=one_id, run_id="r1")
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.StageControlStub(b).BeginRound(request, metadata=metadata, timeout=10)
            assert info.value.code() == S.UNAUTHENTICATED
            assert "signed for StageServer" in info.value.details()
        from fedpipe.wire.control_client import StageControlClient

        control = StageControlClient(one.address, secret, run_id="r1")
        stranger = StageControlClient(one.address, secret, run_id="r0")
        try:
            control.reset_adapter()
            control.begin_round(1, "r1")
            with pytest.raises(grpc.RpcError) as info:
                stranger.commit_round(1, {})
            assert info.value.code() == S.UNAUTHENTICATED
            assert "signed in run 'r0', this server's run is 'r1'" in info.value.details()
            control.commit_round(1, {})
        finally:
            control.close()
            stranger.close()
    finally:
        one.stop(grace=None)
        two.stop(grace=None)
