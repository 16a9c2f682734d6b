"""`fedpipe bench packing`'s figures: the same tokens and loss tokens both ways, in fewer rows."""

from __future__ import annotations

from fedpipe_bench.packing import packing_figures

from fedpipe.data import Document
from fedpipe.models.tokenizer import build_byte_tokenizer


def test_packed_rows_hold_the_same_tokens_with_a_smaller_pad_share() -> None:
    tok = build_byte_tokenizer()
    docs = [Document(prompt="q" * (3 + i % 5), completion="a" * (2 + i % 4)) for i in range(12)]
    figures = packing_figures(docs, tok, 64, loss_on="answers", overlong="truncate")
    padded, packed = figures["padded"], figures["packed"]
    assert padded["rows"] == 12 and packed["rows"] < padded["rows"]
    assert packed["tokens"] == padded["tokens"] > 0
    assert packed["loss_tokens"] == padded["loss_tokens"] > 0
    assert padded["pad_share"] == round(1 - padded["tokens"] / (12 * 64), 4)
    assert packed["pad_share"] < padded["pad_share"]
    assert packed["tokens_per_row"] > padded["tokens_per_row"]
    assert figures["rows_ratio"] == round(packed["rows"] / 12, 3)
