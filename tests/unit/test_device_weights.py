"""device.weights: a device's frozen weights stored in bf16, int8 or int4 (fedpipe.split.quant).

Round trips within each format's bound; a stored linear's product and input gradient are the
dequantized weight's; a stored device's loss and LoRA gradients stay near fp32's (tolerances
below, measured on the tiny random models); fp32 builds exactly what it built before; a tied
embedding is stored once; the parameter bytes drop ~2x / ~4x / ~7x; a mistyped value is refused
in one line naming the allowed ones.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from fedpipe.config import DEVICE_WEIGHTS, FedpipeConfig, load_config
from fedpipe.lora import LoraSettings, apply_lora
from fedpipe.models import load_config as load_hf_config
from fedpipe.models import resolve_model
from fedpipe.split import build_device_stages, build_stage, quant, split_layout
from fedpipe.split.memory import device_param_bytes
from fedpipe.split.quant import (
    INT4_GROUP,
    StoredEmbedding,
    StoredLinear,
    dequantize,
    pack_rows,
    quantize,
    stored_bytes,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)
STORED = ("bf16", "int8", "int4")
MODELS = ("tiny-llama", "tiny-gpt2")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    cache = tmp_path_factory.mktemp("cache")
    return {name: resolve_model(name, cache_dir=cache) for name in MODELS}


def _weight(rows: int, width: int, seed: int = 0) -> torch.Tensor:
    w = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))
    w[0] *= 50.0  # a row far larger than the others: per-row / per-group scales keep the rest
    w[1] = 0.0  # an all-zero row
    return w


# -- round trips -------------------------------------------------------------------------------
@pytest.mark.parametrize("width", [64, 100, 576])  # 100: a group padded with zeros
def test_round_trip_errors_are_within_each_formats_bound(width: int) -> None:
    w = _weight(37, width)
    # bf16: round to nearest with 8 significant bits, |err| <= 2^-9 |w| (relative)
    data, scale = quantize(w, "bf16")
    assert data.dtype == torch.bfloat16 and scale is None
    err = (dequantize(data, scale, "bf16", width) - w).abs()
    assert bool((err <= w.abs() * 2.0**-8).all())
    # int8, per row: |err| <= scale / 2 = amax(row) / 254
    data, scale = quantize(w, "int8")
    assert data.dtype == torch.int8 and scale is not None and scale.shape == (37,)
    err = (dequantize(data, scale, "int8", width) - w).abs()
    bound = w.abs().amax(dim=1, keepdim=True) / 254
    assert bool((err <= bound * (1 + 1e-5) + 1e-12).all())
    # int4, per group of 64 along a row: |err| <= scale / 2 = amax(group) / 14
    data, scale = quantize(w, "int4")
    groups = -(-width // INT4_GROUP)
    assert data.dtype == torch.uint8 and data.shape == (37, groups * INT4_GROUP // 2)
    assert scale is not None and scale.shape == (37, groups)
    back = dequantize(data, scale, "int4", width)
    assert back.shape == w.shape
    padded = torch.nn.functional.pad(w, (0, groups * INT4_GROUP - width))
    amax = padded.view(37, groups, INT4_GROUP).abs().amax(dim=2)
    bound = amax.repeat_interleave(INT4_GROUP, dim=1)[:, :width] / 14
    assert bool(((back - w).abs() <= bound * (1 + 1e-5) + 1e-12).all())
    for weights in STORED:  # the zero row stays zero
        assert not dequantize(*quantize(w, weights), weights, width)[1].any()


# Relative RMS error of a Gaussian weight's round trip, measured on 2048 x 2048: bf16 0.0017,
# int8 0.0082, int4 0.108 (a group's step is amax / 7, about 0.34 sigma for 64 Gaussians).
TYPICAL = {"bf16": 0.002, "int8": 0.01, "int4": 0.12}


@pytest.mark.parametrize("weights", STORED)
def test_a_gaussian_weights_typical_error(weights: str) -> None:
    w = torch.randn(512, 576, generator=torch.Generator().manual_seed(4))
    back = dequantize(*quantize(w, weights), weights, 576)
    assert ((back - w).norm() / w.norm()).item() < TYPICAL[weights]


def test_a_weight_packed_a_slab_at_a_time_is_the_weight_packed_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    w = _weight(50, 70, seed=1)
    whole = {k: quantize(w, k) for k in STORED}
    monkeypatch.setattr(quant, "SLAB", 7 * 70)  # 7 rows a slab
    read: list[tuple[int, int]] = []

    def rows(a: int, b: int) -> torch.Tensor:
        read.append((a, b))
        return w[a:b]

    for weights in STORED:
        read.clear()
        data, scale = pack_rows(rows, 50, 70, weights)
        assert max(b - a for a, b in read) == 7  # never more than a slab of it in fp32
        assert torch.equal(data, whole[weights][0])
        if scale is not None:
            assert torch.equal(scale, whole[weights][1])


@pytest.mark.parametrize("weights", STORED)
@pytest.mark.parametrize("slab", [1 << 22, 9 * 48])  # one slab, or 9 rows at a time
def test_a_stored_linear_is_the_dequantized_weights_product_and_input_gradient(
    weights: str, slab: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(quant, "SLAB", slab)
    w, bias = _weight(100, 48, seed=2), torch.randn(100)
    data, scale = quantize(w, weights)
    layer = StoredLinear(data, scale, weights=weights, in_features=48, out_features=100, bias=bias)
    ref = nn.Linear(48, 100)
    with torch.no_grad():
        ref.weight.copy_(dequantize(data, scale, weights, 48))
        ref.bias.copy_(bias)
    ref.requires_grad_(False)
    x = torch.randn(3, 5, 48, requires_grad=True)
    out = layer(x)
    out.pow(2).sum().backward()
    assert x.grad is not None
    grad, x.grad = x.grad.clone(), None
    expected = ref(x)
    expected.pow(2).sum().backward()
    # the same products, summed over slabs in another order: equal to fp32 rounding
    assert ((out - expected).norm() / expected.norm()).item() < 1e-6
    assert ((grad - x.grad).norm() / x.grad.norm()).item() < 1e-6
    assert layer.weight is None and not any(p.requires_grad for p in layer.parameters())


@pytest.mark.parametrize("weights", STORED)
def test_a_stored_embedding_gathers_rows_then_dequantizes_them(weights: str) -> None:
    w = _weight(30, 70, seed=3)
    data, scale = quantize(w, weights)
    emb = StoredEmbedding(data, scale, weights=weights, num_embeddings=30, embedding_dim=70)
    ids = torch.tensor([[0, 5, 29], [7, 7, 1]])
    assert torch.equal(emb(ids), dequantize(data, scale, weights, 70)[ids])


# -- a device's loss and gradients -------------------------------------------------------------
def _loss_and_lora_grads(
    folder: Path, weights: str, ids: torch.Tensor
) -> tuple[float, dict[str, torch.Tensor]]:
    """The split's loss (device stored as ``weights``, server middle fp32) and the gradients
    of the device's LoRA weights, from the same nonzero adapters every time."""
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
    middle = build_stage(folder, layout, "middle")
    hidden = head(ids)
    assert hidden.dtype == torch.float32  # what the server expects, whatever is stored
    loss_sum, count = tail(middle(hidden), ids)
    (loss_sum / count).backward()
    grads = {
        n: p.grad.clone()
        for s in (head, tail)
        for n, p in s.named_parameters()
        if p.grad is not None
    }
    assert grads and all(".lora_" in n for n in grads)  # the frozen weights got none
    assert all(p.dtype == torch.float32 for s in (head, tail) for p in s.parameters()
               if p.requires_grad)  # fmt: skip
    return float((loss_sum / count).detach()), grads


