"""fedpipe.models: named configs, caching, tokenizer, family detection; SmolLM2 in the slow tier."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from fedpipe.models import (
    load_causal_lm,
    load_config,
    load_tokenizer,
    model_family,
    resolve_model,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def test_named_models_are_deterministic_across_caches(cache: Path, tmp_path: Path) -> None:
    first = load_file(str(resolve_model("tiny-llama", cache_dir=cache) / "model.safetensors"))
    second = load_file(str(resolve_model("tiny-llama", cache_dir=tmp_path) / "model.safetensors"))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert all(t.dtype == torch.float32 for t in first.values())


def test_resolve_caches_and_leaves_no_temp_folders(cache: Path) -> None:
    folder = resolve_model("tiny-gpt2", cache_dir=cache)
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("tiny-gpt2", cache_dir=cache) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert folder.parent == cache / "models"
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".tmp")]


def test_cache_dir_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDPIPE_CACHE", str(tmp_path))
    assert resolve_model("tiny-llama").parent == tmp_path / "models"


def test_named_configs_have_the_promised_shapes(cache: Path) -> None:
    llama = load_config(resolve_model("tiny-llama", cache_dir=cache))
    assert (llama.hidden_size, llama.intermediate_size, llama.num_hidden_layers) == (64, 128, 4)
    assert (llama.num_attention_heads, llama.num_key_value_heads, llama.vocab_size) == (4, 2, 258)
    assert llama.tie_word_embeddings and llama.max_position_embeddings == 512
    gpt2 = load_config(resolve_model("tiny-gpt2", cache_dir=cache))
    assert (gpt2.n_embd, gpt2.n_layer, gpt2.n_head, gpt2.vocab_size) == (64, 4, 4, 258)
    model = load_causal_lm(resolve_model("tiny-gpt2", cache_dir=cache))
    assert model.config._attn_implementation == "sdpa"


def test_unknown_spec_names_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tiny-llama.*tiny-gpt2.*small-llama.*default"):
        resolve_model("no-such-model", cache_dir=tmp_path)


def test_existing_folder_is_returned_as_is(cache: Path, tmp_path: Path) -> None:
    folder = resolve_model("tiny-llama", cache_dir=cache)
    assert resolve_model(str(folder), cache_dir=tmp_path) == folder
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path), cache_dir=tmp_path)


def test_byte_tokenizer_round_trips_and_has_a_chat_template(cache: Path) -> None:
    tok = load_tokenizer(resolve_model("tiny-llama", cache_dir=cache))
    text = "héllo, wörld\n"
    ids = tok(text).input_ids
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert len(tok) == 258 and tok.eos_token_id == 256 and tok.pad_token_id == 256
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "user: hi" in chat and chat.endswith("assistant: ")


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_llama_layout_family(model_type: str) -> None:
    assert model_family(SimpleNamespace(model_type=model_type)) == "llama"


def test_family_gpt2_and_unsupported() -> None:
    assert model_family(SimpleNamespace(model_type="gpt2")) == "gpt2"
    with pytest.raises(ValueError, match="bert.*supported"):
        model_family(SimpleNamespace(model_type="bert"))


@pytest.mark.slow
def test_default_smollm2_split_matches_whole_model() -> None:
    from fedpipe.split import build_device_stages, build_stage, plan_split

    folder = resolve_model("default")
    assert resolve_model("default") == folder  # cached
    tok = load_tokenizer(folder)
    ids = torch.tensor([tok("The capital of France is Paris. It is a big city.").input_ids])
    with torch.no_grad():
        reference = load_causal_lm(folder)(ids, labels=ids).loss
        plan = plan_split(load_config(folder), head_layers=2, tail_layers=2)
        head, tail = build_device_stages(folder, plan)
        assert tail is not None
        loss_sum, count = tail(build_stage(folder, plan, "middle")(head(ids)), ids)
    assert count == ids.shape[1] - 1
    torch.testing.assert_close(loss_sum / count, reference, rtol=1e-5, atol=1e-5)
    assert reference.item() < 6.0  # a trained model, not random weights


@pytest.mark.slow
def test_device_memory_report_for_smollm2() -> None:
    from fedpipe.split import device_memory_report, plan_split

    folder = resolve_model("default")
    report = device_memory_report(folder, plan_split(load_config(folder)))
    assert 0.1 < report["param_fraction"] < 0.5
    assert report["device_param_bytes"] < report["model_param_bytes"]
    assert 0 < report["device_rss_bytes"] < report["model_rss_bytes"]
    assert report["model_rss_bytes"] > 0.8 * report["model_param_bytes"]
