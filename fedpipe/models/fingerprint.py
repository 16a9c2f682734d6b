"""A fingerprint of a model's base weights and config, so device and server can prove they agree.

The sha256 runs over the normalized config (keys that say where or how the model was saved are
dropped) and every base tensor's name, shape, dtype and bytes, in name order. It is therefore the
same for the same model loaded from different folders or homes, sharded or not, and differs for a
different architecture or a single changed weight. Hashing a large model takes seconds, so the
result is cached beside the weights (or, for a read-only folder, in fedpipe's cache), keyed by the
files' sizes and modification times; models fedpipe converts get theirs as they are written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from fedpipe.errors import ModelFileError
from fedpipe.models.cache import cache_root
from fedpipe.models.weights import WeightFiles

__all__ = ["FINGERPRINT_FILE", "model_fingerprint", "normalized_config"]

log = logging.getLogger(__name__)

FINGERPRINT_FILE = "fedpipe-fingerprint.json"
# Config keys that record how or where a model was saved, not what it computes.
_VOLATILE_KEYS = frozenset(
    {
        "_name_or_path",
        "_commit_hash",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "attn_implementation",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
    }
)


def model_fingerprint(folder: Path) -> str:
    """The sha256 (hex) of ``folder``'s config and base weights, computed once and cached."""
    folder = Path(folder)
    files = WeightFiles(folder)
    stamp = _stamp(folder, files)
    places = _cache_files(folder)
    for place in places:
        cached = _read_cache(place, stamp)
        if cached:
            return cached
    digest = _compute(folder, files)
    for place in places:  # beside the model, else (a read-only folder) in fedpipe's cache
        if _write_cache(place, stamp, digest):
            break
    return digest


def _cache_files(folder: Path) -> list[Path]:
    key = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:24]
    return [folder / FINGERPRINT_FILE, cache_root() / "fingerprints" / f"{key}.json"]


def normalized_config(folder: Path) -> dict[str, Any]:
    """config.json without the keys that only say how or where it was saved."""
    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"{path}: not readable JSON ({type(exc).__name__}: {exc})") from None
    return {k: v for k, v in raw.items() if k not in _VOLATILE_KEYS}


def _compute(folder: Path, files: WeightFiles) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(normalized_config(folder), sort_keys=True).encode())
    for key, tensor in files.tensors():
        header = f"\n{key}|{tuple(tensor.shape)}|{tensor.dtype}|".encode()
        h.update(header)
        h.update(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _stamp(folder: Path, files: WeightFiles) -> list[list[Any]]:
    names = ["config.json", *sorted({p.name for p in files.files_for(files.keys())})]
    out: list[list[Any]] = []
    for name in names:
        stat = (folder / name).stat()
        out.append([name, stat.st_size, stat.st_mtime_ns])
    return out


def _read_cache(path: Path, stamp: list[list[Any]]) -> str | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("stamp") != stamp or not isinstance(data.get("sha256"), str):
        return None
    return str(data["sha256"])


def _write_cache(path: Path, stamp: list[list[Any]], digest: str) -> bool:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"sha256": digest, "stamp": stamp}))
        os.replace(tmp, path)
        return True
    except OSError as exc:
        log.debug("cannot cache the fingerprint in %s: %s", path, exc)
        tmp.unlink(missing_ok=True)
        return False
