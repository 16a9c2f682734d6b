"""Training text for fedpipe: loading documents, spreading them over devices, a held-out split, and
packing them into token blocks that a resumable sampler draws batches from.

Typical use (split first so every device is evaluated on the same held-out text):

    docs = default_corpus()                      # or load_documents("my_data/")
    train, held_out = train_eval_split(docs, eval_fraction=0.1, seed=0)
    parts = partition(train, num_devices, scheme="by-source", seed=0)
    blocks = tokenize_blocks(parts[device_id], tokenizer, seq_len=128)
    batch = BlockSampler(blocks, batch_size=8, seed=device_id).batch(step)
"""

from fedpipe.data.blocks import BlockSampler, held_out_blocks, render_document, tokenize_blocks
from fedpipe.data.documents import Document, default_corpus, load_documents
from fedpipe.data.partition import Scheme, describe, partition, train_eval_split

__all__ = [
    "BlockSampler",
    "Document",
    "Scheme",
    "default_corpus",
    "describe",
    "load_documents",
    "partition",
    "render_document",
    "tokenize_blocks",
    "held_out_blocks",
    "train_eval_split",
]
