"""Tiny random models of the families written as real GGUF files, the way llama.cpp writes them.

:func:`write_gguf` takes a Hugging Face model and writes it with the ``gguf`` package's
``GGUFWriter``: tensor names from gguf's own name map (``get_tensor_name_map``), the metadata
keys llama.cpp's converter writes (the ones transformers' GGUF reader reads, and the others it
writes for the family), and llama.cpp's conventions that transformers reverses on read: Llama's
q/k rows permuted for its rotary layout, Gemma's norm weights stored as ``1 + w``, GPT-2's
Conv1D weights transposed, a tied LM head left out (the reader ties when ``output.weight`` is
absent). The tokenizer is fedpipe's byte-level one (256 byte tokens and two specials) as a GGUF
"gpt2" (byte-level BPE) vocabulary, which the reader builds for every architecture.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from fedpipe.models.tokenizer import EOS_TOKEN, PAD_TOKEN, _byte_to_unicode

__all__ = ["VOCAB", "tiny_model", "write_gguf"]

VOCAB, EOS = 258, 256
_TINY: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=128,
    pad_token_id=EOS,
    bos_token_id=EOS,
    eos_token_id=EOS,
    initializer_range=0.1,  # larger than the default, so every detail moves the logits
    attn_implementation="sdpa",
)
_GPT2: dict[str, Any] = dict(
    n_embd=64,
    n_layer=4,
    n_head=4,
    vocab_size=VOCAB,
    n_positions=1024,  # the reader reads no n_positions: GPT-2's default
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    bos_token_id=EOS,
    eos_token_id=EOS,
)
# model_type -> GGUF general.architecture, where llama.cpp names it differently
_ARCH = {"gemma3_text": "gemma3", "mistral": "llama"}


def tiny_model(model_type: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A random model of ``model_type`` (transformers' own config class), every norm weight
    perturbed so that each norm moves the numbers."""
    base = _GPT2 if model_type == "gpt2" else _TINY
    config = CONFIG_MAPPING[model_type](**{**base, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    with torch.no_grad():
        for key, param in model.named_parameters():
            if "norm" in key or ".ln_" in key:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def write_gguf(
    model: PreTrainedModel,
    path: Path,
    *,
    arch: str | None = None,
    name: str = "tiny",
    extra: dict[str, Any] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """Write ``model`` to ``path`` as a GGUF of architecture ``arch`` (the model's own by
    default), fp32 tensors; ``extra`` adds metadata (key -> int, float or str) and
    ``extra_tensors`` tensors, as a file from another converter might have."""
    config = model.config
    arch = arch or _ARCH.get(config.model_type, config.model_type)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    _add_hparams(writer, config, arch)
    _add_tokenizer(writer)
    for key, value in (extra or {}).items():
        _add_value(writer, key, value)
    names = gguf.get_tensor_name_map(_gguf_arch(arch), config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for key, tensor in model.state_dict().items():
        if tied and key == "lm_head.weight":
            continue
        stem, suffix = key.rsplit(".", 1)
        target = names.get_name(stem)
        if target is None:
            raise KeyError(f"gguf has no name for {key} in architecture {arch!r}")
        writer.add_tensor(f"{target}.{suffix}", _stored(tensor, target, suffix, config, arch))
    for key, array in (extra_tensors or {}).items():
        writer.add_tensor(key, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_arch(arch: str) -> gguf.MODEL_ARCH:
    return next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch)


def _add_hparams(writer: gguf.GGUFWriter, config: Any, arch: str) -> None:
    writer.add_block_count(config.num_hidden_layers)
    writer.add_vocab_size(config.vocab_size)
    if config.model_type == "gpt2":
        writer.add_context_length(config.n_positions)
        writer.add_embedding_length(config.n_embd)
        writer.add_feed_forward_length(4 * config.n_embd)
        writer.add_head_count(config.n_head)
        writer.add_layer_norm_eps(config.layer_norm_epsilon)
        return
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if arch == "phi3":
        writer.add_sliding_window(config.sliding_window or 0)  # llama.cpp: 0 for none


def _add_tokenizer(writer: gguf.GGUFWriter) -> None:
    spelled = _byte_to_unicode()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([spelled[b] for b in range(256)] + [EOS_TOKEN, PAD_TOKEN])
    writer.add_token_types([gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL] * 2)
    writer.add_token_scores([0.0] * VOCAB)  # no merges: the reader derives none from these
    writer.add_eos_token_id(EOS)
    writer.add_pad_token_id(EOS)


def _add_value(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_uint32(key, int(value))


def _stored(tensor: torch.Tensor, target: str, suffix: str, config: Any, arch: str) -> np.ndarray:
    """The tensor as llama.cpp stores it."""
    array = tensor.detach().to(torch.float32).numpy().copy()
    if arch == "llama" and target.endswith(("attn_q", "attn_k")):
        query = target.endswith("attn_q")
        heads = config.num_attention_heads if query else config.num_key_value_heads
        array = _permute(array, heads)
    if arch in ("gemma2", "gemma3") and target.endswith("norm"):
        array = array + 1.0
    if arch == "gpt2" and suffix == "weight":
        if target.endswith(("attn_qkv", "attn_output", "ffn_up", "ffn_down")):
            array = np.ascontiguousarray(array.T)
    return array


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: each head's rotary halves interleaved."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )
