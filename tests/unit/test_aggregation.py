"""Exact aggregation of LoRA adapters: the global model is the weighted mean of the devices'.

The effective weight of an adapted layer is ``W + s B A``. After a merge under ``exact``,
``ffa`` and ``stack`` it must equal the weighted mean of the devices' ``W + s B_i A_i`` (fp32
tolerance), on the server's adapter bank (base folded in place) and on the device side (the
deltas carried in the global arrays); separate averaging must not (so the check can fail).
A checkpointed global state (adapter + base deltas) restores the same effective weights.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from harness.close import FLOAT32_ATOL, FLOAT32_REL, assert_close_to_scale

from fedpipe.config import FederatedConfig, FedpipeConfig, ModelConfig
from fedpipe.edge.trainer import DeviceTrainer
from fedpipe.lora import AdapterBank, LoraSettings
from fedpipe.lora.aggregation import aggregate_adapters, stack_adapters
from fedpipe.lora.base import lora_layers
from fedpipe.lora.batched_bank import BatchedAdapterBank
from fedpipe.models import load_config, resolve_model
from fedpipe.split import build_stage, split_layout

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)
SETTINGS = LoraSettings(r=4, alpha=8, seed=3)
SCALE = SETTINGS.alpha / SETTINGS.r
WEIGHTS = {"a": 1.0, "b": 3.0, "c": 2.0}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    cache = tmp_path_factory.mktemp("cache")
    return {name: resolve_model(name, cache_dir=cache) for name in ("tiny-llama", "tiny-gpt2")}


def _bank(folder: Path) -> AdapterBank:
    return AdapterBank(build_stage(folder, split_layout(load_config(folder)), "middle"), SETTINGS)


def _device_states(
    template: dict[str, torch.Tensor], *, same_a: bool
) -> dict[str, dict[str, torch.Tensor]]:
    """Three devices' trained adapters: random B; random A (or the shared init, as FFA keeps)."""
    out = {}
    for seed, name in enumerate(WEIGHTS, start=1):
        gen = torch.Generator().manual_seed(seed)
        out[name] = {
            k: v.clone()
            if same_a and ".lora_A." in k
            else torch.randn(v.shape, generator=gen) * 0.1
            for k, v in template.items()
        }
    return out


def _effective(
    bank: AdapterBank | BatchedAdapterBank, adapter: str = "global"
) -> dict[str, torch.Tensor]:
    """``W + s B A`` of every adapted layer, as (out, in), for ``adapter``."""
    out = {}
    if isinstance(bank, BatchedAdapterBank):
        params = bank.named_parameters(adapter)
        for name, linear in bank._linears.items():
            a, b = params[f"{name}.lora_A.weight"], params[f"{name}.lora_B.weight"]
            out[name] = (linear.weight.detach().float() + SCALE * (b @ a)).detach()
        return out
    for name, layer in lora_layers(bank.stage).items():
        w = layer.get_base_layer().weight.detach().float()
        w = w.t() if layer.fan_in_fan_out else w
        b, a = layer.lora_B[adapter].weight.float(), layer.lora_A[adapter].weight.float()
        out[name] = (w + SCALE * (b @ a)).detach()
    return out


def _expected(
    bank: AdapterBank | BatchedAdapterBank, states: dict[str, dict[str, torch.Tensor]]
) -> dict:
    """The weighted mean of the devices' effective weights, computed before the merge."""
    total = sum(WEIGHTS.values())
    per_device = {}
    for name, state in states.items():
        bank.add(name, init=state)
        per_device[name] = _effective(bank, name)
    return {
        layer: sum(per_device[n][layer] * (w / total) for n, w in WEIGHTS.items())
        for layer in per_device["a"]
    }


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-gpt2"])
@pytest.mark.parametrize("mode", ["exact", "ffa", "stack", "separate"])
def test_server_merge_equals_the_weighted_mean_of_the_devices(
    folders: dict[str, Path], family: str, mode: str
) -> None:
    bank = _bank(folders[family])
    bank.set_aggregation(mode)
    states = _device_states(bank.global_state(), same_a=mode == "ffa")
    expected = _expected(bank, states)
    bank.merge(WEIGHTS)
    got = _effective(bank)
    if mode == "separate":  # the baseline is inexact: the check below can fail
        assert max(float((got[k] - expected[k]).abs().max()) for k in expected) > 1e-3
    else:
        for key, value in expected.items():
            assert_close_to_scale(got[key], value, rel=0, atol=1e-5, msg=key)
        assert any(k.endswith(".base_delta") for k in bank.global_state()) == (mode != "ffa")


