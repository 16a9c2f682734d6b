"""The StageServer: a :class:`~fedpipe.server.runtime.StageRuntime` served over gRPC.

It is the backend the servicers delegate to (:class:`fedpipe.wire.backend.StageBackend`): it
admits a session (token, split agreement, delta cache) before the runtime opens it, hands each
stream its options, runs round control against the round state, and keeps devices' delta
caches between their sessions. The gRPC server itself is :class:`fedpipe.wire.host.GrpcHost`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
import threading
import time

import torch

from fedpipe.compress.delta import DeltaCache
from fedpipe.errors import AuthError, InvalidRequestError
from fedpipe.lora.robust import AggregationRule
from fedpipe.server.commit import CommitResult
from fedpipe.server.delta_store import DeltaStore
from fedpipe.server.run_state import Authenticator, RoundState
from fedpipe.server.runtime import StageRuntime
from fedpipe.server.sessions import SessionInfo
from fedpipe.server.streams import StreamHandle
from fedpipe.split.agreement import SplitInfo, check_agreement
from fedpipe.wire.backend import (
    CollectedRound,
    OpenedSession,
    SessionProgress,
    SessionRequest,
    StreamOptions,
    StreamPort,
)
from fedpipe.wire.control_servicer import ControlAuth
from fedpipe.wire.host import GrpcHost
from fedpipe.wire.stream_codec import rounding_seed

__all__ = ["StageServer"]

log = logging.getLogger(__name__)

_MAX_STREAM_OPTIONS = 4096  # sessions whose stream options are kept (oldest dropped first)


class StageServer:
    """Hosts a StageRuntime on gRPC with health checks; ``start()`` serves, ``stop()`` ends."""

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
        server_id: str = "",
    ) -> None:
        self.runtime = runtime
        self.split = split
        # This process's identity (Hello): signed control calls must name it.
        self.server_id = server_id or secrets.token_hex(8)
        # What LoadAdapter takes: the stage's own size twice over (dense base deltas of exact
        # aggregation are as large as the layers they change), and room for the adapters.
        self.max_adapter_bytes = 2 * _stage_bytes(runtime) + 64 * 2**20
        self.max_message_bytes = max_message_bytes
        self.max_delta_cache_bytes = max_delta_cache_bytes
        self.rounds = RoundState(authenticate)
        # Devices' delta caches between their sessions (fedpipe.server.delta_store).
        self.delta_store = DeltaStore(delta_store_bytes, runtime.budget)
        self._stream_options: dict[str, StreamOptions] = {}  # by session id
        self._options_lock = threading.Lock()
        runtime.on_drop(self._forget_options)
        self._host = GrpcHost(
            self,
            host=host,
            port=port,
            control_auth=control_auth,
            max_message_bytes=max_message_bytes,
            max_streams=max_streams,
            tls=tls,
            client_ca=client_ca,
        )
        self.host, self.port, self.address = host, self._host.port, self._host.address
        self.tls = self._host.tls

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> StageServer:
        self._host.start()
        return self

    def stop(self, grace: float | None = 1.0) -> None:
        self._host.stop(grace)
        self.runtime.stop()

    def wait(self) -> None:
        self._host.wait()

    def __enter__(self) -> StageServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- sessions (StageBackend) -----------------------------------------------------------------
    def open_session(self, request: SessionRequest) -> OpenedSession:
        """Admit a device's session: its token, its split, its delta cache, then the runtime's
        limits. After authentication only: strangers learn nothing of the model or the cut."""
        view = self.rounds.admit(request.token, request.round, request.device_id)
        check_agreement(
            request.split, self.split, model=self.split.model, offered=self.split.offered()
        )
        split = request.split
        assert split is not None  # check_agreement refuses a device that sent none
        _check_delta_cache(request.delta_cache_bytes, self.max_delta_cache_bytes)
        session_id = self.runtime.open(
            request, blocks=self.split.session_blocks(split.head_layers, split.tail_layers)
        )
        options = StreamOptions(
            request.error_feedback,
            request.delta_cache_bytes,
            uplink_codec=request.uplink_codec,
            run_id=view.run_id,
            stochastic=request.stochastic_rounding,
            seed=rounding_seed(request.device_id, request.round, "server"),
        )
        opened = OpenedSession(session_id)
        if request.delta_cache_bytes:
            try:  # the cache grows to its size on this server: the budget holds that much
                self.runtime.hold(session_id, request.delta_cache_bytes, "a delta cache")
            except Exception:
                self.runtime.discard(session_id, reason="no room for its delta cache")
                raise
            opened = self._resume_delta(request, options, session_id)
        self._keep_options(session_id, options)
        return dataclasses.replace(opened, stream_key=self.runtime.session(session_id).stream_key)

    def _resume_delta(
        self, request: SessionRequest, options: StreamOptions, session_id: str
    ) -> OpenedSession:
        """The session's delta cache: the device's kept one if its identity matches, else empty.

        Keyed by ``request.device_id``, which authentication (when the server has a secret)
        has bound to the session token: a device can only ever resume its own cache.
        """
        wanted = request.delta_identity
        got = self.delta_store.take(
            request.device_id,
            wanted,
            max_bytes=request.delta_cache_bytes,
            codec=options.uplink_codec,
        )
        options.delta_cache = got.cache
        if wanted.cache_id:
            log.info(
                "[device %s] delta cache %s",
                request.device_id,
                f"resumed ({len(got.cache)} samples)" if got.resumed else f"reset: {got.reason}",
            )
        return OpenedSession(session_id, got.resumed, got.reason)

    def _keep_options(self, session_id: str, options: StreamOptions) -> None:
        with self._options_lock:
            self._stream_options[session_id] = options
            while len(self._stream_options) > _MAX_STREAM_OPTIONS:
                del self._stream_options[next(iter(self._stream_options))]

    def _forget_options(self, info: SessionInfo) -> None:
        """A session is gone: its options go, and a delta cache no stream took is freed."""
        with self._options_lock:
            options = self._stream_options.pop(info.session_id, None)
        if options is not None and options.delta_cache is not None:
            log.info(
                "[%s] delta cache of session %s freed: no stream took it",
                info.device_id,
                info.short,
            )
            options.delta_cache = None

    def attach(self, session_id: str, stream_key: str) -> tuple[StreamPort, StreamOptions]:
        """The session's new stream, if it presents the session's stream key, and its options
        (the delta cache goes to the first only)."""
        handle: StreamHandle = self.runtime.attach(session_id, stream_key)
        with self._options_lock:
            options = self._stream_options.get(session_id, StreamOptions())
            cache, options.delta_cache = options.delta_cache, None
        return handle, _with_cache(options, cache)

    def keep_delta(self, port: StreamPort, options: StreamOptions, cache: DeltaCache) -> None:
        """A stream read to its end: its delta cache mirrors the device's; keep it."""
        self.delta_store.keep(
            port.device_id,
            cache,
            codec=options.uplink_codec,
            run_id=options.run_id,
            session_id=port.session_id,  # resumable once the device closes it
        )

    def close_session(self, session_id: str) -> int:
        with self._options_lock:
            self._stream_options.pop(session_id, None)
        steps = self.runtime.close_session(session_id)
        self.delta_store.confirm(session_id)  # a session the device closed: resumable
        return steps

    # -- round control (StageBackend) ------------------------------------------------------------
    def begin_round(
        self,
        round_: int,
        run_id: str,
        aggregation: str,
        rule: str = "",
        *,
        frozen_below: int = 0,
        window: int = 0,
    ) -> None:
        self.rounds.require_run("BeginRound")
        try:  # federated.aggregation and the strategy's rule: how this round's commit merges
            self.runtime.set_aggregation(aggregation, AggregationRule.parse(rule))
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        self.runtime.freeze_below(frozen_below)  # pipeline.freeze: sessions opened from now on
        self.runtime.begin_version(round_, window)  # async rounds: each version's adapter
        self.rounds.begin(round_, run_id, window=window)
        self.delta_store.begin_run(run_id)  # devices' delta caches never cross into another run
        log.info("round %d of run %r begun", round_, run_id)

    def _check_run(self, method: str, signed_run: str | None, *, read_only: bool = False) -> None:
        """A signed call names the run it was made in; it must be this server's run. A
        read-only call may name none (a preflight check of the secret, outside any run)."""
        current = self.rounds.run_id
        if read_only and signed_run == "":
            return
        if signed_run is not None and signed_run != current:
            raise AuthError(
                f"{method} refused: signed in run {signed_run!r}, this server's run is {current!r}"
            )

    def commit_round(
        self, round_: int, weights: dict[str, float], *, signed_run: str | None = None
    ) -> CommitResult:
        self.rounds.require_run("CommitRound", round_)
        self._check_run("CommitRound", signed_run)
        result = self.runtime.commit_round(round_, weights)
        log.info(
            "round %d committed: %d merged, %d discarded, dropped %s",
            round_,
            result.merged,
            result.discarded,
            result.dropped or "none",
        )
        return result

    def commit_updates(
        self,
        round_: int,
        merge: list[tuple[str, int, float]],
        discard: list[tuple[str, int]],
        *,
        server_lr: float = 1.0,
        signed_run: str | None = None,
    ) -> CommitResult:
        """Async rounds: the named sessions merged as their updates, each against its own
        version (:meth:`StageRuntime.commit_updates`)."""
        self.rounds.require_run("CommitUpdates", round_)
        self._check_run("CommitUpdates", signed_run)
        if not self.rounds.view().window and merge:
            raise InvalidRequestError(
                "CommitUpdates merges asynchronous rounds' sessions, but this round was begun "
                "synchronously (BeginRound's window 0): use CommitRound"
            )
        if not (server_lr > 0 and math.isfinite(server_lr)):
            raise InvalidRequestError(f"CommitUpdates: server_lr must be > 0, got {server_lr}")
        result = self.runtime.commit_updates(round_, merge, discard, server_lr=server_lr)
        log.info(
            "version %d: %d updates merged, %d sessions discarded, dropped %s",
            round_,
            result.merged,
            result.discarded,
            result.dropped or "none",
        )
        return result

    def collect_round(
        self, round_: int, weights: dict[str, float], *, signed_run: str | None = None
    ) -> CollectedRound:
        """A replica's part of the commit: the finished devices' adapters, the round's
        sessions discarded (the ServerApp merges across replicas and loads the result back)."""
        self.rounds.require_run("CollectRound", round_)
        self._check_run("CollectRound", signed_run)
        begun = self.rounds.view().begun
        got = self.runtime.collect_round(round_, weights)
        log.info(
            "round %d collected: %d adapters handed over, %d discarded, dropped %s",
            round_,
            len(got.devices),
            got.discarded,
            got.dropped or "none",
        )
        return dataclasses.replace(got, round_s=max(time.time() - begun, 0.0))

    def global_adapter(self, *, signed_run: str | None = None) -> dict[str, torch.Tensor]:
        self.rounds.require_run("GetAdapter")
        self._check_run("GetAdapter", signed_run, read_only=True)
        return self.runtime.global_state()

    def load_adapter(self, state: dict[str, torch.Tensor] | None) -> None:
        self.runtime.load_global_state(state)
        self.rounds.adapter_loaded()

    def round_status(self, round_: int) -> list[SessionProgress]:
        """Read-only: the sessions of ``round_`` not yet committed or dropped, and their steps."""
        now = time.monotonic()
        return [_progress(info, now) for info in self.runtime.sessions() if info.round == round_]


