"""Loading a resolved model folder: its tokenizer, the whole (unsplit) causal LM, and its family."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from fedpipe.errors import ModelFileError
from fedpipe.models.families import FAMILIES, attention_implementation, refusal

__all__ = ["LLAMA_FAMILY_TYPES", "load_config", "load_tokenizer", "load_causal_lm", "model_family"]

# Model types of the Llama layout (embed_tokens, rotary decoder layers, norm, lm_head): the table.
LLAMA_FAMILY_TYPES = tuple(FAMILIES)

Family = Literal["llama", "gpt2"]


def load_config(folder: Path) -> Any:
    """The model's config with sdpa attention (causal via ``is_causal`` when no mask is given),
    or eager attention where the family needs it (Gemma 2's attention soft-capping)."""
    try:
        config = AutoConfig.from_pretrained(folder, attn_implementation="sdpa")
    except (OSError, ValueError, KeyError) as exc:
        reason = " ".join(str(exc).split())[:200]
        raise ModelFileError(
            f"{Path(folder) / 'config.json'}: not a usable model config ({reason})"
        ) from None
    config._attn_implementation = attention_implementation(config)
    return config


def load_tokenizer(folder: Path) -> Any:
    """The tokenizer saved in ``folder`` (offline; nothing is fetched)."""
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        reason = " ".join(str(exc).split())[:200]
        raise ModelFileError(
            f"{folder}: no usable tokenizer ({reason}); save the tokenizer into the model folder "
            "(tokenizer.json and tokenizer_config.json, e.g. tokenizer.save_pretrained(folder))"
        ) from None


def load_causal_lm(folder: Path, *, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The whole, unsplit model in eval mode: the reference for exactness tests and evaluation."""
    attention = attention_implementation(load_config(folder))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attention)
    return model.eval()


def model_family(config: Any) -> Family:
    """Which stage layout fits ``config``: "llama" (every entry of the family table) or "gpt2".

    Anything else is refused in one line naming the model_type, why, and what is supported.
    """
    reason = refusal(config)
    if reason:
        raise ValueError(reason)
    return "gpt2" if config.model_type == "gpt2" else "llama"
