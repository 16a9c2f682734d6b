"""Tiny random stages of every family the batched server bank computes beyond Llama's blocks.

Each case is a config made from transformers' own config class (width 64, 4 heads, 2 KV heads,
4 blocks) with what its family adds switched on and made to matter: a sliding window shorter
than the longer test sequences, q/k norms, post-norms, residual and attention multipliers, a
block without rotary, fused projections with a partial rotary, soft-capped logits, local and
global rotaries. Every norm weight is perturbed (Gemma's start at 0: ``1 + w``), so each norm
moves the numbers. The stages hold blocks 1 and 2, the middle of a 1+1 split.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from fedpipe.split import MiddleStage, ServerLossStage

__all__ = ["BLOCKS", "CASES", "WIDTH", "lora_targets", "save_tiny", "tiny_config", "tiny_stage"]

WIDTH, VOCAB, WINDOW = 64, 200, 5
BLOCKS = (1, 2)
_TINY: dict[str, Any] = dict(
    hidden_size=WIDTH,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    attn_implementation="sdpa",
)
_ALTERNATING = ["full_attention", "sliding_attention"] * 2
# name -> (model_type, config overrides)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": (  # per-head q/k norms; block 2 slides (max_window_layers=2)
        "qwen3",
        {
            "head_dim": 16,
            "use_sliding_window": True,
            "max_window_layers": 2,
            "sliding_window": WINDOW,
        },
    ),
    "smollm3": (  # block 1 without rotary and sliding, block 2 with rotary, full attention
        "smollm3",
        {"no_rope_layers": [1, 0, 1, 1], "use_sliding_window": True, "sliding_window": WINDOW},
    ),
    "granite": (
        "granite",
        {
            "attention_multiplier": 0.2,
            "residual_multiplier": 0.5,
            "embedding_multiplier": 3.0,
            "logits_scaling": 3.0,
        },
    ),
    "olmo2": ("olmo2", {}),  # post-norms, q/k norms over the whole projection
    "phi3": (  # fused qkv_proj / gate_up_proj, half the head dims rotary, window on every block
        "phi3",
        {
            "sliding_window": WINDOW,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
        },
    ),
    "gemma2": (
        "gemma2",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 8,
            "sliding_window": WINDOW,
            "layer_types": _ALTERNATING,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
            "attn_implementation": "eager",  # fedpipe runs Gemma 2 eager (its soft-capping)
        },
    ),
    "gemma3": (
        "gemma3_text",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 8,
            "sliding_window": WINDOW,
            "layer_types": _ALTERNATING,
            "final_logit_softcapping": 3.0,
        },
    ),
}


def tiny_config(name: str) -> Any:
    model_type, overrides = CASES[name]
    return CONFIG_MAPPING[model_type](**{**_TINY, **overrides})


def tiny_stage(name: str, kind: str = "middle", seed: int = 0) -> nn.Module:
    """Blocks 1 and 2 of case ``name`` as a MiddleStage (``kind`` "middle") or a
    ServerLossStage ("loss"), random weights from ``seed``, every norm weight perturbed."""
    torch.manual_seed(seed)
    config = tiny_config(name)
    stage = (MiddleStage if kind == "middle" else ServerLossStage)(config, list(BLOCKS))
    _perturb_norms(stage)
    return stage


def save_tiny(name: str, folder: Path, seed: int = 0) -> Path:
    """Case ``name`` as a whole random model saved to ``folder`` (save_pretrained), every
    norm weight perturbed: a model folder the server builds its stage from."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(name))
    _perturb_norms(model)
    model.save_pretrained(folder)
    return folder


def _perturb_norms(module: nn.Module) -> None:
    with torch.no_grad():
        for key, param in module.named_parameters():
            if "norm" in key:
                param.add_(torch.randn_like(param) * 0.1)


def lora_targets(name: str, llama_targets: tuple[str, ...]) -> tuple[str, ...]:
    """Llama's target names in case ``name``'s linears (Phi-3's fused: one for q/k/v, one for
    gate/up)."""
    if CASES[name][0] != "phi3":
        return llama_targets
    fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}
    fused |= {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
    return tuple(dict.fromkeys(fused.get(t, t) for t in llama_targets))
