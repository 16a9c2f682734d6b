"""The bundled LLM (SmolLM2, `model.name = default`): the split equals the whole model, and the
device's memory report."""

from __future__ import annotations

import torch
from harness.close import assert_close_to_scale

from fedpipe.models import load_causal_lm, load_config, load_tokenizer, resolve_model


def test_default_smollm2_split_matches_whole_model() -> None:
    from fedpipe.split import build_device_stages, build_stage, split_layout

    folder = resolve_model("default")
    assert resolve_model("default") == folder  # cached
    tok = load_tokenizer(folder)
    ids = torch.tensor([tok("The capital of France is Paris. It is a big city.").input_ids])
    with torch.no_grad():
        reference = load_causal_lm(folder)(ids, labels=ids).loss
        plan = split_layout(load_config(folder), head_layers=2, tail_layers=2)
        head, tail = build_device_stages(folder, plan)
        assert tail is not None
        loss_sum, count = tail(build_stage(folder, plan, "middle")(head(ids)), ids)
    assert count == ids.shape[1] - 1
    assert_close_to_scale(loss_sum / count, reference, rel=1e-5, atol=1e-5)
    assert reference.item() < 6.0  # a trained model, not random weights


def test_device_memory_report_for_smollm2() -> None:
    from fedpipe.split import device_memory_report, split_layout

    folder = resolve_model("default")
    report = device_memory_report(folder, split_layout(load_config(folder)))
    assert 0.1 < report["param_fraction"] < 0.5
    assert report["device_param_bytes"] < report["model_param_bytes"]
    assert 0 < report["device_rss_bytes"] < report["model_rss_bytes"]
    assert report["model_rss_bytes"] > 0.8 * report["model_param_bytes"]


def test_answers_only_labels_on_smollm2s_own_template() -> None:
    """The bundled tokenizer's ChatML template (a default system turn, no {% generation %}
    markers): labels count each answer and its <|im_end|>, against a mask built by hand."""
    from fedpipe.data import IGNORE_INDEX, Document, encode_example

    tok = load_tokenizer(resolve_model("default"))
    chat = (
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome, since 1871."},
    )
    system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    pieces = [
        (f"<|im_start|>system\n{system}<|im_end|>\n", False),
        ("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n", False),
        ("<|im_start|>assistant\n", False),
        ("Paris.<|im_end|>", True),
        ("\n<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n", False),
        ("Rome, since 1871.<|im_end|>", True),
        ("\n", False),
    ]
    assert "".join(p for p, _ in pieces) == tok.apply_chat_template(list(chat), tokenize=False)
    ids: list[int] = []
    labels: list[int] = []
    for text, counts in pieces:
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if counts else [IGNORE_INDEX] * len(piece)
    whole = "".join(p for p, _ in pieces)
    assert tok(whole, add_special_tokens=False)["input_ids"] == ids  # pieces cut at token edges
    assert encode_example(Document(messages=chat), tok, loss_on="answers") == (ids, labels)
