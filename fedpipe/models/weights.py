"""The base weights of a model folder: one ``model.safetensors`` or a sharded set with an index.

Most checkpoints of 1B parameters and up ship sharded (``model.safetensors.index.json`` maps
each tensor to its shard). :class:`WeightFiles` hides the difference: it knows which file holds
each tensor, so a stage opens only the shards that hold its own layers. Every failure to read a
file becomes a :class:`ModelFileError` whose one line names the file and what is wrong, because
a truncated download otherwise surfaces as a deserializer's message that names no file.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from fedpipe.errors import ModelFileError

__all__ = ["INDEX_FILE", "SINGLE_FILE", "WeightFiles"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class WeightFiles:
    """Which safetensors file of ``folder`` holds each base tensor, by file key."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        index, single = self.folder / INDEX_FILE, self.folder / SINGLE_FILE
        if index.is_file():
            self.where = _read_index(index)
        elif single.is_file():
            with _opened(single) as f:
                self.where = {key: SINGLE_FILE for key in f.keys()}
        else:
            raise ModelFileError(
                f"{self.folder}: no {SINGLE_FILE} or {INDEX_FILE}; fedpipe reads safetensors "
                "weights (save the model with save_pretrained, or give a .gguf file)"
            )

    def keys(self) -> set[str]:
        return set(self.where)

    def files_for(self, keys: Iterable[str]) -> list[Path]:
        """The files that hold ``keys`` (each once, in name order): all a stage needs to open."""
        return [self.folder / name for name in sorted({self._file(k) for k in keys})]

    def read(
        self, keys: Iterable[str], *, dtype: torch.dtype | None = None, device: Any = "cpu"
    ) -> dict[str, torch.Tensor]:
        """Exactly ``keys``, opening only the files that hold them."""
        by_file: dict[str, list[str]] = defaultdict(list)
        for key in keys:
            by_file[self._file(key)].append(key)
        out: dict[str, torch.Tensor] = {}
        for name, file_keys in sorted(by_file.items()):
            path = self.folder / name
            with _opened(path) as f:
                for key in file_keys:
                    tensor = _get(f, path, key)
                    out[key] = tensor.to(device=device, dtype=dtype or tensor.dtype)
        return out

    def read_rows(
        self,
        key: str,
        start: int,
        stop: int,
        *,
        dtype: torch.dtype | None = None,
        device: Any = "cpu",
    ) -> torch.Tensor:
        """Rows ``[start:stop)`` of tensor ``key`` only (the rest of it is never read): how a
        stored device weight is filled a slab at a time (fedpipe.split.quant)."""
        path = self.folder / self._file(key)
        with _opened(path) as f:
            try:
                tensor = f.get_slice(key)[start:stop]
            except Exception as exc:
                raise ModelFileError(
                    f"{path}: cannot read rows {start}:{stop} of tensor {key!r} ({_reason(exc)}); "
                    "the file is probably truncated or corrupt: copy or convert it again"
                ) from None
        return tensor.to(device=device, dtype=dtype or tensor.dtype)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor in key order across all files (the same order sharded or not)."""
        with ExitStack() as stack:
            handles = {p.name: stack.enter_context(_opened(p)) for p in self.files_for(self.where)}
            for key in sorted(self.where):
                name = self.where[key]
                yield key, _get(handles[name], self.folder / name, key)

    def shape(self, key: str) -> list[int]:
        path = self.folder / self._file(key)
        with _opened(path) as f:
            return list(f.get_slice(key).get_shape())

    def _file(self, key: str) -> str:
        try:
            return self.where[key]
        except KeyError:
            raise ModelFileError(
                f"{self.folder}: its weights have no tensor {key!r}; the folder's config.json "
                "and weights disagree (a different model, or an incomplete save)"
            ) from None


def _read_index(path: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelFileError(
            f"{path}: not a valid safetensors index ({type(exc).__name__}: {exc}); it must be "
            'JSON with a "weight_map" of tensor name -> shard file'
        ) from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelFileError(f"{path}: its weight_map is empty or not an object")
    return {str(k): str(v) for k, v in weight_map.items()}


@contextmanager
def _opened(path: Path) -> Iterator[Any]:
    """``safe_open`` whose failures name the file (a torn download, a file of another format)."""
    if not path.is_file():
        raise ModelFileError(
            f"{path}: missing, but {INDEX_FILE} lists it as a shard of this model; copy every "
            "shard into the folder"
        )
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error types, and OSError
        raise ModelFileError(
            f"{path}: not a readable safetensors file ({_reason(exc)}); it is probably "
            "truncated or corrupt: copy or convert it again"
        ) from None
    with handle as f:
        yield f


def _get(f: Any, path: Path, key: str) -> torch.Tensor:
    try:
        return f.get_tensor(key)
    except Exception as exc:
        raise ModelFileError(
            f"{path}: cannot read tensor {key!r} ({_reason(exc)}); the file is probably "
            "truncated or corrupt: copy or convert it again"
        ) from None


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__
