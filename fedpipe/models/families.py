"""The dense decoder families fedpipe splits, one table entry each, and why others are refused.

Every family in :data:`FAMILIES` has the Llama layout of Hugging Face's modeling code: a token
embedding ``model.embed_tokens``, decoder layers ``model.layers.N`` called as
``layer(hidden, attention_mask=, position_ids=, position_embeddings=)``, a rotary embedding
``model.rotary_emb`` computed from the config, a final norm ``model.norm`` and ``lm_head``. What a
family does beyond that (a scaled embedding, logits soft-capping or scaling, a rotary per layer
type, eager attention, fused LoRA targets) is a field of its :class:`FamilySpec`; how its decoder
layer computes, for the batched server bank's own forward and backward, is its
:class:`BlockLayout`. Adding a dense family of that layout is one entry. GPT-2 has its own
layout and is not in the table.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

__all__ = [
    "FAMILIES",
    "BlockLayout",
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
class BlockLayout:
    """How a family's decoder layer computes, for the batched server bank's own forward and
    backward of it (:mod:`fedpipe.lora.batched_blocks`): the Llama block by default.

    Norms are attribute names of the layer (None: the block has none there): ``attn_norm`` and
    ``mlp_norm`` normalise the branch inputs (Llama's ``input_layernorm`` and
    ``post_attention_layernorm``), ``attn_post_norm`` and ``mlp_post_norm`` the branch outputs
    before their residual add (OLMo 2, Gemma). ``norm_offset``: the RMSNorms scale by
    ``offset + w`` (Gemma's ``1 + w``). ``qk_norm``: ``self_attn.q_norm`` / ``k_norm`` on q and k
    before rotary, over each head (Qwen3, Gemma 3) or over the whole projection (OLMo 2).
    ``qkv`` and ``gate_up`` name the attention's and the MLP's input linears, one fused linear
    split in that order (Phi-3) or one each. ``act`` is the MLP's activation attribute and
    ``act_config`` the config field naming it. The other fields name config fields:
    ``residual_multiplier`` scales both branches before their residual add (Granite),
    ``rope_layers`` says per block whether it applies rotary (SmolLM3's ``no_rope_layers``),
    ``softcap`` caps the attention logits, ``cap * tanh(scores / cap)`` (Gemma 2). The attention
    scale is the layer's own ``self_attn.scaling`` (Granite's ``attention_multiplier``, Gemma's
    ``query_pre_attn_scalar``), the mask the stages' (causal, or banded where a block slides).
    """

    attn_norm: str | None = "input_layernorm"
    attn_post_norm: str | None = None
    mlp_norm: str | None = "post_attention_layernorm"
    mlp_post_norm: str | None = None
    norm_offset: float = 0.0
    qk_norm: Literal["none", "head", "projection"] = "none"
    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    gate_up: tuple[str, ...] = ("gate_proj", "up_proj")
    act: str = "act_fn"
    act_config: str = "hidden_act"
    residual_multiplier: str | None = None
    rope_layers: str | None = None
    softcap: str | None = None

    @property
    def linears(self) -> tuple[str, ...]:
        """Every linear of the block, in the order its forward runs them."""
        return (*self.qkv, "o_proj", *self.gate_up, "down_proj")


_GEMMA = BlockLayout(
    attn_post_norm="post_attention_layernorm",
    mlp_norm="pre_feedforward_layernorm",
    mlp_post_norm="post_feedforward_layernorm",
    norm_offset=1.0,
    act_config="hidden_activation",
)


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
    or none); ``block`` describes the decoder layer's computation for the batched server bank,
    and ``batched`` marks the families whose blocks it computes exactly.
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
    block: BlockLayout = BlockLayout()

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
    "qwen3": FamilySpec("qwen3", "Qwen3", batched=True, block=BlockLayout(qk_norm="head")),
    "olmo2": FamilySpec(
        "olmo2",
        "Olmo2",
        sliding="none",
        batched=True,
        block=BlockLayout(
            attn_norm=None,
            attn_post_norm="post_attention_layernorm",
            mlp_norm=None,
            mlp_post_norm="post_feedforward_layernorm",
            qk_norm="projection",
        ),
    ),
    "granite": FamilySpec(
        "granite",
        "Granite",
        embed=_embedding_multiplier,
        logits=_logits_scaling,
        sliding="none",
        batched=True,
        block=BlockLayout(residual_multiplier="residual_multiplier"),
    ),
    "smollm3": FamilySpec(
        "smollm3", "SmolLM3", batched=True, block=BlockLayout(rope_layers="no_rope_layers")
    ),
    "phi3": FamilySpec(
        "phi3",
        "Phi3",
        lora_targets=("qkv_proj", "o_proj"),
        sliding="every_block",
        batched=True,
        block=BlockLayout(qkv=("qkv_proj",), gate_up=("gate_up_proj",), act="activation_fn"),
    ),
    "gemma2": FamilySpec(
        "gemma2",
        "Gemma2",
        embed=_sqrt_hidden,
        logits=_final_softcap,
        eager=True,
        batched=True,
        block=dataclasses.replace(_GEMMA, softcap="attn_logit_softcapping"),
    ),
    "gemma3_text": FamilySpec(
        "gemma3",
        "Gemma3",
        embed=_sqrt_hidden,
        logits=_final_softcap,
        rotary_per_layer_type=True,
        batched=True,
        block=dataclasses.replace(_GEMMA, qk_norm="head"),
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
