"""Training text for fedpipe: loading documents, spreading them over devices, a held-out split, and
packing them into token blocks that a resumable sampler draws batches from.

Typical use (split first so every device is evaluated on the same held-out text):

    docs = default_corpus()                      # or load_documents("my_data/")
    train, held_out = train_eval_split(docs, eval_fraction=0.1, seed=0)
    parts = partition(train, num_devices, scheme="by-source", seed=0)
    blocks = tokenize_blocks(parts[device_id], tokenizer, seq_len=128)
    batch = BlockSampler(blocks, batch_size=8, seed=device_id).batch(step)

Instruction data (chats, prompt/completion pairs) becomes one right-padded row per example with
labels that count its answers only (`example_rows`, `encode_example`):

    rows = example_rows(parts[device_id], tokenizer, seq_len=128, loss_on="answers")
    batch = BlockSampler(rows.input_ids, 8, seed=device_id, labels=rows.labels).batch(step)
"""

from fedpipe.data.blocks import BlockSampler, held_out_blocks, render_document, tokenize_blocks
from fedpipe.data.documents import Document, default_corpus, load_documents
from fedpipe.data.masks import IGNORE_INDEX, LOSS_ON, LossOn, encode_example
from fedpipe.data.partition import Scheme, describe, partition, train_eval_split
from fedpipe.data.rows import (
    OVERLONG,
    ExampleCounts,
    ExampleRows,
    Overlong,
    example_rows,
    held_out_rows,
)

__all__ = [
    "IGNORE_INDEX",
    "LOSS_ON",
    "OVERLONG",
    "BlockSampler",
    "Document",
    "ExampleCounts",
    "ExampleRows",
    "LossOn",
    "Overlong",
    "Scheme",
    "default_corpus",
    "describe",
    "encode_example",
    "example_rows",
    "held_out_rows",
    "load_documents",
    "partition",
    "render_document",
    "tokenize_blocks",
    "held_out_blocks",
    "train_eval_split",
]
