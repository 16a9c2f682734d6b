"""device.dtype: the device's head and tail forwards in bf16 under CPU autocast (edge.runtime).

A bf16 device step (the device runtime against the middle run in process) gives a loss and
LoRA gradients near fp32's (bounds below, measured on the tiny random models); the LoRA
parameters and their gradients stay fp32 tensors; everything the device sends (activations,
output gradients) is fp32; the default is fp32 and its step is the unsplit model's, bit for bit;
an unknown value, and bf16 with privacy.label_resample, are refused in one line.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fedpipe.config import DEVICE_DTYPES, FedpipeConfig, load_config
from fedpipe.edge.runtime import DeviceRuntime
from fedpipe.lora import LoraSettings, apply_lora
from fedpipe.messages import Kind, StageMsg
from fedpipe.models import load_config as load_hf_config
from fedpipe.models import resolve_model
from fedpipe.split import build_device_stages, build_stage, split_layout

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)
MODELS = ("tiny-llama", "tiny-gpt2")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    cache = tmp_path_factory.mktemp("cache")
    return {name: resolve_model(name, cache_dir=cache) for name in MODELS}


class _LocalServer:
    """A StageChannel whose server runs the fp32 middle in process (forward on ACTIVATION,
    backward on OUTPUT_GRAD) and keeps every tensor the device sent."""

    _REPLY = {Kind.ACTIVATION: Kind.OUTPUT, Kind.OUTPUT_GRAD: Kind.INPUT_GRAD}

    def __init__(self, middle: nn.Module) -> None:
        self.middle = middle
        self.sent: list[tuple[Kind, torch.Tensor]] = []
        self.graphs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.inbox: dict[tuple[Kind, int, int], StageMsg] = {}

    def send(self, msg: StageMsg) -> None:
        key = (msg.step, msg.microbatch)
        tensor = None
        if msg.tensor is not None:
            self.sent.append((msg.kind, msg.tensor))
        if msg.kind is Kind.ACTIVATION:
            assert msg.tensor is not None
            x = msg.tensor.detach().clone().requires_grad_(True)
            y = self.middle(x)
            self.graphs[key] = (x, y)
            tensor = y.detach().clone()
        elif msg.kind is Kind.OUTPUT_GRAD:
            x, y = self.graphs.pop(key)
            y.backward(msg.tensor)
            tensor = x.grad
        kind = self._REPLY.get(msg.kind, Kind.STEP_DONE)
        self.inbox[(kind, *key)] = StageMsg(kind, msg.step, msg.microbatch, tensor=tensor)

    def ready(self, kind: Kind, step: int, microbatch: int) -> bool:
        return (kind, step, microbatch) in self.inbox

    def receive(self, kind: Kind, step: int, microbatch: int) -> StageMsg:
        return self.inbox.pop((kind, step, microbatch))

    def wait_any(self, timeout: float) -> None:
        return None


def _stages(folder: Path, weights: str = "fp32") -> tuple[nn.Module, nn.Module, nn.Module]:
    """head (2 blocks), middle, tail (1 block) with the same nonzero adapters every time; the
    device's frozen weights stored as ``weights`` (device.weights)."""
    config = load_hf_config(folder)
    layout = split_layout(config, head_layers=2, tail_layers=1)
    head, tail = build_device_stages(folder, layout, weights=weights)
    assert tail is not None
    family = "gpt2" if config.model_type == "gpt2" else "llama"
    gen = torch.Generator().manual_seed(5)
    for stage in (head, tail):
        apply_lora(stage, LoraSettings(), family)
        with torch.no_grad():
            for name, param in sorted(stage.named_parameters()):
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return head, build_stage(folder, layout, "middle"), tail


def _grads(*stages: nn.Module) -> dict[str, torch.Tensor]:
    return {
        f"{i}.{n}": p.grad.clone()
        for i, s in enumerate(stages)
        for n, p in s.named_parameters()
        if p.grad is not None
    }


def _ids() -> torch.Tensor:
    return torch.randint(0, 258, (4, 40), generator=torch.Generator().manual_seed(0))


def _device_step(
    folder: Path, weights: str = "fp32", **dtype: Any
) -> tuple[float, dict[str, torch.Tensor], Any]:
    """One training step of the device runtime (2 microbatches, no optimizer): its loss, the
    device's LoRA gradients, and the channel (what was sent)."""
    head, middle, tail = _stages(folder, weights)
    channel = _LocalServer(middle)
    runtime = DeviceRuntime(head, tail, channel, optimizer=None, microbatches=2, **dtype)
    ids = _ids()
    result = runtime.train_step({"input_ids": ids, "labels": ids}, step=0)
    runtime.finish()
    grads = _grads(head, tail)
    assert grads and all(".lora_" in n for n in grads)  # the frozen weights got none
    params = [p for s in (head, tail) for p in s.parameters() if p.requires_grad]
    assert all(p.dtype == torch.float32 for p in params)
    return result.loss, grads, channel


# Measured here (tiny-llama, tiny-gpt2; 2 + 1 device blocks, fp32 middle, the same adapters):
#   loss |l - l32| / l32:                          2.0e-5, 8.2e-6
#   LoRA gradients ||g - g32|| / ||g32||, cosine:  0.0081 0.99997, 0.0073 0.99998
# bf16 rounds each product's inputs to 8 significant bits (2^-9 relative); the bounds leave
# 6-50x room over what was measured.
LOSS_TOL, GRAD_TOL, MIN_COSINE = 1e-3, 0.05, 0.999