# The tolerances (tiny random models, 2 + 1 device blocks, the tied embedding / LM head stored,
# the server's middle fp32, the same nonzero adapters). Measured here (tiny-llama, tiny-gpt2):
#   loss |l - l32| / l32:   bf16 1.1e-5, 6.3e-6   int8 4.3e-5, 1.5e-5   int4 2.1e-4, 1.4e-3
#   gradients ||g - g32|| / ||g32|| (all LoRA weights together), cosine:
#                           bf16 0.004, 1.0000    int8 0.012, 0.9999    int4 0.22 0.975, 0.19 0.983
# Each weight moves by <= 2^-9 of itself (bf16), <= 1/254 of its row's largest (int8) or <= 1/14
# of its group's largest (int4; ~11% RMS on Gaussian weights). The loss is a mean over tokens and
# moves little; the gradients come back through every stored linear and the stored LM head, so
# int4's error shows there. The bounds leave 2-10x room over what was measured.
TOLERANCE = {  # weights: (loss, gradients, min cosine)
    "bf16": (1e-4, 0.02, 0.9998),
    "int8": (1e-3, 0.05, 0.998),
    "int4": (5e-3, 0.40, 0.92),
}


@pytest.mark.parametrize("weights", STORED)
@pytest.mark.parametrize("name", MODELS)
def test_a_stored_devices_loss_and_lora_gradients_stay_near_fp32(
    folders: dict[str, Path], name: str, weights: str
) -> None:
    ids = torch.randint(0, 258, (2, 40), generator=torch.Generator().manual_seed(0))
    ref_loss, ref = _loss_and_lora_grads(folders[name], "fp32", ids)
    loss, grads = _loss_and_lora_grads(folders[name], weights, ids)
    assert set(grads) == set(ref)
    flat_ref = torch.cat([ref[k].flatten() for k in sorted(ref)])
    flat = torch.cat([grads[k].flatten() for k in sorted(ref)])
    loss_tol, grad_tol, cosine = TOLERANCE[weights]
    assert abs(loss - ref_loss) / ref_loss < loss_tol, (loss, ref_loss)
    assert ((flat - flat_ref).norm() / flat_ref.norm()).item() < grad_tol
    assert torch.nn.functional.cosine_similarity(flat, flat_ref, dim=0).item() > cosine


