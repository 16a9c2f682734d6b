"""The server side of the pipeline: one middle stage shared by many device sessions.

Each session (one device, one round) trains its own LoRA adapter on the shared, frozen middle
blocks. One compute worker runs every session's work in arrival order, switching adapters per
message; the transport's threads decode and encode around it so that I/O keeps flowing while
the worker computes. The worker walks the server's half of the schedule implicitly: it answers
``ACTIVATION`` with a forward and ``OUTPUT_GRAD`` with a backward, in the order the device's
schedule sent them, and applies the session's optimizer on ``STEP_END``.

At the end of a round the ServerApp commits it: the adapters of devices whose Flower reply
arrived are averaged into the global server adapter (with the strategy's weights) and every
other session of the round is discarded, so a device that vanished leaves no trace.
"""

from __future__ import annotations

import itertools
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from fedpipe.errors import (
    SessionStateError,
    StageCapacityError,
    UnknownSessionError,
)
from fedpipe.pipeline.messages import Kind, StageMsg
from fedpipe.split import AdapterBank

__all__ = ["SessionInfo", "StageRuntime"]

log = logging.getLogger(__name__)

Outbox = Callable[[StageMsg | BaseException], None]
OptimizerFactory = Callable[[list[nn.Parameter], float, float], torch.optim.Optimizer]


