"""Device sessions on the StageServer: what is known of each, and what a device may ask for.

A session is one device in one round: its own LoRA adapter on the shared frozen stage, its
optimizer, and the shape it declared at OpenSession. :class:`RuntimeLimits` bound what any
device may ask for, so that none can poison, crash or starve the others; the checks here
refuse a request outside them with the setting that bounds it.
"""

from __future__ import annotations

import math
import secrets
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fedpipe.errors import InvalidRequestError

__all__ = [
    "OptimizerFactory",
    "RuntimeLimits",
    "SessionInfo",
    "adamw",
    "check_declared",
    "check_optimizer",
    "seq_bound",
    "short_id",
]

OptimizerFactory = Callable[[list[nn.Parameter], float, float], torch.optim.Optimizer]


def adamw(params: list[nn.Parameter], lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """The server's optimizer for a session's adapter."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


@dataclass(frozen=True)
class RuntimeLimits:
    """Bounds that keep one device from poisoning, crashing or starving the others."""

    max_sessions: int = 64
    max_in_flight: int = 64  # microbatches forwarded whose gradients have not arrived
    max_pending: int = 64  # messages queued for compute + replies the stream has not taken
    max_pending_bytes: int = 256 * 2**20  # the same, counted in tensor bytes
    max_microbatch_size: int = 64
    max_seq_len: int = 0  # 0: the model's positions bound it alone
    max_learning_rate: float = 1e-2
    max_weight_decay: float = 0.1
    default_learning_rate: float = 1e-3  # for a device that asks for none
    session_idle_s: float = 120.0
    stream_idle_s: float = 60.0
    max_device_streams: int = 4  # streams of one device open at once, live or ending
    max_echoes: int = 64  # link probes (ECHO) one session may send
    memory_budget_bytes: int = 4096 * 2**20  # all devices together (fedpipe.server.budget)


@dataclass(eq=False)
class SessionInfo:
    """What the runtime knows of one device session."""

    session_id: str
    device_id: str
    round: int
    optimizer: torch.optim.Optimizer
    microbatch_size: int  # declared (or the server's bound): no tensor may have more rows
    seq_len: int  # declared (or the model's positions): no tensor may have more tokens
    codecs: tuple[str, str] = ("fp32", "")  # the transport's (downlink, gradient) codecs
    step: int = 0
    steps_done: int = 0  # steps applied that trained at least one microbatch
    microbatches: int = 0  # training forwards computed (a replica's throughput, per round)
    # The work the server did, as it counts it (never as the device reports it): rows and
    # tokens of the microbatches that ran forward and backward in this unfinished step, and in
    # the steps applied so far. A round's weight for the device is ``rows_done``.
    step_rows: int = 0
    step_tokens: int = 0
    rows_done: int = 0
    tokens_done: int = 0
    # microbatch -> (input, output with its graph | the batched bank's Tape): the executor's
    cache: dict[int, tuple[torch.Tensor, object]] = field(default_factory=dict)
    last_seen: float = field(default_factory=time.monotonic)
    # time.monotonic() at open and at the first and last completed step (0: none yet)
    opened_at: float = field(default_factory=time.monotonic)
    first_step_at: float = 0.0
    last_step_at: float = 0.0
    closed: bool = False  # CloseSession called: waits for its round's commit
    dropped: bool = False  # gone from the runtime; late work is refused
    stream: Any = None  # the live Exchange stream, a fedpipe.server.streams.StreamHandle, or None
    streams_opened: int = 0
    frozen_head: bool = False  # frozen-device mode: no input gradient goes back
    frozen_below: int = 0  # pipeline.freeze: its adapter's blocks below this train nothing
    blocks: tuple[int, ...] | None = None  # the stage's blocks its cut runs (None: all)
    echoes: int = 0  # link probes answered, over all its streams
    held_bytes: int = 0  # drawn from the server's budget for the session itself (delta cache)
    # The secret a stream of this session must present (OpenSession gives it to the device
    # alone): the session id, which every message names, is not enough to take a stream over.
    stream_key: str = field(default_factory=lambda: secrets.token_urlsafe(24), repr=False)

    @property
    def short(self) -> str:
        """The id as logs and errors show it: a prefix, never the whole secret id."""
        return short_id(self.session_id)


def short_id(session_id: str) -> str:
    """A session id's first 8 characters: enough to tell sessions apart in a log, too few to
    take the session over (the whole id is 192 random bits)."""
    return f"{session_id[:8]}…"


def _f32(x: float) -> float:
    """``x`` rounded to float32, as a device's request carries it."""
    return float(struct.unpack("f", struct.pack("f", x))[0])


def check_optimizer(limits: RuntimeLimits, lr: float, weight_decay: float) -> float:
    """The learning rate a session gets (0 asks for the default); refuses one out of bounds.

    The server's optimizer settings are the server's: a device asks within bounds.
    """
    lr = lr or limits.default_learning_rate
    if not (math.isfinite(lr) and 0 < lr <= _f32(limits.max_learning_rate)):
        raise InvalidRequestError(
            f"learning rate {lr:g} refused: the server allows (0, {limits.max_learning_rate:g}] "
            "(server.max_learning_rate); ask for less"
        )
    if not (math.isfinite(weight_decay) and 0 <= weight_decay <= _f32(limits.max_weight_decay)):
        raise InvalidRequestError(
            f"weight decay {weight_decay:g} refused: the server allows "
            f"[0, {limits.max_weight_decay:g}] (server.max_weight_decay)"
        )
    return lr


def check_declared(
    limits: RuntimeLimits, max_seq_len: int, microbatch_size: int, seq_len: int
) -> tuple[int, int]:
    """A session's declared shape, within the server's bounds (0: the bound itself)."""
    rows_max, tokens_max = limits.max_microbatch_size, max_seq_len
    if not 0 <= microbatch_size <= rows_max:
        raise InvalidRequestError(
            f"microbatch_size {microbatch_size} refused: the server allows 1 to {rows_max} "
            "(server.max_microbatch_size); send smaller microbatches"
        )
    if not 0 <= seq_len <= tokens_max:
        raise InvalidRequestError(
            f"seq_len {seq_len} refused: the server allows 1 to {tokens_max} (the model's "
            "positions or server.max_seq_len); use shorter sequences"
        )
    return microbatch_size or rows_max, seq_len or tokens_max


def seq_bound(max_positions: int, max_seq_len: int) -> int:
    """The longest sequence a session may declare: the model's positions, capped by the setting."""
    bounds = [b for b in (max_positions, max_seq_len) if b > 0]
    return min(bounds) if bounds else 2048  # a model that states no positions: a safe cap