@pytest.mark.parametrize("name", MODELS)
def test_a_bf16_device_step_stays_near_fp32_with_fp32_gradients_and_wire(
    folders: dict[str, Path], name: str
) -> None:
    ref_loss, ref, _ = _device_step(folders[name], dtype="fp32")
    loss, grads, channel = _device_step(folders[name], dtype="bf16")
    assert set(grads) == set(ref)
    assert all(g.dtype == torch.float32 for g in grads.values())
    kinds = [kind for kind, _ in channel.sent]
    assert kinds.count(Kind.ACTIVATION) == 2 and kinds.count(Kind.OUTPUT_GRAD) == 2
    assert all(t.dtype == torch.float32 for _, t in channel.sent)
    flat_ref = torch.cat([ref[k].flatten() for k in sorted(ref)])
    flat = torch.cat([grads[k].flatten() for k in sorted(ref)])
    assert loss != ref_loss  # it did compute in bf16
    assert abs(loss - ref_loss) / ref_loss < LOSS_TOL, (loss, ref_loss)
    assert ((flat - flat_ref).norm() / flat_ref.norm()).item() < GRAD_TOL
    assert torch.nn.functional.cosine_similarity(flat, flat_ref, dim=0).item() > MIN_COSINE


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("name", MODELS)
def test_bf16_compute_over_stored_weights_stays_near_their_fp32_compute(
    folders: dict[str, Path], name: str, weights: str
) -> None:
    """device.dtype = bf16 with device.weights int8/int4 (stored linears and embedding): the
    step stays within the same bounds of the fp32 step over the same stored weights, with fp32
    LoRA gradients and an fp32 wire; what the stored weights themselves cost is
    test_device_weights' concern. Measured here (tiny-llama, tiny-gpt2): loss 4e-6 to 1.1e-5
    relative, gradients 0.0077 to 0.0088 relative, cosine 0.99996 or more."""
    ref_loss, ref, _ = _device_step(folders[name], weights, dtype="fp32")
    loss, grads, channel = _device_step(folders[name], weights, dtype="bf16")
    assert set(grads) == set(ref) and all(g.dtype == torch.float32 for g in grads.values())
    assert all(t.dtype == torch.float32 for _, t in channel.sent)
    flat_ref = torch.cat([ref[k].flatten() for k in sorted(ref)])
    flat = torch.cat([grads[k].flatten() for k in sorted(ref)])
    assert loss != ref_loss  # it did compute in bf16
    assert abs(loss - ref_loss) / ref_loss < LOSS_TOL, (loss, ref_loss)
    assert ((flat - flat_ref).norm() / flat_ref.norm()).item() < GRAD_TOL
    assert torch.nn.functional.cosine_similarity(flat, flat_ref, dim=0).item() > MIN_COSINE


@pytest.mark.parametrize("name", MODELS)
def test_a_bf16_evaluation_sends_fp32_and_stays_near_fp32(
    folders: dict[str, Path], name: str
) -> None:
    losses = {}
    for dtype in DEVICE_DTYPES:
        head, middle, tail = _stages(folders[name])
        channel = _LocalServer(middle)
        runtime = DeviceRuntime(head, tail, channel, optimizer=None, microbatches=2, dtype=dtype)
        ids = _ids()
        loss_sum, tokens = runtime.evaluate({"input_ids": ids, "labels": ids}, step=0)
        assert all(t.dtype == torch.float32 for _, t in channel.sent)
        losses[dtype] = loss_sum / tokens
    assert abs(losses["bf16"] - losses["fp32"]) / losses["fp32"] < LOSS_TOL


@pytest.mark.parametrize("name", MODELS)
def test_the_default_fp32_step_is_the_unsplit_models_bit_for_bit(
    folders: dict[str, Path], name: str
) -> None:
    """No dtype given: fp32, the loss and LoRA gradients of one forward and backward through
    head, middle and tail on the whole batch (the same sums, split into two microbatches)."""
    loss, grads, _ = _device_step(folders[name])
    head, middle, tail = _stages(folders[name])
    ids = _ids()
    parts = []
    for part in ids.chunk(2):
        loss_sum, _ = tail(middle(head(part)), part)
        parts.append(loss_sum)
    tokens = ids.shape[0] * (ids.shape[1] - 1)
    for part_sum in parts:
        (part_sum / tokens).backward()
    assert loss == sum(float(p.detach()) for p in parts) / tokens
    ref = _grads(head, tail)
    assert set(grads) == set(ref) and all(torch.equal(grads[k], ref[k]) for k in ref)


def test_the_setting_defaults_to_fp32() -> None:
    assert FedpipeConfig().device.dtype == "fp32" and DEVICE_DTYPES == ("fp32", "bf16")
    config = load_config(None, {"device.dtype": "bf16"})
    assert config.device.dtype == "bf16"
    assert FedpipeConfig().with_overrides(config.to_flat()) == config


@pytest.mark.parametrize("value", ["fp16", "bfloat16", ""])
def test_an_unknown_value_is_refused_in_one_line_naming_the_allowed(value: str) -> None:
    with pytest.raises(ValueError) as info:
        load_config(None, {"device.dtype": value})
    text = str(info.value)
    assert "\n" not in text and text.startswith("device.dtype ") and "fp32, bf16" in text


def test_the_runtime_refuses_an_unknown_dtype() -> None:
    with pytest.raises(ValueError, match="dtype 'fp16' unknown"):
        DeviceRuntime(nn.Identity(), None, _LocalServer(nn.Identity()), optimizer=None,
                      dtype="fp16")  # fmt: skip


def test_bf16_with_label_resample_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError) as info:
        load_config(None, {"device.dtype": "bf16", "privacy.label_resample": 0.2})
    text = str(info.value)
    assert "\n" not in text and "device.dtype = bf16" in text and "label_resample" in text
