"""The device side of the pipeline: walks a schedule over the head and tail stages.

For each step the batch is cut into microbatches; the runtime runs the schedule's actions
(``F``: head forward and send, ``T``: tail forward + loss + backward, ``B``: head backward),
while the channel sends and receives in the background, so device compute, both link
directions and the server's compute overlap. Losses are summed over tokens and divided by the
step's total token count, so any schedule and any number of microbatches give the same loss
and gradients as the unsplit model on the whole batch.

A step ends by sending ``STEP_END`` without waiting for the server's ``STEP_DONE``: the server's
worker serves a session's messages in order, so its optimizer update is applied before the next
step's first activation is computed. ``STEP_DONE`` is collected lazily, before the next step's
first reply is consumed (or by :meth:`DeviceRuntime.finish`), so a failed update still surfaces,
and a step no longer pays one round trip of the link at its end.

``dtype`` = bf16 (``device.dtype``) runs the head's and tail's forwards under
``torch.autocast("cpu", dtype=torch.bfloat16)`` (their backwards then run in the dtypes autocast
chose, outside it); parameters, their gradients and the optimizer stay fp32, the tail's loss
is upcast to fp32 (fedpipe.split.loss), and the head's output is cast to fp32 before it is sent
(the output gradient is the gradient of the tail's fp32 input, so fp32 already).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from fedpipe.config.device import DEVICE_DTYPES
from fedpipe.edge.schedules import Action, Op, Schedule, make_schedule
from fedpipe.messages import Kind, StageMsg
from fedpipe.trace import Tracer

__all__ = [
    "DeviceRuntime",
    "StageChannel",
    "StepResult",
    "count_tokens",
    "merge_losses",
    "split_batch",
]

log = logging.getLogger(__name__)


class StageChannel(Protocol):
    """A device session's link to the server, as the runtime sees it."""

    def send(self, msg: StageMsg) -> None:
        """Queue a message for sending; returns at once."""

    def ready(self, kind: Kind, step: int, microbatch: int) -> bool:
        """Whether that message has arrived."""

    def receive(self, kind: Kind, step: int, microbatch: int) -> StageMsg:
        """Block until that message arrives (raises :class:`StageLinkError` on failure)."""

    def wait_any(self, timeout: float) -> None:
        """Block until any new message arrives, or ``timeout`` seconds pass."""


class Throttle(Protocol):
    def run(self) -> AbstractContextManager[object]: ...


