"""The StageServer's gRPC face: thin servicers over a :class:`StageRuntime`.

``StageLink`` carries per-step traffic (one bidirectional stream per device session),
``StageControl`` lets the ServerApp begin and commit rounds, and the standard
``grpc.health.v1.Health`` service reports readiness. Servicers only decode, check and map
errors to status codes; all compute happens in the runtime's worker.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fedpipe.errors import AuthError, InvalidRequestError
from fedpipe.pipeline.messages import Kind, StageMsg
from fedpipe.pipeline.server_runtime import END, StageRuntime, StreamHandle
from fedpipe.proto import stage_pb2 as pb
from fedpipe.proto import stage_pb2_grpc as pb_grpc
from fedpipe.split.agreement import check_agreement
from fedpipe.transport.client import SESSION_HEADER, channel_options
from fedpipe.transport.codec import codec_from_proto
from fedpipe.transport.codec_names import check_codec, codec_base
from fedpipe.transport.delta import CacheIdentity, DeltaCache
from fedpipe.transport.delta_store import DeltaStore
from fedpipe.transport.errors import status_for
from fedpipe.transport.serde import MessageBounds
from fedpipe.transport.stream_codec import (
    StreamCodecs,
    StreamDecoder,
    StreamEncoder,
    rounding_seed,
)

__all__ = ["SplitInfo", "StageServer"]

log = logging.getLogger(__name__)

# (token, round, device_id, run_id, when the round began) -> None; raises AuthError
Authenticator = Callable[[str, int, str, str, float], None]
# (method, request bytes, metadata) -> None; raises AuthError
ControlAuth = Callable[[str, bytes, Sequence[tuple[str, str | bytes]]], None]
_POLL_S = 1.0  # how often a waiting reply loop checks that its RPC is still alive
_UNARY_THREADS = 16  # gRPC threads kept free of streams: health, sessions and control
MAX_ECHOES = 64  # link probes (ECHO) one stream may send: they bypass the pending limits
_MAX_STREAM_OPTIONS = 4096  # sessions whose stream options are kept (oldest dropped first)


@dataclass(frozen=True)
class SplitInfo:
    """What devices must know of the server's half (sent back on OpenSession)."""

    model: str
    num_layers: int
    head_layers: int
    tail_layers: int
    mode: str
    hidden_size: int
    dtype: str
    fingerprint: str = ""  # sha256 over the model's config and base weights
    max_positions: int = 0  # longest sequence the model's positions cover (0: unknown)
    vocab_size: int = 0
    cuts: tuple[tuple[int, int], ...] = ()  # (head, tail) cuts offered; () = only the one above

    def offered(self) -> tuple[tuple[int, int], ...]:
        """The cuts a device may open a session with (the server's own cut at least)."""
        return self.cuts or ((self.head_layers, self.tail_layers),)

    def session_blocks(self, head: int, tail: int) -> tuple[int, ...] | None:
        """The server blocks a session of cut (head, tail) runs; None when it is all of them."""
        lowest = min(h for h, _ in self.offered())
        stage_tail = 0 if self.mode == "two" else min(t for _, t in self.offered())
        if (head, tail) == (lowest, stage_tail):
            return None
        return tuple(range(head, self.num_layers - (0 if self.mode == "two" else tail)))

    def to_proto(self) -> pb.SplitSpec:
        return pb.SplitSpec(
            model=self.model,
            num_layers=self.num_layers,
            head_layers=self.head_layers,
            tail_layers=self.tail_layers,
            mode=self.mode,
            hidden_size=self.hidden_size,
            dtype=self.dtype,
            fingerprint=self.fingerprint,
            max_positions=self.max_positions,
            vocab_size=self.vocab_size,
            cuts=[pb.SplitCut(head_layers=h, tail_layers=t) for h, t in self.offered()],
        )


class _RoundState:
    """The run and round the ServerApp has begun; tokens are only valid for them."""

    def __init__(self) -> None:
        self.current = 0
        self.run_id = ""
        self.begun = 0.0  # time.time() when BeginRound arrived
        self.adapter_set = False  # LoadAdapter (load or reset) since this server started
        self.lock = threading.Lock()


