"""A byte-level tokenizer for the named test models: 256 byte tokens plus two specials (258 ids).

Token id ``b`` is byte ``b``, so any text round-trips without training a vocabulary.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

__all__ = ["BYTE_VOCAB_SIZE", "EOS_TOKEN", "PAD_TOKEN", "CHAT_TEMPLATE", "build_byte_tokenizer"]

EOS_TOKEN = "<|endoftext|>"  # id 256: end of text, also used as padding
PAD_TOKEN = "<|pad|>"  # id 257: reserved
BYTE_VOCAB_SIZE = 258

# One line per message, the role first; generation continues after "assistant: ".
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}" + EOS_TOKEN + "\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def _byte_to_unicode() -> dict[int, str]:
    """Map each byte to a printable character, the convention byte-level pre-tokenizers use."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """Build the 258-token byte tokenizer (no merges) with eos/pad and a simple chat template."""
    vocab = {ch: b for b, ch in _byte_to_unicode().items()}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([EOS_TOKEN, PAD_TOKEN])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, bos_token=None
    )
    tok.chat_template = CHAT_TEMPLATE
    if len(tok) != BYTE_VOCAB_SIZE:  # a guard on the id layout the named configs rely on
        raise RuntimeError(f"byte tokenizer has {len(tok)} tokens, expected {BYTE_VOCAB_SIZE}")
    return tok
