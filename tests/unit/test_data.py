"""fedpipe.data: loaders on real files, partition schemes, the held-out split, token blocks with a
real (byte-level, built here) fast tokenizer, and the resumable batch sampler."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from fedpipe.data import (
    BlockSampler,
    Document,
    default_corpus,
    describe,
    held_out_blocks,
    load_documents,
    partition,
    tokenize_blocks,
    train_eval_split,
)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with no merges: one token per UTF-8 byte, so counts are exact."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=8,  # shorter than the docs: packing must not warn or truncate
    )


def _docs(n: int, sources: int = 3) -> list[Document]:
    return [Document(text=f"doc {i}", source=f"s{i % sources}") for i in range(n)]


def _write_jsonl(path: Path, records: list[object]) -> None:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")


# ---- Document and loaders ----


def test_document_needs_exactly_one_of_text_or_messages() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        Document()
    with pytest.raises(ValueError, match="exactly one"):
        Document(text="a", messages=({"role": "user", "content": "b"},))
    doc = Document(messages=[{"role": "user", "content": "hey"}])  # type: ignore[arg-type]
    assert isinstance(doc.messages, tuple) and doc.num_chars == 3


def test_load_txt_groups_paragraphs_and_uses_stem(tmp_path: Path) -> None:
    para = "word " * 300  # 1500 chars; documents close once they pass 4000
    (tmp_path / "notes.txt").write_text("\n\n\n".join([para] * 7) + "\n", encoding="utf-8")
    docs = load_documents(tmp_path / "notes.txt")
    assert [d.text.count("word") for d in docs if d.text] == [900, 900, 300]
    assert {d.source for d in docs} == {"notes"}
    assert load_documents(tmp_path / "notes.txt", source="me")[0].source == "me"


def test_load_jsonl_text_chat_and_source(tmp_path: Path) -> None:
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    records = [
        {"body": "first", "source": "alice"},
        {"body": "second"},
        {"messages": chat},
        {"body": "   "},  # empty text: skipped
    ]
    _write_jsonl(tmp_path / "mix.jsonl", records)
    docs = load_documents(tmp_path / "mix.jsonl", text_field="body")
    assert [d.text for d in docs] == ["first", "second", None]
    assert [d.source for d in docs] == ["alice", "mix", "mix"]
    assert docs[2].messages == tuple(chat)


def test_load_gz_and_directory_in_sorted_order(tmp_path: Path) -> None:
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"text": "from gz"}) + "\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("from txt", encoding="utf-8")
    _write_jsonl(tmp_path / "a.jsonl", [{"text": "from jsonl"}])
    (tmp_path / "ignored.csv").write_text("x,y", encoding="utf-8")
    assert load_documents(tmp_path / "b.jsonl.gz") == [Document(text="from gz", source="b")]
    docs = load_documents(tmp_path)
    assert [(d.text, d.source) for d in docs] == [
        ("from jsonl", "a"),
        ("from gz", "b"),
        ("from txt", "c"),
    ]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"other": 1}', "exactly one of"),
        ('{"text": 5}', "must be a string"),
        ('{"messages": [{"role": "user"}]}', "messages\\[0\\]"),
        ('{"text": "a", "messages": []}', "exactly one of"),
    ],
)
def test_bad_record_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n' + line + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=f"bad.jsonl:3: .*{message}"):
        load_documents(path)


def test_load_errors_for_paths(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_documents(tmp_path / "missing.jsonl")
    (tmp_path / "x.csv").write_text("a", encoding="utf-8")
    with pytest.raises(ValueError, match="unsupported file type"):
        load_documents(tmp_path / "x.csv")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no .* files"):
        load_documents(tmp_path / "empty")


def test_default_corpus_is_ten_kjv_books() -> None:
    docs = default_corpus()
    sources = {d.source for d in docs}
    assert len(docs) == 362 and len(sources) == 10
    assert {"Genesis", "Psalms", "Revelation"} <= sources
    assert docs[0].text and docs[0].text.startswith("In the beginning God created")


# ---- partition, split, describe ----


@settings(max_examples=40, deadline=None)
@given(
    k=st.integers(1, 8),
    extra=st.integers(0, 52),
    scheme=st.sampled_from(["iid", "dirichlet"]),
    alpha=st.floats(0.01, 10.0),
    seed=st.integers(0, 2**16),
)
def test_partition_covers_every_doc_once(
    k: int, extra: int, scheme: str, alpha: float, seed: int
) -> None:
    docs = _docs(k + extra)  # at least one document per partition
    parts = partition(docs, k, scheme=scheme, alpha=alpha, seed=seed)  # type: ignore[arg-type]
    assert len(parts) == k and all(parts)
    assert sorted(d.text for p in parts for d in p) == sorted(d.text for d in docs)  # type: ignore[type-var]
    assert parts == partition(docs, k, scheme=scheme, alpha=alpha, seed=seed)  # type: ignore[arg-type]


@settings(max_examples=20, deadline=None)
@given(
    k=st.integers(2, 8),
    data=st.data(),
    scheme=st.sampled_from(["iid", "dirichlet"]),
    seed=st.integers(0, 2**16),
)
def test_fewer_docs_than_partitions_is_refused(
    k: int, data: st.DataObject, scheme: str, seed: int
) -> None:
    docs = _docs(data.draw(st.integers(1, k - 1)))
    with pytest.raises(ValueError, match="cannot fill"):
        partition(docs, k, scheme=scheme, seed=seed)  # type: ignore[arg-type]


def test_iid_sizes_balanced_and_seed_matters() -> None:
    docs = _docs(23)
    parts = partition(docs, 4, seed=1)
    assert sorted(len(p) for p in parts) == [5, 6, 6, 6]
    assert parts != partition(docs, 4, seed=2)


def test_by_source_purity_and_error() -> None:
    docs = _docs(30, sources=5)
    parts = partition(docs, 3, scheme="by-source", seed=3)
    owner = {d.source: i for i, p in enumerate(parts) for d in p}
    assert all(owner[d.source] == i for i, p in enumerate(parts) for d in p)
    assert sum(len(p) for p in parts) == 30 and all(parts)
    with pytest.raises(ValueError, match="5 sources for 6 partitions"):
        partition(docs, 6, scheme="by-source")


def test_dirichlet_small_alpha_is_skewed_and_non_empty() -> None:
    docs = _docs(400, sources=4)
    parts = partition(docs, 8, scheme="dirichlet", alpha=0.05, seed=0)
    assert all(parts)
    # with tiny alpha most sources land (almost) wholly in one partition
    assert min(len(describe([p])[0]["sources"]) for p in parts) == 1


def test_partition_rejects_bad_options() -> None:
    with pytest.raises(ValueError, match="unknown partition scheme"):
        partition(_docs(4), 2, scheme="random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="alpha must be > 0"):
        partition(_docs(4), 2, scheme="dirichlet", alpha=0)
    with pytest.raises(ValueError, match="num_partitions"):
        partition(_docs(4), 0)


def test_train_eval_split_deterministic_and_disjoint() -> None:
    docs = _docs(50)
    train, held_out = train_eval_split(docs, eval_fraction=0.2, seed=7)
    assert len(held_out) == 10 and len(train) == 40
    assert (train, held_out) == train_eval_split(docs, eval_fraction=0.2, seed=7)
    assert {d.text for d in train}.isdisjoint(d.text for d in held_out)
    assert held_out != train_eval_split(docs, eval_fraction=0.2, seed=8)[1]
    assert len(train_eval_split(docs[:3], eval_fraction=0.01)[1]) == 1
    with pytest.raises(ValueError, match="too few"):
        train_eval_split(docs[:1], eval_fraction=0.5)
    with pytest.raises(ValueError, match="eval_fraction"):
        train_eval_split(docs, eval_fraction=1.0)


def test_describe_counts() -> None:
    chat = Document(messages=({"role": "user", "content": "hey"},), source="b")
    rows = describe([[Document(text="abcd", source="a"), chat], []])
    assert rows == [
        {"partition": 0, "docs": 2, "chars": 7, "sources": {"a": 1, "b": 1}},
        {"partition": 1, "docs": 0, "chars": 0, "sources": {}},
    ]


# ---- token blocks ----


def test_tokenize_blocks_packs_with_eos(tokenizer: PreTrainedTokenizerFast) -> None:
    eos = tokenizer.eos_token_id
    docs = [Document(text="abc"), Document(text="de")]  # 3+1 + 2+1 = 7 tokens
    blocks = tokenize_blocks(docs, tokenizer, seq_len=3)
    assert blocks.dtype == torch.long and blocks.shape == (2, 3)
    a, b, c, d, e = (tokenizer.convert_tokens_to_ids(ch) for ch in "abcde")
    assert blocks.tolist() == [[a, b, c], [eos, d, e]]  # the final eos is the dropped remainder
    long_doc = [Document(text="x" * 100)]  # longer than model_max_length: packed, not truncated
    assert tokenize_blocks(long_doc, tokenizer, seq_len=10).shape == (10, 10)
    assert tokenize_blocks(long_doc, tokenizer, seq_len=10, max_blocks=4).shape == (4, 10)
    assert tokenize_blocks([Document(text="a")], tokenizer, seq_len=5).shape == (0, 5)


def test_held_out_blocks_spread_over_every_document(tokenizer: PreTrainedTokenizerFast) -> None:
    """The evaluation set stands for all held-out text, not its first documents (the bundled
    corpus's first held-out documents are 2-3 chapters of one book)."""
    letters = "abcdefgh"
    docs = [Document(text=ch * 39, source=ch) for ch in letters]  # 40 tokens each with eos
    blocks = held_out_blocks(docs, tokenizer, seq_len=10, n_blocks=8)  # 32 blocks in all
    assert blocks.shape == (8, 10)
    ids = {tokenizer.convert_tokens_to_ids(ch): ch for ch in letters}
    seen = {ids[t] for row in blocks.tolist() for t in row if t in ids}
    assert seen == set(letters)  # one block from each document's span
    first = tokenize_blocks(docs, tokenizer, seq_len=10, max_blocks=8)
    assert {ids[t] for row in first.tolist() for t in row if t in ids} == {"a", "b"}
    whole = tokenize_blocks(docs, tokenizer, seq_len=10)
    assert all(any(torch.equal(b, w) for w in whole) for b in blocks)  # real blocks, unchanged
    assert held_out_blocks(docs, tokenizer, seq_len=10, n_blocks=99).shape == (32, 10)
    with pytest.raises(ValueError, match="n_blocks"):
        held_out_blocks(docs, tokenizer, seq_len=10, n_blocks=-1)


def test_tokenize_blocks_chat_template_and_fallback(tokenizer: PreTrainedTokenizerFast) -> None:
    chat = Document(messages=({"role": "user", "content": "hi"},))
    plain = tokenize_blocks([chat], tokenizer, seq_len=1).flatten().tolist()
    assert tokenizer.decode(plain) == "user: hi<|endoftext|>"
    tokenizer.chat_template = CHAT_TEMPLATE
    try:
        templated = tokenize_blocks([chat], tokenizer, seq_len=1).flatten().tolist()
    finally:
        tokenizer.chat_template = None
    start, end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>"))
    assert templated[0] == start and end in templated  # special tokens, not their spelled-out bytes
    assert tokenizer.decode(templated) == "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>"


def test_tokenize_blocks_default_corpus_slice(tokenizer: PreTrainedTokenizerFast) -> None:
    docs = default_corpus()[:3]
    blocks = tokenize_blocks(docs, tokenizer, seq_len=64)
    total = sum(len(d.text.encode()) + 1 for d in docs if d.text)  # ascii: one token per char
    assert blocks.shape == (total // 64, 64)


# ---- BlockSampler ----


def test_block_sampler_deterministic_and_epochwise() -> None:
    blocks = torch.arange(10 * 4).view(10, 4)
    sampler = BlockSampler(blocks, batch_size=5, seed=3)
    assert sampler.num_examples == 10
    b0 = sampler.batch(0)
    assert b0["input_ids"].shape == (5, 4) and torch.equal(b0["input_ids"], b0["labels"])
    # one epoch (two batches) visits every block exactly once
    seen = torch.cat([sampler.batch(0)["input_ids"], sampler.batch(1)["input_ids"]])
    assert sorted(seen[:, 0].tolist()) == list(range(0, 40, 4))
    resumed = BlockSampler(blocks, batch_size=5, seed=3)  # a restart draws the same batch 7
    assert torch.equal(resumed.batch(7)["input_ids"], sampler.batch(7)["input_ids"])
    assert not torch.equal(
        BlockSampler(blocks, batch_size=5, seed=4).batch(0)["input_ids"], b0["input_ids"]
    )
    assert sampler.epoch_of(2) == 1
    assert not torch.equal(sampler.batch(2)["input_ids"], b0["input_ids"])


def test_block_sampler_batch_larger_than_data_and_errors() -> None:
    sampler = BlockSampler(torch.arange(6).view(3, 2), batch_size=7, seed=0)
    assert sampler.batch(0)["input_ids"].shape == (7, 2)
    assert sorted(sampler.indices(0)[:3].tolist()) == [0, 1, 2]
    with pytest.raises(ValueError, match="non-empty"):
        BlockSampler(torch.zeros(0, 4, dtype=torch.long), batch_size=2, seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        BlockSampler(torch.zeros(2, 4, dtype=torch.long), batch_size=0, seed=0)