@dataclass
class _StreamOptions:
    """The transport's own per-session options from OpenSession, which the runtime need not know."""

    error_feedback: bool = False
    delta_bytes: int = 0  # delta coding's cache size (0: none)
    delta_cache: DeltaCache | None = field(default=None, repr=False)  # until the stream takes it
    uplink_codec: str = ""
    run_id: str = ""  # the run the session was opened in: its cache goes back only there
    stochastic: bool = False  # int4/int2 gradients round stochastically (OpenSession)
    seed: int | None = None  # of that rounding: from (device, round), so a run repeats


class _StreamSlots:
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


class _LinkServicer(pb_grpc.StageLinkServicer):
    def __init__(
        self,
        runtime: StageRuntime,
        split: SplitInfo,
        rounds: _RoundState,
        authenticate: Authenticator | None,
        max_message_bytes: int,
        max_streams: int,
        max_delta_cache_bytes: int = 0,
        store: DeltaStore | None = None,
    ) -> None:
        self.runtime = runtime
        self.split = split
        self.rounds = rounds
        self.authenticate = authenticate
        self.max_message_bytes = max_message_bytes
        self.max_delta_cache_bytes = max_delta_cache_bytes
        self.slots = _StreamSlots(max_streams)
        self.store = store if store is not None else DeltaStore(0)
        self._stream_options: dict[str, _StreamOptions] = {}  # by session id
        self._options_lock = threading.Lock()

    def OpenSession(self, request: pb.OpenSessionRequest, context: grpc.ServicerContext):  # noqa: N802
        try:
            if not request.device_id:
                raise AuthError("OpenSession needs a device_id")
            with self.rounds.lock:
                current, run_id, begun = (
                    self.rounds.current,
                    self.rounds.run_id,
                    self.rounds.begun,
                )
            if self.authenticate is not None:
                if request.round != current:
                    raise AuthError(
                        f"session for round {request.round}, but the server is in round {current}"
                    )
                self.authenticate(request.token, request.round, request.device_id, run_id, begun)
            # After authentication: strangers learn nothing of the model or the cut.
            check_agreement(
                request.split if request.HasField("split") else None,
                self.split,
                model=self.split.model,
                offered=self.split.offered(),
            )
            blocks = self.split.session_blocks(request.split.head_layers, request.split.tail_layers)
            codec = _session_codec(request.downlink_codec_name, request.downlink_codec or pb.FP32)
            grad_codec = (
                _session_codec(request.gradient_codec_name, request.gradient_codec)
                if request.gradient_codec
                else ""
            )
            _check_delta_cache(request.delta_cache_bytes, self.max_delta_cache_bytes)
            session_id = self.runtime.open_session(
                request.device_id,
                request.round,
                lr=request.learning_rate,
                weight_decay=request.weight_decay,
                microbatch_size=request.microbatch_size,
                seq_len=request.seq_len,
                codecs=(codec, grad_codec),
                frozen_head=request.frozen_head,
                blocks=blocks,
            )
        except Exception as exc:
            context.abort(status_for(exc), str(exc))
        options = _StreamOptions(
            request.error_feedback,
            request.delta_cache_bytes,
            run_id=run_id,
            stochastic=request.stochastic_rounding,
            seed=rounding_seed(request.device_id, request.round, "server"),
        )
        reply = pb.OpenSessionReply(
            session_id=session_id,
            split=self.split.to_proto(),
            max_message_bytes=self.max_message_bytes,
        )
        if request.delta_cache_bytes:
            self._resume_delta(request, options, reply)
        self._keep_options(session_id, options)
        return reply

    def _resume_delta(
        self, request: pb.OpenSessionRequest, options: _StreamOptions, reply: pb.OpenSessionReply
    ) -> None:
        """The session's delta cache: the device's kept one if its identity matches, else empty.

        Keyed by ``request.device_id``, which authentication (when the server has a secret)
        has bound to the session token: a device can only ever resume its own cache.
        """
        options.uplink_codec = pb.Codec.Name(request.uplink_codec)
        wanted = CacheIdentity(
            request.delta_cache_id, request.delta_cache_entries, request.delta_cache_digest
        )
        got = self.store.take(
            request.device_id,
            wanted,
            max_bytes=request.delta_cache_bytes,
            codec=options.uplink_codec,
        )
        options.delta_cache = got.cache
        reply.delta_resumed, reply.delta_reset_reason = got.resumed, got.reason
        if wanted.cache_id:
            log.info(
                "[device %s] delta cache %s",
                request.device_id,
                f"resumed ({len(got.cache)} samples)" if got.resumed else f"reset: {got.reason}",
            )

    def _keep_options(self, session_id: str, options: _StreamOptions) -> None:
        with self._options_lock:
            self._stream_options[session_id] = options
            while len(self._stream_options) > _MAX_STREAM_OPTIONS:
                del self._stream_options[next(iter(self._stream_options))]

    def _options(self, session_id: str) -> tuple[_StreamOptions, DeltaCache | None]:
        """The session's options, and its delta cache (taken: only its first stream gets it)."""
        with self._options_lock:
            options = self._stream_options.get(session_id, _StreamOptions())
            cache, options.delta_cache = options.delta_cache, None
            return options, cache

    def CloseSession(self, request: pb.CloseSessionRequest, context: grpc.ServicerContext):  # noqa: N802
        with self._options_lock:
            self._stream_options.pop(request.session_id, None)
        try:
            steps = self.runtime.close_session(request.session_id)
        except Exception as exc:
            context.abort(status_for(exc), str(exc))
        self.store.confirm(request.session_id)  # a session the device closed: resumable
        return pb.CloseSessionReply(steps=steps)

    def Exchange(
        self, request_iterator, context: grpc.ServicerContext
    ) -> Iterator[pb.StageMessage]:  # noqa: N802
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

    def _exchange(self, request_iterator, context: grpc.ServicerContext):  # type: ignore[no-untyped-def]
        session_id = dict(context.invocation_metadata()).get(SESSION_HEADER, "")
        try:
            handle = self.runtime.attach(session_id)
        except Exception as exc:
            context.abort(status_for(exc), str(exc))
        context.add_callback(lambda: handle.fail(_Gone()))  # wakes the loop below at once
        info = handle.info
        bounds = MessageBounds(
            hidden_size=self.split.hidden_size,
            max_batch=info.microbatch_size,
            max_tokens=info.seq_len,
            vocab_size=self.split.vocab_size if self.split.mode == "two" else 0,
        )
        codec, grad_codec = info.codecs
        options, delta_cache = self._options(session_id)
        # Per stream: the device's stream lives as long as its session, and so does this state
        # (but a delta cache may come from the device's last session and outlive this one).
        encoder = StreamEncoder(
            StreamCodecs(
                codec,
                grad_codec,
                error_feedback=options.error_feedback,
                stochastic=options.stochastic,
                seed=options.seed,
            ),
            session_id=session_id,
        )
        decoder = StreamDecoder(
            delta_cache_bytes=options.delta_bytes,
            delta_cache=delta_cache,
            bounds=bounds,
            max_elements=self.max_message_bytes,
        )
        reader = threading.Thread(
            target=self._read,
            args=(handle, request_iterator, decoder, options),
            name=f"stage-read-{session_id[:8]}",
            daemon=True,
        )
        reader.start()
        try:
            while (item := handle.next_reply(timeout=_POLL_S)) is not END:
                if isinstance(item, _Gone) or (item is None and not context.is_active()):
                    return
                if item is None:
                    continue
                if isinstance(item, BaseException):
                    context.abort(status_for(item), str(item))
                assert isinstance(item, StageMsg)
                yield encoder.encode(item)
        finally:
            handle.close()

    def _read(  # type: ignore[no-untyped-def]
        self, handle: StreamHandle, requests, decoder: StreamDecoder, options: _StreamOptions
    ) -> None:
        echoes = 0
        try:
            for raw in requests:
                msg = decoder.decode(raw)
                if msg.kind is Kind.ECHO:
                    echoes += 1
                    assert decoder.bounds is not None  # Exchange always decodes with bounds
                    _echo(handle, msg, decoder.bounds, echoes)
                    continue
                handle.submit(msg)
        except grpc.RpcError:
            return  # the device went away; the stream's end cleans up
        except Exception as exc:
            handle.fail(exc)
            return
        if options.delta_bytes:  # read to the end: this cache mirrors the device's
            self.store.keep(
                handle.info.device_id,
                decoder.delta.cache,
                codec=options.uplink_codec,
                run_id=options.run_id,
                session_id=handle.info.session_id,  # resumable once the device closes it
            )
        handle.finish()  # half-closed: end the replies after those to what it sent


