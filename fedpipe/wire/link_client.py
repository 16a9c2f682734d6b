"""The device's end of the stage link: a gRPC client and one streaming session per round.

A :class:`StageSession` is the :class:`~fedpipe.edge.runtime.StageChannel` the
device runtime walks its schedule over. Sends return at once: an encoder thread turns
messages into protobuf, the uplink emulator holds them for as long as the emulated link
would, and gRPC's request iterator takes them. A reader thread takes replies off the stream,
holds them in the downlink emulator, decodes them and files them in a mailbox keyed by
``(kind, step, microbatch)``. Emulating both directions here keeps the server untouched and
works on loopback without privileges.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, replace

import grpc

from fedpipe.compress.delta import DeltaEncoder
from fedpipe.emulation import DelayLine, DuplexLink, LinkProfile, RealClock
from fedpipe.errors import StageLinkError
from fedpipe.messages import Kind, StageMsg
from fedpipe.proto import stage_pb2 as pb
from fedpipe.proto import stage_pb2_grpc as pb_grpc
from fedpipe.trace import Tracer
from fedpipe.wire.backend import SessionRequest
from fedpipe.wire.channels import (
    EXCHANGE_METHOD,
    SESSION_HEADER,
    STREAM_KEY_HEADER,
    channel_options,
    reconnect_call,
    secure_channel_credentials,
)
from fedpipe.wire.serde import session_request_to_proto, wire_header
from fedpipe.wire.stream_codec import StreamCodecs, StreamDecoder, StreamEncoder, rounding_seed

__all__ = [
    "SessionStats",
    "StageClient",
    "StageSession",
]

log = logging.getLogger(__name__)

# Timeline names of transfers, by message kind (activation, output, output grad, input grad).
_TRANSFER_NAMES = {
    Kind.ACTIVATION: "a",
    Kind.OUTPUT: "o",
    Kind.OUTPUT_GRAD: "g",
    Kind.INPUT_GRAD: "i",
    Kind.STEP_END: "end",
    Kind.STEP_DONE: "done",
    Kind.ERROR: "error",
    Kind.ECHO: "echo",
}
_END = object()


@dataclass
class SessionStats:
    """Traffic of one session as seen on the wire (encoded protobuf bytes)."""

    bytes_up: int = 0
    bytes_down: int = 0
    messages_up: int = 0
    messages_down: int = 0


class StageClient:
    """A connection to a StageServer; opens sessions and checks health."""

    def __init__(
        self,
        address: str,
        *,
        max_message_bytes: int = 64 * 1024 * 1024,
        root_certificates: bytes | None = None,
        certificate_chain: bytes | None = None,
        private_key: bytes | None = None,
        reconnect_s: float = 60.0,
    ) -> None:
        self.address = address
        self.reconnect_s = reconnect_s
        self.max_message_bytes = max_message_bytes
        options = channel_options(max_message_bytes)
        if root_certificates is not None:
            creds = secure_channel_credentials(root_certificates, certificate_chain, private_key)
            self.channel = grpc.secure_channel(address, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        self.stub = pb_grpc.StageLinkStub(self.channel)

    def open(
        self,
        request: SessionRequest,
        *,
        delta: DeltaEncoder | None = None,
        delta_codec: str = "",
        link: LinkProfile | str | None = None,
        link_seed: int | str | None = None,
        tracer: Tracer | None = None,
        timeout_s: float = 120.0,
    ) -> StageSession:
        """Open the session ``request`` asks for (retrying while the server is unavailable) and
        start its stream; the request goes as it is, but for the delta cache's identity, which
        ``delta`` (the device's encoder, kept across sessions) gives: the server resumes its
        copy of that cache if their identities match (``session.delta_resumed``); if not, this
        call clears ``delta``'s cache, as the server starts an empty one. None: a cache for
        this session only, which the server keeps nothing of.

        The server refuses a request without ``split`` (what the device built: model
        fingerprint and cut), or one that differs from its own, with FAILED_PRECONDITION, and
        tensors larger than its ``microbatch_size`` and ``seq_len`` with INVALID_ARGUMENT.

        The rest is this device's side of the session: ``delta_codec`` codes the activations
        whose rows all go as differences, ``link`` the emulated link (``link_seed`` its
        draws), ``timeout_s`` how long a reply may take.
        """
        size = request.delta_cache_bytes
        if delta is not None and delta.cache.max_bytes != size:
            raise ValueError(
                f"the delta encoder holds {delta.cache.max_bytes} bytes but the session asks "
                f"for delta_cache_bytes {size}: make the encoder with that size"
            )
        identity = delta.cache.identity if delta is not None and size else None
        if identity is not None:
            request = replace(request, delta_identity=identity)
        reply = reconnect_call(
            lambda: self.stub.OpenSession(session_request_to_proto(request), timeout=30),
            budget_s=self.reconnect_s,
            what=f"opening a session on {self.address}",
        )
        if delta is not None and identity is not None and not reply.delta_resumed:
            delta.reset()  # the server starts an empty cache: so does the device
        duplex = DuplexLink.from_profile(link or LinkProfile.unlimited(), seed=link_seed)
        return StageSession(
            self,
            reply,
            duplex,
            codecs=StreamCodecs(
                request.uplink_codec,
                request.gradient_codec,
                error_feedback=request.error_feedback,
                delta_cache_bytes=size,
                delta_codec=delta_codec,
                stochastic=request.stochastic_rounding,
                seed=rounding_seed(request.device_id, request.round, "device"),
            ),
            tracer=tracer,
            timeout_s=timeout_s,
            delta=delta if identity is not None else None,
        )

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> StageClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StageSession:
    """One device session's stream; implements the runtime's ``StageChannel``."""

    def __init__(
        self,
        client: StageClient,
        reply: pb.OpenSessionReply,
        link: DuplexLink,
        *,
        codecs: StreamCodecs,
        tracer: Tracer | None,
        timeout_s: float,
        delta: DeltaEncoder | None = None,
    ) -> None:
        self.client = client
        self.session_id = reply.session_id
        self.split = reply.split
        self.link = link
        self.codec = codecs.codec
        self.gradient_codec = codecs.gradient_codec
        # Whether the server resumed the device's delta cache (and why not, if it did not).
        self.delta_resumed, self.delta_reset_reason = reply.delta_resumed, reply.delta_reset_reason
        self._encoder = StreamEncoder(codecs, session_id=self.session_id, delta=delta)
        sent = self._encoder.delta
        self._delta_before = (sent.rows_delta, sent.rows_whole) if sent is not None else (0, 0)
        self._decoder = StreamDecoder(max_elements=client.max_message_bytes)
        self.timeout_s = timeout_s
        self.tracer = tracer
        self.stats = SessionStats()
        self._clock = RealClock()
        self._outgoing: queue.Queue[object] = queue.Queue()
        self._wire: queue.Queue[object] = queue.Queue()
        self._mailbox: dict[tuple[int, int, int], StageMsg] = {}
        self._arrived = threading.Condition()
        self._failure: StageLinkError | None = None
        self._closed = False
        self._up = DelayLine(link.up, self._clock, self._wire.put, name="uplink")
        self._down = DelayLine(link.down, self._clock, self._file, name="downlink")
        exchange = client.channel.stream_stream(EXCHANGE_METHOD)  # bytes in, bytes out
        metadata = ((SESSION_HEADER, self.session_id), (STREAM_KEY_HEADER, reply.stream_key))
        self._call = exchange(self._requests(), metadata=metadata)
        self._threads = [
            threading.Thread(target=self._encode_loop, name="stage-encode", daemon=True),
            threading.Thread(target=self._read_loop, name="stage-read", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    @property
    def delta_rows(self) -> tuple[int, int]:
        """Activation rows this session sent as differences (hits) and whole (misses)."""
        sent = self._encoder.delta
        if sent is None:
            return 0, 0
        return sent.rows_delta - self._delta_before[0], sent.rows_whole - self._delta_before[1]

    # -- StageChannel -----------------------------------------------------------------------
    def send(self, msg: StageMsg) -> None:
        self._raise_if_failed()
        self._outgoing.put(msg)

    def ready(self, kind: Kind, step: int, microbatch: int) -> bool:
        with self._arrived:
            self._raise_if_failed()
            return (int(kind), step, microbatch) in self._mailbox

    def receive(self, kind: Kind, step: int, microbatch: int) -> StageMsg:
        key = (int(kind), step, microbatch)
        deadline = time.monotonic() + self.timeout_s
        with self._arrived:
            while key not in self._mailbox:
                self._raise_if_failed()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StageLinkError(
                        f"no {kind.name} for step {step} microbatch {microbatch} within "
                        f"{self.timeout_s:.0f} s from {self.client.address}; the server may be "
                        "overloaded or gone (raise pipeline.timeout_s if it is just slow)"
                    )
                self._arrived.wait(min(left, 1.0))
            return self._mailbox.pop(key)

    def wait_any(self, timeout: float) -> None:
        with self._arrived:
            self._raise_if_failed()
            self._arrived.wait(timeout)

    # -- lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        """Finish the stream after everything queued is sent, then close the session."""
        if self._closed:
            return
        self._closed = True
        self._outgoing.put(_END)
        self._threads[0].join(timeout=self.timeout_s)
        self._up.close(drop=self._failure is not None)
        self._wire.put(_END)
        self._threads[1].join(timeout=self.timeout_s)
        self._down.close(drop=True)
        if self._failure is None:
            try:
                self.client.stub.CloseSession(
                    pb.CloseSessionRequest(session_id=self.session_id), timeout=10
                )
            except grpc.RpcError as exc:
                log.warning("closing session %s: %s", self.session_id, exc.details())

    def abort(self) -> None:
        """Drop the stream at once (a device that vanishes mid-step); stops this side's threads."""
        self._closed = True
        self._call.cancel()
        self._fail(StageLinkError("session aborted by the device"))
        self._outgoing.put(_END)
        # Its delta cache may outlive this session: no late encode may touch it after this.
        self._threads[0].join(timeout=self.timeout_s)
        self._wire.put(_END)
        self._up.close(drop=True)
        self._down.close(drop=True)

    def __enter__(self) -> StageSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- threads ----------------------------------------------------------------------------
    def _requests(self):  # type: ignore[no-untyped-def]
        while (item := self._wire.get()) is not _END:
            yield item

    def _encode_loop(self) -> None:
        while (item := self._outgoing.get()) is not _END:
            assert isinstance(item, StageMsg)
            if self._failure is not None:
                continue  # nothing more goes up (nor into a delta cache) after a failure
            try:
                raw = self._encoder.encode(item)
            except Exception as exc:  # a bug or a bad tensor on our side
                self._fail(StageLinkError(f"cannot encode {item}: {exc}"))
                continue
            size = len(raw)
            self.stats.bytes_up += size
            self.stats.messages_up += 1
            sent = self._clock.now()
            at = self._up.put(raw, size)
            if self.tracer is not None:
                self.tracer.add(
                    f"{_TRANSFER_NAMES[item.kind]}{item.microbatch}",
                    "uplink",
                    sent,
                    at,
                    {"bytes": size},
                )

    def _read_loop(self) -> None:
        try:
            for raw in self._call:
                size = len(raw)
                self.stats.bytes_down += size
                self.stats.messages_down += 1
                sent = self._clock.now()
                at = self._down.put(raw, size)
                if self.tracer is not None:
                    head = wire_header(raw)
                    name = _TRANSFER_NAMES.get(Kind(head.kind), "?")
                    self.tracer.add(
                        f"{name}{head.microbatch}", "downlink", sent, at, {"bytes": size}
                    )
        except grpc.RpcError as exc:
            if not self._closed or exc.code() != grpc.StatusCode.CANCELLED:
                code = exc.code().name if exc.code() else "UNKNOWN"
                self._fail(StageLinkError(f"stage link {code}: {exc.details()}"))
        except Exception as exc:
            self._fail(StageLinkError(f"stage link failed: {exc}"))

    def _file(self, raw: bytes) -> None:
        try:
            msg = self._decoder.decode(raw)
        except Exception as exc:
            self._fail(StageLinkError(f"bad message from the server: {exc}"))
            return
        with self._arrived:
            self._mailbox[msg.key] = msg
            self._arrived.notify_all()

    def _fail(self, error: StageLinkError) -> None:
        log.warning("session %s: %s", self.session_id, error)
        with self._arrived:
            if self._failure is None:
                self._failure = error
            self._arrived.notify_all()

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure
