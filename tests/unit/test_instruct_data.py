"""The verse-to-book instruction set: deterministic, held-out verses never trained on, one-word
answers among the corpus's books, balanced, records the data loader takes, and the files the
example ships are the builder's output."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from fedpipe.config import load_config
from fedpipe.data import load_documents
from fedpipe.data.documents import default_corpus
from fedpipe.data.instruct import QUESTION, verse_questions, write_verse_questions
from fedpipe.data.masks import prompt_and_answer

ROOT = Path(__file__).resolve().parents[2]


def test_the_set_is_deterministic_balanced_and_held_out_verses_are_unseen() -> None:
    train, test = verse_questions(train_per_book=12, test_per_book=3, seed=1)
    assert (train, test) == verse_questions(train_per_book=12, test_per_book=3, seed=1)
    assert verse_questions(train_per_book=12, test_per_book=3, seed=2)[1] != test
    books = {doc.source for doc in default_corpus()}
    assert Counter(r["source"] for r in train) == dict.fromkeys(books, 12)
    assert Counter(r["source"] for r in test) == dict.fromkeys(books, 3)
    prompts = [r["prompt"][0]["content"] for r in train]
    assert not {r["prompt"][0]["content"] for r in test} & set(prompts)
    assert len(set(prompts)) == len(prompts)
    for r in train + test:
        (answer,) = r["completion"]
        assert answer == {"role": "assistant", "content": r["source"]}
        assert r["source"] in books and len(r["source"].split()) == 1
        assert r["prompt"][0]["content"].startswith(QUESTION)


def test_the_records_load_as_chat_examples_with_the_book_as_reference(tmp_path: Path) -> None:
    train_path, test_path = write_verse_questions(tmp_path, train_per_book=2, test_per_book=1)
    docs = load_documents(test_path)
    assert len(docs) == 10 and len(load_documents(train_path)) == 20
    for doc, record in zip(docs, map(json.loads, test_path.read_text().splitlines()), strict=True):
        assert doc.prompt_turns == 1 and doc.source == record["source"]
        _, reference = prompt_and_answer(doc, tokenizer=None) or ("", "")
        assert reference == record["source"]


def test_too_few_verses_is_refused() -> None:
    with pytest.raises(ValueError, match="books with fewer than"):
        verse_questions(train_per_book=60, test_per_book=5)  # Ruth has about 50


def test_the_example_ships_the_builders_output_and_trains_on_it(tmp_path: Path) -> None:
    write_verse_questions(tmp_path)
    for name in ("train.jsonl", "test.jsonl"):
        assert (ROOT / "examples" / "instruct" / name).read_text() == (tmp_path / name).read_text()
    cfg = load_config(ROOT / "examples" / "instruct.toml")
    assert cfg.federated.data == "examples/instruct/train.jsonl"
    assert (cfg.model.name, cfg.data.loss_on, cfg.federated.num_devices) == (
        "default",
        "answers",
        4,
    )
    assert len(set(cfg.federated.profiles)) == 4
