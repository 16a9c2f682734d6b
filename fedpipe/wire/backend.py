"""What the StageServer's servicers need from the server behind them, as types and protocols.

The servicers (:mod:`fedpipe.wire.link_servicer`, :mod:`fedpipe.wire.control_servicer`) only
translate: a request becomes a :class:`SessionRequest`, a call on a :class:`StageBackend`, and
its result a reply; an exception becomes a status code. Everything the server decides (who may
open a session, admission limits, round state, delta caches, compute) lives behind the
protocol, in :mod:`fedpipe.server`. This is also the seam a replica on another process or
machine plugs into.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

import torch

from fedpipe.compress.delta import CacheIdentity, DeltaCache
from fedpipe.messages import StageMsg
from fedpipe.split.agreement import SplitInfo, SplitLike

__all__ = [
    "CollectedRound",
    "CommitSummary",
    "OpenedSession",
    "SessionProgress",
    "SessionRequest",
    "StageBackend",
    "StreamOptions",
    "StreamPort",
]


@dataclass(frozen=True)
class SessionRequest:
    """What a device asks when it opens a session: who, for which round, with what settings.

    One type end to end: the device builds it once from its settings
    (``DeviceTrainer.session_request``), :meth:`StageClient.open
    <fedpipe.wire.link_client.StageClient.open>` sends it as ``OpenSessionRequest``
    (``serde.session_request_to_proto``), the servicer decodes it into this type again
    (``link_servicer.session_request``) and the runtime opens the session from it
    (``StageRuntime.open``). ``delta_identity`` is the device's delta cache, which the client
    fills from the encoder it is given.
    """

    device_id: str
    round: int
    token: str = ""
    split: SplitLike | None = None  # what the device built (None: an old device sent nothing)
    downlink_codec: str = "fp32"  # the codec the server sends with
    gradient_codec: str = ""  # "" = the direction's codec
    uplink_codec: str = "fp32"
    learning_rate: float = 0.0  # 0: the server's default
    weight_decay: float = 0.0
    microbatch_size: int = 0  # 0: the server's bound
    seq_len: int = 0  # 0: the server's bound
    frozen_head: bool = False
    error_feedback: bool = False
    stochastic_rounding: bool = False
    delta_cache_bytes: int = 0  # delta coding's cache size (0: none)
    delta_identity: CacheIdentity = field(default_factory=lambda: CacheIdentity("", 0, b""))


@dataclass
class StreamOptions:
    """How a session's stream encodes and decodes, fixed at OpenSession."""

    error_feedback: bool = False
    delta_bytes: int = 0  # delta coding's cache size (0: none)
    # The device's cache resumed from its last session (handed to the first stream only).
    delta_cache: DeltaCache | None = field(default=None, repr=False)
    uplink_codec: str = ""
    run_id: str = ""  # the run the session was opened in: its cache goes back only there
    stochastic: bool = False  # int4/int2 gradients round stochastically
    seed: int | None = None  # of that rounding: from (device, round), so a run repeats


@dataclass(frozen=True)
class OpenedSession:
    """What OpenSession answers: the session and whether its delta cache resumed."""

    session_id: str
    delta_resumed: bool = False
    delta_reset_reason: str = ""
    stream_key: str = field(default="", repr=False)  # what the session's streams present


@dataclass(frozen=True)
class SessionProgress:
    """How far one session has got, as the StageServer counts it (RoundStatus).

    Times are seconds before the answer, on the server's clock, so that no clock is compared
    across hosts; the step times are None while the session has done no step.
    """

    device_id: str
    steps_done: int
    opened_s_ago: float
    first_step_s_ago: float | None = None
    last_step_s_ago: float | None = None
    closed: bool = False
    rows_done: int = 0  # rows of the microbatches trained in the steps applied
    tokens_done: int = 0


