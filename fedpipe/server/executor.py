"""The StageServer's executor: a batch of sessions' messages through the shared stage.

It knows nothing of gRPC, streams, queues or limits beyond a message's own shape: the runtime
(:mod:`fedpipe.server.runtime`) and its policy decide which messages run together, and the
runtime holds the bank lock around each call. Received activations become leaves
(``x.detach().requires_grad_(True)``) whose graphs are cached per microbatch until their
gradient arrives; ``STEP_END`` applies the session's optimizer, and only its own.

A call computes the ACTIVATIONs of all its sessions in one batched forward of the bank (one
frozen matmul over every session's tokens, each session's LoRA on its own rows). On the batched
bank (split mode "u") a training forward keeps no autograd graph but a tape per microbatch, and
the OUTPUT_GRADs of a call run as ONE batched backward over their tapes, whichever forward calls
recorded them (:meth:`BatchedAdapterBank.backward`); on peft's bank each OUTPUT_GRAD runs its
own graph.

Two options change where the work of a waiting microbatch lives and when it runs, never its
numbers. ``offload`` (``server.offload = "auto"``): what a microbatch keeps for its backward
waits in host memory (:mod:`fedpipe.server.stash`). ``input_grad_first``
(``server.input_grad_first``, the batched bank): a batched backward computes the input
gradients and replies; the adapters' weight gradients it recorded run later
(:meth:`StageExecutor.compute_weight_grads`: the runtime calls it when idle, and a session's
``STEP_END`` or reset runs its own first), oldest first, so every ``.grad`` sums as before.
Every message gets its own reply or its own error: a message that fails (a wrong shape, a
duplicate, a reply that would hold NaN) fails alone, and the others of the call are answered
as if they had run by themselves.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from fedpipe.errors import InvalidRequestError, SessionStateError, StageCapacityError
from fedpipe.lora import AdapterBank, BatchedAdapterBank, Group
from fedpipe.lora.batched_blocks import Tape
from fedpipe.messages import Kind, StageMsg
from fedpipe.server.deferred_weights import DeferredWeights
from fedpipe.server.device_copies import DeviceCopies
from fedpipe.server.sessions import SessionInfo
from fedpipe.server.stash import SavedTensors, Stash

__all__ = ["StageExecutor"]

log = logging.getLogger(__name__)

Work = tuple[SessionInfo, StageMsg]
Result = StageMsg | Exception


@dataclass
class _Forward:
    """One validated ACTIVATION of a call: where its reply goes and its group."""

    index: int
    info: SessionInfo
    msg: StageMsg
    group: Group


@dataclass
class _Backward:
    """One validated OUTPUT_GRAD of a call whose forward left a tape."""

    index: int
    info: SessionInfo
    msg: StageMsg
    tape: Tape
    grad: torch.Tensor


class StageExecutor:
    """Forward, backward and optimizer steps of device sessions on one adapter bank."""

    def __init__(
        self,
        bank: AdapterBank | BatchedAdapterBank,
        *,
        mode: str,
        hidden_size: int,
        device: torch.device,
        dtype: torch.dtype,
        max_in_flight: int,
        copies: DeviceCopies | None = None,
        offload: bool = False,
        input_grad_first: bool = False,
    ) -> None:
        self.bank = bank
        self.copies = copies or DeviceCopies(device)  # uploads and replies off the compute stream
        self.mode = mode
        self.hidden_size = hidden_size
        self.device = device
        self.dtype = dtype
        self.max_in_flight = max_in_flight
        # Waiting microbatches' saved tensors: on the device, or in host memory (offload).
        self.stash = Stash(device, offload=offload and mode == "u")
        self.input_grad_first = input_grad_first
        # Weight gradients batched backwards left for later (input_grad_first).
        self.deferred = DeferredWeights(BatchedAdapterBank.add_weight_grads)
        # (session, microbatch) -> its peft graph's saved tensors, while the graph lives
        self._saved: weakref.WeakValueDictionary[tuple[str, int], SavedTensors] = (
            weakref.WeakValueDictionary()
        )

    def compute(self, info: SessionInfo, msg: StageMsg) -> StageMsg:
        """The reply to one device message of ``info``'s current step (raises on failure)."""
        (reply,) = self.compute_batch([(info, msg)])
        if isinstance(reply, Exception):
            raise reply
        return reply

    def compute_batch(self, work: Sequence[Work]) -> list[Result]:
        """One reply or error per message, in order; each session's messages keep their order."""
        start = time.perf_counter()
        results: list[Result | None] = [None] * len(work)
        for segment in _segments(work):
            self._forwards(
                work, [i for i in segment if work[i][1].kind is Kind.ACTIVATION], results
            )
            self._backwards(
                work, [i for i in segment if work[i][1].kind is Kind.OUTPUT_GRAD], results
            )
            for i in segment:
                if results[i] is None:
                    results[i] = self._one(*work[i])
        self._replies_to_host(work, results)  # waits for this call's copies, not the device
        _share_time(work, results, time.perf_counter() - start)
        return [r if r is not None else RuntimeError("no reply computed") for r in results]

    def reset(self, info: SessionInfo) -> None:
        """Forget the session's unfinished step: cached graphs and accumulated gradients."""
        self.deferred.compute_for(info.session_id)  # none of them may land after the reset
        self.deferred.failure(info.session_id)
        info.cache.clear()
        info.optimizer.zero_grad(set_to_none=True)
        info.step_rows = info.step_tokens = 0

    def forget(self, info: SessionInfo) -> None:
        """Let go of what the session holds here (it is being dropped)."""
        info.cache.clear()
        self.deferred.failure(info.session_id)

    # -- weight gradients after the input gradients (B/W split) -------------------------------
    @property
    def weights_pending(self) -> bool:
        """Whether backwards left weight gradients to compute."""
        return self.deferred.pending

    def compute_weight_grads(self) -> int:
        """Every weight gradient backwards left, oldest first; returns how many backwards'.

        A computation that fails adds nothing; the step of each session it served then fails
        at its ``STEP_END``.
        """
        return self.deferred.compute_all()

    # -- one message at a time: backward, step -----------------------------------------------
    def _one(self, info: SessionInfo, msg: StageMsg) -> Result:
        try:
            if msg.kind is Kind.OUTPUT_GRAD:
                return _finite(msg, self._backward(info, msg))
            if msg.kind is Kind.STEP_END:
                return self._step(info, msg)
            raise InvalidRequestError(f"{msg.kind.name} is not a device-to-server message")
        except Exception as exc:  # this message's failure is its own
            return exc

    # -- forwards, batched ---------------------------------------------------------------------
    def _forwards(
        self, work: Sequence[Work], indices: list[int], results: list[Result | None]
    ) -> None:
        """Validate every ACTIVATION, then run the valid ones: training and evaluation apart."""
        train: list[_Forward] = []
        evaluate: list[_Forward] = []
        reserved: dict[str, set[int]] = {}  # microbatches of this call, per session
        for i in indices:
            info, msg = work[i]
            try:
                fwd = self._prepare(i, info, msg, reserved.setdefault(info.session_id, set()))
            except Exception as exc:
                results[i] = exc
                continue
            (evaluate if msg.forward_only else train).append(fwd)
        if evaluate:
            with torch.no_grad():
                self._run(evaluate, results)
        if train:
            self._run(train, results)

    def _prepare(self, i: int, info: SessionInfo, msg: StageMsg, reserved: set[int]) -> _Forward:
        """The message's group, once it passed the session's checks (raises otherwise)."""
        mb = msg.microbatch
        if not msg.forward_only:
            if mb in info.cache or mb in reserved:
                raise SessionStateError(f"duplicate ACTIVATION for step {msg.step} microbatch {mb}")
            if len(info.cache) + len(reserved) >= self.max_in_flight:
                raise StageCapacityError(
                    f"session {info.short} has {len(info.cache) + len(reserved)} "
                    "microbatches in flight, the server's limit (server.max_in_flight = "
                    f"{self.max_in_flight}); send fewer before their gradients"
                )
            reserved.add(mb)
        x = self._to_stage(info, msg.tensor, "ACTIVATION")
        if not msg.forward_only and not _frozen_head(info) and not self._taped():
            x.requires_grad_(True)
        labels = self._labels(msg, x) if self.mode == "two" else None
        segments = self._segments(msg, x)
        group = Group(info.session_id, x, labels, blocks=info.blocks, segments=segments)
        return _Forward(i, info, msg, group)

    def _run(self, forwards: list[_Forward], results: list[Result | None]) -> None:
        """The groups in one call of the bank; if the call fails, each group alone."""
        try:
            outs = self._call(forwards)
        except Exception as exc:
            if len(forwards) == 1:
                results[forwards[0].index] = exc
                return
            for fwd in forwards:  # find the culprit: the others must not pay for it
                self._run([fwd], results)
            return
        for fwd, out in zip(forwards, outs, strict=True):
            try:
                results[fwd.index] = _finite(fwd.msg, self._reply(fwd, out))
            except Exception as exc:
                results[fwd.index] = exc

    def _call(self, forwards: list[_Forward]) -> list[object]:
        """The bank's outputs: (loss, tokens), an output with its graph, or (output, tape)."""
        groups = [f.group for f in forwards]
        if self.mode == "two":
            return list(self.bank.run_loss(groups))
        if self._taped() and torch.is_grad_enabled():
            assert isinstance(self.bank, BatchedAdapterBank)
            wants = [not _frozen_head(f.info) for f in forwards]
            taped = self.bank.run_taped(groups, wants)
            tapes = self.stash.put_tapes([t for _, t in taped], [g.hidden for g in groups])
            return [(y, tape) for (y, _), tape in zip(taped, tapes, strict=True)]
        if self.stash.hooked and torch.is_grad_enabled():
            return [self._saving(f) for f in forwards]
        return list(self.bank.run(groups))

    def _saving(self, fwd: _Forward) -> torch.Tensor:
        """One group through peft's bank, its graph's saved tensors in the stash."""
        assert isinstance(self.bank, AdapterBank)
        saved = self.stash.saving(self.bank.stage, fwd.group.hidden)
        with saved.hooks():
            (y,) = self.bank.run([fwd.group])
        self._saved[(fwd.info.session_id, fwd.msg.microbatch)] = saved
        return y

    def _taped(self) -> bool:
        """Whether training forwards keep tapes (and backwards run batched)."""
        return self.mode == "u" and isinstance(self.bank, BatchedAdapterBank)

    def _reply(self, fwd: _Forward, out: object) -> StageMsg:
        """The reply to one forward: OUTPUT (u), or the loss and INPUT_GRAD (two)."""
        info, msg, x = fwd.info, fwd.msg, fwd.group.hidden
        if not msg.forward_only:
            info.microbatches += 1
            info.step_rows += x.shape[0]  # (B, T, C): its backward comes before STEP_END
            info.step_tokens += x.shape[0] * x.shape[1]
        if self.mode == "u":
            y, graph = out if isinstance(out, tuple) else (out, out)
            assert isinstance(y, torch.Tensor)
            if not msg.forward_only:
                info.cache[msg.microbatch] = (x, graph)
            return StageMsg(Kind.OUTPUT, msg.step, msg.microbatch, tensor=y.detach().float())
        assert isinstance(out, tuple)
        loss_sum, tokens = out
        if msg.forward_only:
            return StageMsg(
                Kind.INPUT_GRAD, msg.step, msg.microbatch, loss_sum=float(loss_sum), tokens=tokens
            )
        (loss_sum.float() * msg.loss_scale).backward()
        info.cache[msg.microbatch] = (x, x)  # marks the microbatch as seen this step
        return StageMsg(
            Kind.INPUT_GRAD,
            msg.step,
            msg.microbatch,
            tensor=_input_grad(info, x),
            loss_sum=float(loss_sum.detach()),
            tokens=int(tokens),
        )

    # -- checks ------------------------------------------------------------------------------
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
        return self.copies.to_device(tensor, self.dtype)

    def _replies_to_host(self, work: Sequence[Work], results: list[Result | None]) -> None:
        """Reply tensors copied back in one go, and checked for NaN/Inf on the host copy."""
        replies = [
            (i, r)
            for i, r in enumerate(results)
            if isinstance(r, StageMsg) and r.tensor is not None
        ]
        hosts = self.copies.to_host([r.tensor for _, r in replies if r.tensor is not None])
        for (i, reply), host in zip(replies, hosts, strict=True):
            moved, reply.tensor = host is not reply.tensor, host
            try:
                results[i] = _finite(work[i][1], reply) if moved else reply
            except Exception as exc:
                results[i] = exc

    def _segments(self, msg: StageMsg, x: torch.Tensor) -> torch.Tensor | None:
        """Packed rows' segment ids on the stage's device, if they fit the activation."""
        if msg.segments is None:
            return None
        if tuple(msg.segments.shape) != tuple(x.shape[:2]):
            raise InvalidRequestError(
                f"segments must have shape {tuple(x.shape[:2])} (the activation's rows and "
                f"tokens), got {tuple(msg.segments.shape)}"
            )
        return self.copies.to_device(msg.segments)

    def _labels(self, msg: StageMsg, x: torch.Tensor) -> torch.Tensor:
        if msg.labels is None or tuple(msg.labels.shape) != tuple(x.shape[:2]):
            got = None if msg.labels is None else tuple(msg.labels.shape)
            raise InvalidRequestError(f"labels must have shape {tuple(x.shape[:2])}, got {got}")
        return self.copies.to_device(msg.labels)

    # -- backwards, batched ------------------------------------------------------------------
    def _backwards(
        self, work: Sequence[Work], indices: list[int], results: list[Result | None]
    ) -> None:
        """Validate every OUTPUT_GRAD with a tape, then run them in one batched backward."""
        ready: list[_Backward] = []
        claimed: set[tuple[str, int]] = set()  # (session, microbatch) of this call
        for i in indices:
            info, msg = work[i]
            if not isinstance(info.cache.get(msg.microbatch, (None, None))[1], Tape):
                continue  # an autograd graph (or nothing): one at a time, in _one
            try:
                ready.append(self._prepare_backward(i, info, msg, claimed))
            except Exception as exc:
                results[i] = exc
        if ready:
            self._run_backward(ready, results)

    def _prepare_backward(
        self, i: int, info: SessionInfo, msg: StageMsg, claimed: set[tuple[str, int]]
    ) -> _Backward:
        """The message's tape and gradient, once they fit (raises otherwise)."""
        key = (info.session_id, msg.microbatch)
        if key in claimed:  # its ACTIVATION's tape goes to the first gradient only
            raise SessionStateError(
                f"OUTPUT_GRAD for step {msg.step} microbatch {msg.microbatch} without its "
                "ACTIVATION (a second gradient for it in the same call)"
            )
        tape = info.cache[msg.microbatch][1]
        assert isinstance(tape, Tape)
        grad = self._to_stage(info, msg.tensor, "OUTPUT_GRAD")
        if tuple(grad.shape) != tape.shape:
            raise InvalidRequestError(
                f"OUTPUT_GRAD shape {tuple(grad.shape)} != OUTPUT shape {tape.shape}"
            )
        claimed.add(key)
        return _Backward(i, info, msg, tape, grad)

    def _run_backward(self, items: list[_Backward], results: list[Result | None]) -> None:
        """The items in one backward of the bank; if it fails, each item alone."""
        assert isinstance(self.bank, BatchedAdapterBank)
        try:
            tapes = self.stash.fetch_tapes([b.tape for b in items])
            pairs = [(tape, b.grad) for tape, b in zip(tapes, items, strict=True)]
            if self.input_grad_first:
                dxs, weights = self.bank.backward_inputs(pairs)
                self.deferred.put(weights, {b.info.session_id for b in items})
            else:
                dxs = self.bank.backward(pairs)
            del tapes, pairs  # a recorded weight gradient keeps what it needs
        except Exception as exc:  # nothing was accumulated: retry alone to find the culprit
            if len(items) == 1:
                results[items[0].index] = exc
                return
            for item in items:
                self._run_backward([item], results)
            return
        for item, dx in zip(items, dxs, strict=True):
            msg = item.msg
            del item.info.cache[msg.microbatch]
            tensor = None if dx is None or _frozen_head(item.info) else dx.float()
            reply = StageMsg(Kind.INPUT_GRAD, msg.step, msg.microbatch, tensor=tensor)
            try:
                results[item.index] = _finite(msg, reply)
            except Exception as exc:
                results[item.index] = exc

    # -- backward and step ---------------------------------------------------------------------
    def _backward(self, info: SessionInfo, msg: StageMsg) -> StageMsg:
        """One OUTPUT_GRAD through its own autograd graph (peft's bank)."""
        mb = msg.microbatch
        if mb not in info.cache:
            raise SessionStateError(
                f"OUTPUT_GRAD for step {msg.step} microbatch {mb} without its ACTIVATION"
            )
        x, y = info.cache[mb]
        assert isinstance(y, torch.Tensor)
        grad = self._to_stage(info, msg.tensor, "OUTPUT_GRAD")
        if grad.shape != y.shape:
            raise InvalidRequestError(
                f"OUTPUT_GRAD shape {tuple(grad.shape)} != OUTPUT shape {tuple(y.shape)}"
            )
        saved = self._saved.get((info.session_id, mb))
        with saved.on_device() if saved is not None else nullcontext():
            y.backward(grad)  # this session's graph only: the others' are separate
        del info.cache[mb]
        return StageMsg(Kind.INPUT_GRAD, msg.step, mb, tensor=_input_grad(info, x))

    def _step(self, info: SessionInfo, msg: StageMsg) -> StageMsg:
        if self.mode == "u" and info.cache:
            pending = sorted(info.cache)
            raise SessionStateError(
                f"STEP_END for step {msg.step} while microbatches {pending} await gradients"
            )
        self.deferred.compute_for(info.session_id)  # the step waits for its weight gradients
        failed = self.deferred.failure(info.session_id)
        if failed is not None:
            raise SessionStateError(
                f"STEP_END for step {msg.step}: its weight gradients failed "
                f"({type(failed).__name__}: {failed})"
            )
        info.step += 1
        if info.step_rows == 0:  # no microbatch trained: nothing to apply, nothing counted
            log.info(
                "[%s] STEP_END for step %d with no microbatch: not counted",
                info.device_id,
                msg.step,
            )
            return StageMsg(Kind.STEP_DONE, msg.step)
        info.optimizer.step()
        info.optimizer.zero_grad(set_to_none=True)
        info.cache.clear()
        now = time.monotonic()  # stamped before the count: a reader never sees one without it
        info.first_step_at = info.first_step_at or now
        info.last_step_at = now
        info.rows_done += info.step_rows
        info.tokens_done += info.step_tokens
        info.step_rows = info.step_tokens = 0
        info.steps_done += 1
        return StageMsg(Kind.STEP_DONE, msg.step)


