"""The stage link's servicer: OpenSession, the Exchange stream, CloseSession.

It translates and delegates: a request becomes a :class:`~fedpipe.wire.backend.SessionRequest`
for the :class:`~fedpipe.wire.backend.StageBackend`, a stream's frames become messages for its
:class:`~fedpipe.wire.backend.StreamPort` (decoded on a reader thread of their own, so the reply
loop keeps sending while the device sends), and an exception becomes a status code. It decides
nothing about sessions, limits or compute.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import grpc

from fedpipe.compress.delta import CacheIdentity
from fedpipe.config.codecs import check_codec, codec_base
from fedpipe.errors import InvalidRequestError
from fedpipe.messages import END, Kind, StageMsg
from fedpipe.proto import stage_pb2 as pb
from fedpipe.proto import stage_pb2_grpc as pb_grpc
from fedpipe.wire.backend import SessionRequest, StageBackend, StreamOptions, StreamPort
from fedpipe.wire.channels import SESSION_HEADER, STREAM_KEY_HEADER
from fedpipe.wire.serde import MessageBounds, split_info_to_proto
from fedpipe.wire.status import status_for
from fedpipe.wire.stream_codec import StreamCodecs, StreamDecoder, StreamEncoder
from fedpipe.wire.tensors import codec_from_proto

__all__ = ["LinkServicer", "StreamSlots", "add_link_servicer", "session_request"]

log = logging.getLogger(__name__)

_POLL_S = 1.0  # how often a waiting reply loop checks that its RPC is still alive


class StreamSlots:
    """Counts live Exchange streams, so that they can never take every gRPC thread."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.live = 0
        self._lock = threading.Lock()

    def acquire(self) -> bool:
        with self._lock:
            if self.live >= self.limit:
                return False
            self.live += 1
            return True

    def release(self) -> None:
        with self._lock:
            self.live -= 1


class _Gone(Exception):
    """The RPC ended (cancelled, deadline, client gone): the reply loop stops."""


def _session_codec(name: str, value: int) -> str:
    """The codec the server sends with: the full name when the device gave one (``int4tg128``:
    groups, layout, outliers), else the enum's base codec (an older device)."""
    base = codec_from_proto(value)
    if not name:
        return base
    try:
        check_codec(name)
    except ValueError as exc:
        raise InvalidRequestError(f"OpenSession: {exc}") from None
    if codec_base(name) != base:
        raise InvalidRequestError(
            f"OpenSession: codec name {name!r} is a {codec_base(name)} codec, but its enum "
            f"says {base}; send the same codec in both fields"
        )
    return name


def _uplink_codec(value: int) -> str:
    """The device's uplink codec by its enum name (what its delta cache was coded with)."""
    try:
        return pb.Codec.Name(value)
    except ValueError:
        raise InvalidRequestError(
            f"OpenSession: uplink_codec {value} is no codec this server knows"
        ) from None


def session_request(request: pb.OpenSessionRequest) -> SessionRequest:
    """An OpenSession request decoded and checked for form (raises InvalidRequestError)."""
    return SessionRequest(
        device_id=request.device_id,
        round=request.round,
        token=request.token,
        split=request.split if request.HasField("split") else None,
        downlink_codec=_session_codec(
            request.downlink_codec_name, request.downlink_codec or pb.FP32
        ),
        gradient_codec=(
            _session_codec(request.gradient_codec_name, request.gradient_codec)
            if request.gradient_codec
            else ""
        ),
        uplink_codec=_uplink_codec(request.uplink_codec),
        learning_rate=request.learning_rate,
        weight_decay=request.weight_decay,
        microbatch_size=request.microbatch_size,
        seq_len=request.seq_len,
        frozen_head=request.frozen_head,
        error_feedback=request.error_feedback,
        stochastic_rounding=request.stochastic_rounding,
        delta_cache_bytes=request.delta_cache_bytes,
        delta_identity=CacheIdentity(
            request.delta_cache_id, request.delta_cache_entries, request.delta_cache_digest
        ),
    )


