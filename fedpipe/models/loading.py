"""Loading a resolved model folder: its tokenizer, the whole (unsplit) causal LM, and its family."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from fedpipe.errors import ModelFileError

__all__ = ["LLAMA_FAMILY_TYPES", "load_config", "load_tokenizer", "load_causal_lm", "model_family"]

# Model types sharing the Llama decoder layout (pre-norm RMSNorm, rotary attention, gated MLP).
LLAMA_FAMILY_TYPES = ("llama", "qwen2", "mistral")

Family = Literal["llama", "gpt2"]


def load_config(folder: Path) -> Any:
    """The model's config with sdpa attention (causal via ``is_causal`` when no mask is given)."""
    try:
        return AutoConfig.from_pretrained(folder, attn_implementation="sdpa")
    except (OSError, ValueError, KeyError) as exc:
        reason = " ".join(str(exc).split())[:200]
        raise ModelFileError(
            f"{Path(folder) / 'config.json'}: not a usable model config ({reason})"
        ) from None


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
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def model_family(config: Any) -> Family:
    """Which stage layout fits ``config``: "llama" (Llama, Qwen2, Mistral) or "gpt2"."""
    model_type = getattr(config, "model_type", None)
    if model_type in LLAMA_FAMILY_TYPES:
        return "llama"
    if model_type == "gpt2":
        return "gpt2"
    raise ValueError(
        f"model_type {model_type!r} is not supported for splitting; supported: "
        f"{', '.join(LLAMA_FAMILY_TYPES)} (Llama layout) and gpt2. Convert the model to one of "
        "these architectures or add its block layout to fedpipe/split/stages.py."
    )
