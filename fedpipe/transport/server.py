"""The StageServer's gRPC face: thin servicers over a :class:`StageRuntime`.

``StageLink`` carries per-step traffic (one bidirectional stream per device session),
``StageControl`` lets the ServerApp begin and commit rounds, and the standard
``grpc.health.v1.Health`` service reports readiness. Servicers only decode, check and map
errors to status codes; all compute happens in the runtime's worker.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fedpipe.errors import AuthError
from fedpipe.pipeline.messages import StageMsg
from fedpipe.pipeline.server_runtime import StageRuntime
from fedpipe.proto import stage_pb2 as pb
from fedpipe.proto import stage_pb2_grpc as pb_grpc
from fedpipe.split.agreement import check_agreement
from fedpipe.transport.client import SESSION_HEADER, channel_options
from fedpipe.transport.codec import codec_from_proto
from fedpipe.transport.errors import status_for
from fedpipe.transport.serde import codec_for, msg_from_proto, msg_to_proto

__all__ = ["SplitInfo", "StageServer"]

log = logging.getLogger(__name__)

# (token, round, device_id, run_id, when the round began) -> None; raises AuthError
Authenticator = Callable[[str, int, str, str, float], None]
# (method, request bytes, metadata) -> None; raises AuthError
ControlAuth = Callable[[str, bytes, Sequence[tuple[str, str | bytes]]], None]
_END = object()


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
        )


class _RoundState:
    """The run and round the ServerApp has begun; tokens are only valid for them."""

    def __init__(self) -> None:
        self.current = 0
        self.run_id = ""
        self.begun = 0.0  # time.time() when BeginRound arrived
        self.adapter_set = False  # LoadAdapter (load or reset) since this server started
        self.lock = threading.Lock()


class _LinkServicer(pb_grpc.StageLinkServicer):
    def __init__(
        self,
        runtime: StageRuntime,
        split: SplitInfo,
        rounds: _RoundState,
        authenticate: Authenticator | None,
        max_message_bytes: int,
    ) -> None:
        self.runtime = runtime
        self.split = split
        self.rounds = rounds
        self.authenticate = authenticate
        self.max_message_bytes = max_message_bytes
        self.codecs: dict[str, tuple[str, str]] = {}  # session -> (downlink, gradient) codecs

    def OpenSession(self, request: pb.OpenSessionRequest, context: grpc.ServicerContext):  # noqa: N802
        try:
            if not request.device_id:
                raise AuthError("OpenSession needs a device_id")
            if self.authenticate is not None:
                with self.rounds.lock:
                    current, run_id, begun = (
                        self.rounds.current,
                        self.rounds.run_id,
                        self.rounds.begun,
                    )
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
            )
            codec = codec_from_proto(request.downlink_codec or pb.FP32)
            grad_codec = codec_from_proto(request.gradient_codec) if request.gradient_codec else ""
            session_id = self.runtime.open_session(
                request.device_id,
                request.round,
                lr=request.learning_rate or 1e-3,
                weight_decay=request.weight_decay,
            )
        except Exception as exc:
            context.abort(status_for(exc), str(exc))
        self.codecs[session_id] = (codec, grad_codec)
        return pb.OpenSessionReply(
            session_id=session_id,
            split=self.split.to_proto(),
            max_message_bytes=self.max_message_bytes,
        )

    def CloseSession(self, request: pb.CloseSessionRequest, context: grpc.ServicerContext):  # noqa: N802
        try:
            steps = self.runtime.close_session(request.session_id)
        except Exception as exc:
            context.abort(status_for(exc), str(exc))
        self.codecs.pop(request.session_id, None)
        return pb.CloseSessionReply(steps=steps)

    def Exchange(
        self, request_iterator, context: grpc.ServicerContext
    ) -> Iterator[pb.StageMessage]:  # noqa: N802
        session_id = dict(context.invocation_metadata()).get(SESSION_HEADER, "")
        try:
            self.runtime.session(session_id)
        except Exception as exc:
            context.abort(status_for(exc), str(exc))
        outbox: queue.Queue[object] = queue.Queue()
        self.runtime.attach(session_id, outbox.put)
        reader = threading.Thread(
            target=self._read, args=(session_id, request_iterator, outbox), daemon=True
        )
        reader.start()
        codec, grad_codec = self.codecs.get(session_id, ("fp32", ""))
        try:
            while (item := outbox.get()) is not _END:
                if isinstance(item, BaseException):
                    context.abort(status_for(item), str(item))
                assert isinstance(item, StageMsg)
                kind_codec = codec_for(item.kind, codec, grad_codec)
                yield msg_to_proto(item, session_id=session_id, codec=kind_codec)
        finally:
            self.runtime.detach(session_id)

    def _read(self, session_id: str, requests, outbox: queue.Queue[object]) -> None:  # type: ignore[no-untyped-def]
        try:
            for raw in requests:
                msg = msg_from_proto(
                    raw,
                    hidden_size=self.split.hidden_size,
                    max_elements=self.max_message_bytes,
                )
                self.runtime.submit(session_id, msg)
        except grpc.RpcError:
            pass  # the device went away; the finally below cleans up
        except Exception as exc:
            outbox.put(exc)
            return
        # The device half-closed: end the reply stream after the replies to what it sent.
        self.runtime.after_pending(session_id, lambda: outbox.put(_END))


class _ControlServicer(pb_grpc.StageControlServicer):
    def __init__(
        self, runtime: StageRuntime, rounds: _RoundState, auth: ControlAuth | None
    ) -> None:
        self.runtime = runtime
        self.rounds = rounds
        self.auth = auth

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
        with self.rounds.lock:
            self.rounds.current, self.rounds.run_id = request.round, request.run_id
            self.rounds.begun = time.time()
        log.info("round %d of run %r begun", request.round, request.run_id)
        return pb.BeginRoundReply()

    def CommitRound(self, request: pb.CommitRoundRequest, context: grpc.ServicerContext):  # noqa: N802
        self._check("CommitRound", request, context)
        self._require_run("CommitRound", context, request.round)
        weights = {f.device_id: f.weight for f in request.finished}
        merged, discarded = self.runtime.commit_round(request.round, weights)
        log.info("round %d committed: %d merged, %d discarded", request.round, merged, discarded)
        return pb.CommitRoundReply(merged=merged, discarded=discarded)

    def GetAdapter(self, request: pb.AdapterRequest, context: grpc.ServicerContext):  # noqa: N802
        self._check("GetAdapter", request, context)
        self._require_run("GetAdapter", context)
        state = {k: v.contiguous() for k, v in self.runtime.bank.global_state().items()}
        return pb.AdapterReply(safetensors=st_save(state))

    def LoadAdapter(self, request: pb.LoadAdapterRequest, context: grpc.ServicerContext):  # noqa: N802
        self._check("LoadAdapter", request, context)
        try:
            if request.safetensors:
                self.runtime.bank.set_global_state(st_load(request.safetensors))
            else:
                self.runtime.bank.reset_global_state()
        except Exception as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad adapter: {exc}")
        with self.rounds.lock:
            self.rounds.adapter_set = True
        return pb.LoadAdapterReply()


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
        workers: int = 64,
    ) -> None:
        self.runtime = runtime
        self.split = split
        self.rounds = _RoundState()
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="stage-grpc"),
            options=channel_options(max_message_bytes),
        )
        self._link = _LinkServicer(runtime, split, self.rounds, authenticate, max_message_bytes)
        pb_grpc.add_StageLinkServicer_to_server(self._link, self._server)
        pb_grpc.add_StageControlServicer_to_server(
            _ControlServicer(runtime, self.rounds, control_auth), self._server
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
        self.address = f"{host}:{self.port}"

    def start(self) -> StageServer:
        self._server.start()
        serving = health_pb2.HealthCheckResponse.SERVING
        for service in ("", "fedpipe.proto.StageLink", "fedpipe.proto.StageControl"):
            self._health.set(service, serving)
        log.info("StageServer listening on %s (%s)", self.address, self.tls)
        if self.tls == "plaintext":
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