@dataclass(frozen=True)
class CollectedRound:
    """A replica's part of a round's commit (CollectRound), merged by the ServerApp.

    ``states[i]``: the adapter of ``devices[i]`` (the blocks its cut ran), to be merged with
    weight ``weights[i]``; ``dropped``: finished devices left out, and why; ``microbatches``
    and ``round_s``: the training forwards the replica computed in the round and the seconds
    since it began it (its own counts).
    """

    devices: list[str]
    weights: list[float]
    states: list[dict[str, torch.Tensor]]
    discarded: int
    dropped: dict[str, str] = field(default_factory=dict)
    microbatches: int = 0
    round_s: float = 0.0


class CommitSummary(Protocol):
    """What a CommitRound did (``fedpipe.server.commit.CommitResult``)."""

    @property
    def merged(self) -> int: ...
    @property
    def discarded(self) -> int: ...
    @property
    def dropped(self) -> Mapping[str, str]: ...


class StreamPort(Protocol):
    """One Exchange stream of a session, as the link servicer drives it.

    The servicer's reader thread decodes each frame inside :meth:`decoding` (which holds the
    server's budget for it), calls :meth:`submit` (or :meth:`echo` for a link probe) per
    message and :meth:`finish` when the device half-closes; its reply loop takes
    :meth:`next_reply` until it gets :data:`fedpipe.messages.END`. :meth:`bind_cancel` gives the
    server a way to cut the RPC off when a stream it ended does not go (a device that reads
    nothing).
    """

    @property
    def session_id(self) -> str: ...
    @property
    def device_id(self) -> str: ...
    @property
    def microbatch_size(self) -> int: ...
    @property
    def seq_len(self) -> int: ...
    @property
    def codecs(self) -> tuple[str, str]: ...

    def submit(self, msg: StageMsg) -> None: ...
    def echo(self, msg: StageMsg) -> None: ...
    def decoding(self, nbytes: int) -> AbstractContextManager[None]: ...
    def bind_cancel(self, cancel: Callable[[], object]) -> None: ...
    def finish(self) -> None: ...
    def next_reply(self, timeout: float) -> object | None: ...
    def fail(self, error: BaseException) -> None: ...
    def close(self) -> None: ...


class StageBackend(Protocol):
    """The StageServer as its servicers see it. Every method raises a ``fedpipe.errors`` type
    (mapped to a status code by :func:`fedpipe.wire.status.status_for`) on a refusal.

    ``signed_run``: the run a signed control call names (None: calls are not signed); a call
    signed in another run than the server's is refused.
    """

    @property
    def split(self) -> SplitInfo: ...
    @property
    def max_message_bytes(self) -> int: ...
    @property
    def server_id(self) -> str: ...
    @property
    def max_adapter_bytes(self) -> int: ...

    def open_session(self, request: SessionRequest) -> OpenedSession: ...
    def attach(self, session_id: str, stream_key: str) -> tuple[StreamPort, StreamOptions]: ...
    def keep_delta(self, port: StreamPort, options: StreamOptions, cache: DeltaCache) -> None: ...
    def close_session(self, session_id: str) -> int: ...
    def begin_round(
        self,
        round_: int,
        run_id: str,
        aggregation: str,
        rule: str,
        *,
        frozen_below: int = 0,
        window: int = 0,
    ) -> None: ...
    def commit_round(
        self, round_: int, weights: dict[str, float], *, signed_run: str | None = None
    ) -> CommitSummary: ...
    def commit_updates(
        self,
        round_: int,
        merge: list[tuple[str, int, float]],
        discard: list[tuple[str, int]],
        *,
        server_lr: float = 1.0,
        signed_run: str | None = None,
    ) -> CommitSummary: ...
    def collect_round(
        self, round_: int, weights: dict[str, float], *, signed_run: str | None = None
    ) -> CollectedRound: ...
    def global_adapter(self, *, signed_run: str | None = None) -> dict[str, torch.Tensor]: ...
    def load_adapter(self, state: dict[str, torch.Tensor] | None) -> None: ...
    def round_status(self, round_: int) -> list[SessionProgress]: ...
