"""Did a run learn what was asked: its model and the base on held-out examples, side by side.

For a file of examples in the training formats (:func:`fedpipe.data.load_documents`), each
model gets

- ``answer_loss``: the mean next-token loss over the answer tokens of every example, pooled
  (their sum over their count), the rows and masks built exactly as training builds them
  (:func:`fedpipe.data.rows.example_rows` with ``loss_on = "answers"``, the run's
  ``train.seq_len`` and ``data.overlong``); plain-text records count every token, as in
  training;
- for the examples with a reference answer (a completion, a chat's last assistant turn):
  greedy generation (transformers' ``generate``) from the prompt rendered as training renders
  it (:func:`fedpipe.data.masks.prompt_and_answer`), and the share of answers that equal the
  reference once whitespace is trimmed (``exact_match``) and that contain it (``contains``).

The run's model is its checkpoint merged into the whole model (:func:`merged_model`: every
aggregation, base deltas included); the base is the model the run started from.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from fedpipe.data import load_documents
from fedpipe.data.documents import Document
from fedpipe.data.masks import prompt_and_answer
from fedpipe.data.rows import example_rows
from fedpipe.models import load_causal_lm, load_tokenizer
from fedpipe.models.cache import write_atomic
from fedpipe.runs.export import load_run_model, merged_model
from fedpipe.split.loss import shifted_loss_sum

__all__ = [
    "Answer",
    "Scores",
    "eval_path",
    "evaluate_run",
    "format_table",
    "generated_scores",
    "load_examples",
    "score_model",
    "share",
]

_LOSS_BATCH = 8


@dataclass(frozen=True)
class Answer:
    """One generated answer and its reference."""

    reference: str
    generated: str

    @property
    def exact(self) -> bool:
        return self.generated.strip() == self.reference.strip()

    @property
    def contains(self) -> bool:
        return self.reference.strip() in self.generated


@dataclass(frozen=True)
class Scores:
    """One model's figures on the examples."""

    answer_loss: float | None  # None: no token to score
    exact_match: float | None  # share of ``answered``; None when no example has a reference
    contains: float | None
    examples: int  # examples in the file (after --limit)
    scored_tokens: int  # answer tokens in answer_loss
    loss_rows: int  # examples in answer_loss (those left with an answer token)
    answered: int  # examples with a reference answer, generated
    answers: list[Answer] = field(default_factory=list, repr=False)

    def to_json(self, *, samples: int = 5) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "answers"}
        out["samples"] = [asdict(a) for a in self.answers[:samples]]
        return out


