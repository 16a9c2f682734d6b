"""The dense decoder families fedpipe splits, one table entry each, and why others are refused.

Every family in :data:`FAMILIES` has the Llama layout of Hugging Face's modeling code: a token
embedding ``model.embed_tokens``, decoder layers ``model.layers.N`` called as
``layer(hidden, attention_mask=, position_ids=, position_embeddings=)``, a rotary embedding
``model.rotary_emb`` computed from the config, a final norm ``model.norm`` and ``lm_head``. What a
family does beyond that (a scaled embedding, logits soft-capping or scaling, a rotary per layer
type, eager attention, fused LoRA targets) is a field of its :class:`FamilySpec`. Adding a dense
family of that layout is one entry. GPT-2 has its own layout and is not in the table.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

__all__ = [
    "FAMILIES",
    "FamilySpec",
    "attention_implementation",
    "family_spec",
    "refusal",
    "supported_types",
]

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def _sqrt_hidden(hidden: Tensor, config: Any) -> Tensor:
    """Gemma: embeddings times sqrt(hidden_size), that factor rounded to the weights' dtype."""
    return hidden * torch.tensor(config.hidden_size**0.5).to(hidden.dtype)


def _embedding_multiplier(hidden: Tensor, config: Any) -> Tensor:
    """Granite: embeddings times ``config.embedding_multiplier``."""
    return hidden * config.embedding_multiplier


def _final_softcap(logits: Tensor, config: Any) -> Tensor:
    """Gemma 2/3: cap * tanh(logits / cap) when ``final_logit_softcapping`` is set."""
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


def _logits_scaling(logits: Tensor, config: Any) -> Tensor:
    """Granite: logits divided by ``config.logits_scaling``."""
    return logits / config.logits_scaling


@dataclass(frozen=True)
class FamilySpec:
    """What fedpipe needs to know of one model_type beyond the common Llama layout.

    ``classes`` is the prefix of the modeling module's class names (``Qwen3`` for
    ``Qwen3DecoderLayer``, ``Qwen3RMSNorm``, ``Qwen3RotaryEmbedding``); ``module`` the
    ``transformers.models`` subpackage. ``embed`` and ``logits`` post-process the embedding output
    and the LM head's output; ``rotary_per_layer_type`` calls the rotary embedding once per
    ``layer_types`` entry (Gemma 3's local and global rotaries); ``eager`` runs eager attention
    (Gemma 2's attention soft-capping); ``sliding`` says which blocks a config's
    ``sliding_window`` applies to (those ``layer_types`` mark ``sliding_attention``, every block,
    or none); ``batched`` marks families whose blocks the batched server bank computes exactly
    (plain Llama blocks).
    """

    module: str
    classes: str
    lora_targets: tuple[str, ...] = _ATTENTION
    embed: Callable[[Tensor, Any], Tensor] | None = None
    logits: Callable[[Tensor, Any], Tensor] | None = None
    rotary_per_layer_type: bool = False
    eager: bool = False
    sliding: Literal["layer_types", "every_block", "none"] = "layer_types"
    batched: bool = False

    def _class(self, suffix: str) -> Any:
        # Deferred: importing every family's modeling module would slow each start.
        modeling = importlib.import_module(
            f"transformers.models.{self.module}.modeling_{self.module}"
        )
        return getattr(modeling, f"{self.classes}{suffix}")

    @property
    def decoder_layer(self) -> Any:
        """The family's Hugging Face decoder layer class."""
        return self._class("DecoderLayer")

    @property
    def norm(self) -> Any:
        """The family's RMSNorm class (Gemma's computes x * (1 + w))."""
        return self._class("RMSNorm")

    @property
    def rotary(self) -> Any:
        """The family's rotary embedding class (built from the config, nothing loaded)."""
        return self._class("RotaryEmbedding")


