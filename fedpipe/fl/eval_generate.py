"""``federated.eval_generate = N``: greedy answers at each round's evaluation.

The round's model, as ``fedpipe eval`` builds it (round 0: the base model, which the initial
adapters leave unchanged; later rounds: the checkpoint just saved, merged by
:func:`fedpipe.runs.export.merged_model`), answers the first N held-out prompt/completion
examples greedily, scored as ``fedpipe eval`` scores them (:mod:`fedpipe.runs.evaluate`:
exact match after trimming, and "contains"). The figures join the round's record
(``eval_exact_match``, ``eval_contains``, ``eval_answered``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedpipe.data.documents import Document
from fedpipe.data.masks import prompt_and_answer
from fedpipe.models import load_causal_lm, load_tokenizer
from fedpipe.runs.evaluate import generated_scores, share
from fedpipe.runs.export import load_run_model, merged_model

__all__ = ["GENERATE_TOKENS", "generation_record", "questions"]

log = logging.getLogger(__name__)

GENERATE_TOKENS = 32  # the most tokens an answer may take (fedpipe eval's default)


def questions(docs: Sequence[Document], tokenizer: Any, n: int) -> list[Document]:
    """The first ``n`` of ``docs`` that have a prompt and a reference answer."""
    out: list[Document] = []
    for doc in docs:
        if len(out) >= n:
            break
        pair = prompt_and_answer(doc, tokenizer)
        if pair is not None and pair[1].strip():
            out.append(doc)
    return out


def generation_record(
    docs: Sequence[Document], model_folder: Path, run: Path, round_: int, *, base: bool
) -> dict[str, float]:
    """``eval_exact_match``, ``eval_contains`` and ``eval_answered`` of the round's model
    (``base``: the base model in ``model_folder``; else round ``round_``'s checkpoint of
    ``run``) on ``docs``; {} when none of them has a reference answer."""
    if not docs:
        return {}
    model = (
        load_causal_lm(model_folder) if base else merged_model(load_run_model(run, round_=round_))
    )
    answers = generated_scores(
        model, load_tokenizer(model_folder), docs, max_new_tokens=GENERATE_TOKENS
    )
    exact, contains = share(answers, "exact"), share(answers, "contains")
    if exact is None or contains is None:
        return {}
    log.info("round %d: exact match %.1f%%, contains %.1f%%", round_, 100 * exact, 100 * contains)
    return {"eval_exact_match": exact, "eval_contains": contains, "eval_answered": len(answers)}
