"""GGUF files of every family transformers' GGUF reader reads: a tiny random model written as a
real GGUF (llama.cpp's names, keys and conventions, tests/harness/gguf_files.py) converts through
fedpipe's own path (``resolve_model``) to a model whose logits equal the model it was written
from, and that model splits exactly. GGUF files of the families the reader does not read, and
files that set what the reader does not read, are refused in one line naming the file's value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from harness.close import FLOAT32_ATOL, FLOAT32_REL, assert_close_to_scale
from harness.gguf_files import VOCAB, tiny_model, write_gguf
from transformers import AutoModelForCausalLM

from fedpipe.errors import ModelFileError
from fedpipe.models import load_config
from fedpipe.models.registry import gguf_architectures, resolve_model
from fedpipe.split import build_device_stages, build_stage, split_layout

torch.set_num_threads(1)
LENGTH, WINDOW = 12, 4  # the sliding window is shorter than the sequence
_GEMMA = {
    "head_dim": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "sliding_window": WINDOW,
}
# name -> (model_type, config overrides, GGUF architecture, model_type the reader gives back)
CASES: dict[str, tuple[str, dict[str, Any], str, str]] = {
    "llama": ("llama", {"tie_word_embeddings": False}, "llama", "llama"),
    # llama.cpp writes Mistral as "llama" (no sliding window: Mistral 7B v0.2 and later)
    "mistral": ("mistral", {"tie_word_embeddings": True}, "llama", "llama"),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}, "qwen2", "qwen2"),
    # the reader reads no head_dim for qwen3: Qwen3Config's default, 128, as every Qwen3 has
    "qwen3": (
        "qwen3",
        {"head_dim": 128, "num_attention_heads": 2, "num_key_value_heads": 1},
        "qwen3",
        "qwen3",
    ),
    "phi3": ("phi3", {"tie_word_embeddings": False}, "phi3", "phi3"),
    # Gemma: head size 256, the query_pre_attn_scalar the reader leaves (llama.cpp scales by the
    # head size). Alternating sliding (window 4) and full blocks, soft-capping, (1 + w) norms
    "gemma2": ("gemma2", {**_GEMMA, "attn_implementation": "eager"}, "gemma2", "gemma2"),
    # five sliding blocks then a full one (Gemma 3's pattern), local and global rotaries
    "gemma3": ("gemma3_text", {**_GEMMA, "num_hidden_layers": 6}, "gemma3", "gemma3_text"),
    "gpt2": ("gpt2", {}, "gpt2", "gpt2"),
}


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, LENGTH), generator=torch.Generator().manual_seed(1))


def _converted(name: str, tmp_path: Path) -> tuple[torch.nn.Module, Path]:
    model_type, overrides, arch, _ = CASES[name]
    model = tiny_model(model_type, **overrides)
    gguf_file = write_gguf(model, tmp_path / f"{name}.gguf", arch=arch, name=f"tiny {name}")
    return model, resolve_model(str(gguf_file), cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("name", list(CASES))
def test_a_gguf_of_the_family_converts_to_the_model_it_was_written_from(
    name: str, tmp_path: Path
) -> None:
    model, folder = _converted(name, tmp_path)
    converted = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert converted.config.model_type == CASES[name][3]
    assert converted.config.vocab_size == VOCAB
    ids = _ids()
    with torch.no_grad():
        assert_close_to_scale(
            converted(ids).logits, model(ids).logits, rel=FLOAT32_REL, atol=FLOAT32_ATOL
        )
    # and it splits: head 1 block, middle, tail 1 block equal the unsplit model's loss
    plan = split_layout(load_config(folder), head_layers=1, tail_layers=1)
    head, tail = build_device_stages(folder, plan)
    assert tail is not None
    middle = build_stage(folder, plan, "middle")
    with torch.no_grad():
        loss_sum, count = tail(middle(head(ids)), ids)
        reference = converted(ids, labels=ids).loss
    assert_close_to_scale(loss_sum / count, reference, rel=1e-6, atol=1e-6)


def test_the_architectures_named_as_read_are_the_ones_tested_here() -> None:
    """gguf_architectures() (what the refusals name) is what this file converts exactly."""
    readable = {CASES[n][3] for n in CASES} | {"mistral"}  # mistral: read as llama (above)
    assert set(gguf_architectures()) == readable


@pytest.mark.parametrize("model_type", ["olmo2", "granite", "smollm3"])
def test_a_gguf_of_a_family_the_reader_does_not_read_is_refused_in_one_line(
    model_type: str, tmp_path: Path
) -> None:
    gguf_file = write_gguf(tiny_model(model_type), tmp_path / f"{model_type}.gguf")
    with pytest.raises(ModelFileError) as info:
        resolve_model(str(gguf_file), cache_dir=tmp_path / "cache")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{gguf_file}: a GGUF of architecture {model_type!r}")
    assert "transformers' GGUF reader does not read" in message
    read = sorted("gemma3" if t == "gemma3_text" else t for t in gguf_architectures())
    assert message.endswith(f"architectures {', '.join(read)})")
    assert not list((tmp_path / "cache" / "models").iterdir())  # nothing cached


@pytest.mark.parametrize(
    ("name", "overrides", "extra", "tensors", "stated", "converted"),
    [
        (  # Phi-3-mini-4k's window: the reader reads none for phi3
            "phi3",
            {"sliding_window": WINDOW},
            {},
            {},
            f"phi3.attention.sliding_window = {WINDOW}",
            "sliding_window = None",
        ),
        (  # a Qwen3 whose head_dim is not Qwen3Config's default
            "qwen3",
            {"head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 2},
            {},
            {},
            "qwen3.attention.key_length = 16",
            "head_dim = 128",
        ),
        (  # the reader leaves Gemma 2's soft-capping at the config's default, 30
            "gemma2",
            {"final_logit_softcapping": 3.0},
            {},
            {},
            "gemma2.final_logit_softcapping = 3.0",
            "final_logit_softcapping = 30.0",
        ),
        (  # a Gemma whose head size is not the 256 transformers scales its attention by
            "gemma3",
            {"head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 2},
            {},
            {},
            "gemma3.attention.key_length = 16",
            "query_pre_attn_scalar = 256 where llama.cpp scales attention by the head size (27B: "
            "hidden size / heads)",
        ),
        (  # Gemma 3 4B and larger: linear rope scaling
            "gemma3",
            {},
            {"gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0},
            {},
            "gemma3.rope.scaling.type = 'linear'",
            "no rope scaling",
        ),
        (  # Llama 3.x: llama.cpp stores its rope scaling as a tensor of frequency factors
            "llama",
            {},
            {},
            {"rope_freqs.weight": np.ones(8, dtype=np.float32)},
            "a rope_freqs.weight tensor (rope scaling factors)",
            "no rope scaling",
        ),
    ],
)
def test_a_gguf_setting_what_the_reader_does_not_read_is_refused_naming_both_values(
    name: str,
    overrides: dict[str, Any],
    extra: dict[str, Any],
    tensors: dict[str, np.ndarray],
    stated: str,
    converted: str,
    tmp_path: Path,
) -> None:
    model_type, base, arch, _ = CASES[name]
    model = tiny_model(model_type, **{**base, **overrides})
    path = tmp_path / "m.gguf"
    gguf_file = write_gguf(model, path, arch=arch, extra=extra, extra_tensors=tensors)
    with pytest.raises(ModelFileError) as info:
        resolve_model(str(gguf_file), cache_dir=tmp_path / "cache")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{gguf_file}: the GGUF has {stated}, which transformers' GGUF")
    assert "reader does not carry over" in message
    assert f"the converted model would have {converted} and compute differently" in message
    assert not list((tmp_path / "cache" / "models").iterdir())