def load_examples(path: Path, *, limit: int | None = None) -> list[Document]:
    """The records of ``path`` (the data loader's refusals, one line), the first ``limit``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--data {path}: no such file")
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    docs = load_documents(path)
    if not docs:
        raise ValueError(f"--data {path} holds no record")
    return docs[:limit] if limit is not None else docs


def answer_loss(
    model: Any,
    tokenizer: Any,
    docs: Sequence[Document],
    *,
    seq_len: int,
    overlong: str = "truncate",
) -> tuple[float | None, int, int]:
    """(mean loss over the answer tokens, their count, rows scored) of ``docs``."""
    rows = example_rows(docs, tokenizer, seq_len, loss_on="answers", overlong=overlong)  # type: ignore[arg-type]
    total, count = 0.0, 0
    device = next(model.parameters()).device
    with torch.no_grad():
        for start in range(0, int(rows.input_ids.shape[0]), _LOSS_BATCH):
            ids = rows.input_ids[start : start + _LOSS_BATCH].to(device)  # (B, T)
            labels = rows.labels[start : start + _LOSS_BATCH].to(device)  # (B, T)
            loss_sum, tokens = shifted_loss_sum(model(input_ids=ids).logits, labels)
            total, count = total + float(loss_sum), count + tokens
    return (total / count if count else None), count, rows.counts.rows


def greedy_answer(model: Any, tokenizer: Any, prompt: str, *, max_new_tokens: int) -> str:
    """The greedy continuation of ``prompt`` (tokenized as training tokenizes it), decoded
    without special tokens."""
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt", verbose=False)
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in ids.items()}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad
        )
    return str(tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))


def generated_scores(
    model: Any, tokenizer: Any, docs: Sequence[Document], *, max_new_tokens: int
) -> list[Answer]:
    """Greedy answers to the examples of ``docs`` that have a reference answer, in order."""
    answers = []
    for doc in docs:
        pair = prompt_and_answer(doc, tokenizer)
        if pair is None or not pair[1].strip():
            continue
        generated = greedy_answer(model, tokenizer, pair[0], max_new_tokens=max_new_tokens)
        answers.append(Answer(pair[1], generated))
    return answers


def share(answers: Sequence[Answer], what: str) -> float | None:
    """The share of ``answers`` that are ``exact`` or ``contains`` (None: no answer)."""
    return sum(getattr(a, what) for a in answers) / len(answers) if answers else None


def score_model(
    model: Any,
    tokenizer: Any,
    docs: Sequence[Document],
    *,
    seq_len: int,
    overlong: str = "truncate",
    max_new_tokens: int = 32,
) -> Scores:
    """``model``'s answer loss and greedy answers on ``docs``."""
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    loss, tokens, loss_rows = answer_loss(
        model, tokenizer, docs, seq_len=seq_len, overlong=overlong
    )
    answers = generated_scores(model, tokenizer, docs, max_new_tokens=max_new_tokens)
    n = len(answers)
    return Scores(
        answer_loss=loss,
        exact_match=share(answers, "exact"),
        contains=share(answers, "contains"),
        examples=len(docs),
        scored_tokens=tokens,
        loss_rows=loss_rows,
        answered=n,
        answers=answers,
    )


def eval_path(run: Path, round_: int | None) -> Path:
    """``RUN/eval.json``, or ``RUN/eval-round-N.json`` for an explicit round."""
    return Path(run) / ("eval.json" if round_ is None else f"eval-round-{round_}.json")


def evaluate_run(
    run: Path,
    data: Path,
    *,
    round_: int | None = None,
    max_new_tokens: int = 32,
    limit: int | None = None,
    model: str | None = None,
    command: str = "",
    write: bool = True,
) -> dict[str, Any]:
    """The base model and round ``round_`` (None: the last) of ``run`` on ``data``; written to
    :func:`eval_path` when ``write``. Returns what is written."""
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    docs = load_examples(data, limit=limit)  # refused before any model loads
    run_model = load_run_model(run, round_=round_, model=model)
    cfg = run_model.config
    tokenizer = load_tokenizer(run_model.folder)
    scores = {}
    for side in ("base", "finetuned"):  # one model in memory at a time
        built = load_causal_lm(run_model.folder) if side == "base" else merged_model(run_model)
        scores[side] = score_model(
            built,
            tokenizer,
            docs,
            seq_len=cfg.train.seq_len,
            overlong=cfg.data.overlong,
            max_new_tokens=max_new_tokens,
        ).to_json()
        del built
    record = {
        "run": str(run_model.run),
        "round": run_model.round,
        "data": str(data),
        "model": str(run_model.folder),
        "max_new_tokens": max_new_tokens,
        "limit": limit,
        "seq_len": cfg.train.seq_len,
        "command": command,
        **scores,
    }
    if write:
        write_atomic(eval_path(run_model.run, round_), json.dumps(record, indent=2) + "\n")
    return record


def _cell(value: float | None, percent: bool) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.1f}%" if percent else f"{value:.4f}"


def format_table(record: dict[str, Any]) -> str:
    """The record as aligned text: one row per figure, base and fine-tuned side by side."""
    base, tuned = record["base"], record["finetuned"]
    rows = [("", "base", f"round {record['round']}")]
    for key, percent in (("answer_loss", False), ("exact_match", True), ("contains", True)):
        rows.append((key, _cell(base[key], percent), _cell(tuned[key], percent)))
    rows.append(("examples", str(base["examples"]), str(tuned["examples"])))
    rows.append(("answered", str(base["answered"]), str(tuned["answered"])))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(
        f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}".rstrip() for r in rows
    )