@pytest.mark.parametrize("mode", ["exact", "ffa", "stack"])
def test_the_batched_bank_merges_exactly_and_restores_the_fold(
    folders: dict[str, Path], mode: str
) -> None:
    """The StageServer's default (batched) bank aggregates as peft's bank does."""
    stage = build_stage(
        folders["tiny-llama"], split_layout(load_config(folders["tiny-llama"])), "middle"
    )
    bank = BatchedAdapterBank(stage, SETTINGS)
    original = _effective(bank)
    bank.set_aggregation(mode)
    states = _device_states(bank.global_state(), same_a=mode == "ffa")
    expected = _expected(bank, states)
    bank.merge(WEIGHTS)
    got = _effective(bank)
    for key, value in expected.items():
        assert_close_to_scale(got[key], value, rel=0, atol=1e-5, msg=key)
    if mode == "ffa":
        bank.add("dev")
        flags = [p.requires_grad for p in bank.parameters("dev")]
        assert flags[0::2] == [False] * (len(flags) // 2) and all(flags[1::2])
        return
    saved = bank.global_state()
    assert any(k.endswith(".base_delta") for k in saved)
    fresh_stage = build_stage(
        folders["tiny-llama"], split_layout(load_config(folders["tiny-llama"])), "middle"
    )
    fresh = BatchedAdapterBank(fresh_stage, SETTINGS)
    fresh.set_global_state(saved)
    for layer, value in _effective(fresh).items():
        assert_close_to_scale(value, got[layer], rel=0, atol=1e-6)
    fresh.reset_global_state()
    for layer, value in _effective(fresh).items():
        torch.testing.assert_close(value, original[layer], rtol=0, atol=0)


def test_ffa_trains_b_only_on_the_server(folders: dict[str, Path]) -> None:
    bank = _bank(folders["tiny-llama"])
    bank.set_aggregation("ffa")
    bank.add("dev")
    flags = [p.requires_grad for p in bank.parameters("dev")]
    assert flags[0::2] == [False] * (len(flags) // 2) and all(flags[1::2])  # (A, B) pairs


def test_a_checkpointed_global_state_restores_the_folded_base(folders: dict[str, Path]) -> None:
    bank = _bank(folders["tiny-llama"])
    original = _effective(bank)
    bank.set_aggregation("exact")
    _expected(bank, _device_states(bank.global_state(), same_a=False))
    bank.merge(WEIGHTS)
    saved, merged = bank.global_state(), _effective(bank)
    fresh = _bank(folders["tiny-llama"])  # a restarted StageServer, as `--resume` meets it
    fresh.set_global_state(saved)
    for layer, value in _effective(fresh).items():
        assert_close_to_scale(value, merged[layer], rel=0, atol=1e-6)
    fresh.reset_global_state()  # a new run: the original base again
    for layer, value in _effective(fresh).items():
        torch.testing.assert_close(value, original[layer], rtol=0, atol=0)


def test_stack_admits_different_ranks() -> None:
    gen = torch.Generator().manual_seed(0)
    factors = [
        (torch.randn(r, 12, generator=gen), torch.randn(10, r, generator=gen)) for r in (2, 5)
    ]
    a, b = stack_adapters(factors, [0.25, 0.75])
    assert a.shape == (7, 12) and b.shape == (10, 7)
    want = 0.25 * factors[0][1] @ factors[0][0] + 0.75 * factors[1][1] @ factors[1][0]
    assert_close_to_scale(b @ a, want, rel=FLOAT32_REL, atol=FLOAT32_ATOL)


def test_unknown_aggregation_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"federated.aggregation 'mean' unknown"):
        FederatedConfig(aggregation="mean")
    with pytest.raises(ValueError, match=r"needs federated.strategy fedavg or fedprox"):
        FederatedConfig(aggregation="exact", strategy="fedadam")


@pytest.mark.parametrize("mode", ["exact", "stack"])
def test_device_side_deltas_make_the_devices_mean_exact(
    folders: dict[str, Path], mode: str
) -> None:
    """The ServerApp's arithmetic on device adapters, loaded by a device: exact weights."""
    cfg = FedpipeConfig(model=ModelConfig(name=str(folders["tiny-llama"]), lora_r=4, lora_alpha=8))
    trainer = DeviceTrainer(cfg, device_id="d", folder=folders["tiny-llama"])
    initial = trainer.adapters()
    states = list(_device_states(initial, same_a=False).values())
    weights = list(WEIGHTS.values())
    merged, deltas = aggregate_adapters(states, weights, mode, scale=SCALE, initial=initial)
    layers = {**lora_layers(trainer.head), **lora_layers(trainer.tail)}  # type: ignore[arg-type]
    originals = {n: layer.get_base_layer().weight.detach().clone() for n, layer in layers.items()}
    trainer.load_adapters({**merged, **{k + ".base_delta": v for k, v in deltas.items()}})
    total = sum(weights)
    for name, layer in layers.items():
        w0 = originals[name].float()
        b, a = layer.lora_B["default"].weight.float(), layer.lora_A["default"].weight.float()
        got = (layer.get_base_layer().weight.float() + SCALE * (b @ a)).detach()
        want = w0 + sum(
            (w / total) * SCALE * (s[f"{name}.lora_B.weight"] @ s[f"{name}.lora_A.weight"])
            for s, w in zip(states, weights, strict=True)
        )
        assert_close_to_scale(got, want, rel=0, atol=1e-5)
    trainer.load_adapters(initial)  # no deltas: the original base again
    for name, layer in layers.items():
        assert torch.equal(layer.get_base_layer().weight, originals[name])


def test_the_server_app_carries_cumulative_device_deltas(tmp_path: Path) -> None:
    """The ServerApp's strategy hook: exact aggregation over Flower replies, deltas added up."""
    from types import SimpleNamespace

    from flwr.app import ArrayRecord, MetricRecord

    from fedpipe.fl.aggregate import ExactState, held

    gen = torch.Generator().manual_seed(0)
    template = {
        "l.lora_A.weight": torch.randn(2, 6, generator=gen),
        "l.lora_B.weight": torch.zeros(5, 2),
    }
    states = [{k: torch.randn(v.shape, generator=gen) for k, v in template.items()} for _ in "ab"]
    replies = [
        SimpleNamespace(
            content={"arrays": ArrayRecord(s), "metrics": MetricRecord({"num-examples": n})},
            has_error=lambda: False,
        )
        for s, n in zip(states, (1, 3), strict=True)
    ]
    state = ExactState("exact", 2.0, device_initial=template)
    state.device_deltas = {"l": torch.ones(5, 6)}  # what earlier rounds folded
    arrays, _ = state.fold(held(replies), (ArrayRecord({}), None))  # type: ignore[arg-type]
    got = arrays.to_torch_state_dict()  # type: ignore[union-attr]
    mean_ba = sum(
        w * s["l.lora_B.weight"] @ s["l.lora_A.weight"]
        for s, w in zip(states, (0.25, 0.75), strict=True)
    )
    effective = got["l.base_delta"] + 2.0 * got["l.lora_B.weight"] @ got["l.lora_A.weight"]
    assert_close_to_scale(
        effective, torch.ones(5, 6) + 2.0 * mean_ba, rel=FLOAT32_REL, atol=FLOAT32_ATOL
    )


def test_a_fold_that_a_bf16_base_cannot_hold_is_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from fedpipe.lora.aggregation import BaseFold

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(32, 64, generator=gen) * 0.05  # SmolLM2-like magnitudes
    residual = torch.randn(32, 64, generator=gen) * 1e-5  # exact's residual, measured ~1e-5
    folds = {}
    for dtype in (torch.float32, torch.bfloat16):
        linear = torch.nn.Linear(64, 32, bias=False).to(dtype)
        with torch.no_grad():
            linear.weight.copy_(weight)
        folds[dtype] = (BaseFold.of_linears({"l": linear}), linear)
    fold32, linear32 = folds[torch.float32]
    fold32.set({"l": residual})
    assert fold32.kept == 1.0
    assert_close_to_scale(linear32.weight - weight, residual, rel=1e-5, atol=1e-8)
    fold16, _ = folds[torch.bfloat16]
    with caplog.at_level("WARNING", logger="fedpipe.lora.aggregation"):
        fold16.set({"l": residual})
    assert fold16.kept < 0.5 and "server.dtype = float32" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="fedpipe.lora.aggregation"):
        fold16.set({"l": weight})  # as large as the weights: bf16 holds it to ~0.4%
    assert fold16.kept > 0.99 and not caplog.text