def _progress(info: SessionInfo, now: float) -> SessionProgress:
    stepped = info.steps_done > 0
    return SessionProgress(
        device_id=info.device_id,
        steps_done=info.steps_done,
        opened_s_ago=now - info.opened_at,
        first_step_s_ago=now - info.first_step_at if stepped else None,
        last_step_s_ago=now - info.last_step_at if stepped else None,
        closed=info.closed,
        rows_done=info.rows_done,
        tokens_done=info.tokens_done,
    )


def _with_cache(options: StreamOptions, cache: DeltaCache | None) -> StreamOptions:
    """A stream's copy of the session's options, holding the cache it was handed."""
    return StreamOptions(
        options.error_feedback,
        options.delta_bytes,
        cache,
        options.uplink_codec,
        options.run_id,
        options.stochastic,
        options.seed,
    )


def _check_delta_cache(requested: int, limit: int) -> None:
    """Refuse a delta cache this server will not hold for a session."""
    if not 0 <= requested <= limit:
        raise InvalidRequestError(
            f"delta_cache_bytes {requested} is outside [0, {limit}] (this StageServer's "
            "server.max_delta_cache_mb per session); set pipeline.delta_cache_mb lower, or "
            "pipeline.delta = false"
        )


def _stage_bytes(runtime: StageRuntime) -> int:
    """Bytes of the stage's weights (frozen base and adapters), at fp32."""
    stage = getattr(runtime.bank, "stage", None)
    if stage is None:
        return 0
    return sum(p.numel() * 4 for p in stage.parameters())