@pytest.mark.parametrize("name", MODELS)
def test_fp32_builds_exactly_what_it_built_before(folders: dict[str, Path], name: str) -> None:
    """weights = fp32 is the old path: plain modules, the file's tensors, the same bits."""
    folder = folders[name]
    layout = split_layout(load_hf_config(folder), head_layers=2, tail_layers=1)
    old = build_device_stages(folder, layout)
    new = build_device_stages(folder, layout, weights="fp32")
    for a, b in zip(old, new, strict=True):
        assert a is not None and b is not None
        assert not any(isinstance(m, StoredLinear | StoredEmbedding) for m in b.modules())
        sa, sb = a.state_dict(), b.state_dict()
        assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    ids = torch.randint(0, 258, (2, 40), generator=torch.Generator().manual_seed(0))
    loss_a, grads_a = _loss_and_lora_grads(folder, "fp32", ids)
    loss_b, grads_b = _loss_and_lora_grads(folder, "fp32", ids)
    assert loss_a == loss_b and all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)


# -- bytes -------------------------------------------------------------------------------------
def _unique_bytes(*stages: nn.Module | None) -> int:
    params = {id(p): p for s in stages if s is not None for p in s.parameters()}
    return sum(p.numel() * p.element_size() for p in params.values())


@pytest.mark.parametrize("weights", STORED)
@pytest.mark.parametrize("name", MODELS)
def test_a_tied_embedding_is_stored_once(folders: dict[str, Path], name: str, weights: str) -> None:
    folder = folders[name]
    config = load_hf_config(folder)
    layout = split_layout(config, head_layers=2, tail_layers=1)
    head, tail = build_device_stages(folder, layout, weights=weights)
    assert tail is not None
    embedding, lm_head = head.embedding, tail.lm_head
    assert isinstance(embedding, StoredEmbedding) and isinstance(lm_head, StoredLinear)
    assert lm_head.qweight is embedding.qweight and lm_head.qscale is embedding.qscale
    vocab, width = int(config.vocab_size), int(config.hidden_size)
    once = stored_bytes(vocab, width, weights)
    built = _unique_bytes(head, tail)
    assert built == device_param_bytes(folder, layout, weights)  # the planner's count
    # the tail on its own would hold the embedding again; together they hold it once
    assert built == _unique_bytes(head) + _unique_bytes(tail) - once


SMOLLM2 = {  # config.json of HuggingFaceTB/SmolLM2-135M, the fields the stages read
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
}


