"""Every family of the table split at several cuts equals the unsplit Hugging Face model: the loss
and the gradient of every weight (tied and untied embeddings, sliding and full layers, Gemma's
scaled embedding and soft-capping, Granite's multipliers, SmolLM3's blocks without rope, Phi-3's
fused projections); and the types fedpipe cannot split are refused in one line."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from harness.close import assert_close_to_scale
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from fedpipe.lora import AdapterBank, Group, LoraSettings, adapter_bank, apply_lora
from fedpipe.lora.base import lora_layers
from fedpipe.lora.batched_bank import BatchedAdapterBank, batchable
from fedpipe.models import load_config, model_family
from fedpipe.models.families import FAMILIES, supported_types
from fedpipe.split import build_device_stages, build_stage, split_layout

torch.set_num_threads(1)
VOCAB, LENGTH, WINDOW = 128, 12, 4  # the sliding window is shorter than the sequence
_TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.1,  # larger than the default, so every detail moves the loss
)
_LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8,
)
_ALTERNATING = ["sliding_attention", "full_attention"] * 2
# name -> (model_type, config overrides). Each family once tied and once untied across the list.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {"tie_word_embeddings": False}),
    "llama3-rope-tied": ("llama", {"tie_word_embeddings": True, "rope_parameters": _LLAMA3_ROPE}),
    "qwen2-sliding": (
        "qwen2",
        {"use_sliding_window": True, "max_window_layers": 2, "sliding_window": WINDOW},
    ),
    "mistral-sliding": ("mistral", {"sliding_window": WINDOW, "tie_word_embeddings": True}),
    "qwen3-sliding-tied": (
        "qwen3",
        {
            "use_sliding_window": True,
            "max_window_layers": 2,
            "sliding_window": WINDOW,
            "head_dim": 16,
            "tie_word_embeddings": True,
        },
    ),
    "qwen3-untied": ("qwen3", {"head_dim": 8, "tie_word_embeddings": False}),
    "olmo2": ("olmo2", {"tie_word_embeddings": False}),
    "olmo2-tied": ("olmo2", {"tie_word_embeddings": True}),
    "granite": (
        "granite",
        {
            "embedding_multiplier": 0.25,
            "logits_scaling": 3.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.2,
            "tie_word_embeddings": True,
        },
    ),
    "smollm3-sliding-tied": (
        "smollm3",
        {"use_sliding_window": True, "sliding_window": WINDOW, "tie_word_embeddings": True},
    ),
    "smollm3-untied": ("smollm3", {"tie_word_embeddings": False}),
    "phi3": ("phi3", {"tie_word_embeddings": False}),
    "phi3-sliding-tied": ("phi3", {"sliding_window": WINDOW, "tie_word_embeddings": True}),
    "gemma2-tied": (
        "gemma2",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "layer_types": _ALTERNATING,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 1.0,
        },
    ),
    "gemma2-untied": (
        "gemma2",
        {"head_dim": 16, "sliding_window": WINDOW, "tie_word_embeddings": False},
    ),
    "gemma3-tied": (
        "gemma3_text",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "layer_types": _ALTERNATING,
            "final_logit_softcapping": 1.0,
        },
    ),
    "gemma3-untied": (
        "gemma3_text",
        {"head_dim": 16, "sliding_window": WINDOW, "tie_word_embeddings": False},
    ),
}
# (mode, head blocks, tail blocks): U splits at two cuts, and the two-part split.
CUTS = [("u", 1, 1), ("u", 2, 1), ("two", 1, 0)]


def _config(name: str) -> Any:
    model_type, overrides = CASES[name]
    return CONFIG_MAPPING[model_type](**{**_TINY, **overrides})


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each case saved once with save_pretrained (random weights, fixed seed)."""
    root = tmp_path_factory.mktemp("families")
    folders = {}
    for name in CASES:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_config(name))
        _perturb_norms(model)
        model.save_pretrained(root / name)
        folders[name] = root / name
    return folders


