"""A real fedpipe training run with a wiretap on the server's side of the stage link.

The honest-but-curious server of ``fedpipe bench privacy`` keeps a copy of everything the
device sends it and of what it sends back. The tap wraps the StageServer's runtime from the
outside (:class:`TappedRuntime`): the transport hands each decoded device message to
``StreamHandle.submit`` and takes each reply from ``StreamHandle.next_reply``, so the tap sees
exactly what crossed the wire, after the device's defences and the codecs, and the runtime and
transport stay untouched.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from fedpipe.config import FedpipeConfig
from fedpipe.edge.runtime import DeviceRuntime
from fedpipe.edge.trainer import DeviceTrainer
from fedpipe.messages import Kind, StageMsg
from fedpipe.privacy import LinkDefence
from fedpipe.server.build import build_runtime
from fedpipe.server.runtime import StageRuntime
from fedpipe.server.stage_server import StageServer
from fedpipe.server.streams import StreamHandle
from fedpipe.wire.backend import SessionRequest
from fedpipe.wire.link_client import StageClient

__all__ = ["Released", "RunResult", "Tap", "TappedRuntime", "record_training"]

Key = tuple[int, int]  # (step, microbatch)


@dataclass
class Tap:
    """What the server saw of the training sessions of ``device_id`` (evaluation is skipped)."""

    device_id: str
    activations: dict[Key, torch.Tensor] = field(default_factory=dict)  # uplink (b, T, C)
    outputs: dict[Key, torch.Tensor] = field(default_factory=dict)  # downlink (b, T, C)
    output_grads: dict[Key, torch.Tensor] = field(default_factory=dict)  # uplink (b, T, C)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def see(self, device_id: str, msg: StageMsg) -> None:
        """Keep a copy of a training message's tensor, filed by kind and (step, microbatch)."""
        if device_id != self.device_id or msg.forward_only or msg.tensor is None:
            return
        book = {
            Kind.ACTIVATION: self.activations,
            Kind.OUTPUT: self.outputs,
            Kind.OUTPUT_GRAD: self.output_grads,
        }.get(msg.kind)
        if book is not None:
            with self.lock:
                book[(msg.step, msg.microbatch)] = msg.tensor.detach().float().clone()


class _TappedHandle:
    """A StreamHandle whose traffic both ways goes past the tap first."""

    def __init__(self, handle: StreamHandle, tap: Tap) -> None:
        self._handle, self._tap = handle, tap

    def submit(self, msg: StageMsg) -> None:
        self._tap.see(self._handle.info.device_id, msg)
        self._handle.submit(msg)

    def next_reply(self, timeout: float) -> object | None:
        item = self._handle.next_reply(timeout)
        if isinstance(item, StageMsg):
            self._tap.see(self._handle.info.device_id, item)
        return item

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


class TappedRuntime:
    """A StageRuntime seen through a tap: ``attach`` hands out tapped stream handles."""

    def __init__(self, runtime: StageRuntime, tap: Tap) -> None:
        self._runtime, self._tap = runtime, tap

    def attach(self, session_id: str, stream_key: str | None = None) -> _TappedHandle:
        return _TappedHandle(self._runtime.attach(session_id, stream_key), self._tap)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runtime, name)


@dataclass
class Released:
    """What the server holds after the round, which an adaptive attacker fits to.

    The device's adapters reach the ServerApp through Flower every round: ``head`` and
    ``tail`` are the device's stages with them. ``public_outputs`` is what the server's own
    middle (its round's adapter merged) returns for the attacker's public text sent through
    that head: the downlink tensors a device would get for that text.
    """

    head: nn.Module
    tail: nn.Module
    public_outputs: torch.Tensor | None  # (N, T, C); None when no public text was given


@dataclass
class RunResult:
    """One recorded training run: the tap, the device's batches and the held-out loss after."""

    tap: Tap
    batches: list[dict[str, torch.Tensor]]
    train_loss: float
    eval_loss: float  # fedpipe's evaluator: clean activations
    eval_loss_defended: float  # through the defended link, as the device itself would infer
    released: Released
    decorrelation: float | None = None  # the head's mean dCor with its tokens (if penalised)


