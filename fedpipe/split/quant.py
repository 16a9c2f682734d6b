"""A device's frozen weights stored in bf16, int8 or int4, dequantized on the fly (device.weights).

What is stored: the token embedding, every linear of the device's blocks, and the LM head (a
tied embedding and LM head once, the same two tensors in both modules). Norms, biases and
GPT-2's position embedding stay fp32 (a few KB). Compute stays fp32: a weight is dequantized a
slab of at most :data:`SLAB` values at a time (the whole weight of a SmolLM2 block linear, a
slice of a 128k-row LM head), used and dropped, in the forward and again in the backward.

- ``bf16``: the weight rounded to bfloat16 (2 bytes), upcast to fp32 per slab;
- ``int8``: symmetric, per output channel (per row: per token of the embedding): an int8 per
  weight and an fp32 scale per row, ``w ~ q * scale``, ``|q| <= 127``;
- ``int4``: symmetric, per group of :data:`INT4_GROUP` weights along a row: a 4-bit ``q`` in
  ``[-8, 7]`` (two per byte, stored as ``q + 8``) and an fp32 scale per group (``amax / 7``);
  a row whose width the group does not divide is padded with zeros.

A stored linear (:class:`StoredLinear`, an ``nn.Linear`` whose ``weight`` is None) computes
``x @ w.T`` in a custom autograd function whose backward gives the gradient of its input only
(the weights are frozen; LoRA's adapters beside it take their own gradients through it), and it
saves no tensor for that backward: the weight is dequantized again. peft wraps it as it wraps
any ``nn.Linear``; its ``compute_dtype`` (fp32) is what peft casts the adapters to, so LoRA
weights, their gradients and AdamW's state stay fp32. A stored embedding
(:class:`StoredEmbedding`) gathers its rows, then dequantizes those rows only.

Why not torchao or optimum-quanto: see docs/guides/device-memory.md (on CPU torch 2.13,
torchao's int4 weight-only needs CUDA kernels or stores a byte per int4 value, and quanto's int4
matmul ran ~50x slower than fp32).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from fedpipe.config.device import DEVICE_WEIGHTS

__all__ = [
    "DEVICE_WEIGHTS",
    "INT4_GROUP",
    "SLAB",
    "RowReader",
    "StoredEmbedding",
    "StoredLinear",
    "dequantize",
    "linear_product",
    "linear_product_t",
    "quantize",
    "stored_bytes",
    "storage_of",
    "stored_modules",
    "store_module",
]

INT4_GROUP = 64  # int4: weights per scale, along a row
# Weights dequantized at once: 4 MiB in fp32 (a 128k x 2048 LM head in 251 slabs of 512 rows).
# What a slab costs besides its product is held only while it runs.
SLAB = 1 << 20

# (start, stop) -> fp32 rows [start:stop) of a weight (out, in): how a stored weight is filled
RowReader = Callable[[int, int], Tensor]


def _check(weights: str) -> None:
    if weights not in DEVICE_WEIGHTS[1:]:
        raise ValueError(
            f"stored weights {weights!r} unknown; choose one of {', '.join(DEVICE_WEIGHTS[1:])}"
        )


def _groups(in_features: int) -> int:
    return -(-in_features // INT4_GROUP)


def stored_bytes(out_features: int, in_features: int, weights: str) -> int:
    """Bytes of a (out, in) weight stored as ``weights`` (fp32: 4 a weight), scales included."""
    if weights == "fp32":
        return 4 * out_features * in_features
    _check(weights)
    if weights == "bf16":
        return 2 * out_features * in_features
    if weights == "int8":
        return out_features * in_features + 4 * out_features
    groups = _groups(in_features)
    return out_features * groups * (INT4_GROUP // 2 + 4)


def quantize(weight: Tensor, weights: str) -> tuple[Tensor, Tensor | None]:
    """(data, scale) of ``weight`` (rows, in) stored as ``weights``; rows are independent, so
    a weight quantized a slab of rows at a time is the same as quantized whole."""
    _check(weights)
    w = weight.detach().float()
    if weights == "bf16":
        return w.to(torch.bfloat16), None
    if weights == "int8":
        scale = w.abs().amax(dim=1) / 127.0  # (rows,)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row
        q = torch.div(w, scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        return q, scale
    rows, width = w.shape
    groups = _groups(width)
    if groups * INT4_GROUP != width:
        w = F.pad(w, (0, groups * INT4_GROUP - width))
    g = w.view(rows, groups, INT4_GROUP)
    scale = g.abs().amax(dim=2) / 7.0  # (rows, groups)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.div(g, scale[..., None]).round_().clamp_(-8, 7).add_(8).to(torch.uint8)
    q = q.view(rows, groups * INT4_GROUP)
    return q[:, 0::2] | (q[:, 1::2] << 4), scale  # (rows, groups * GROUP / 2) two per byte


def dequantize(data: Tensor, scale: Tensor | None, weights: str, in_features: int) -> Tensor:
    """fp32 rows (..., in) of stored ``data`` (..., stored width) and their ``scale``."""
    if weights == "bf16":
        return data.float()
    assert scale is not None
    if weights == "int8":
        return data * scale.unsqueeze(-1)  # int8 x fp32 -> fp32 in one pass
    lead = data.shape[:-1]
    nibbles = torch.stack((data & 15, data >> 4), dim=-1)  # (..., P, 2) uint8, 0..15
    groups = scale.shape[-1]
    q = nibbles.view(torch.int8).view(*lead, groups, INT4_GROUP).sub_(8)  # -8..7, exact
    out = (q * scale.unsqueeze(-1)).view(*lead, groups * INT4_GROUP)  # int8 x fp32 -> fp32
    return out if groups * INT4_GROUP == in_features else out[..., :in_features]


def pack_rows(
    read: RowReader, rows: int, in_features: int, weights: str, device: Any = "cpu"
) -> tuple[Tensor, Tensor | None]:
    """(data, scale) of a (rows, in) weight read a slab of rows at a time from ``read``, so
    that no more than one slab of it is ever held in fp32 (a 1 GB embedding never is)."""
    _check(weights)
    step = max(1, SLAB // max(in_features, 1))
    data_out: Tensor | None = None
    scale_out: Tensor | None = None
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        data, scale = quantize(read(start, stop), weights)
        if data_out is None:  # filled in place: the packed weight is never held twice
            data_out = torch.empty((rows, *data.shape[1:]), dtype=data.dtype, device=device)
            if scale is not None:
                scale_out = torch.empty((rows, *scale.shape[1:]), device=device)
        data_out[start:stop] = data
        if scale_out is not None and scale is not None:
            scale_out[start:stop] = scale
    assert data_out is not None, "a weight of no rows"
    return data_out, scale_out


class _Stored:
    """What a stored linear and a stored embedding share: the packed weight and its rows."""

    qweight: nn.Parameter
    qscale: nn.Parameter | None
    weights: str
    stored_width: int  # the weight's in-features (the embedding's width)

    def _init_store(
        self, data: Tensor | nn.Parameter, scale: Tensor | nn.Parameter | None, weights: str
    ) -> None:
        """Register the packed tensors (Parameters that never train: a tied pair shares them,
        and ``parameters()`` counts them once)."""
        module = cast(nn.Module, self)
        module.register_parameter("weight", None)
        module.register_parameter("qweight", _frozen(data))
        module.register_parameter("qscale", None if scale is None else _frozen(scale))
        self.weights = weights

    def rows(self, start: int, stop: int) -> Tensor:
        """fp32 rows [start:stop) of the weight."""
        scale = None if self.qscale is None else self.qscale[start:stop]
        return dequantize(self.qweight[start:stop], scale, self.weights, self.stored_width)

    def stored(self) -> tuple[nn.Parameter, nn.Parameter | None]:
        """The packed tensors themselves (to tie another module to them)."""
        return self.qweight, self.qscale


def _frozen(tensor: Tensor | nn.Parameter) -> nn.Parameter:
    if isinstance(tensor, nn.Parameter):
        return tensor  # shared with the module it is tied to
    return nn.Parameter(tensor, requires_grad=False)


class _FrozenProduct(torch.autograd.Function):
    """``x @ w.T`` of a stored weight: the gradient of ``x`` only, nothing saved."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, layer: StoredLinear) -> Tensor:  # type: ignore[override]
        ctx.layer = layer
        return layer.product(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None]:  # type: ignore[override]
        if not ctx.needs_input_grad[0]:
            return None, None
        return ctx.layer.product_t(grad), None


