"""Building a stage that holds only its own weights, read tensor by tensor from safetensors.

Modules are created on the meta device (no memory), then exactly the tensors the stage needs are
read (from ``model.safetensors``, or from only the shards that hold them when the folder is
sharded) and assigned, so the whole model is never materialised on a device.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, cast

import torch
from torch import nn

from fedpipe.errors import ModelFileError
from fedpipe.models.loading import load_config
from fedpipe.models.weights import WeightFiles
from fedpipe.split.layout import SplitLayout
from fedpipe.split.quant import StoredEmbedding, store_module, stored_modules
from fedpipe.split.stages import (
    HeadStage,
    MiddleStage,
    ServerLossStage,
    TailStage,
    rotary_embedding,
)

__all__ = ["Part", "build_stage", "build_device_stages", "stage_blocks", "stage_file_keys"]

Part = Literal["head", "middle", "tail", "server_loss"]
_BODY_PREFIXES = ("model.", "transformer.", "")


def stage_blocks(layout: SplitLayout, part: Part) -> range:
    """The global block indices ``part`` holds under ``plan`` (checking the part fits the mode)."""
    if part == "head":
        return layout.head_blocks
    if part == "middle" and layout.mode == "u":
        return layout.server_blocks
    if part == "tail" and layout.mode == "u":
        return layout.tail_blocks
    if part == "server_loss" and layout.mode == "two":
        return layout.server_blocks
    wanted = {"u": "head, middle, tail", "two": "head, server_loss"}[layout.mode]
    raise ValueError(
        f"part {part!r} does not exist in mode {layout.mode!r}; its parts are: {wanted}"
    )


def build_stage(
    folder: Path,
    layout: SplitLayout,
    part: Part,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    weights: str = "fp32",
) -> nn.Module:
    """Build one stage of ``plan`` from ``folder`` with frozen base weights.

    ``weights`` (``server.weights``): fp32 builds it as read; bf16, int8 or int4 store the
    linears of its blocks so (fedpipe.split.quant), each read and packed a slab of rows at a
    time; its other tensors (norms, an LM head) are read whole in ``dtype``.
    """
    if weights != "fp32":
        return _build_stored(
            Path(folder),
            layout,
            part,
            weights=weights,
            device=device,
            dtype=dtype,
            blocks_only=True,
        )
    return _build(Path(folder), layout, part, dtype=dtype, device=device)


def build_device_stages(
    folder: Path,
    layout: SplitLayout,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    weights: str = "fp32",
) -> tuple[HeadStage, TailStage | None]:
    """The device's (head, tail); tail is None in mode "two".

    When the model ties its embedding and LM head, both stages share one tensor (one copy).
    ``weights`` (``device.weights``): fp32 builds them as read; bf16, int8 or int4 store the
    embedding, the block linears and the LM head so (fedpipe.split.quant), each weight read and
    packed a slab of rows at a time, the tied pair stored once.
    """
    folder = Path(folder)
    if weights != "fp32":
        return _build_stored_device(folder, layout, weights=weights, device=device)
    head = _build(folder, layout, "head", dtype=dtype, device=device)
    if layout.mode == "two":
        return head, None
    shared = head.embedding.weight if _ties_embeddings(folder, head.config) else None
    tail = _build(folder, layout, "tail", dtype=dtype, device=device, lm_head=shared)
    return head, tail


def _build_stored_device(
    folder: Path, layout: SplitLayout, *, weights: str, device: str | torch.device
) -> tuple[HeadStage, TailStage | None]:
    """``build_device_stages`` with the frozen weights stored as ``weights``."""
    head = cast(HeadStage, _build_stored(folder, layout, "head", weights=weights, device=device))
    if layout.mode == "two":
        return head, None
    embedding = cast(StoredEmbedding, head.embedding)
    tied = embedding.stored() if _ties_embeddings(folder, head.config) else None
    tail = _build_stored(folder, layout, "tail", weights=weights, device=device, tied=tied)
    return head, cast(TailStage, tail)


def _build_stored(
    folder: Path,
    layout: SplitLayout,
    part: Part,
    *,
    weights: str,
    device: str | torch.device,
    tied: tuple[nn.Parameter, nn.Parameter | None] | None = None,
    dtype: torch.dtype = torch.float32,
    blocks_only: bool = False,
) -> Any:
    """One stage whose embedding, block linears and LM head are stored as ``weights`` (with
    ``blocks_only``, the server's: its block linears only): the other tensors (norms, biases)
    are read whole in ``dtype``; each stored weight is read a slab of rows at a time and
    packed, so at most one slab of it is ever held in fp32."""
    config = load_config(folder)
    _check_depth(folder, config, layout)
    stage = _meta_stage(config, layout, part)
    stored = stored_modules(stage)
    if blocks_only:
        stored = [name for name in stored if name.split(".", 1)[0] in ("layers", "h")]
    packed = {f"{name}.weight" for name in stored}
    files = WeightFiles(folder)
    prefix = _body_prefix(files.keys(), folder)
    plain = [n for n in stage.state_dict() if n not in packed]
    if plain:
        tensors = _read_tensors(folder, plain, dtype=dtype, device=device)
        stage.load_state_dict(tensors, strict=False, assign=True)
    for name in stored:
        if name == "lm_head" and tied is not None:
            store_module(stage, name, weights, None, device=device, tied=tied)
            continue
        key = _file_key(f"{name}.weight", prefix, files.keys())

        def read(start: int, stop: int, key: str = key) -> torch.Tensor:
            return files.read_rows(key, start, stop, dtype=torch.float32)

        store_module(stage, name, weights, read, device=device)
    if stage.family == "llama" and stage.block_indices:
        stage.rotary_emb = rotary_embedding(config).to(device)  # computed buffers, not weights
    meta = [n for n, t in (*stage.named_parameters(), *stage.named_buffers()) if t.is_meta]
    if meta:  # every tensor is either read or stored: a name left over is a bug here
        raise RuntimeError(f"stage {part}: tensors left unread: {meta[:4]}")
    stage.requires_grad_(False)
    return stage.eval()


def _build(
    folder: Path,
    layout: SplitLayout,
    part: Part,
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    lm_head: nn.Parameter | None = None,
) -> Any:
    config = load_config(folder)
    _check_depth(folder, config, layout)
    stage = _meta_stage(config, layout, part)
    names = [n for n in stage.state_dict() if not (lm_head is not None and n == "lm_head.weight")]
    tensors = _read_tensors(folder, names, dtype=dtype, device=device)
    if lm_head is not None:
        tensors["lm_head.weight"] = lm_head
    stage.load_state_dict(tensors, strict=True, assign=True)
    if lm_head is not None:
        tail = cast(TailStage, stage)  # only a tail is given the head's embedding
        tail.lm_head.weight = lm_head  # the very same Parameter as the head's embedding
    if stage.family == "llama" and stage.block_indices:
        stage.rotary_emb = rotary_embedding(config).to(device)  # computed buffers, not weights
    stage.requires_grad_(False)
    return stage.eval()


def _check_depth(folder: Path, config: Any, layout: SplitLayout) -> None:
    if int(config.num_hidden_layers) != layout.num_layers:
        raise ValueError(
            f"layout is for {layout.num_layers} blocks but {folder} has "
            f"{config.num_hidden_layers}; "
            "make the layout with split_layout(config) for this model"
        )


def _meta_stage(config: Any, layout: SplitLayout, part: Part) -> Any:
    """``part``'s modules on the meta device: its structure and names, no memory."""
    cls = {"head": HeadStage, "middle": MiddleStage, "tail": TailStage}.get(part, ServerLossStage)
    with torch.device("meta"):
        return cls(config, stage_blocks(layout, part))


def _read_tensors(
    folder: Path, names: list[str], *, dtype: torch.dtype, device: str | torch.device
) -> dict[str, torch.Tensor]:
    """Read exactly ``names`` (stage-local names), opening only the files that hold them."""
    files = WeightFiles(folder)
    keys = files.keys()
    prefix = _body_prefix(keys, folder)
    file_keys = {name: _file_key(name, prefix, keys) for name in names}
    tensors = files.read(file_keys.values(), dtype=dtype, device=device)
    return {name: tensors[key] for name, key in file_keys.items()}


def stage_file_keys(folder: Path, layout: SplitLayout, part: Part) -> list[str]:
    """The file keys of the tensors ``part`` reads (to check which shards a stage opens)."""
    stage = _meta_stage(load_config(folder), layout, part)
    keys = WeightFiles(folder).keys()
    prefix = _body_prefix(keys, folder)
    return [_file_key(name, prefix, keys) for name in stage.state_dict()]


def _body_prefix(keys: set[str], folder: Path) -> str:
    for prefix in _BODY_PREFIXES:
        if f"{prefix}embed_tokens.weight" in keys or f"{prefix}wte.weight" in keys:
            return prefix
    raise ModelFileError(
        f"{folder}: its weights hold no token embedding (embed_tokens / wte); is it a causal LM?"
    )


def _file_key(name: str, prefix: str, keys: set[str]) -> str:
    if name != "lm_head.weight":
        return prefix + name
    if "lm_head.weight" in keys:
        return "lm_head.weight"
    embed = f"{prefix}embed_tokens.weight"  # tied: the LM head is the token embedding
    return embed if embed in keys else f"{prefix}wte.weight"


def _ties_embeddings(folder: Path, config: Any) -> bool:
    """Tied when the config says so, or when the file has no separate LM head."""
    if getattr(config, "tie_word_embeddings", False):
        return True
    return "lm_head.weight" not in WeightFiles(folder).keys()