# (tail, its input x (a leaf), labels, the step's token count) -> (loss sum, gradient to send up)
TailStep = Callable[[nn.Module, torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class StepResult:
    """What one pipelined step did, for metrics and benchmarks."""

    step: int
    loss: float  # mean token loss over the whole batch
    tokens: int
    wall_s: float
    schedule: str
    microbatches: int
    compute_s: dict[str, float] = field(default_factory=dict)  # device seconds per op kind
    server_compute_s: float = 0.0
    stash_peak: int = 0  # most microbatches stashed for the head's backward at once


def split_batch(batch: dict[str, torch.Tensor], num: int) -> list[dict[str, torch.Tensor]]:
    """Cut a batch into ``num`` microbatches along the batch dimension (sizes differ by <= 1)."""
    size = batch["input_ids"].shape[0]
    if not 1 <= num <= size:
        raise ValueError(
            f"cannot cut a batch of {size} sequences into {num} microbatches; "
            f"use between 1 and {size} microbatches or a larger batch"
        )
    parts = {k: torch.tensor_split(v, num) for k, v in batch.items()}
    return [{k: parts[k][i] for k in batch} for i in range(num)]


def count_tokens(labels: torch.Tensor) -> int:
    """Tokens that count in the loss: shifted labels that are not ``-100``."""
    return int((labels[:, 1:] != -100).sum())


def merge_losses(loss_sums: list[float], tokens: int) -> float:
    """The batch's mean token loss from per-microbatch sums."""
    return sum(loss_sums) / max(tokens, 1)


@dataclass
class _StepState:
    step: int
    microbatches: list[dict[str, torch.Tensor]]
    total_tokens: int
    schedule: Schedule
    heads: dict[int, torch.Tensor] = field(default_factory=dict)  # mb -> head output (graph)
    penalties: dict[int, torch.Tensor] = field(default_factory=dict)  # mb -> head penalty
    loss_sums: list[float] = field(default_factory=list)
    done: set[Action] = field(default_factory=set)
    server_s: float = 0.0
    stash_peak: int = 0


class DeviceRuntime:
    """Runs pipelined training steps of one device session."""

    def __init__(
        self,
        head: nn.Module,
        tail: nn.Module | None,
        channel: StageChannel,
        *,
        optimizer: torch.optim.Optimizer | None,
        schedule: str = "greedy",
        microbatches: int = 4,
        max_in_flight: int | None = None,
        throttle: Throttle | None = None,
        tracer: Tracer | None = None,
        wait_step_done: bool = False,
        frozen_head: bool = False,
        recompute_head: bool = False,
        transform_up: Callable[[Kind, torch.Tensor], torch.Tensor] | None = None,
        head_penalty: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None,
        tail_step: TailStep | None = None,
        dtype: str = "fp32",
    ) -> None:
        self.head = head
        self.tail = tail
        self.channel = channel
        self.optimizer = optimizer
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.max_in_flight = max_in_flight
        self.throttle = throttle
        self.tracer = tracer or Tracer()
        self.wait_step_done = wait_step_done  # True: every step waits for its STEP_DONE
        self._unconfirmed: int | None = None  # a step whose STEP_DONE is not collected yet
        # Frozen-device mode: the head runs forward only; no input gradient comes back.
        self.frozen_head = frozen_head
        # Recompute: the forward keeps no graph; the backward runs the head again with one.
        self.recompute_head = recompute_head
        # Privacy defences (fedpipe.privacy): applied to ACTIVATION and OUTPUT_GRAD tensors of
        # training steps just before sending; training continues from what was sent.
        self.transform_up = transform_up
        # A loss term on the head's output, (input_ids, output, 1/microbatches) -> scalar, in
        # the head's graph (privacy.decorrelation); its gradient joins the server's on backward.
        self.head_penalty = head_penalty
        # The tail's loss and the gradient to send up, when they differ (privacy.label_resample):
        # (tail, x, labels, step tokens) -> (loss sum, gradient); it runs the tail's backward.
        self.tail_step = tail_step
        # device.dtype: fp32, or bf16 forwards under autocast (see the module's docstring)
        if dtype not in DEVICE_DTYPES:
            raise ValueError(f"dtype {dtype!r} unknown; choose one of {', '.join(DEVICE_DTYPES)}")
        if dtype != "fp32" and tail_step is not None:
            raise ValueError(f"dtype {dtype} cannot run a tail_step (it runs its own backward)")
        self.dtype = dtype
        make_schedule(schedule, microbatches, has_tail=tail is not None)  # validate early

    def train_step(self, batch: dict[str, torch.Tensor], *, step: int) -> StepResult:
        """Run one pipelined step over ``batch`` (``input_ids`` and ``labels``, (B, T)).

        Gradients are cleared before the step and again if it fails, and a failed step's
        stashed head outputs are dropped: a step that breaks halfway (the link fails, the
        server refuses a message) must not leave half a gradient for the next step to add to.
        """
        self._clear_grads()
        schedule = make_schedule(
            self.schedule_name,
            self.microbatches,
            has_tail=self.tail is not None,
            max_in_flight=self.max_in_flight,
        )
        state = _StepState(
            step,
            split_batch(batch, schedule.num_microbatches),
            count_tokens(batch["labels"]),
            schedule,
        )
        try:
            return self._walk(state)
        except BaseException:
            state.heads.clear()  # the graphs of microbatches whose backward never came
            state.penalties.clear()
            self._clear_grads()
            log.warning("step %d failed; its gradients and stashed activations are dropped", step)
            raise

    def finish(self) -> None:
        """Collect the last step's ``STEP_DONE``; call it before reporting a session's steps.

        Raises :class:`StageLinkError` when the server's optimizer update failed.
        """
        self._confirm(None)

    def _confirm(self, state: _StepState | None) -> None:
        """Take the previous step's ``STEP_DONE`` if it is still out (it waits at most for it)."""
        if self._unconfirmed is None:
            return
        step, self._unconfirmed = self._unconfirmed, None
        reply = self.channel.receive(Kind.STEP_DONE, step, 0)
        if state is not None:  # the server's update ran at the start of this step
            self._server_span("So", 0, reply, state)

    def _walk(self, state: _StepState) -> StepResult:
        """The step's actions, the optimizer update, and (maybe) the server's confirmation."""
        start = time.perf_counter()
        n_events = len(self.tracer.events)
        if state.schedule.strict:
            for action in state.schedule.actions:
                self._run(action, state)
        else:
            self._run_greedy(state)
        self._confirm(state)  # a step without replies (none today) still collects the last one
        self.channel.send(StageMsg(Kind.STEP_END, state.step))
        self._unconfirmed = state.step
        with self._compute("O", "device"):
            if self.optimizer is not None:
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
        if self.wait_step_done:
            self._confirm(state)
        return self._result(state, time.perf_counter() - start, n_events)

    def _clear_grads(self) -> None:
        for stage in (self.head, self.tail):
            if stage is not None:
                stage.zero_grad(set_to_none=True)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def evaluate(self, batch: dict[str, torch.Tensor], *, step: int) -> tuple[float, int]:
        """Summed token loss and token count of ``batch`` through the split model (no update).

        All head forwards go out first, then the tails run as outputs come back, so the
        link's latency is paid about once per batch, not once per microbatch.
        """
        self._confirm(None)
        parts = split_batch(batch, min(self.microbatches, batch["input_ids"].shape[0]))
        kind = Kind.OUTPUT if self.tail is not None else Kind.INPUT_GRAD
        for mb, data in enumerate(parts):
            segments = data.get("segments")
            head = self._head(data["input_ids"], segments)
            msg = StageMsg(Kind.ACTIVATION, step, mb, tensor=head)
            msg.forward_only, msg.segments = True, segments
            if self.tail is None:
                msg.labels = data["labels"]
            self.channel.send(msg)
        loss_sum, tokens = 0.0, 0
        for mb, data in enumerate(parts):
            reply = self.channel.receive(kind, step, mb)
            if self.tail is None:
                loss_sum, tokens = loss_sum + reply.loss_sum, tokens + reply.tokens
                continue
            with self._autocast():
                part_sum, part_tokens = self.tail(
                    reply.tensor, data["labels"], segments=data.get("segments")
                )
            loss_sum, tokens = loss_sum + float(part_sum), tokens + int(part_tokens)
        return loss_sum, tokens

    # -- actions ----------------------------------------------------------------------------
    def _run(self, action: Action, state: _StepState) -> None:
        if action.op is Op.FORWARD:
            self._forward(action.microbatch, state)
        elif action.op is Op.TAIL:
            self._tail(action.microbatch, state)
        else:
            self._backward(action.microbatch, state)
        state.done.add(action)

    @contextmanager
    def _compute(self, name: str, lane: str) -> Iterator[None]:
        """Trace a device computation; the throttle stretches it by the device's slowdown."""
        with self.throttle.run() if self.throttle else nullcontext():
            with self.tracer.span(name, lane):
                yield

    def _autocast(self) -> AbstractContextManager[object]:
        """The forwards' compute dtype: nothing for fp32, CPU autocast to bfloat16 for bf16."""
        if self.dtype == "bf16":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return nullcontext()

    def _head(self, input_ids: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        """The head's output (b, T, C) in fp32, what the server expects, whatever it computed in
        (``segments``: a packed row's examples)."""
        if self.dtype == "fp32":
            return self.head(input_ids, segments)  # type: ignore[no-any-return]
        with self._autocast():
            h = self.head(input_ids, segments)
        return h.float()  # in the graph: the head's backward takes the fp32 reply

    def _forward(self, mb: int, state: _StepState) -> None:
        data = state.microbatches[mb]
        keep_graph = not (self.frozen_head or self.recompute_head)
        with self._compute(f"F{mb}", "device"), torch.set_grad_enabled(keep_graph):
            # (b, T, C); frozen or recompute: no graph kept
            h = self._head(data["input_ids"], data.get("segments"))
            if self.head_penalty is not None and keep_graph:
                scale = 1.0 / state.schedule.num_microbatches
                state.penalties[mb] = self.head_penalty(data["input_ids"], h, scale)
            if self.transform_up is not None:  # in the graph: head backward sees what was sent
                h = self.transform_up(Kind.ACTIVATION, h)
        state.heads[mb] = h
        state.stash_peak = max(state.stash_peak, len(state.heads))
        # inputs: the device's transport keys delta coding by them (never sent); a packed row's
        # activation depends on its segments too, so they join its key
        segments = data.get("segments")  # packed rows: the server's blocks need them too
        ids = data["input_ids"] if segments is None else torch.cat((data["input_ids"], segments), 1)
        msg = StageMsg(Kind.ACTIVATION, state.step, mb, tensor=h.detach(), inputs=ids)
        msg.segments = segments
        if self.tail is None:  # two-part split: the server computes the loss
            msg.labels = data["labels"]
            msg.loss_scale = 1.0 / max(state.total_tokens, 1)
        self.channel.send(msg)

    def _tail(self, mb: int, state: _StepState) -> None:
        assert self.tail is not None
        self._confirm(state)
        reply = self.channel.receive(Kind.OUTPUT, state.step, mb)
        self._server_span("Sf", mb, reply, state)
        with self._compute(f"T{mb}", "device"):
            assert reply.tensor is not None, "OUTPUT replies always carry the middle's output"
            x = reply.tensor.detach().requires_grad_(True)  # (b, T, C), a leaf
            labels = state.microbatches[mb]["labels"]
            segments = state.microbatches[mb].get("segments")
            grad: torch.Tensor | None
            if self.tail_step is not None:
                loss_sum, grad = self.tail_step(self.tail, x, labels, state.total_tokens)
            else:
                with self._autocast():
                    loss_sum, _ = self.tail(x, labels, segments=segments)
                (loss_sum / max(state.total_tokens, 1)).backward()
                grad = x.grad
        state.loss_sums.append(float(loss_sum.detach()))
        if self.transform_up is not None and grad is not None:
            grad = self.transform_up(Kind.OUTPUT_GRAD, grad)
        self.channel.send(StageMsg(Kind.OUTPUT_GRAD, state.step, mb, tensor=grad))

    def _backward(self, mb: int, state: _StepState) -> None:
        self._confirm(state)
        reply = self.channel.receive(Kind.INPUT_GRAD, state.step, mb)
        self._server_span("Sb", mb, reply, state)
        if self.tail is None:
            state.loss_sums.append(reply.loss_sum)
        head = state.heads.pop(mb)
        if self.frozen_head:  # nothing to train before the cut: the reply carries no tensor
            return
        if reply.tensor is None:
            raise ValueError(f"INPUT_GRAD for step {state.step} microbatch {mb} has no tensor")
        with self._compute(f"B{mb}", "device"):
            if self.recompute_head:  # the same forward again, this time with its graph
                data = state.microbatches[mb]
                head = self._head(data["input_ids"], data.get("segments"))
            penalty = state.penalties.pop(mb, None)
            if penalty is None:
                head.backward(reply.tensor)
            else:  # one backward through the head for both (the graph is freed after it)
                torch.autograd.backward([head, penalty], [reply.tensor, None])

    def _server_span(self, name: str, mb: int, reply: StageMsg, state: _StepState) -> None:
        """Record the server's compute for this reply (placed just before its receipt)."""
        state.server_s += reply.compute_s
        now = self.tracer.clock()
        self.tracer.add(f"{name}{mb}", "server", now - reply.compute_s, now)

    def _run_greedy(self, state: _StepState) -> None:
        """Tail-first: a ready T, else a ready B, else the next F within the in-flight cap."""
        m = state.schedule.num_microbatches
        cap = state.schedule.max_in_flight or m
        next_f = 0
        while len(state.done) < len(state.schedule.actions):
            action = self._next_ready(state, next_f, cap)
            if action is None:
                self.channel.wait_any(0.05)
                continue
            self._run(action, state)
            next_f += action.op is Op.FORWARD

    def _next_ready(self, state: _StepState, next_f: int, cap: int) -> Action | None:
        step, ops = state.step, state.schedule.ops
        for op, kind in ((Op.TAIL, Kind.OUTPUT), (Op.BACKWARD, Kind.INPUT_GRAD)):
            if op not in ops:
                continue
            for mb in range(next_f):
                action = Action(op, mb)
                prior = ops[ops.index(op) - 1]
                if (
                    action not in state.done
                    and Action(prior, mb) in state.done
                    and self.channel.ready(kind, step, mb)
                ):
                    return action
        if next_f < state.schedule.num_microbatches and len(state.heads) < cap:
            return Action(Op.FORWARD, next_f)
        return None

    def _result(self, state: _StepState, wall_s: float, n_events: int) -> StepResult:
        compute: dict[str, float] = {}
        for event in self.tracer.events[n_events:]:
            if event.lane == "device":
                compute[event.name[0]] = compute.get(event.name[0], 0.0) + event.duration
        return StepResult(
            step=state.step,
            loss=merge_losses(state.loss_sums, state.total_tokens),
            tokens=state.total_tokens,
            wall_s=wall_s,
            schedule=state.schedule.name,
            microbatches=state.schedule.num_microbatches,
            compute_s=compute,
            server_compute_s=state.server_s,
            stash_peak=state.stash_peak,
        )