class StoredLinear(_Stored, nn.Linear):
    """A frozen ``nn.Linear`` whose weight is stored as bf16, int8 or int4 (``weight`` is None).

    The product runs over slabs of output rows of at most :data:`SLAB` weights, each
    dequantized to fp32, multiplied and dropped; the backward does the same for the input's
    gradient. The bias (if any) stays fp32 and frozen.
    """

    compute_dtype = torch.float32  # peft casts the LoRA adapters beside it to this

    def __init__(
        self,
        data: Tensor | nn.Parameter,
        scale: Tensor | nn.Parameter | None,
        *,
        weights: str,
        in_features: int,
        out_features: int,
        bias: Tensor | None = None,
    ) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.stored_width = in_features
        self._init_store(data, scale, weights)
        frozen = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.register_parameter("bias", frozen)

    def _slabs(self) -> range:
        return range(0, self.out_features, max(1, SLAB // max(self.in_features, 1)))

    def product(self, x: Tensor) -> Tensor:
        """(..., in) -> (..., out) ``x @ w.T``, the weight dequantized slab by slab."""
        flat = x.reshape(-1, self.in_features)
        slabs = self._slabs()
        if len(slabs) == 1:
            out = flat @ self.rows(0, self.out_features).to(x.dtype).t()
        else:
            out = flat.new_empty(flat.shape[0], self.out_features)
            for start in slabs:
                stop = min(start + slabs.step, self.out_features)
                out[:, start:stop] = flat @ self.rows(start, stop).to(x.dtype).t()
        return _shaped(out, x.shape[:-1])

    def product_t(self, grad: Tensor) -> Tensor:
        """(..., out) -> (..., in) ``grad @ w``: the input's gradient, slab by slab."""
        flat = grad.reshape(-1, self.out_features)
        slabs = self._slabs()
        if len(slabs) == 1:
            out = flat @ self.rows(0, self.out_features).to(grad.dtype)
        else:
            out = flat.new_zeros(flat.shape[0], self.in_features)
            for start in slabs:
                stop = min(start + slabs.step, self.out_features)
                out.addmm_(flat[:, start:stop], self.rows(start, stop).to(grad.dtype))
        return _shaped(out, grad.shape[:-1])

    def forward(self, x: Tensor) -> Tensor:
        out = cast(Tensor, _FrozenProduct.apply(x, self))
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, weights={self.weights}"
        )


def _shaped(out: Tensor, lead: torch.Size) -> Tensor:
    """(rows, width) ``out`` as (*lead, width); itself, not a view of it, when 2-D already:
    the batched bank adds LoRA terms into its rows in place, which autograd refuses on a view
    whose slice covers the whole of a leaf (as a plain linear's product never is)."""
    return out if len(lead) == 1 else out.view(*lead, out.shape[-1])


class StoredEmbedding(_Stored, nn.Embedding):
    """A frozen ``nn.Embedding`` stored as bf16, int8 or int4: rows gathered, then dequantized."""

    def __init__(
        self,
        data: Tensor | nn.Parameter,
        scale: Tensor | nn.Parameter | None,
        *,
        weights: str,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
    ) -> None:
        nn.Module.__init__(self)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        self.max_norm, self.norm_type = None, 2.0
        self.scale_grad_by_freq, self.sparse = False, False
        self.stored_width = embedding_dim
        self._init_store(data, scale, weights)

    def forward(self, ids: Tensor) -> Tensor:
        scale = None if self.qscale is None else self.qscale[ids]
        return dequantize(self.qweight[ids], scale, self.weights, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, weights={self.weights}"


def linear_product(linear: nn.Linear, x: Tensor) -> Tensor:
    """``x @ W.T + b`` of a frozen linear, no graph through its weight: a stored one's weight
    dequantized slab by slab, a plain one's ``F.linear`` (what the server's batched bank calls
    on the joined rows of all its sessions)."""
    if isinstance(linear, StoredLinear):
        out = linear.product(x)
        return out if linear.bias is None else out + linear.bias
    return F.linear(x, linear.weight, linear.bias)


def linear_product_t(linear: nn.Linear, grad: Tensor) -> Tensor:
    """``grad @ W``: the input's gradient through a frozen linear, stored or plain."""
    if isinstance(linear, StoredLinear):
        return linear.product_t(grad)
    return grad @ linear.weight


def storage_of(module: nn.Module) -> str:
    """How ``module``'s linears are stored: the first stored linear's format, else fp32."""
    for sub in module.modules():
        if isinstance(sub, StoredLinear):
            return sub.weights
    return "fp32"


def stored_modules(stage: nn.Module) -> list[str]:
    """Names of the modules of ``stage`` whose weight ``device.weights`` stores: its token
    embedding, every linear of its blocks and its LM head (GPT-2's position embedding and every
    norm stay fp32). Works on a stage on the meta device."""
    names: list[str] = []
    for name, module in stage.named_modules():
        top = name.split(".", 1)[0]
        if name in ("embed_tokens", "wte", "lm_head"):
            names.append(name)
        elif top in ("layers", "h") and isinstance(module, nn.Linear | Conv1D):
            names.append(name)
    return names


def store_module(
    stage: nn.Module,
    name: str,
    weights: str,
    read: RowReader | None,
    *,
    device: Any = "cpu",
    tied: tuple[nn.Parameter, nn.Parameter | None] | None = None,
) -> nn.Module:
    """Replace module ``name`` of ``stage`` (an embedding, linear or GPT-2 Conv1D, possibly on
    the meta device) by its stored form, its weight read from ``read`` (fp32 rows of the
    (out, in) weight; a Conv1D's rows are its (in, out) parameter's), or the packed tensors
    ``tied`` of the module it is tied to. Its bias is kept as it is (fp32)."""
    old = stage.get_submodule(name)
    if isinstance(old, nn.Embedding):
        rows, width = old.num_embeddings, old.embedding_dim
    elif isinstance(old, nn.Linear):
        rows, width = old.out_features, old.in_features
    elif isinstance(old, Conv1D):
        rows, width = old.nf, old.nx
    else:
        raise TypeError(f"{name} is a {type(old).__name__}: only embeddings and linears are stored")
    data: Tensor | nn.Parameter
    scale: Tensor | nn.Parameter | None
    if tied is not None:
        data, scale = tied
    else:
        assert read is not None
        if isinstance(old, Conv1D):  # stored (in, out): read it whole (GPT-2's are small)
            whole = read(0, width).t()
            data, scale = pack_rows(lambda a, b: whole[a:b], rows, width, weights, device)
            del whole
        else:
            data, scale = pack_rows(read, rows, width, weights, device)
    new: nn.Module
    if isinstance(old, nn.Embedding):
        new = StoredEmbedding(
            data,
            scale,
            weights=weights,
            num_embeddings=rows,
            embedding_dim=width,
            padding_idx=old.padding_idx,
        )
    else:
        bias = old.bias if isinstance(old.bias, Tensor) and not old.bias.is_meta else None
        new = StoredLinear(
            data, scale, weights=weights, in_features=width, out_features=rows, bias=bias
        )
    parent, _, leaf = name.rpartition(".")
    setattr(stage.get_submodule(parent) if parent else stage, leaf, new)
    return new
