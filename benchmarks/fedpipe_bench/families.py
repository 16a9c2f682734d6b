"""Tiny random models of every family fedpipe splits, saved as Hugging Face folders.

Each is made from transformers' own config class (width 64, 4 blocks, 4 attention heads, 2 KV
heads, tiny-llama's 258-token byte tokenizer) with what makes the family its own switched on
(:data:`EXTRA`): what the federated-rounds tests, the family simulations and
``fedpipe bench memory --families`` run on.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from fedpipe.models import resolve_model

__all__ = ["EXTRA", "tiny_family_folder"]

EXTRA: dict[str, dict[str, Any]] = {  # what makes each family's tiny config its own
    "mistral": {"sliding_window": 8},
    "qwen2": {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
    "qwen3": {"tie_word_embeddings": True},
    "smollm3": {"no_rope_layer_interval": 2},
    "granite": {"embedding_multiplier": 2.0, "logits_scaling": 2.0, "residual_multiplier": 0.5},
    "phi3": {"tie_word_embeddings": False},
    "gemma2": {"head_dim": 16, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma3_text": {"head_dim": 16, "sliding_window": 8},
}


def tiny_family_folder(root: Path, model_type: str) -> Path:
    """A tiny random ``model_type`` (seed 0) with tiny-llama's tokenizer, saved to
    ``root/model_type``."""
    config = CONFIG_MAPPING[model_type](
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=258,
        max_position_embeddings=64,
        pad_token_id=256,
        eos_token_id=256,
        bos_token_id=None,
        **EXTRA.get(model_type, {}),
    )
    torch.manual_seed(0)
    out = root / model_type
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tiny = resolve_model("tiny-llama")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny / name, out / name)
    return out
