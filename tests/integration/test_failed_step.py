"""A step that fails halfway leaves no gradient behind: the next step equals a clean one exactly.

Over real loopback gRPC: the device's link breaks after part of a step's backward passes have
run (tail gradients and one head gradient are in the adapters); the device opens a new session
and runs the step again. Its loss and adapters must equal those of a device that never failed,
bit for bit in fp32 (before the fix the stale half-gradient was added to the next one).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedpipe.config import FedpipeConfig, ModelConfig, PipelineConfig, TrainConfig
from fedpipe.edge.runtime import StepResult
from fedpipe.edge.trainer import DeviceTrainer
from fedpipe.errors import StageLinkError
from fedpipe.messages import Kind, StageMsg
from fedpipe.server.stage_server import StageServer
from fedpipe.wire.link_client import StageClient, StageSession

torch.set_num_threads(1)
BATCH, SEQ = 4, 8
CONFIG = FedpipeConfig(
    model=ModelConfig(name="tiny-llama", head_layers=1, tail_layers=1),
    pipeline=PipelineConfig(microbatches=2, schedule="gpipe", timeout_s=20.0),
    train=TrainConfig(batch_size=BATCH, seq_len=SEQ, lr=1e-2),
)


class BreaksOnce:
    """A real session whose link breaks when the given reply is awaited (once)."""

    def __init__(self, session: StageSession, kind: Kind, microbatch: int) -> None:
        self.session, self.kind, self.microbatch = session, kind, microbatch
        self.broken = False

    def send(self, msg: StageMsg) -> None:
        self.session.send(msg)

    def ready(self, kind: Kind, step: int, microbatch: int) -> bool:
        return self.session.ready(kind, step, microbatch)

    def wait_any(self, timeout: float) -> None:
        self.session.wait_any(timeout)

    def receive(self, kind: Kind, step: int, microbatch: int) -> StageMsg:
        if (kind, microbatch) == (self.kind, self.microbatch) and not self.broken:
            self.broken = True
            self.session.abort()
            raise StageLinkError("stage link UNAVAILABLE: injected break")
        return self.session.receive(kind, step, microbatch)


SERVER_CONFIG = CONFIG  # for the `server` fixture (conftest.py)


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "labels": ids.clone()}


def _step(trainer: DeviceTrainer, client: StageClient, opt: torch.optim.Optimizer) -> StepResult:
    session, runtime = trainer.connect(client, optimizer=opt)
    with session:
        return runtime.train_step(_batch(), step=0)


@pytest.mark.parametrize(
    ("kind", "mb"), [(Kind.INPUT_GRAD, 1), (Kind.OUTPUT, 1)], ids=["input-grad", "output"]
)
def test_the_step_after_a_failed_one_equals_a_clean_step(
    server: StageServer, folder: Path, kind: Kind, mb: int
) -> None:
    clean = DeviceTrainer(CONFIG, device_id="clean", folder=folder)
    failing = DeviceTrainer(CONFIG, device_id="failing", folder=folder)
    with StageClient(server.address) as client:
        expected = _step(clean, client, torch.optim.AdamW(clean.parameters(), lr=1e-2))
        opt = torch.optim.AdamW(failing.parameters(), lr=1e-2)
        session, runtime = failing.connect(client, optimizer=opt)
        runtime.channel = BreaksOnce(session, kind, mb)
        with pytest.raises(StageLinkError, match="injected"):
            runtime.train_step(_batch(), step=0)
        assert all(p.grad is None for p in failing.parameters())
        again = _step(failing, client, opt)
    assert again.loss == expected.loss
    ours, theirs = failing.adapters(), clean.adapters()
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key
