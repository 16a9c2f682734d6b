"""Instruction data: the formats TRL users know, and one example per right-padded row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fedpipe.data import (
    IGNORE_INDEX,
    BlockSampler,
    Document,
    ExampleCounts,
    encode_example,
    example_rows,
    held_out_rows,
    load_documents,
)
from fedpipe.models.tokenizer import build_byte_tokenizer

USER = {"role": "user", "content": "Name a colour."}
ANSWER = {"role": "assistant", "content": "Blue."}


def _write(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_every_trl_format_loads(tmp_path: Path) -> None:
    system = {"role": "system", "content": "Be brief."}
    records = [
        {"text": "plain"},
        {"messages": [system, USER, ANSWER, USER, ANSWER], "source": "chats"},
        {"prompt": "2+2=", "completion": "4"},
        {"prompt": [USER], "completion": [ANSWER]},
    ]
    docs = load_documents(_write(tmp_path / "mixed.jsonl", records))
    assert docs == [
        Document(text="plain", source="mixed"),
        Document(messages=(system, USER, ANSWER, USER, ANSWER), source="chats"),
        Document(prompt="2+2=", completion="4", source="mixed"),
        Document(messages=(USER, ANSWER), prompt_turns=1, source="mixed"),
    ]
    assert [d.is_example for d in docs] == [False, True, True, True]


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"prompt": "a"}, "exactly one of"),
        ({"completion": "a"}, "exactly one of"),
        ({"prompt": "a", "completion": [ANSWER]}, "must both be strings or both lists"),
        ({"prompt": [USER], "completion": [{"role": "assistant"}]}, "completion\\[0\\]"),
        ({"messages": [USER], "prompt": "a", "completion": "b"}, "exactly one of"),
        ({"question": "a", "answer": "b"}, "keys found: \\['answer', 'question'\\]"),
    ],
)
def test_a_record_fitting_no_format_names_file_line_and_what_was_expected(
    tmp_path: Path, record: dict[str, object], message: str
) -> None:
    path = _write(tmp_path / "bad.jsonl", [{"text": "ok"}, record])
    with pytest.raises(ValueError, match=f"bad.jsonl:2: .*{message}"):
        load_documents(path)


def _chat(answer: str) -> Document:
    return Document(messages=(USER, {"role": "assistant", "content": answer}))


def test_each_example_is_its_own_right_padded_row() -> None:
    tok = build_byte_tokenizer()
    docs = [_chat("Blue."), _chat("Red, or green."), Document(prompt="1+1=", completion="2")]
    rows = example_rows(docs, tok, seq_len=64)
    assert rows.input_ids.shape == rows.labels.shape == (3, 64)
    assert rows.counts == ExampleCounts(rows=3)
    for r, doc in enumerate(docs):
        ids, labels = encode_example(doc, tok, loss_on="answers")
        assert rows.input_ids[r, : len(ids)].tolist() == ids  # from the row's start, whole
        assert rows.labels[r, : len(ids)].tolist() == labels
        assert set(rows.input_ids[r, len(ids) :].tolist()) == {tok.pad_token_id}
        assert set(rows.labels[r, len(ids) :].tolist()) == {IGNORE_INDEX}


def test_overlong_examples_keep_the_answer_or_are_dropped() -> None:
    tok = build_byte_tokenizer()
    long_prompt = Document(messages=({"role": "user", "content": "x" * 100}, ANSWER))
    ids, labels = encode_example(long_prompt, tok, loss_on="answers")
    rows = example_rows([long_prompt, _chat("Blue.")], tok, seq_len=40)
    assert rows.counts == ExampleCounts(rows=2, truncated=1)
    end = max(i for i, t in enumerate(labels) if t != IGNORE_INDEX) + 1  # the answer's end
    assert end < len(ids)  # the template's newline after the turn is all that goes from the end
    assert rows.input_ids[0].tolist() == ids[end - 40 : end]  # the prompt lost its start
    assert rows.labels[0].tolist() == labels[end - 40 : end]
    assert [t for t in labels if t != IGNORE_INDEX] == [
        t for t in rows.labels[0].tolist() if t != IGNORE_INDEX
    ]
    dropped = example_rows([long_prompt, _chat("Blue.")], tok, seq_len=40, overlong="drop")
    assert dropped.counts == ExampleCounts(rows=1, dropped_overlong=1)
    assert torch.equal(dropped.input_ids[0], rows.input_ids[1])


def test_an_answer_longer_than_the_row_is_cut_from_the_start() -> None:
    tok = build_byte_tokenizer()
    doc = _chat("y" * 100)
    ids, labels = encode_example(doc, tok, loss_on="answers")
    rows = example_rows([doc], tok, seq_len=40)
    assert rows.input_ids[0].tolist() == ids[:40] and rows.labels[0].tolist() == labels[:40]
    assert (rows.labels[0] != IGNORE_INDEX).sum() > 0


def test_a_chat_without_an_answer_is_dropped_and_counted() -> None:
    tok = build_byte_tokenizer()
    rows = example_rows([Document(messages=(USER,)), _chat("Blue.")], tok, seq_len=64)
    assert rows.counts == ExampleCounts(rows=1, dropped_unanswered=1)
    assert rows.counts.metrics() == {
        "examples-rows": 1,
        "examples-truncated": 0,
        "examples-dropped-overlong": 0,
        "examples-dropped-unanswered": 1,
    }


def test_loss_on_all_counts_the_prompt_but_never_the_pads() -> None:
    tok = build_byte_tokenizer()
    rows = example_rows([_chat("Blue.")], tok, seq_len=64, loss_on="all")
    n = len(encode_example(_chat("Blue."), tok, loss_on="all")[0])
    assert torch.equal(rows.labels[0, :n], rows.input_ids[0, :n])
    assert set(rows.labels[0, n:].tolist()) == {IGNORE_INDEX}


def test_held_out_rows_spread_over_the_examples() -> None:
    tok = build_byte_tokenizer()
    docs = [_chat("a" * (i + 1)) for i in range(10)]
    whole = example_rows(docs, tok, seq_len=64)
    picked = held_out_rows(docs, tok, 64, 2)
    assert torch.equal(picked.input_ids, whole.input_ids[[2, 7]])
    assert torch.equal(picked.labels, whole.labels[[2, 7]])
    assert held_out_rows(docs, tok, 64, 20).input_ids.shape[0] == 10


def test_sampler_draws_the_rows_own_labels_and_blocks_stay_their_labels() -> None:
    tok = build_byte_tokenizer()
    rows = example_rows([_chat("a" * (i + 1)) for i in range(6)], tok, seq_len=32)
    sampler = BlockSampler(rows.input_ids, 4, seed=3, labels=rows.labels)
    picks = sampler.indices(1)
    batch = sampler.batch(1)
    assert torch.equal(batch["input_ids"], rows.input_ids[picks])
    assert torch.equal(batch["labels"], rows.labels[picks])
    plain = BlockSampler(rows.input_ids, 4, seed=3).batch(1)
    assert torch.equal(plain["labels"], plain["input_ids"])
    with pytest.raises(ValueError, match="do not fit"):
        BlockSampler(rows.input_ids, 4, seed=3, labels=rows.labels[:, :8])


def test_packed_rows_hold_the_padded_rows_examples_in_fewer_rows() -> None:
    """data.packing: the same examples, each whole with its labels (its first one -100), in
    fewer rows; the segments come with the rows through held-out picks and the sampler."""
    tok = build_byte_tokenizer()
    docs = [Document(prompt="p" * (1 + i % 4), completion="c" * (2 + i % 3)) for i in range(9)]
    padded = example_rows(docs, tok, 64)
    packed = example_rows(docs, tok, 64, packing=True)
    assert packed.segments is not None and padded.segments is None
    assert packed.counts.rows == packed.input_ids.shape[0] < padded.counts.rows == 9
    real = packed.input_ids != tok.pad_token_id
    assert int(real.sum()) == int((padded.input_ids != tok.pad_token_id).sum())
    counted = int((packed.labels != IGNORE_INDEX).sum())
    assert counted == int((padded.labels[:, 1:] != IGNORE_INDEX).sum())  # what the shift counts
    assert example_rows(docs, tok, 64, packing=True, max_rows=1).input_ids.shape[0] == 1
    held = held_out_rows(docs, tok, 64, 1, packing=True)
    assert held.segments is not None and held.segments.shape == held.input_ids.shape
    sampler = BlockSampler(
        packed.input_ids, 2, seed=0, labels=packed.labels, segments=packed.segments
    )
    batch = sampler.batch(0)
    picks = torch.from_numpy(sampler.indices(0))
    assert torch.equal(batch["segments"], packed.segments[picks])
    assert torch.equal(batch["input_ids"], packed.input_ids[picks])