class LinkServicer(pb_grpc.StageLinkServicer):
    """StageLink over a :class:`StageBackend`; at most ``max_streams`` streams at once."""

    def __init__(self, backend: StageBackend, *, max_streams: int) -> None:
        self.backend = backend
        self.slots = StreamSlots(max_streams)

    def OpenSession(self, request: pb.OpenSessionRequest, context: grpc.ServicerContext):  # noqa: N802
        try:
            opened = self.backend.open_session(session_request(request))
        except Exception as exc:
            context.abort(status_for(exc), str(exc))
        return pb.OpenSessionReply(
            session_id=opened.session_id,
            split=split_info_to_proto(self.backend.split),
            max_message_bytes=self.backend.max_message_bytes,
            delta_resumed=opened.delta_resumed,
            delta_reset_reason=opened.delta_reset_reason,
            stream_key=opened.stream_key,
        )

    def CloseSession(self, request: pb.CloseSessionRequest, context: grpc.ServicerContext):  # noqa: N802
        try:
            steps = self.backend.close_session(request.session_id)
        except Exception as exc:
            context.abort(status_for(exc), str(exc))
        return pb.CloseSessionReply(steps=steps)

    def Exchange(self, request_iterator, context: grpc.ServicerContext) -> Iterator[bytes]:  # noqa: N802
        if not self.slots.acquire():
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the StageServer serves {self.slots.limit} streams at once "
                "(server.max_streams); retry later",
            )
        try:
            yield from self._exchange(request_iterator, context)
        finally:
            self.slots.release()

    def _exchange(self, request_iterator, context: grpc.ServicerContext) -> Iterator[bytes]:  # type: ignore[no-untyped-def]
        metadata = dict(context.invocation_metadata())
        session_id = metadata.get(SESSION_HEADER, "")
        try:
            port, options = self.backend.attach(session_id, metadata.get(STREAM_KEY_HEADER, ""))
        except Exception as exc:
            context.abort(status_for(exc), str(exc))
        context.add_callback(lambda: port.fail(_Gone()))  # wakes the loop below at once
        port.bind_cancel(context.cancel)
        encoder, decoder = self._codecs(port, options)
        reader = threading.Thread(
            target=self._read,
            args=(port, request_iterator, decoder, options),
            name=f"stage-read-{session_id[:8]}",
            daemon=True,
        )
        reader.start()
        try:
            while (item := port.next_reply(timeout=_POLL_S)) is not END:
                if isinstance(item, _Gone) or (item is None and not context.is_active()):
                    return
                if item is None:
                    continue
                if isinstance(item, BaseException):
                    context.abort(status_for(item), str(item))
                assert isinstance(item, StageMsg)
                yield encoder.encode(item)
        finally:
            port.close()

    def _codecs(
        self, port: StreamPort, options: StreamOptions
    ) -> tuple[StreamEncoder, StreamDecoder]:
        """The stream's encoder and decoder (they live as long as the stream)."""
        split = self.backend.split
        bounds = MessageBounds(
            hidden_size=split.hidden_size,
            max_batch=port.microbatch_size,
            max_tokens=port.seq_len,
            vocab_size=split.vocab_size if split.mode == "two" else 0,
        )
        codec, grad_codec = port.codecs
        encoder = StreamEncoder(
            StreamCodecs(
                codec,
                grad_codec,
                error_feedback=options.error_feedback,
                stochastic=options.stochastic,
                seed=options.seed,
            ),
            session_id=port.session_id,
        )
        decoder = StreamDecoder(
            delta_cache_bytes=options.delta_bytes,
            delta_cache=options.delta_cache,
            bounds=bounds,
            max_elements=self.backend.max_message_bytes,
        )
        return encoder, decoder

    def _read(  # type: ignore[no-untyped-def]
        self, port: StreamPort, requests, decoder: StreamDecoder, options: StreamOptions
    ) -> None:
        try:
            for raw in requests:
                with port.decoding(len(raw)):  # counted from the frame to the queued message
                    msg = decoder.decode(raw)
                    if msg.kind is Kind.ECHO:
                        port.echo(msg)
                    else:
                        port.submit(msg)
        except grpc.RpcError:
            return  # the device went away; the stream's end cleans up
        except Exception as exc:
            port.fail(exc)
            return
        if options.delta_bytes:  # read to the end: this cache mirrors the device's
            self.backend.keep_delta(port, options, decoder.delta.cache)
        port.finish()  # half-closed: end the replies after those to what it sent


def add_link_servicer(servicer: LinkServicer, server: grpc.Server) -> None:
    """Register StageLink as the generated code does, but Exchange takes and gives bytes.

    serde frames stream messages itself (``msg_to_wire`` / ``msg_from_wire``): the tensor is
    copied once into a frame and decoded in place, where protobuf's (de)serialisers would copy
    it twice more. The bytes on the wire are an ordinary StageMessage either way.
    """
    handlers = {
        "OpenSession": grpc.unary_unary_rpc_method_handler(
            servicer.OpenSession,
            request_deserializer=pb.OpenSessionRequest.FromString,
            response_serializer=pb.OpenSessionReply.SerializeToString,
        ),
        "Exchange": grpc.stream_stream_rpc_method_handler(servicer.Exchange),
        "CloseSession": grpc.unary_unary_rpc_method_handler(
            servicer.CloseSession,
            request_deserializer=pb.CloseSessionRequest.FromString,
            response_serializer=pb.CloseSessionReply.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("fedpipe.proto.StageLink", handlers),)
    )