def _echo(handle: StreamHandle, msg: StageMsg, bounds: MessageBounds, count: int) -> None:
    """Answer a link probe at once, beside the worker's replies (stage.proto: ECHO).

    The reply skips the compute queue, so a probe times the link, not the server's backlog;
    it holds no pending slot, so the count per stream is capped instead.
    """
    if count > MAX_ECHOES:
        raise InvalidRequestError(
            f"ECHO number {count} on one stream; a stream may probe the link {MAX_ECHOES} "
            "times (a planner needs about 10)"
        )
    reply = StageMsg(Kind.ECHO, msg.step, msg.microbatch)
    if msg.tokens > 0:
        reply.tensor = torch.zeros(msg.tokens, bounds.max_tokens, bounds.hidden_size)
    handle._end(reply)  # StreamHandle's queue of replies; nbytes -1: no pending slot


def _check_delta_cache(requested: int, limit: int) -> None:
    """Refuse a delta cache this server will not hold for a session."""
    if not 0 <= requested <= limit:
        raise InvalidRequestError(
            f"delta_cache_bytes {requested} is outside [0, {limit}] (this StageServer's "
            "server.max_delta_cache_mb per session); set pipeline.delta_cache_mb lower, or "
            "pipeline.delta = false"
        )


def _add_link_servicer(servicer: pb_grpc.StageLinkServicer, server: grpc.Server) -> None:
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


