"""fedpipe.models: named configs, caching, tokenizer, family detection; SmolLM2 in the slow tier."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from fedpipe.errors import ModelFileError
from fedpipe.models import (
    WeightFiles,
    load_causal_lm,
    load_config,
    load_tokenizer,
    model_family,
    model_fingerprint,
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


# -- models users bring: sharded folders, broken files --------------------------------------------
@pytest.fixture(scope="module")
def sharded(cache: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """tiny-llama, and the same weights saved in shards of at most 40 kB."""
    folder = resolve_model("tiny-llama", cache_dir=cache)
    out = tmp_path_factory.mktemp("sharded") / "tiny-llama-sharded"
    load_causal_lm(folder).save_pretrained(out, max_shard_size="40KB")
    return folder, out


def test_sharded_folder_splits_like_the_single_file(sharded: tuple[Path, Path]) -> None:
    from fedpipe.split import build_device_stages, build_stage, split_layout

    folder, out = sharded
    assert (out / "model.safetensors.index.json").is_file()
    assert not (out / "model.safetensors").exists()
    assert len(list(out.glob("model-*.safetensors"))) > 3
    ids = torch.randint(0, 258, (2, 12), generator=torch.Generator().manual_seed(5))
    results = []
    for source in (folder, out):
        plan = split_layout(load_config(source), head_layers=1, tail_layers=1)
        head, tail = build_device_stages(source, plan)
        middle = build_stage(source, plan, "middle")
        assert tail is not None
        results.append((head, middle, tail, tail(middle(head(ids)), ids)[0]))
    for single, split in zip(results[0][:3], results[1][:3], strict=True):
        expected = single.state_dict()
        assert all(torch.equal(v, expected[k]) for k, v in split.state_dict().items())
    assert torch.equal(results[0][3], results[1][3])
    assert model_fingerprint(out) == model_fingerprint(folder)


def test_each_stage_opens_only_the_shards_of_its_own_layers(
    sharded: tuple[Path, Path], tmp_path: Path
) -> None:
    import shutil

    from fedpipe.split import build_stage, split_layout, stage_file_keys

    _, out = sharded
    plan = split_layout(load_config(out), head_layers=1, tail_layers=1)
    files = WeightFiles(out)
    head_files = files.files_for(stage_file_keys(out, plan, "head"))
    middle_files = files.files_for(stage_file_keys(out, plan, "middle"))
    assert len(head_files) < len(files.files_for(files.keys()))
    device_only = tmp_path / "head-shards-only"
    shutil.copytree(out, device_only)
    for shard in device_only.glob("model-*.safetensors"):
        if shard.name not in {p.name for p in head_files}:
            shard.unlink()
    head = build_stage(device_only, plan, "head")  # reads nothing from the removed shards
    assert sorted(head.blocks) == ["0"]
    missing = {p.name for p in middle_files} - {p.name for p in head_files}
    with pytest.raises(ModelFileError, match=f"{sorted(missing)[0]}: missing.*shard"):
        build_stage(device_only, plan, "middle")


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text
    return text


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors_gives_one_line_naming_the_file(
    cache: Path, tmp_path: Path, damage: str
) -> None:
    import shutil

    from fedpipe.split import build_stage, split_layout

    folder = tmp_path / "broken"
    shutil.copytree(resolve_model("tiny-llama", cache_dir=cache), folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"\x13\x37" * 64 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(ModelFileError) as info:
        build_stage(folder, split_layout(load_config(folder)), "head")
    text = _one_line(info.value)
    assert text.startswith(f"{weights}: ") and "truncated or corrupt" in text


def test_cli_prints_a_broken_model_in_one_line(
    cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    from fedpipe.cli.main import main

    folder = tmp_path / "broken"
    shutil.copytree(resolve_model("tiny-llama", cache_dir=cache), folder)
    (folder / "model.safetensors").write_bytes(b"not safetensors at all")
    assert main(["bench", "memory", "--model", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert f"{folder / 'model.safetensors'}: not a readable safetensors file" in err


def _tiny_gguf(path: Path) -> Path:
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.ones((258, 64), dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.weight", np.ones((64, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_gguf_gives_one_line_naming_the_file(tmp_path: Path, keep: float) -> None:
    whole = _tiny_gguf(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: int(len(whole) * keep)])
    with pytest.raises(ModelFileError) as info:
        resolve_model(str(cut), cache_dir=tmp_path / "cache")
    assert _one_line(info.value).startswith(f"{cut}: truncated or corrupt GGUF")
    assert not list((tmp_path / "cache" / "models").iterdir())  # nothing half-written is cached


def test_a_file_that_is_not_gguf_says_so(tmp_path: Path) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 a zip, not a model")
    with pytest.raises(ModelFileError, match=r"model.gguf: not a GGUF file \(it starts with b'PK"):
        resolve_model(str(fake), cache_dir=tmp_path / "cache")


def test_a_folder_without_a_tokenizer_says_so_in_one_line(cache: Path, tmp_path: Path) -> None:
    import shutil

    source = resolve_model("tiny-llama", cache_dir=cache)
    folder = tmp_path / "weights-only"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(source / name, folder / name)
    with pytest.raises(ModelFileError) as info:
        load_tokenizer(folder)
    assert _one_line(info.value).startswith(f"{folder}: no usable tokenizer")