FAMILIES: dict[str, FamilySpec] = {
    "llama": FamilySpec("llama", "Llama", sliding="none", batched=True),
    "qwen2": FamilySpec("qwen2", "Qwen2", batched=True),
    "mistral": FamilySpec("mistral", "Mistral", sliding="every_block", batched=True),
    "qwen3": FamilySpec("qwen3", "Qwen3"),
    "olmo2": FamilySpec("olmo2", "Olmo2", sliding="none"),
    "granite": FamilySpec(
        "granite", "Granite", embed=_embedding_multiplier, logits=_logits_scaling, sliding="none"
    ),
    "smollm3": FamilySpec("smollm3", "SmolLM3"),
    "phi3": FamilySpec("phi3", "Phi3", lora_targets=("qkv_proj", "o_proj"), sliding="every_block"),
    "gemma2": FamilySpec("gemma2", "Gemma2", embed=_sqrt_hidden, logits=_final_softcap, eager=True),
    "gemma3_text": FamilySpec(
        "gemma3", "Gemma3", embed=_sqrt_hidden, logits=_final_softcap, rotary_per_layer_type=True
    ),
}

_MIXTURE_OF_EXPERTS = {
    "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "flex_olmo", "granitemoe", "granitemoeshared",
    "phimoe", "jetmoe", "dbrx", "deepseek_v2", "deepseek_v3", "gpt_oss", "llama4_text",
    "ernie4_5_moe", "glm4_moe", "hunyuan_v1_moe", "dots1", "minimax", "switch_transformers",
}  # fmt: skip
_HYBRID_OR_LINEAR = {
    "qwen3_next", "qwen3_5", "qwen3_5_text", "granitemoehybrid", "recurrent_gemma", "jamba",
    "zamba", "zamba2", "bamba", "falcon_h1", "falcon_mamba", "mamba", "mamba2", "nemotron_h",
    "lfm2", "rwkv",
}  # fmt: skip
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_COMPUTED_LAYER_TYPES = ("full_attention", "sliding_attention")


def supported_types() -> tuple[str, ...]:
    """Every model_type fedpipe splits, sorted."""
    return tuple(sorted([*FAMILIES, "gpt2"]))


def family_spec(config: Any) -> FamilySpec:
    """The table entry of ``config``'s model_type (a ValueError for GPT-2 or a refused type)."""
    spec = FAMILIES.get(getattr(config, "model_type", None) or "")
    reason = refusal(config)
    if spec is None or reason:
        raise ValueError(reason or f"model_type {config.model_type!r} has no Llama-layout entry")
    return spec


def attention_implementation(config: Any) -> str:
    """The attention the stages and the unsplit reference run: eager where a family needs it."""
    spec = FAMILIES.get(getattr(config, "model_type", None) or "")
    return "eager" if spec is not None and spec.eager else "sdpa"


def refusal(config: Any) -> str:
    """One line saying why ``config`` cannot be split ("" when it can)."""
    model_type = getattr(config, "model_type", None)
    why = _why_refused(config)
    if not why:
        return ""
    return (
        f"model_type {model_type!r} is not supported for splitting: {why}; supported: "
        f"{', '.join(supported_types())} (dense decoder-only causal LMs)"
    )


def _why_refused(config: Any) -> str:
    """The reason in a few words ("" when fedpipe splits it)."""
    model_type = getattr(config, "model_type", None)
    if model_type in _HYBRID_OR_LINEAR:
        return "hybrid or linear attention / state-space blocks (not computed by the stages)"
    if model_type in _MIXTURE_OF_EXPERTS or any(getattr(config, n, 0) for n in _EXPERT_COUNTS):
        return "a mixture-of-experts model (fedpipe's stages run dense MLP blocks only)"
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model (fedpipe splits decoder-only causal LMs)"
    if hasattr(config, "text_config") or hasattr(config, "vision_config"):
        return "a multimodal config (a text-only config may be split, e.g. gemma3_text for gemma3)"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention (fedpipe's stages are causal)"
    layer_types = getattr(config, "layer_types", None) or ()
    odd = sorted({t for t in layer_types if t not in _COMPUTED_LAYER_TYPES})
    if odd:
        return f"layer_types {odd} (the stages compute {', '.join(_COMPUTED_LAYER_TYPES)} only)"
    if model_type not in FAMILIES and model_type != "gpt2":
        return (
            "no stage layout for this architecture (add a FamilySpec in fedpipe/models/families.py)"
        )
    return ""