class _Gone(Exception):
    """The RPC ended (cancelled, deadline, client gone): the reply loop stops."""


class _ControlServicer(pb_grpc.StageControlServicer):
    def __init__(
        self,
        runtime: StageRuntime,
        rounds: _RoundState,
        auth: ControlAuth | None,
        store: DeltaStore | None = None,
    ) -> None:
        self.runtime = runtime
        self.rounds = rounds
        self.auth = auth
        self.store = store

    def _check(self, method: str, request, context: grpc.ServicerContext) -> None:  # type: ignore[no-untyped-def]
        """Verify the call's MAC (over the method and the request as re-serialised here)."""
        if self.auth is None:
            return
        try:
            body = request.SerializeToString(deterministic=True)
            self.auth(f"/fedpipe.proto.StageControl/{method}", body, context.invocation_metadata())
        except AuthError as exc:
            log.warning("%s", exc)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))

    def _require_run(self, method: str, context: grpc.ServicerContext, round_: int = -1) -> None:
        """Refuse calls that need the run's state when this server lacks it (it restarted).

        A StageServer restarted mid-run holds the initial adapter, not the run's: carrying on
        would train silently wrong, so the ServerApp is stopped with a status that says why.
        """
        with self.rounds.lock:
            ready, current = self.rounds.adapter_set, self.rounds.current
        if not ready:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{method}: this StageServer has not been given the run's server adapter since "
                "it started (it restarted mid-run?): resume with `fedpipe run --resume`, which "
                "reloads it from the last checkpoint",
            )
        if round_ >= 0 and round_ != current:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{method}: round {round_} was not begun on this StageServer (its round is "
                f"{current}): resume with `fedpipe run --resume`",
            )

    def BeginRound(self, request: pb.BeginRoundRequest, context: grpc.ServicerContext):  # noqa: N802
        self._check("BeginRound", request, context)
        self._require_run("BeginRound", context)
        try:  # federated.aggregation: how this round's CommitRound merges
            self.runtime.set_aggregation(request.aggregation or "separate")
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        with self.rounds.lock:
            self.rounds.current, self.rounds.run_id = request.round, request.run_id
            self.rounds.begun = time.time()
        if self.store is not None:  # devices' delta caches never cross into another run
            self.store.begin_run(request.run_id)
        log.info("round %d of run %r begun", request.round, request.run_id)
        return pb.BeginRoundReply()

    def CommitRound(self, request: pb.CommitRoundRequest, context: grpc.ServicerContext):  # noqa: N802
        self._check("CommitRound", request, context)
        self._require_run("CommitRound", context, request.round)
        weights = {f.device_id: f.weight for f in request.finished}
        try:
            result = self.runtime.commit_round(request.round, weights)
        except Exception as exc:
            context.abort(status_for(exc), str(exc))
        log.info(
            "round %d committed: %d merged, %d discarded, dropped %s",
            request.round,
            result.merged,
            result.discarded,
            result.dropped or "none",
        )
        return pb.CommitRoundReply(
            merged=result.merged,
            discarded=result.discarded,
            dropped=list(result.dropped),
            dropped_reason=list(result.dropped.values()),
        )

    def GetAdapter(self, request: pb.AdapterRequest, context: grpc.ServicerContext):  # noqa: N802
        self._check("GetAdapter", request, context)
        self._require_run("GetAdapter", context)
        state = {k: v.contiguous() for k, v in self.runtime.global_state().items()}
        return pb.AdapterReply(safetensors=st_save(state))

    def LoadAdapter(self, request: pb.LoadAdapterRequest, context: grpc.ServicerContext):  # noqa: N802
        self._check("LoadAdapter", request, context)
        try:
            state = st_load(request.safetensors) if request.safetensors else None
            self.runtime.load_global_state(state)
        except Exception as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad adapter: {exc}")
        with self.rounds.lock:
            self.rounds.adapter_set = True
        return pb.LoadAdapterReply()