def _perturb_norms(model: nn.Module) -> None:
    """Norm weights start at 1 (or 0 for Gemma's 1 + w): make them random so each one matters."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)


def _reference(folder: Path) -> PreTrainedModel:
    """The unsplit model as transformers loads it by default (its own attention choice)."""
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _ids() -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(1))


def _split_stages(folder: Path, mode: str, head_blocks: int, tail_blocks: int) -> list[nn.Module]:
    """The stages of one split, in data order, every weight trainable."""
    plan = split_layout(
        load_config(folder), head_layers=head_blocks, tail_layers=tail_blocks, mode=mode
    )
    if mode == "u":
        head, tail = build_device_stages(folder, plan)
        assert tail is not None
        stages: list[nn.Module] = [head, build_stage(folder, plan, "middle"), tail]
    else:
        stages = [build_stage(folder, plan, "head"), build_stage(folder, plan, "server_loss")]
    return [stage.requires_grad_(True) for stage in stages]


def _split_loss(stages: list[nn.Module], ids: torch.Tensor) -> torch.Tensor:
    hidden = stages[0](ids)
    for stage in stages[1:-1]:
        hidden = stage(hidden)
    loss_sum, count = stages[-1](hidden, ids)
    return loss_sum / count


def _grads(stages: list[nn.Module], tied: bool) -> dict[str, torch.Tensor]:
    """Each weight's gradient under its unsplit name. A tied LM head held apart from the
    embedding (the server's copy in mode "two") adds its gradient to the embedding's, as the
    unsplit model's one tensor gets both."""
    seen: set[int] = set()
    grads: dict[str, torch.Tensor] = {}
    for stage in stages:
        for name, param in stage.named_parameters(remove_duplicate=False):
            if id(param) in seen:
                continue  # the head's embedding shared by the tail's LM head: one tensor
            seen.add(id(param))
            assert param.grad is not None, name
            key = "lm_head.weight" if name == "lm_head.weight" else f"model.{name}"
            key = "model.embed_tokens.weight" if tied and key == "lm_head.weight" else key
            grads[key] = grads[key] + param.grad if key in grads else param.grad
    return grads


@pytest.mark.parametrize("cut", CUTS, ids=lambda c: f"{c[0]}-{c[1]}+{c[2]}")
@pytest.mark.parametrize("name", list(CASES))
def test_split_loss_and_every_gradient_equal_the_unsplit_model(
    saved: dict[str, Path], name: str, cut: tuple[str, int, int]
) -> None:
    folder = saved[name]
    whole = _reference(folder)
    ids = _ids()
    reference = whole(ids, labels=ids).loss
    reference.backward()
    stages = _split_stages(folder, *cut)
    loss = _split_loss(stages, ids)
    loss.backward()
    assert_close_to_scale(loss, reference, rel=1e-6, atol=1e-6)
    expected = dict(whole.named_parameters())
    grads = _grads(stages, tied="lm_head.weight" not in expected)
    assert sorted(grads) == sorted(expected)
    for key, grad in grads.items():
        assert_close_to_scale(grad, expected[key].grad, rel=1e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize(
    ("name", "field", "value"),
    [
        ("gemma3-tied", "logits", None),
        ("gemma3-tied", "embed", None),
        ("gemma2-tied", "logits", None),
        ("gemma2-untied", "embed", None),
        ("granite", "logits", None),
        ("granite", "embed", None),
    ],
)
def test_a_split_without_its_table_entry_detail_is_not_exact(
    saved: dict[str, Path], name: str, field: str, value: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each field of the table changes the loss beyond the tolerance above."""
    model_type = CASES[name][0]
    plain = dataclasses.replace(FAMILIES[model_type], **{field: value})
    monkeypatch.setitem(FAMILIES, model_type, plain)
    ids = _ids()
    reference = _reference(saved[name])(ids, labels=ids).loss
    loss = _split_loss(_split_stages(saved[name], "u", 1, 1), ids)
    assert not torch.allclose(loss, reference, atol=1e-4)


def test_gemma2_runs_eager_attention_for_its_soft_capping(
    saved: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert load_config(saved["gemma2-tied"])._attn_implementation == "eager"
    monkeypatch.setitem(FAMILIES, "gemma2", dataclasses.replace(FAMILIES["gemma2"], eager=False))
    with pytest.raises(ValueError, match="sdpa.*softcap"):  # transformers' sdpa refuses it
        _split_loss(_split_stages(saved["gemma2-tied"], "u", 1, 1), _ids())


@pytest.mark.parametrize("name", ["phi3", "qwen3-untied", "gemma3-untied"])
def test_default_lora_targets_are_the_family_attention_and_exact(
    saved: dict[str, Path], name: str
) -> None:
    folder = saved[name]
    settings = LoraSettings(r=4)
    plan = split_layout(load_config(folder), head_layers=1, tail_layers=1)
    head, tail = build_device_stages(folder, plan)
    assert tail is not None
    stages = [
        apply_lora(s, settings, "llama") for s in (head, build_stage(folder, plan, "middle"), tail)
    ]
    whole = apply_lora(_reference(folder), settings, model_family(load_config(folder)))
    targets = {n.rsplit(".", 1)[-1] for s in stages for n in lora_layers(s)}
    assert targets == set(FAMILIES[CASES[name][0]].lora_targets)
    ids = _ids()
    loss_sum, count = stages[2](stages[1](stages[0](ids)), ids)
    (loss_sum / count).backward()
    reference = whole(ids, labels=ids).loss
    reference.backward()
    expected = {k: v for k, v in whole.named_parameters() if "lora_" in k}
    got = {k: v for s in stages for k, v in s.named_parameters() if "lora_" in k}
    assert len(got) == len(expected) > 0
    for key, param in got.items():
        assert_close_to_scale(param.grad, expected[f"model.{key}"].grad, atol=1e-6, rel=1e-4)


@pytest.mark.parametrize("name", list(CASES))
def test_the_batched_bank_computes_every_family_as_peft_does(
    saved: dict[str, Path], name: str
) -> None:
    """The server's middle stage of each case (loaded as the server loads it, its default LoRA
    targets): the batched bank's outputs, input gradients and LoRA gradients are peft's."""
    folder = saved[name]
    plan = split_layout(load_config(folder), head_layers=1, tail_layers=1)
    middle = build_stage(folder, plan, "middle")
    settings = LoraSettings(r=4, alpha=8)
    assert batchable(middle, settings, "llama") == ""
    solo = AdapterBank(copy.deepcopy(middle), settings, family="llama")
    batched = adapter_bank(middle, settings, family="llama")
    assert isinstance(batched, BatchedAdapterBank)
    gen = torch.Generator().manual_seed(2)
    state = {k: torch.randn(v.shape, generator=gen) * 0.1 for k, v in solo.global_state().items()}
    for bank in (solo, batched):
        bank.add("a", init=state)
    xs = [torch.randn(b, t, 64, generator=gen) for b, t in ((2, LENGTH), (1, WINDOW - 1))]
    gs = [torch.randn(x.shape, generator=gen) for x in xs]
    taped = batched.run_taped([Group("a", x) for x in xs])
    dxs = batched.backward([(tape, g) for (_, tape), g in zip(taped, gs, strict=True)])
    for (y, _), x, g, dx in zip(taped, xs, gs, dxs, strict=True):
        x = x.clone().requires_grad_(True)
        want = solo.run([Group("a", x)])[0]
        want.backward(g)
        assert_close_to_scale(y, want.detach(), rel=1e-5, atol=1e-5)
        assert_close_to_scale(dx, x.grad, rel=1e-5, atol=1e-5)
    want_grads = {k: p.grad for k, p in solo.named_parameters("a").items()}
    for key, param in batched.named_parameters("a").items():
        assert_close_to_scale(param.grad, want_grads[key], rel=1e-5, atol=1e-5, msg=key)


def test_the_batched_bank_refuses_families_it_does_not_compute(
    saved: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    middle = build_stage(
        saved["qwen3-untied"], split_layout(load_config(saved["qwen3-untied"])), "middle"
    )
    monkeypatch.setitem(FAMILIES, "qwen3", dataclasses.replace(FAMILIES["qwen3"], batched=False))
    reason = batchable(middle, LoraSettings(), "llama")
    assert "model_type 'qwen3' has no batched forward" in reason
    with pytest.raises(ValueError, match="cannot be batched: model_type 'qwen3'"):
        BatchedAdapterBank(middle, LoraSettings())
    assert isinstance(adapter_bank(middle, LoraSettings(), family="llama"), AdapterBank)


def test_the_batched_bank_refuses_what_its_blocks_do_not_compute(saved: dict[str, Path]) -> None:
    """LoRA targets outside the family's linears (Phi-3 has no q_proj), and dropout in the
    blocks of a training stage (the server's stages run in eval mode)."""
    plan = split_layout(load_config(saved["phi3"]))
    phi3 = build_stage(saved["phi3"], plan, "middle")
    assert batchable(phi3, LoraSettings(targets=("gate_up_proj", "down_proj")), "llama") == ""
    reason = batchable(phi3, LoraSettings(targets=("q_proj", "qkv_proj")), "llama")
    assert reason == "LoRA targets ['q_proj'] are outside the blocks' linears"
    phi3.config.resid_pdrop = 0.1
    assert batchable(phi3, LoraSettings(), "llama") == ""  # eval mode: no dropout runs
    reason = batchable(phi3.train(), LoraSettings(), "llama")
    assert reason.startswith("resid_pdrop in a training stage")


@pytest.mark.parametrize(
    ("model_type", "why"),
    [
        ("qwen3_moe", "mixture-of-experts"),
        ("mixtral", "mixture-of-experts"),
        ("olmoe", "mixture-of-experts"),
        ("qwen3_next", "hybrid or linear attention"),
        ("granitemoehybrid", "hybrid or linear attention"),
        ("recurrent_gemma", "hybrid or linear attention"),
        ("gemma3", "multimodal"),
        ("llava", "multimodal"),
        ("t5", "encoder-decoder"),
        ("bert", "no stage layout"),
    ],
)
def test_unsupported_types_are_refused_in_one_line(model_type: str, why: str) -> None:
    with pytest.raises(ValueError) as caught:
        model_family(CONFIG_MAPPING[model_type]())
    message = str(caught.value)
    assert "\n" not in message
    assert f"model_type {model_type!r}" in message and why in message
    assert ", ".join(supported_types()) in message


def test_attention_types_the_stages_do_not_compute_are_refused() -> None:
    config = SimpleNamespace(model_type="qwen3", layer_types=["full_attention", "linear_attention"])
    with pytest.raises(ValueError, match=r"'qwen3'.*layer_types \['linear_attention'\]"):
        model_family(config)
    dense = SimpleNamespace(model_type="qwen3", num_experts=8)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        model_family(dense)


@pytest.mark.parametrize("model_type", [*FAMILIES, "gpt2"])
def test_every_table_family_is_accepted(model_type: str) -> None:
    expected = "gpt2" if model_type == "gpt2" else "llama"
    assert model_family(CONFIG_MAPPING[model_type]()) == expected


def test_gguf_files_of_the_families_transformers_reads() -> None:
    from fedpipe.models.registry import gguf_architectures

    readable = gguf_architectures()
    assert {"llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_text"} <= set(readable)
    assert not {"olmo2", "granite", "smollm3"} & set(readable)  # no GGUF reader for them


def test_a_sliding_window_applies_where_the_family_code_applies_it() -> None:
    from fedpipe.split import sliding_window

    def blocks(model_type: str, **extra: Any) -> list[int | None]:
        config = CONFIG_MAPPING[model_type](num_hidden_layers=4, sliding_window=WINDOW, **extra)
        return [sliding_window(config, i) for i in range(4)]

    assert blocks("olmo2") == blocks("granite") == blocks("llama") == [None] * 4  # ignored
    assert blocks("phi3") == blocks("mistral") == [WINDOW] * 4
    assert blocks("gemma3_text", layer_types=_ALTERNATING) == [WINDOW, None, WINDOW, None]
    qwen3 = blocks("qwen3", use_sliding_window=True, max_window_layers=2)
    assert qwen3 == [None, None, WINDOW, WINDOW]


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("name", list(CASES))
def test_every_family_stores_its_device_weights(
    saved: dict[str, Path], name: str, weights: str
) -> None:
    """device.weights on every family (fused projections, scaled embeddings, soft-capping,
    untied heads): the device's stages build stored, the split's loss stays near fp32's."""
    from fedpipe.split.quant import StoredEmbedding, StoredLinear

    folder = saved[name]
    plan = split_layout(load_config(folder), head_layers=1, tail_layers=1)
    middle = build_stage(folder, plan, "middle")
    losses = {}
    for stored in ("fp32", weights):
        head, tail = build_device_stages(folder, plan, weights=stored)
        assert tail is not None
        if stored != "fp32":
            assert isinstance(head.embedding, StoredEmbedding)
            assert isinstance(tail.lm_head, StoredLinear)
            tied = tail.lm_head.qweight is head.embedding.qweight
            assert tied == bool(_config(name).tie_word_embeddings)
        with torch.no_grad():
            loss_sum, count = tail(middle(head(_ids())), _ids())
        losses[stored] = float(loss_sum / count)
    # Weights drawn at initializer_range 0.1 (loss ~5): measured int8 <= 0.009 and int4 <= 0.13
    # over the families; a misplaced weight (an untied head read as the embedding) moves it by
    # whole units.
    assert abs(losses[weights] - losses["fp32"]) < {"int8": 0.03, "int4": 0.3}[weights], losses
