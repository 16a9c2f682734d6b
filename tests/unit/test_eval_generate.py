"""federated.eval_generate: which held-out examples a round's model answers, and where the
scores show (the round line; the setting's check). The generation itself runs in
tests/system/test_instruct_simulation.py."""

from __future__ import annotations

import pytest

from fedpipe.config import FederatedConfig
from fedpipe.data import Document
from fedpipe.fl.eval_generate import questions
from fedpipe.models.tokenizer import build_byte_tokenizer
from fedpipe.runs.report import format_record
from fedpipe.runs.tensorboard import _ROUND_TAGS


def test_the_first_examples_with_a_reference_answer_are_asked() -> None:
    tok = build_byte_tokenizer()
    docs = [
        Document(text="plain text has no answer"),
        Document(prompt="1+1=", completion="2"),
        Document(prompt="empty answer", completion="  "),
        Document(prompt="2+2=", completion="4"),
        Document(prompt="3+3=", completion="6"),
    ]
    assert [d.prompt for d in questions(docs, tok, 2)] == ["1+1=", "2+2="]
    assert questions(docs, tok, 0) == []


def test_the_round_line_and_tensorboard_show_the_scores() -> None:
    rec = {"event": "eval", "round": 1, "eval_loss": 1.5, "eval_ppl": 4.48, "wall_s": 2.0}
    plain = format_record(rec, rounds=3)
    assert plain is not None and "exact" not in plain
    scored = {**rec, "eval_exact_match": 0.25, "eval_contains": 0.5, "eval_answered": 4}
    line = format_record(scored, rounds=3)
    assert line is not None and "exact 25% contains 50% of 4" in line
    assert {"eval_exact_match", "eval_contains"} <= set(_ROUND_TAGS)


def test_a_negative_count_is_refused() -> None:
    with pytest.raises(ValueError, match="federated.eval_generate must be >= 0"):
        FederatedConfig(eval_generate=-1)