def _is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable only from this machine (no one else on the path)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


class StageServer:
    """Hosts a StageRuntime on gRPC with health checks; ``start()`` binds, ``stop()`` ends."""

    def __init__(
        self,
        runtime: StageRuntime,
        split: SplitInfo,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        authenticate: Authenticator | None = None,
        control_auth: ControlAuth | None = None,
        max_message_bytes: int = 64 * 1024 * 1024,
        tls: tuple[bytes, bytes] | None = None,
        client_ca: bytes | None = None,
        max_streams: int = 64,
        max_delta_cache_bytes: int = 256 * 2**20,
        delta_store_bytes: int = 1024 * 2**20,
    ) -> None:
        self.runtime = runtime
        self.split = split
        self.rounds = _RoundState()
        # Devices' delta caches between their sessions (fedpipe.transport.delta_store).
        self.delta_store = DeltaStore(delta_store_bytes)
        # Each live stream holds a gRPC thread; streams are capped below the pool's size so that
        # health checks, sessions and control calls always find a thread.
        workers = max_streams + _UNARY_THREADS
        # Devices ping every 20 s (keepalive) also while they wait quietly for replies queued
        # behind other sessions' work; gRPC's default (one ping per 5 min without data) would
        # answer a wait of about a minute with GOAWAY "too many pings" and drop the device.
        options = [
            *channel_options(max_message_bytes),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ]
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="stage-grpc"),
            options=options,
        )
        self._link = _LinkServicer(
            runtime,
            split,
            self.rounds,
            authenticate,
            max_message_bytes,
            max_streams,
            max_delta_cache_bytes,
            self.delta_store,
        )
        _add_link_servicer(self._link, self._server)
        pb_grpc.add_StageControlServicer_to_server(
            _ControlServicer(runtime, self.rounds, control_auth, self.delta_store), self._server
        )
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        bind = f"{host}:{port}"
        self.tls = "mtls" if client_ca is not None else "tls" if tls is not None else "plaintext"
        if tls is not None:
            creds = grpc.ssl_server_credentials(  # [(key, cert)]; client_ca: mutual TLS
                [(tls[1], tls[0])],
                root_certificates=client_ca,
                require_client_auth=client_ca is not None,
            )
            self.port = self._server.add_secure_port(bind, creds)
        elif client_ca is not None:
            raise ValueError("client certificates (mutual TLS) need the server's own TLS files")
        else:
            self.port = self._server.add_insecure_port(bind)
        if self.port == 0:
            raise OSError(f"could not bind the StageServer to {bind}")
        self.host = host
        self.address = f"{host}:{self.port}"

    def start(self) -> StageServer:
        self._server.start()
        serving = health_pb2.HealthCheckResponse.SERVING
        for service in ("", "fedpipe.proto.StageLink", "fedpipe.proto.StageControl"):
            self._health.set(service, serving)
        log.info("StageServer listening on %s (%s)", self.address, self.tls)
        if self.tls == "plaintext" and not _is_loopback(self.host):
            log.warning(
                "the stage link on %s is plaintext: activations, gradients and session tokens "
                "cross the network readable by anyone on the path; give the StageServer "
                "server.tls_cert and server.tls_key (fedpipe certs makes test ones)",
                self.address,
            )
        return self

    def stop(self, grace: float | None = 1.0) -> None:
        self._health.enter_graceful_shutdown()
        self._server.stop(grace).wait()
        self.runtime.stop()

    def wait(self) -> None:
        self._server.wait_for_termination()

    def __enter__(self) -> StageServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
