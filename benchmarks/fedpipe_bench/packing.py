"""`fedpipe bench packing`: how full the rows of an instruction set are, padded and packed.

The rows of ``examples/instruct.toml``'s training data (its model's tokenizer, its
``train.seq_len`` and ``data.*``) made both ways: one example per right-padded row
(``data.packing = false``) and whole examples packed into shared rows (``true``). Per way:
rows, real tokens per row, the share of pad tokens, and the tokens in the loss (the same both
ways: packing changes where an example sits, not what it counts). Fewer rows for the same
tokens are fewer forward and backward passes per epoch; nothing here is timed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fedpipe.data import IGNORE_INDEX, Document, load_documents
from fedpipe.data.rows import ExampleRows, example_rows
from fedpipe.models import load_tokenizer, resolve_model

__all__ = ["packing_figures", "row_figures", "run_packing_bench"]


def row_figures(rows: ExampleRows) -> dict[str, Any]:
    """Rows, real tokens per row, pad share and loss tokens of one way of making rows."""
    n, seq_len = (int(d) for d in rows.input_ids.shape)
    assert rows.row_tokens is not None  # example_rows always counts them
    real, slots = int(rows.row_tokens.sum()), n * seq_len
    return {
        "rows": n,
        "tokens": real,
        "tokens_per_row": round(real / n, 1) if n else None,
        "pad_share": round(1 - real / slots, 4) if slots else None,
        "loss_tokens": int((rows.labels[:, 1:] != IGNORE_INDEX).sum()),
    }


def packing_figures(
    docs: Sequence[Document], tokenizer: Any, seq_len: int, **options: Any
) -> dict[str, Any]:
    """``padded`` and ``packed`` figures of ``docs`` at ``seq_len`` (``options``: data.*)."""
    padded = example_rows(docs, tokenizer, seq_len, **options)
    packed = example_rows(docs, tokenizer, seq_len, packing=True, **options)
    out: dict[str, Any] = {"padded": row_figures(padded), "packed": row_figures(packed)}
    out["rows_ratio"] = round(out["packed"]["rows"] / max(out["padded"]["rows"], 1), 3)
    return out


def run_packing_bench(overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The figures of the instruct example's training data (``overrides``: its settings)."""
    from fedpipe_bench.instruct import instruct_config

    config = instruct_config(overrides)
    tokenizer = load_tokenizer(resolve_model(config.model.name))
    docs = load_documents(config.federated.data)
    figures = packing_figures(
        docs,
        tokenizer,
        config.train.seq_len,
        loss_on=config.data.loss_on,
        overlong=config.data.overlong,
    )
    return {
        "bench": "packing",
        "data": config.federated.data,
        "model": config.model.name,
        "seq_len": config.train.seq_len,
        "examples": len(docs),
        **figures,
    }