def _adamw(params: list[nn.Parameter], lr: float, weight_decay: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


@dataclass
class SessionInfo:
    """What the runtime knows of one device session."""

    session_id: str
    device_id: str
    round: int
    optimizer: torch.optim.Optimizer
    step: int = 0
    steps_done: int = 0
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    outbox: Outbox | None = None
    last_seen: float = field(default_factory=time.monotonic)


class StageRuntime:
    """Serves the middle stage (U-shaped split) or the server's loss stage (two-part split)."""

    def __init__(
        self,
        bank: AdapterBank,
        *,
        mode: str,
        hidden_size: int,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        max_sessions: int = 64,
        max_in_flight: int = 64,
        optimizer_factory: OptimizerFactory | None = None,
    ) -> None:
        self.bank = bank
        self.optimizer_factory = optimizer_factory or _adamw
        self.mode = mode
        self.hidden_size = hidden_size
        self.device = device
        self.dtype = dtype
        self.max_sessions = max_sessions
        self.max_in_flight = max_in_flight
        self._sessions: dict[str, SessionInfo] = {}
        self._lock = threading.RLock()  # guards _sessions and the bank's adapter set
        # (session, message) to compute, or (session, callback) to call once all the
        # session's earlier work is done; None stops the worker.
        self._work: queue.Queue[tuple[str, StageMsg | Callable[[], None]] | None] = queue.Queue()
        self._ids = itertools.count()
        self._worker = threading.Thread(target=self._run, name="stage-compute", daemon=True)
        self._worker.start()

    # -- sessions ---------------------------------------------------------------------------
    def open_session(
        self, device_id: str, round_: int, *, lr: float, weight_decay: float = 0.0
    ) -> str:
        """Start a session on a fresh copy of the global adapter; replaces the device's old one."""
        with self._lock:
            for old in [s for s in self._sessions.values() if s.device_id == device_id]:
                self._drop(old.session_id, reason="replaced by a new session")
            if len(self._sessions) >= self.max_sessions:
                raise StageCapacityError(
                    f"StageServer holds {len(self._sessions)} sessions, its limit "
                    f"(--max-sessions {self.max_sessions}); retry later or raise the limit"
                )
            session_id = f"{device_id}-r{round_}-{next(self._ids)}-{secrets.token_hex(4)}"
            self.bank.add(session_id)
            params = self.bank.parameters(session_id)
            opt = self.optimizer_factory(params, lr, weight_decay)
            self._sessions[session_id] = SessionInfo(session_id, device_id, round_, opt)
            log.info("[%s] session %s opened for round %d", device_id, session_id, round_)
            return session_id

    def session(self, session_id: str) -> SessionInfo:
        with self._lock:
            try:
                return self._sessions[session_id]
            except KeyError:
                raise UnknownSessionError(
                    f"unknown session {session_id!r}: it was never opened, was closed, or was "
                    "discarded when its round was committed; open a new session"
                ) from None

    def attach(self, session_id: str, outbox: Outbox) -> None:
        """Route the session's replies to a stream; a new stream replaces the old one."""
        info = self.session(session_id)
        info.outbox = outbox

    def detach(self, session_id: str) -> None:
        """The session's stream ended: forget its unfinished step (nothing half-applied stays)."""
        with self._lock:
            info = self._sessions.get(session_id)
            if info is None:
                return
            info.outbox = None
        self._work.put((session_id, StageMsg(Kind.ERROR, step=-1, error="detached")))

    def close_session(self, session_id: str) -> int:
        """End a session; a trained adapter is kept until its round is committed.

        A session that completed no step (an evaluation, or a device that gave up) has nothing
        to merge and is dropped at once.
        """
        info = self.session(session_id)
        info.outbox = None
        if info.steps_done == 0:
            with self._lock:
                self._drop(session_id, reason="closed without a completed step")
        return info.steps_done

    def sessions(self) -> list[SessionInfo]:
        with self._lock:
            return list(self._sessions.values())

    def _drop(self, session_id: str, *, reason: str) -> None:
        info = self._sessions.pop(session_id, None)
        if info is None:
            return
        info.cache.clear()
        self.bank.remove(session_id)
        log.info("[%s] session %s dropped: %s", info.device_id, session_id, reason)

    # -- rounds -----------------------------------------------------------------------------
    def commit_round(self, round_: int, finished: dict[str, float]) -> tuple[int, int]:
        """Average the finished devices' adapters of ``round_`` into the global one; drop the rest.

        ``finished`` maps device id to its aggregation weight (e.g. num-examples). Returns
        ``(merged, discarded)`` session counts.
        """
        with self._lock:
            merge = {
                s.session_id: finished[s.device_id]
                for s in self._sessions.values()
                if s.round == round_ and s.device_id in finished and s.steps_done > 0
            }
            if merge:
                self.bank.merge(merge)
                for session_id in merge:
                    self._sessions.pop(session_id, None)
            stale = [s.session_id for s in self._sessions.values() if s.round <= round_]
            for session_id in stale:
                self._drop(session_id, reason=f"round {round_} committed without it")
            return len(merge), len(stale)

    # -- work -------------------------------------------------------------------------------
    def submit(self, session_id: str, msg: StageMsg) -> None:
        """Queue one message of a session for the compute worker."""
        info = self.session(session_id)
        info.last_seen = time.monotonic()
        if msg.kind is Kind.ACTIVATION and len(info.cache) >= self.max_in_flight:
            raise StageCapacityError(
                f"session {session_id} has {len(info.cache)} microbatches in flight, the "
                f"server's limit ({self.max_in_flight}); send fewer before their gradients"
            )
        self._work.put((session_id, msg))

    def after_pending(self, session_id: str, callback: Callable[[], None]) -> None:
        """Call ``callback`` on the worker once everything queued before it has been computed.

        The transport uses it when a device half-closes its stream: replies to the messages it
        sent last must still go out before the stream ends.
        """
        self._work.put((session_id, callback))

    def stop(self) -> None:
        self._work.put(None)
        self._worker.join(timeout=10)

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            session_id, msg = item
            if callable(msg):
                msg()
                continue
            with self._lock:
                info = self._sessions.get(session_id)
            if info is None:
                continue
            reply: StageMsg | BaseException | None
            try:
                reply = self._handle(info, msg)
            except Exception as exc:  # one session's bad message must not stop the others
                log.warning("[%s] %s failed: %s", info.device_id, msg, exc)
                self._reset_step(info)
                reply = exc
            outbox = info.outbox  # read once: detach() may clear it from a gRPC thread
            if reply is not None and outbox is not None:
                outbox(reply)

    def _handle(self, info: SessionInfo, msg: StageMsg) -> StageMsg | None:
        if msg.kind is Kind.ERROR:  # the stream went away
            self._reset_step(info)
            return None
        if msg.step != info.step:
            raise SessionStateError(
                f"message for step {msg.step}, but session {info.session_id} is at step {info.step}"
            )
        start = time.perf_counter()
        with self._lock:
            self.bank.activate(info.session_id)
            if msg.kind is Kind.ACTIVATION:
                reply = self._forward(info, msg)
            elif msg.kind is Kind.OUTPUT_GRAD:
                reply = self._backward(info, msg)
            elif msg.kind is Kind.STEP_END:
                reply = self._step(info, msg)
            else:
                raise SessionStateError(f"{msg.kind.name} is not a device-to-server message")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        reply.compute_s = time.perf_counter() - start
        return reply

    def _to_stage(self, tensor: torch.Tensor | None, what: str) -> torch.Tensor:
        if tensor is None:
            raise SessionStateError(f"{what} message carries no tensor")
        if tensor.dim() != 3 or tensor.shape[-1] != self.hidden_size:
            raise SessionStateError(
                f"{what} must be (batch, tokens, {self.hidden_size}), got {tuple(tensor.shape)}"
            )
        return tensor.to(self.device, self.dtype)

    def _forward(self, info: SessionInfo, msg: StageMsg) -> StageMsg:
        if msg.forward_only:
            with torch.no_grad():
                return self._evaluate(msg)
        mb = msg.microbatch
        if mb in info.cache:
            raise SessionStateError(f"duplicate ACTIVATION for step {msg.step} microbatch {mb}")
        x = self._to_stage(msg.tensor, "ACTIVATION").requires_grad_(True)
        if self.mode == "two":
            return self._forward_loss(info, msg, x)
        y = self.bank.stage(x)  # (B, T, C)
        info.cache[mb] = (x, y)
        return StageMsg(Kind.OUTPUT, msg.step, mb, tensor=y.detach().float())

    def _evaluate(self, msg: StageMsg) -> StageMsg:
        x = self._to_stage(msg.tensor, "ACTIVATION")
        if self.mode == "u":
            y = self.bank.stage(x)
            return StageMsg(Kind.OUTPUT, msg.step, msg.microbatch, tensor=y.float())
        if msg.labels is None:
            raise SessionStateError("evaluation in the two-part split needs labels")
        loss_sum, tokens = self.bank.stage(x, msg.labels.to(self.device))
        return StageMsg(
            Kind.INPUT_GRAD, msg.step, msg.microbatch, loss_sum=float(loss_sum), tokens=int(tokens)
        )

    def _forward_loss(self, info: SessionInfo, msg: StageMsg, x: torch.Tensor) -> StageMsg:
        if msg.labels is None or tuple(msg.labels.shape) != tuple(x.shape[:2]):
            got = None if msg.labels is None else tuple(msg.labels.shape)
            raise SessionStateError(f"labels must have shape {tuple(x.shape[:2])}, got {got}")
        loss_sum, tokens = self.bank.stage(x, msg.labels.to(self.device))
        (loss_sum.float() * msg.loss_scale).backward()
        assert x.grad is not None
        info.cache[msg.microbatch] = (x, x)  # marks the microbatch as seen this step
        return StageMsg(
            Kind.INPUT_GRAD,
            msg.step,
            msg.microbatch,
            tensor=x.grad.float(),
            loss_sum=float(loss_sum.detach()),
            tokens=int(tokens),
        )

    def _backward(self, info: SessionInfo, msg: StageMsg) -> StageMsg:
        mb = msg.microbatch
        if mb not in info.cache:
            raise SessionStateError(
                f"OUTPUT_GRAD for step {msg.step} microbatch {mb} without its ACTIVATION"
            )
        x, y = info.cache[mb]
        grad = self._to_stage(msg.tensor, "OUTPUT_GRAD")
        if grad.shape != y.shape:
            raise SessionStateError(
                f"OUTPUT_GRAD shape {tuple(grad.shape)} != OUTPUT shape {tuple(y.shape)}"
            )
        y.backward(grad)
        del info.cache[mb]
        assert x.grad is not None
        return StageMsg(Kind.INPUT_GRAD, msg.step, mb, tensor=x.grad.float())

    def _step(self, info: SessionInfo, msg: StageMsg) -> StageMsg:
        if self.mode == "u" and info.cache:
            pending = sorted(info.cache)
            raise SessionStateError(
                f"STEP_END for step {msg.step} while microbatches {pending} await gradients"
            )
        info.optimizer.step()
        info.optimizer.zero_grad(set_to_none=True)
        info.cache.clear()
        info.step += 1
        info.steps_done += 1
        return StageMsg(Kind.STEP_DONE, msg.step)

    def _reset_step(self, info: SessionInfo) -> None:
        """Forget a failed step's graphs and gradients; the session may retry the same step."""
        info.cache.clear()
        info.optimizer.zero_grad(set_to_none=True)
