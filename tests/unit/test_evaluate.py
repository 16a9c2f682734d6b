"""`fedpipe eval` in-process: the answer loss is the masked cross-entropy of the merged model
(worked by hand on byte tokens), exact match and containment are counted from transformers'
own greedy answer, the base and the run differ once adapters move, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from harness.export import tiny_model, write_run

from fedpipe.data.documents import Document
from fedpipe.models import load_causal_lm, load_tokenizer
from fedpipe.runs.evaluate import answer_loss, evaluate_run, format_table, score_model
from fedpipe.runs.export import load_run_model, merged_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("eval")
    model = tiny_model(root / "model", "llama")
    return write_run(root / "runs", "r", model, **{"federated.aggregation": "exact"}).path


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _greedy(model: torch.nn.Module, prompt: str, n: int) -> str:
    ids = torch.tensor([list(prompt.encode())])  # the byte tokenizer: one token per byte
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=n, do_sample=False, pad_token_id=256)
    return bytes(t for t in out[0, ids.shape[1] :].tolist() if t < 256).decode(errors="replace")


def test_answer_loss_is_the_hand_masked_cross_entropy_of_the_merged_model(run: Path) -> None:
    merged = merged_model(load_run_model(run))
    tokenizer = load_tokenizer(load_run_model(run).folder)
    docs = [Document(prompt="ab", completion="cd"), Document(prompt="x", completion="yz!")]
    loss, tokens, rows = answer_loss(merged, tokenizer, docs, seq_len=16)

    terms = []
    for prompt, answer in (("ab", "cd"), ("x", "yz!")):
        ids = [*prompt.encode(), *answer.encode(), 256]  # bytes, then the eos (it counts)
        with torch.no_grad():
            logits = merged(input_ids=torch.tensor([ids])).logits[0]
        for pos in range(len(prompt), len(ids)):  # each answer token, predicted from before it
            terms.append(F.cross_entropy(logits[pos - 1], torch.tensor(ids[pos])))
    assert (tokens, rows) == (len(terms), 2) == (7, 2)
    assert loss == pytest.approx(float(torch.stack(terms).mean()), abs=1e-5)


def test_exact_match_and_contains_count_transformers_greedy_answer(run: Path) -> None:
    merged = merged_model(load_run_model(run))
    tokenizer = load_tokenizer(load_run_model(run).folder)
    said = _greedy(merged, "The sea", 6)
    assert len(said.strip()) >= 2, said
    inner = said.strip()[1:]  # contained, not equal
    docs = [
        Document(prompt="The sea", completion=f" {said} "),  # equal once trimmed
        Document(prompt="The sea", completion=inner),
        Document(prompt="The sea", completion="\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9"),
        Document(text="plain text: scored in the loss, not generated"),
    ]
    scores = score_model(merged, tokenizer, docs, seq_len=32, max_new_tokens=6)
    assert [a.generated for a in scores.answers] == [said] * 3
    assert (scores.answered, scores.examples, scores.loss_rows) == (3, 4, 4)
    assert scores.exact_match == pytest.approx(1 / 3)
    assert scores.contains == pytest.approx(2 / 3)


def test_chat_prompts_are_rendered_by_the_template_up_to_the_last_answer(run: Path) -> None:
    base = load_causal_lm(load_run_model(run).folder)
    tokenizer = load_tokenizer(load_run_model(run).folder)
    chat = (
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "and?"},
        {"role": "assistant", "content": "so"},
    )
    said = _greedy(base, "<|user|>hi\n<|assistant|>yo\n<|user|>and?\n<|assistant|>", 5)
    docs = [Document(messages=chat), Document(messages=chat[:2], prompt_turns=1)]
    scores = score_model(base, tokenizer, docs, seq_len=64, max_new_tokens=5)
    assert [a.reference for a in scores.answers] == ["so", "yo"]
    assert scores.answers[0].generated == said


def test_the_run_and_its_base_differ_and_the_record_is_written(run: Path, tmp_path: Path) -> None:
    data = _jsonl(
        tmp_path / "test.jsonl",
        [
            {"prompt": "The sea", "completion": "x"},
            {"messages": [{"role": "user", "content": "a"}]},
        ],
    )
    record = evaluate_run(run, data, max_new_tokens=4, command="fedpipe eval ...")
    base, tuned = record["base"], record["finetuned"]
    assert base["answer_loss"] != pytest.approx(tuned["answer_loss"], abs=1e-4)
    assert (base["examples"], base["loss_rows"], base["answered"]) == (2, 1, 1)  # no answer: 1
    assert json.loads((run / "eval.json").read_text()) == record
    assert record["round"] == 2 and record["command"] == "fedpipe eval ..."
    evaluate_run(run, data, round_=2, max_new_tokens=4)
    assert (run / "eval-round-2.json").is_file()
    table = format_table(record).splitlines()
    assert table[0].split() == ["base", "round", "2"] and table[1].startswith("answer_loss")


@pytest.mark.parametrize(
    ("records", "says"),
    [
        (None, "no such file"),
        ([{"question": "a"}], "test.jsonl:1: a record needs exactly one of"),
    ],
)
def test_bad_data_is_refused_in_one_line(
    run: Path, tmp_path: Path, records: list[dict] | None, says: str
) -> None:
    data = tmp_path / "test.jsonl"
    if records is not None:
        _jsonl(data, records)
    with pytest.raises((ValueError, FileNotFoundError), match=says):
        evaluate_run(run, data, write=False)