def test_the_device_param_bytes_drop_2x_4x_7x(tmp_path: Path) -> None:
    """SmolLM2-135M's shape at 2 + 2 blocks (counted on the meta device, nothing built)."""
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    layout = split_layout(load_hf_config(tmp_path), head_layers=2, tail_layers=2)
    fp32 = device_param_bytes(tmp_path, layout)
    assert fp32 == device_param_bytes(tmp_path, layout, "fp32")
    assert 169e6 < fp32 < 171e6  # the 49k x 576 embedding (tied, once) and four blocks
    ratio = {w: fp32 / device_param_bytes(tmp_path, layout, w) for w in STORED}
    assert 1.99 < ratio["bf16"] <= 2.0  # norms stay fp32
    assert 3.95 < ratio["int8"] < 4.0  # + one fp32 scale per row
    assert 7.0 < ratio["int4"] < 7.12  # 4 bits + an fp32 scale per 64 weights: 4 / 0.5625


# -- the setting -------------------------------------------------------------------------------
def test_the_setting_defaults_to_fp32_and_is_dealt_to_devices() -> None:
    assert FedpipeConfig().device.weights == ("fp32",) and DEVICE_WEIGHTS[0] == "fp32"
    config = load_config(None, {"device.weights": "int4, fp32"})
    assert [config.device_weights(p) for p in range(3)] == ["int4", "fp32", "int4"]
    assert config.device_weights(-1) == "fp32"  # the evaluator beside the server
    own = config.with_device_weights("int8")
    assert own.device.weights == ("int8",) and own.device.stored == "int8"
    assert FedpipeConfig().with_overrides(own.to_flat()) == own


@pytest.mark.parametrize("value", ["int3", "fp16", "int4,q4", ""])
def test_a_mistyped_value_is_refused_in_one_line_naming_the_allowed(value: str) -> None:
    with pytest.raises(ValueError) as info:
        load_config(None, {"device.weights": value})
    text = str(info.value)
    assert "\n" not in text and text.startswith("device.weights ")
    assert "fp32, bf16, int8, int4" in text


def test_a_deployed_devices_own_weights_are_checked_and_reach_its_node_config() -> None:
    from fedpipe.cli.client import client_setup, node_config, own_settings
    from fedpipe.cli.parser import build_parser
    from fedpipe.cli.preflight import SettingsError, _check_weights

    args = build_parser().parse_args(["client", "--weights", "int4"])
    setup = client_setup(args)
    assert node_config(setup)["weights"] == "int4" and "weights int4" in own_settings(setup)
    assert "weights" not in node_config(client_setup(build_parser().parse_args(["client"])))
    with pytest.raises(SettingsError, match="--weights 'int5' unknown; choose one of fp32, "):
        _check_weights("int5")


def test_folding_base_deltas_into_stored_weights_is_refused() -> None:
    with pytest.raises(ValueError, match="federated.aggregation = exact folds") as info:
        load_config(None, {"device.weights": "int8", "federated.aggregation": "exact"})
    assert "\n" not in str(info.value)
    load_config(None, {"device.weights": "int8", "federated.aggregation": "ffa"})


def test_each_device_is_dealt_its_storage_and_says_it() -> None:
    from fedpipe.edge.trainer import TrainReport
    from fedpipe.fl.device_work import DeviceWork
    from fedpipe.fl.replies import TrainReply
    from fedpipe.runs.summary import build_summary

    config = load_config(None, {"model.name": "tiny-llama", "device.weights": "int4,fp32"})
    works = [DeviceWork(config, device_id=f"d{p}", partition=p, num_partitions=2) for p in (0, 1)]
    assert [w.trainer.weights for w in works] == ["int4", "fp32"]
    own = DeviceWork(config, device_id="own", partition=0, num_partitions=2, weights="int8")
    assert own.trainer.weights == "int8"  # `fedpipe client --weights` wins over the cycle
    content = TrainReply.of(TrainReport(), 0, "1+1", weights=own.trainer.weights).write({})
    assert dict(content["device"]) == {"cut": "1+1", "weights": "int8"}
    history = [
        {"event": "train", "round": 1, "partition": p, "train_loss": 3.0, "weights": w}
        for p, w in ((0, "int4"), (1, "fp32"))
    ]
    summary = build_summary(history, config={})
    assert summary["weights"] == {"0": "int4", "1": "fp32"}
    assert summary["rounds"][0]["weights"] == {"0": "int4", "1": "fp32"}
