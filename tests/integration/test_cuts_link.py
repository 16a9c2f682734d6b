"""Two devices on different cuts train at once against one StageServer over real gRPC.

The server offers cuts 1+1, 2+1 and 1+2 of a 4-block model (``model.cuts``) and holds
blocks 1..2; device A runs head 2 + tail 1 (the server runs block 2 for it), device B head
1 + tail 2 (block 1). Their microbatches share the server's batched calls. Each device's
losses and gradients (its own adapters and its server session's) must equal the unsplit
model's on its batches, at fp32 tolerance; a cut the server does not offer is refused with
FAILED_PRECONDITION naming the offered ones.
"""

from __future__ import annotations

import threading
from typing import Any

import grpc
import pytest
import torch
from harness.batches import random_batches
from harness.close import assert_close_to_scale
from harness.stage import stage_server

from fedpipe.config import FedpipeConfig, ModelConfig, PipelineConfig, TrainConfig
from fedpipe.edge.trainer import DeviceTrainer
from fedpipe.lora import (
    apply_lora,
    load_lora_state_dict,
    lora_parameters,
    lora_settings,
    lora_state_dict,
)
from fedpipe.lora.aggregation import adapter_block
from fedpipe.models import load_causal_lm, model_family, resolve_model
from fedpipe.proto import stage_pb2 as pb
from fedpipe.proto import stage_pb2_grpc as pb_grpc
from fedpipe.server.build import build_runtime
from fedpipe.wire.link_client import StageClient
from fedpipe.wire.serde import split_to_proto

LR = 1e-2
BATCH, SEQ = 4, 16
TOL = {"atol": 1e-5, "rel": 1e-4}


class RecordingAdamW(torch.optim.AdamW):
    """AdamW that keeps every gradient it is given, None for parameters that got none."""

    def __init__(self, params, **kw):  # type: ignore[no-untyped-def]
        super().__init__(params, **kw)
        self.grads: list[list[torch.Tensor | None]] = []

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        self.grads.append(
            [
                None if p.grad is None else p.grad.detach().clone()
                for g in self.param_groups
                for p in g["params"]
            ]
        )
        return super().step(closure)


CUTS = {"u": "2+1,1+2", "two": "2+0,3+0"}  # offered besides 1+1 (u) or 1+0 (two)


def _config(head: int = 1, tail: int = 1, split: str = "u") -> FedpipeConfig:
    model = ModelConfig(
        name="tiny-llama", head_layers=head, tail_layers=tail, cuts=CUTS[split], split=split
    )
    return FedpipeConfig(
        model=model,
        pipeline=PipelineConfig(microbatches=2, schedule="gpipe"),
        train=TrainConfig(batch_size=BATCH, seq_len=SEQ, lr=LR),
    )


def _batches(vocab: int, seed: int, n: int = 2) -> list[dict[str, torch.Tensor]]:
    return random_batches(n, BATCH, SEQ, vocab=vocab, seed=seed, pad_from=10)


@pytest.fixture(scope="module")
def served() -> Any:
    yield from _serve("u")


@pytest.fixture(scope="module")
def served_two() -> Any:
    yield from _serve("two")


def _serve(split: str) -> Any:
    """A StageServer on port 0 offering ``CUTS[split]``, and the unsplit reference model."""
    folder = resolve_model("tiny-llama")
    config = _config(1, 1 if split == "u" else 0, split)
    runtime, info = build_runtime(config, folder=folder)
    opts: dict[int, RecordingAdamW] = {}

    def factory(params, lr, wd):  # type: ignore[no-untyped-def]
        opt = RecordingAdamW(params, lr=lr, weight_decay=wd)
        opts[id(params[0])] = opt
        return opt

    runtime.optimizer_factory = factory
    with stage_server(runtime=runtime, split=info) as server:
        full = load_causal_lm(folder)
        reference = apply_lora(full, lora_settings(config), model_family(full.config))
        gen = torch.Generator().manual_seed(7)
        adapter = {
            k: torch.randn(v.shape, generator=gen) * 0.1
            for k, v in lora_state_dict(reference).items()
        }
        runtime.bank.set_global_state({k: adapter[k] for k in runtime.bank.global_state()})
        yield {
            "folder": folder,
            "server": server,
            "runtime": runtime,
            "opts": opts,
            "reference": reference,
            "adapter": adapter,
            "split": split,
        }