def record_training(
    cfg: FedpipeConfig,
    folder: Path,
    batches: list[dict[str, torch.Tensor]],
    eval_blocks: torch.Tensor,
    *,
    defence_seed: int | None = None,
    public: torch.Tensor | None = None,
) -> RunResult:
    """Train one device for ``len(batches)`` steps over loopback gRPC, tapped at the server.

    A fresh server runtime and device (same initial adapters every call) per run; after the
    steps the server merges the device's adapter (as a committed round does) and the split
    model is evaluated on ``eval_blocks`` through the same server by an evaluator session.
    ``public`` (the attacker's own text) is then sent through the released head to the server,
    which keeps its outputs (:class:`Released`).
    """
    tap = Tap("device-0")
    runtime, split = build_runtime(cfg, folder=folder)
    server = StageServer(cast(StageRuntime, TappedRuntime(runtime, tap)), split, port=0)
    server.start()
    try:
        trainer = DeviceTrainer(cfg, device_id=tap.device_id, folder=folder)
        if defence_seed is not None:  # repeatable draws (a real device's come from the OS)
            for generator in _generators(trainer):
                generator.manual_seed(defence_seed)
        with StageClient(server.address) as client:
            report = trainer.train_round(client, batches, round_=0)
        examples = sum(int(b["input_ids"].shape[0]) for b in batches)
        runtime.commit_round(0, {tap.device_id: float(examples)})
        eval_loss = _evaluate(trainer, trainer.head, server.address, eval_blocks, cfg)
        defended = eval_loss
        if trainer.defence is not None:
            head = _DefendedHead(trainer.head, trainer.defence)
            defended = _evaluate(trainer, head, server.address, eval_blocks, cfg)
        outputs = None
        if public is not None:
            outputs = _server_outputs(trainer, server.address, public, cfg)
    finally:
        server.stop(grace=None)
    released = Released(trainer.head, trainer.tail, outputs) if trainer.tail else None
    if released is None:
        raise ValueError("the privacy bench taps the U-shaped split: the device needs a tail")
    dcor = report.privacy.get("privacy-decorrelation")
    return RunResult(tap, batches, report.mean_loss, eval_loss, defended, released, dcor)


@torch.no_grad()
def _server_outputs(
    trainer: DeviceTrainer, address: str, blocks: torch.Tensor, cfg: FedpipeConfig
) -> torch.Tensor:
    """The server's middle output for ``blocks`` sent through the device's released head."""
    outputs = []
    with StageClient(address) as client:
        session = client.open(
            SessionRequest(device_id="attacker", round=1, split=trainer.split, learning_rate=1e-3),
            timeout_s=cfg.pipeline.timeout_s,
        )
        with session:
            for batch in torch.split(blocks, cfg.train.batch_size):  # as evaluate() sends
                parts = batch.tensor_split(min(cfg.pipeline.microbatches, len(batch)))
                for mb, part in enumerate(parts):
                    msg = StageMsg(Kind.ACTIVATION, 0, mb, tensor=trainer.head(part))
                    msg.forward_only = True
                    session.send(msg)
                for mb in range(len(parts)):
                    reply = session.receive(Kind.OUTPUT, 0, mb)
                    assert reply.tensor is not None
                    outputs.append(reply.tensor.float())
    return torch.cat(outputs)


def _generators(trainer: DeviceTrainer) -> list[torch.Generator]:
    """The random generators of the device's defences (noise, penalty sampling, labels)."""
    out = [c.generator for c in trainer.defence.channels.values()] if trainer.defence else []
    if trainer.decorrelation is not None:
        out.append(trainer.decorrelation.generator)
    if trainer.label_resample is not None:
        out.append(trainer.label_resample.generator)
    return out


class _DefendedHead(nn.Module):
    """The device's head with the link's defence on its output (for evaluation through it)."""

    def __init__(self, head: nn.Module, defence: LinkDefence) -> None:
        super().__init__()
        self.head, self.defence = head, defence

    def forward(
        self, input_ids: torch.Tensor, segments: torch.Tensor | None = None
    ) -> torch.Tensor:  # the head's own signature: DeviceRuntime passes a packed row's segments
        return self.defence(Kind.ACTIVATION, self.head(input_ids, segments))


def _evaluate(
    trainer: DeviceTrainer,
    head: nn.Module,
    address: str,
    blocks: torch.Tensor,
    cfg: FedpipeConfig,
) -> float:
    """Held-out mean token loss of the split model (device adapters + merged server adapter)."""
    loss_sum, tokens = 0.0, 0
    with StageClient(address) as client:
        session = client.open(
            SessionRequest(device_id="evaluator", round=1, split=trainer.split, learning_rate=1e-3),
            timeout_s=cfg.pipeline.timeout_s,
        )
        with session:
            runtime = DeviceRuntime(
                head,
                trainer.tail,
                session,
                optimizer=None,
                microbatches=cfg.pipeline.microbatches,
            )
            for batch in torch.split(blocks, cfg.train.batch_size):
                part_sum, part_tokens = runtime.evaluate(
                    {"input_ids": batch, "labels": batch}, step=0
                )
                loss_sum, tokens = loss_sum + part_sum, tokens + part_tokens
    return loss_sum / tokens if tokens else math.nan
