"""Loading causal LMs: HF folders, GGUF files, the bundled SmolLM2, and tiny named test configs."""

import os

# fedpipe never fetches from a model hub (devices are often offline): make transformers and
# huggingface_hub fail fast instead of trying the network, unless the user says otherwise.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from fedpipe.models.cache import cache_root, write_atomic
from fedpipe.models.fingerprint import model_fingerprint
from fedpipe.models.loading import load_causal_lm, load_config, load_tokenizer, model_family
from fedpipe.models.registry import NAMED_CONFIGS, named_config, resolve_model
from fedpipe.models.tokenizer import build_byte_tokenizer
from fedpipe.models.weights import WeightFiles

__all__ = [
    "NAMED_CONFIGS",
    "WeightFiles",
    "build_byte_tokenizer",
    "cache_root",
    "load_causal_lm",
    "load_config",
    "load_tokenizer",
    "model_family",
    "model_fingerprint",
    "named_config",
    "resolve_model",
    "write_atomic",
    "write_atomic",
]