def _reference(served: Any, batches: list[dict[str, torch.Tensor]]) -> tuple[list, dict]:  # type: ignore[type-arg]
    """The unsplit model's losses over ``batches`` (AdamW steps between) and first gradients."""
    model = served["reference"]
    load_lora_state_dict(model, served["adapter"])
    params = lora_parameters(model)
    opt = torch.optim.AdamW(list(params.values()), lr=LR, weight_decay=0.0)
    losses = []
    grads: dict[str, torch.Tensor] = {}
    for step, batch in enumerate(batches):
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        losses.append(float(loss.detach()))
        if step == 0:
            grads = {k: p.grad.detach().clone() for k, p in params.items() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    return losses, grads


def _device_run(served: Any, cut: tuple[int, int], batches, out: dict) -> None:  # type: ignore[no-untyped-def,type-arg]
    config = _config(*cut, served["split"])
    name = f"dev-{cut[0]}+{cut[1]}"
    trainer = DeviceTrainer(config, device_id=name, folder=served["folder"])
    trainer.load_adapters(served["adapter"])  # the whole model's: it takes its own blocks
    params = lora_parameters(trainer.head)
    if trainer.tail is not None:
        params |= lora_parameters(trainer.tail)
    opt = RecordingAdamW(list(params.values()), lr=LR, weight_decay=0.0)
    with StageClient(served["server"].address) as client:
        session, runtime = trainer.connect(client, optimizer=opt)
        with session:
            losses = [runtime.train_step(b, step=s).loss for s, b in enumerate(batches)]
            runtime.finish()
    out[name] = (losses, dict(zip(params, opt.grads[0], strict=True)))


def test_two_devices_of_different_cuts_each_equal_the_unsplit_model(served: Any) -> None:
    _check_devices(served, [(2, 1), (1, 2)])


def test_two_part_split_devices_of_different_heads_equal_the_unsplit_model(
    served_two: Any,
) -> None:
    """The server computes the loss: heads of 2 and 3 blocks, the server runs the rest."""
    _check_devices(served_two, [(2, 0), (3, 0)])


def _check_devices(served: Any, cuts: list[tuple[int, int]]) -> None:
    """Devices of ``cuts`` train at once; each equals the unsplit model on its batches."""
    vocab = int(served["reference"].get_input_embeddings().num_embeddings)
    runs = {cut: _batches(vocab, seed=i + 1) for i, cut in enumerate(cuts)}
    out: dict[str, Any] = {}
    errors: list[BaseException] = []

    def run(cut: tuple[int, int]) -> None:
        try:
            _device_run(served, cut, runs[cut], out)
        except BaseException as exc:  # re-raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(cut,)) for cut in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    runtime = served["runtime"]
    sessions = {s.device_id: s for s in runtime.sessions()}
    for cut, batches in runs.items():
        name = f"dev-{cut[0]}+{cut[1]}"
        want_losses, want_grads = _reference(served, batches)
        losses, grads = out[name]
        assert losses == pytest.approx(want_losses, rel=1e-5, abs=1e-6)
        session = sessions[name]
        assert session.blocks == tuple(range(cut[0], 4 - cut[1]))
        server_params = runtime.bank.named_parameters(session.session_id)
        opt = served["opts"][id(next(iter(server_params.values())))]
        server_grads = dict(zip(server_params, opt.grads[0], strict=True))
        for key, grad in server_grads.items():
            if adapter_block(key) in session.blocks:
                assert_close_to_scale(grad, want_grads[key], **TOL, msg=key)
            else:  # a server block outside the device's cut: no gradient, no update
                assert grad is None, key
        for key, grad in grads.items():  # the device's own blocks
            assert_close_to_scale(grad, want_grads[key], **TOL, msg=key)
        ran = set(grads) | {k for k, g in server_grads.items() if g is not None}
        assert ran == set(want_grads)  # every block of the model, on one side or the other


def test_a_cut_the_server_does_not_offer_is_refused_naming_the_offered_ones(
    served: Any,
) -> None:
    trainer = DeviceTrainer(_config(2, 0), device_id="dev-2+0", folder=served["folder"])
    channel = grpc.insecure_channel(served["server"].address)
    try:
        stub = pb_grpc.StageLinkStub(channel)
        request = pb.OpenSessionRequest(device_id="dev-2+0", split=split_to_proto(trainer.split))
        with pytest.raises(grpc.RpcError) as info:
            stub.OpenSession(request, timeout=30)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        details = info.value.details()
        assert "head=2 tail=0" in details and "offers 1+1, 2+1, 1+2" in details, details
        offered_trainer = DeviceTrainer(_config(1, 2), device_id="x", folder=served["folder"])
        request = pb.OpenSessionRequest(
            device_id="dev-ok", split=split_to_proto(offered_trainer.split)
        )
        reply = stub.OpenSession(request, timeout=30)
        offered = [(c.head_layers, c.tail_layers) for c in reply.split.cuts]
        assert offered == [(1, 1), (2, 1), (1, 2)]
    finally:
        channel.close()
