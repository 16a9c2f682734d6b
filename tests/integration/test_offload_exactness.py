"""server.offload and server.input_grad_first change where and when, never the numbers.

A device trains two steps of four microbatches over real loopback gRPC against a StageServer
on port 0 (tiny-llama, U-shaped split), once per setting: the losses, the server's gradients
(as its optimizer applies them) and both sides' weights after the steps equal the default
run's to the bit, on peft's bank and on the batched bank. Each call computes one message
(``batch_tokens = 1``) so that every run makes the same calls. The runs also show that the
setting did its work: with offload the stash waited in host memory (on the stage's device
only the received inputs waited), and with the input gradient first every backward's weight
gradients were computed after its reply.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from harness.batches import random_batches
from harness.stage import stage_server

from fedpipe.config import FedpipeConfig, ModelConfig, PipelineConfig, ServerConfig, TrainConfig
from fedpipe.edge.trainer import DeviceTrainer
from fedpipe.lora import AdapterBank, BatchedAdapterBank, lora_parameters
from fedpipe.server.build import build_runtime
from fedpipe.wire.link_client import StageClient

LR = 1e-2
BATCH, SEQ, M = 8, 16, 4


class RecordingAdamW(torch.optim.AdamW):
    """AdamW that keeps a copy of every gradient it applies (in parameter order)."""

    def __init__(self, params, **kw):  # type: ignore[no-untyped-def]
        super().__init__(params, **kw)
        self.grads: list[list[torch.Tensor]] = []

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        self.grads.append([p.grad.detach().clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


@dataclass
class Result:
    losses: list[float]
    server_grads: list[list[torch.Tensor]]  # per step, in the server optimizer's order
    weights: dict[str, torch.Tensor]
    stash: dict[str, int]
    weights_after_reply: int  # backwards whose weight gradients ran after their reply


def _config(*, batching: bool, offload: str, input_grad_first: bool) -> FedpipeConfig:
    return FedpipeConfig(
        model=ModelConfig(name="tiny-llama", head_layers=1, tail_layers=1, split="u"),
        pipeline=PipelineConfig(microbatches=M, schedule="1f1b"),
        train=TrainConfig(batch_size=BATCH, seq_len=SEQ, lr=LR),
        server=ServerConfig(
            batching=batching,
            batch_tokens=1,  # one message per call: every run makes the same calls
            offload=offload,
            input_grad_first=input_grad_first,
        ),
    )


def _batches() -> list[dict[str, torch.Tensor]]:
    return random_batches(2, BATCH, SEQ, seed=3, pad_from=10)


def _run(folder: Path, config: FedpipeConfig) -> Result:
    torch.manual_seed(0)  # both sides' adapters start the same in every run
    runtime, info = build_runtime(config, folder=folder)
    executor = runtime.executor
    executor.stash.meter.enabled = True
    opts: list[RecordingAdamW] = []

    def factory(params, lr, wd):  # type: ignore[no-untyped-def]
        opts.append(RecordingAdamW(params, lr=lr, weight_decay=wd))
        return opts[-1]

    runtime.optimizer_factory = factory
    trainer = DeviceTrainer(config, device_id="dev-offload", folder=folder)
    params = lora_parameters(trainer.head) | (lora_parameters(trainer.tail) if trainer.tail else {})
    opt = torch.optim.AdamW(list(params.values()), lr=LR, weight_decay=0.0)
    losses = []
    with ExitStack() as stack:
        server = stack.enter_context(stage_server(runtime=runtime, split=info))
        with StageClient(server.address) as client:
            session, device = trainer.connect(client, optimizer=opt)
            with session:
                for step, batch in enumerate(_batches()):
                    losses.append(device.train_step(batch, step=step).loss)
        # After the session's end: its last STEP_END has been applied.
        (server_session,) = runtime.sessions()
        weights = trainer.adapters() | runtime.bank.state_dict(server_session.session_id)
    (server_opt,) = opts
    return Result(
        losses,
        server_opt.grads,
        weights,
        executor.stash.meter.snapshot(),
        executor.deferred.computed,
    )


def _assert_same(got: Result, want: Result) -> None:
    assert got.losses == want.losses
    assert len(got.server_grads) == len(want.server_grads) == 2
    for step, (g, w) in enumerate(zip(got.server_grads, want.server_grads, strict=True)):
        assert len(g) == len(w) > 0
        for i, (a, b) in enumerate(zip(g, w, strict=True)):
            assert torch.equal(a, b), f"step {step}: server gradient {i} differs"
    assert set(got.weights) == set(want.weights)
    for key, value in want.weights.items():
        assert torch.equal(got.weights[key], value), key


@pytest.fixture(scope="module")
def runs(folder: Path) -> Iterator[dict[tuple[bool, str, bool], Result]]:
    done: dict[tuple[bool, str, bool], Result] = {}
    yield done


def _get(runs, folder: Path, batching: bool, offload: str, first: bool) -> Result:  # type: ignore[no-untyped-def]
    key = (batching, offload, first)
    if key not in runs:
        config = _config(batching=batching, offload=offload, input_grad_first=first)
        runs[key] = _run(folder, config)
    return runs[key]


def test_the_banks_are_the_ones_named(folder: Path) -> None:
    for batching, bank in ((True, BatchedAdapterBank), (False, AdapterBank)):
        runtime, _ = build_runtime(
            _config(batching=batching, offload="off", input_grad_first=False), folder=folder
        )
        assert isinstance(runtime.bank, bank)


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "peft"])
def test_offload_is_bit_identical_and_keeps_the_stash_in_host_memory(
    runs, folder: Path, batching: bool
) -> None:
    off = _get(runs, folder, batching, "off", False)
    on = _get(runs, folder, batching, "auto", False)
    _assert_same(on, off)
    # Off: the stash waits on the stage's device and nothing is offloaded.
    assert off.stash["peak_waiting_bytes"] > 0
    assert off.stash["peak_offloaded_bytes"] == 0
    # Auto: at least as many bytes waited in host memory as waited on the device without it,
    # and what stayed on the device (the received inputs, the tapes brought back for their
    # backward) peaked lower.
    assert on.stash["peak_offloaded_bytes"] >= off.stash["peak_waiting_bytes"] // 2
    assert on.stash["peak_waiting_bytes"] < off.stash["peak_waiting_bytes"] // 2
    assert on.stash["peak_stash_bytes"] < off.stash["peak_stash_bytes"]
    # Everything was let go once the steps ended.
    assert on.stash["stash_bytes"] == on.stash["offloaded_bytes"] == 0


def test_input_grad_first_is_bit_identical_and_defers_the_weight_gradients(
    runs, folder: Path
) -> None:
    off = _get(runs, folder, True, "off", False)
    first = _get(runs, folder, True, "off", True)
    _assert_same(first, off)
    assert off.weights_after_reply == 0
    assert first.weights_after_reply == 2 * M  # every backward's, each after its reply


def test_both_together_are_bit_identical(runs, folder: Path) -> None:
    _assert_same(_get(runs, folder, True, "auto", True), _get(runs, folder, True, "off", False))
