"""The StageServer's executor: one session's message through the shared stage, nothing else.

It knows nothing of gRPC, streams, queues or limits beyond a message's own shape: the runtime
(``server_runtime``) decides which message runs next and holds the bank lock around each call.
Received activations become leaves (``x.detach().requires_grad_(True)``) whose graphs are cached
per microbatch until their gradient arrives; ``STEP_END`` applies the session's optimizer.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from fedpipe.errors import InvalidRequestError, SessionStateError, StageCapacityError
from fedpipe.pipeline.messages import Kind, StageMsg
from fedpipe.split import AdapterBank

if TYPE_CHECKING:
    from fedpipe.pipeline.server_runtime import SessionInfo

__all__ = ["StageExecutor"]


class StageExecutor:
    """Forward, backward and optimizer steps of device sessions on one adapter bank."""

    def __init__(
        self,
        bank: AdapterBank,
        *,
        mode: str,
        hidden_size: int,
        device: torch.device,
        dtype: torch.dtype,
        max_in_flight: int,
    ) -> None:
        self.bank = bank
        self.mode = mode
        self.hidden_size = hidden_size
        self.device = device
        self.dtype = dtype
        self.max_in_flight = max_in_flight

    def compute(self, info: SessionInfo, msg: StageMsg) -> StageMsg:
        """The reply to one device message of ``info``'s current step."""
        start = time.perf_counter()
        self.bank.activate(info.session_id)
        if msg.kind is Kind.ACTIVATION:
            reply = self._forward(info, msg)
        elif msg.kind is Kind.OUTPUT_GRAD:
            reply = self._backward(info, msg)
        elif msg.kind is Kind.STEP_END:
            reply = self._step(info, msg)
        else:
            raise InvalidRequestError(f"{msg.kind.name} is not a device-to-server message")
        if reply.tensor is not None and not _all_finite(reply.tensor):
            raise InvalidRequestError(
                f"{msg}: the reply would hold NaN or Inf; the session's inputs made the "
                "computation overflow (send values of a sane magnitude)"
            )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        reply.compute_s = time.perf_counter() - start
        return reply

    def reset(self, info: SessionInfo) -> None:
        """Forget the session's unfinished step: cached graphs and accumulated gradients."""
        info.cache.clear()
        info.optimizer.zero_grad(set_to_none=True)

    def _to_stage(self, info: SessionInfo, tensor: torch.Tensor | None, what: str) -> torch.Tensor:
        """The tensor on the stage's device, if it fits what the session declared."""
        if tensor is None:
            raise InvalidRequestError(f"{what} message carries no tensor")
        shape = tuple(tensor.shape)
        if (
            len(shape) != 3
            or shape[-1] != self.hidden_size
            or not 1 <= shape[0] <= info.microbatch_size
            or not 1 <= shape[1] <= info.seq_len
        ):
            raise InvalidRequestError(
                f"{what} must be (batch <= {info.microbatch_size}, tokens <= {info.seq_len}, "
                f"{self.hidden_size}), got {shape}"
            )
        return tensor.to(self.device, self.dtype)

    def _forward(self, info: SessionInfo, msg: StageMsg) -> StageMsg:
        if msg.forward_only:
            with torch.no_grad():
                return self._evaluate(info, msg)
        mb = msg.microbatch
        if mb in info.cache:
            raise SessionStateError(f"duplicate ACTIVATION for step {msg.step} microbatch {mb}")
        if len(info.cache) >= self.max_in_flight:
            raise StageCapacityError(
                f"session {info.session_id} has {len(info.cache)} microbatches in flight, the "
                f"server's limit (server.max_in_flight = {self.max_in_flight}); send "
                "fewer before their gradients"
            )
        # Frozen-device mode (agg branch): no graph back to the device's activations.
        x = self._to_stage(info, msg.tensor, "ACTIVATION").requires_grad_(not info.frozen_head)
        if self.mode == "two":
            return self._forward_loss(info, msg, x)
        y = self.bank.stage(x)  # (B, T, C)
        info.cache[mb] = (x, y)
        return StageMsg(Kind.OUTPUT, msg.step, mb, tensor=y.detach().float())

    def _evaluate(self, info: SessionInfo, msg: StageMsg) -> StageMsg:
        x = self._to_stage(info, msg.tensor, "ACTIVATION")
        if self.mode == "u":
            y = self.bank.stage(x)
            return StageMsg(Kind.OUTPUT, msg.step, msg.microbatch, tensor=y.float())
        labels = self._labels(msg, x)
        loss_sum, tokens = self.bank.stage(x, labels)
        return StageMsg(
            Kind.INPUT_GRAD, msg.step, msg.microbatch, loss_sum=float(loss_sum), tokens=int(tokens)
        )

    def _labels(self, msg: StageMsg, x: torch.Tensor) -> torch.Tensor:
        if msg.labels is None or tuple(msg.labels.shape) != tuple(x.shape[:2]):
            got = None if msg.labels is None else tuple(msg.labels.shape)
            raise InvalidRequestError(f"labels must have shape {tuple(x.shape[:2])}, got {got}")
        return msg.labels.to(self.device)

    def _forward_loss(self, info: SessionInfo, msg: StageMsg, x: torch.Tensor) -> StageMsg:
        loss_sum, tokens = self.bank.stage(x, self._labels(msg, x))
        (loss_sum.float() * msg.loss_scale).backward()
        assert x.grad is not None or info.frozen_head
        info.cache[msg.microbatch] = (x, x)  # marks the microbatch as seen this step
        return StageMsg(
            Kind.INPUT_GRAD,
            msg.step,
            msg.microbatch,
            tensor=None if x.grad is None else x.grad.float(),  # None: frozen device (agg)
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
        grad = self._to_stage(info, msg.tensor, "OUTPUT_GRAD")
        if grad.shape != y.shape:
            raise InvalidRequestError(
                f"OUTPUT_GRAD shape {tuple(grad.shape)} != OUTPUT shape {tuple(y.shape)}"
            )
        y.backward(grad)
        del info.cache[mb]
        assert x.grad is not None or info.frozen_head
        tensor = None if x.grad is None else x.grad.float()  # None: frozen device (agg branch)
        return StageMsg(Kind.INPUT_GRAD, msg.step, mb, tensor=tensor)

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


def _all_finite(t: torch.Tensor) -> bool:
    """True when no value is NaN or Inf (a finite sum proves it; otherwise count)."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())