def _segments(work: Sequence[Work]) -> list[list[int]]:
    """Consecutive runs of the call in which no session has messages of two kinds.

    Within a run, forwards are computed together before the rest; a session whose next message
    is of another kind starts a new run, so each session's messages keep their order.
    """
    segments: list[list[int]] = [[]]
    kinds: dict[str, Kind] = {}
    for i, (info, msg) in enumerate(work):
        if kinds.setdefault(info.session_id, msg.kind) is not msg.kind:
            segments.append([])
            kinds = {info.session_id: msg.kind}
        segments[-1].append(i)
    return segments


def _frozen_head(info: SessionInfo) -> bool:
    """Frozen-device sessions send activations that need no gradient back."""
    return info.frozen_head


def _input_grad(info: SessionInfo, x: torch.Tensor) -> torch.Tensor | None:
    """The gradient for the device's head, or None when its head is frozen."""
    if _frozen_head(info):
        return None
    assert x.grad is not None
    return x.grad.float()


def _finite(msg: StageMsg, reply: StageMsg) -> StageMsg:
    """``reply``, unless it holds NaN or Inf; a device tensor is checked once on the host."""
    t = reply.tensor
    if t is not None and t.device.type == "cpu" and not _all_finite(t):
        raise InvalidRequestError(
            f"{msg}: the reply would hold NaN or Inf; the session's inputs made the "
            "computation overflow (send values of a sane magnitude)"
        )
    return reply


def _share_time(work: Sequence[Work], results: list[Result | None], seconds: float) -> None:
    """Each reply's ``compute_s``: the call's time shared by the tokens each message brought."""
    sizes = [_tokens(msg) for _, msg in work]
    total = sum(sizes) or len(work)
    for result, size in zip(results, sizes, strict=True):
        if isinstance(result, StageMsg):
            result.compute_s = seconds * (size or 1) / total


def _tokens(msg: StageMsg) -> int:
    t = msg.tensor
    return int(t.shape[0] * t.shape[1]) if t is not None and t.dim() == 3 else 0


def _all_finite(t: torch.Tensor) -> bool:
    """True when no value is NaN or Inf (a finite sum proves it; otherwise count)."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())
