"""`fedpipe export` and `fedpipe generate` in-process: a run's checkpoint as a PEFT adapter that
peft loads over the base, and as a merged model that transformers loads alone, each giving the
logits of fedpipe's split model for that checkpoint (every family; exact and stack aggregation's
base deltas folded in); the refusals, one line each; generation equal to transformers' own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from harness.cli import error_line
from harness.close import assert_close_to_scale
from harness.export import FAMILY_CONFIGS, split_logits, split_loss, tiny_model, write_run
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from fedpipe.fl.device_work import RunSettings
from fedpipe.fl.server_app import _checkpoint_state
from fedpipe.runs.export import export_run
from fedpipe.runs.folder import FINGERPRINT_KEY
from fedpipe.runs.generate import Sampling, generate, load_model

torch.set_num_threads(1)
ATOL = 1e-5
IDS = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {family: tiny_model(root / family, family) for family in FAMILY_CONFIGS}


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _peft_loaded(base: Path, adapter: Path) -> torch.nn.Module:
    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_peft_adapter_gives_the_split_models_logits(
    family: str, models: dict[str, Path], tmp_path: Path
) -> None:
    run = write_run(tmp_path / "runs", "r", models[family])
    export_run(run.path, tmp_path / "adapter", format="peft")

    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(models[family].resolve())
    assert (config["r"], config["lora_alpha"], config["task_type"]) == (4, 8, "CAUSAL_LM")
    keys = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    body = "transformer.h" if family == "gpt2" else "model.layers"
    assert {int(k.split(".")[4]) for k in keys} == {0, 1, 2, 3}  # head, middle, tail blocks
    assert all(k.startswith(f"base_model.model.{body}.") for k in keys)

    expected = split_logits(run, 2, IDS)
    base = _logits(AutoModelForCausalLM.from_pretrained(models[family]).eval())
    assert (expected - base).abs().max() > 1e-3  # the adapters change the model
    assert_close_to_scale(
        _logits(_peft_loaded(models[family], tmp_path / "adapter")), expected, rel=0, atol=ATOL
    )


@pytest.mark.parametrize(
    ("family", "aggregation"),
    [("llama", "separate"), ("llama", "exact"), ("qwen3", "stack"), ("gpt2", "exact")],
)
def test_merged_model_gives_the_split_models_logits(
    family: str, aggregation: str, models: dict[str, Path], tmp_path: Path
) -> None:
    run = write_run(
        tmp_path / "runs", "r", models[family], **{"federated.aggregation": aggregation}
    )
    assert any(k.endswith(".base_delta") for k in run.load_checkpoint(2).device) == (
        aggregation != "separate"
    )
    export_run(run.path, tmp_path / "merged", format="merged")

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any("lora" in name for name, _ in merged.named_parameters())
    assert_close_to_scale(_logits(merged), split_logits(run, 2, IDS), atol=ATOL, rel=0)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "merged")
    assert "<|assistant|>" in (tokenizer.chat_template or "")


def test_a_run_of_several_cuts_exports_the_evaluators_split(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """With model.cuts the device side holds block 1 too (cut 2+1); the evaluator's cut 1+1
    takes block 1 from the server."""
    run = write_run(tmp_path / "runs", "r", models["llama"], **{"model.cuts": "2+1"})
    device, server = run.load_checkpoint(2).device, run.load_checkpoint(2).server
    key = "layers.1.self_attn.q_proj.lora_B.weight"
    assert key in device and key in server and not torch.equal(device[key], server[key])
    export_run(run.path, tmp_path / "adapter", format="peft")
    logits = _logits(_peft_loaded(models["llama"], tmp_path / "adapter"))
    assert_close_to_scale(logits, split_logits(run, 2, IDS), atol=ATOL, rel=0)


def test_a_two_part_split_exports_the_head_and_the_servers_blocks(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """model.split = "two": the device holds the head only, the server every block after it."""
    settings = {"model.split": "two", "model.tail_layers": 0, "federated.aggregation": "exact"}
    run = write_run(tmp_path / "runs", "r", models["llama"], **settings)
    export_run(run.path, tmp_path / "merged", format="merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        loss = float(merged(input_ids=IDS, labels=IDS).loss)
    assert loss == pytest.approx(split_loss(run, 2, IDS), abs=1e-5)
    base = AutoModelForCausalLM.from_pretrained(models["llama"]).eval()
    with torch.no_grad():
        assert abs(float(base(input_ids=IDS, labels=IDS).loss) - loss) > 1e-3


def test_round_defaults_to_the_last_checkpoint_of_a_resumed_run(
    models: dict[str, Path], tmp_path: Path
) -> None:
    write_run(tmp_path / "runs", "r", models["llama"], round_=1)
    run = write_run(tmp_path / "runs", "r", models["llama"], round_=3)  # resumed: one more
    assert export_run(run.path, tmp_path / "last", format="peft").round == 3
    assert export_run(run.path, tmp_path / "first", format="peft", round_=1).round == 1
    for out, round_ in (("last", 3), ("first", 1)):
        logits = _logits(_peft_loaded(models["llama"], tmp_path / out))
        assert_close_to_scale(logits, split_logits(run, round_, IDS), atol=ATOL, rel=0)


def test_peft_format_refuses_a_run_that_changed_the_base(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_run(tmp_path / "runs", "r", models["llama"], **{"federated.aggregation": "stack"})
    argv = ["export", str(run.path), "--out", str(tmp_path / "a"), "--format", "peft"]
    line = error_line(capsys, argv)
    assert "federated.aggregation = stack" in line and "--format merged" in line
    assert not (tmp_path / "a").exists()


def test_export_refusals_are_one_line(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_run(tmp_path / "runs", "r", models["llama"])
    out = ["--out", str(tmp_path / "out")]
    assert "no checkpoint for round 7" in error_line(
        capsys, ["export", str(run.path), "--round", "7", *out]
    )
    assert "is not a fedpipe run folder" in error_line(capsys, ["export", str(tmp_path), *out])
    assert "does not exist" in error_line(capsys, ["export", str(tmp_path / "nope"), *out])
    other = ["export", str(run.path), "--model", str(models["qwen2"]), *out]
    line = error_line(capsys, other)
    assert "is not the model run" in line and "fingerprint" in line
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    line = error_line(capsys, ["export", str(run.path), "--out", str(tmp_path / "full")])
    assert "not an empty folder" in line
    (run.path / "checkpoints" / "round-0002" / "server.safetensors").write_bytes(b"torn")
    assert "is corrupt" in error_line(capsys, ["export", str(run.path), *out])
    assert not (tmp_path / "out").exists()


def test_checkpoint_state_records_the_base_models_fingerprint() -> None:
    run = RunSettings(run_id="r")
    state = _checkpoint_state(2, run, None, fingerprint="ab" * 32)
    assert state == {"round": 2, "run_id": "r", FINGERPRINT_KEY: "ab" * 32}


def test_generate_gives_the_ids_of_transformers_generate(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_run(tmp_path / "runs", "r", models["llama"])
    export_run(run.path, tmp_path / "adapter", format="peft")
    reference = _peft_loaded(models["llama"], tmp_path / "adapter")
    tokenizer = AutoTokenizer.from_pretrained(models["llama"])
    prompt = tokenizer("The sea", return_tensors="pt")
    for sampling in (Sampling(max_new_tokens=8), Sampling(8, temperature=0.9, top_p=0.8, seed=3)):
        torch.manual_seed(sampling.seed)
        expected = reference.generate(**prompt, **sampling.options(), pad_token_id=256)
        for source in ({"adapter": tmp_path / "adapter"}, {"run": run.path}):
            model, tok = load_model(None, **source)
            capsys.readouterr()
            ids = generate(model, tok, "The sea", sampling=sampling)
            assert torch.equal(ids, expected), (sampling, source)
            new = tok.decode(ids[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
            assert capsys.readouterr().out.strip() == new.strip()


def test_generate_chat_answers_one_user_turn(
    models: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model, tokenizer = load_model(str(models["llama"]))
    ids = generate(model, tokenizer, "hi", chat=True, sampling=Sampling(max_new_tokens=2))
    assert tokenizer.decode(ids[0, :-2]) == "<|user|>hi\n<|assistant|>"
    capsys.readouterr()
    line = error_line(capsys, ["generate", "--model", str(models["llama"]), "--top-p", "0", "x"])
    assert "--top-p must be in (0, 1]" in line


def test_generate_names_the_fix_when_an_adapters_base_is_not_here(tmp_path: Path) -> None:
    """An adapter made elsewhere names a base path this machine lacks: one error, --model."""
    config = {"base_model_name_or_path": str(tmp_path / "gone"), "peft_type": "LORA"}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(FileNotFoundError, match=r"base_model_name_or_path .* pass --model BASE"):
        load_model(None, adapter=tmp_path)
