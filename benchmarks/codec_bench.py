"""Size, error, speed and one-step training effect of each tensor codec on real SmolLM2 traffic.

    python benchmarks/codec_bench.py [--model default] [--head-layers 1] [--batch 8]
                                     [--seq-len 512] [--repeats 5] [--codecs fp32,int4,...]
                                     [--step-batch 4] [--step-seq-len 256]

(with fedpipe installed, or from the repo root with ``PYTHONPATH=.``). Prints one JSON object;
progress goes to stderr.

The tensors are what the link really carries, not noise: the activation is the head's output
(embedding and the first blocks of the bundled model on text from the bundled corpus), and the
output gradient is the gradient of the batch's mean token loss with respect to the middle's
output, from a real backward through the tail. Real hidden states have a few large outlier
channels and real gradients are tiny (the loss is a mean over thousands of tokens): both
matter to a codec's error, and noise has neither.

For each codec and each of the two tensors: bytes per value and per token (scales included),
relative RMS error, max abs error, and encode and decode milliseconds (best of ``--repeats``,
one torch thread, as the device and the server run). ``step`` then runs one training step's
forward and backward through head, middle and tail with every cut coded by the codec
(activation up, output down, output gradient up, input gradient down) and compares the loss
and the gradient the head receives with lossless ones.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from fedpipe.data.blocks import tokenize_blocks
from fedpipe.data.documents import default_corpus
from fedpipe.models import load_config, resolve_model
from fedpipe.models.loading import load_tokenizer
from fedpipe.split import split_layout
from fedpipe.split.build import build_device_stages, build_stage
from fedpipe.wire.tensors import CODECS, encoded_nbytes, tensor_from_proto, tensor_to_proto

BENCH_CODECS = (
    *CODECS,
    "int4t",
    "int4tg32",
    "int4g128",
    "int2t",
    "int2tg16",
    # the largest value(s) of each group sent exactly (o: one, o2: two)
    "int4to",
    "int4tog128",
    "int4to2g128",
    "int2to",
)
# One step with the forward tensors in one codec and the gradients in another ("A/G").
BENCH_STEPS = (
    "int4t/int4",
    "int4t/int2",
    "int4tg32/int4",
    "int8/int4",
    "int4to/int2",
    "int4tog128/int2",
)


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@dataclass
class SplitModel:
    """The model cut as fedpipe cuts it, and a batch of corpus text."""

    head: nn.Module
    middle: nn.Module
    tail: nn.Module
    ids: torch.Tensor  # (batch, seq_len) token ids


def corpus_ids(folder: Any, batch: int, seq_len: int) -> torch.Tensor:
    """(batch, seq_len) token ids of the bundled corpus."""
    ids = tokenize_blocks(default_corpus(), load_tokenizer(folder), seq_len, max_blocks=batch)
    if ids.shape[0] < batch:
        raise ValueError(
            f"the bundled corpus gave {ids.shape[0]} blocks of {seq_len} tokens, fewer than "
            f"--batch {batch}; lower --batch or --seq-len"
        )
    return ids


def load_split(model: str, head_layers: int, batch: int, seq_len: int) -> SplitModel:
    """Head, middle and one-block tail of ``model`` (frozen fp32) and ``batch`` corpus blocks."""
    folder = resolve_model(model)
    plan = split_layout(load_config(folder), head_layers=head_layers, tail_layers=1)
    head, tail = build_device_stages(folder, plan)
    assert tail is not None
    middle = build_stage(folder, plan, "middle")
    return SplitModel(head, middle, tail, corpus_ids(folder, batch, seq_len))


@torch.no_grad()
def head_output(model: str, head_layers: int, batch: int, seq_len: int) -> torch.Tensor:
    """(batch, seq_len, hidden): the first ``head_layers`` blocks run on corpus text."""
    folder = resolve_model(model)
    plan = split_layout(load_config(folder), head_layers=head_layers, tail_layers=1)
    head, _ = build_device_stages(folder, plan)
    return head(corpus_ids(folder, batch, seq_len)).float()


def output_gradient(m: SplitModel, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(mean token loss, d loss / d middle output) of ``ids``: the OUTPUT_GRAD a device sends."""
    with torch.no_grad():
        out = m.middle(m.head(ids))
    out.requires_grad_(True)
    loss_sum, tokens = m.tail(out, ids)
    loss = loss_sum / tokens
    loss.backward()
    assert out.grad is not None
    return float(loss.detach()), out.grad


def _coded(x: torch.Tensor, codec: str) -> torch.Tensor:
    """``x`` after a trip over the wire with ``codec``."""
    return tensor_from_proto(tensor_to_proto(x, codec))


def codec_rows(
    x: torch.Tensor, repeats: int, codecs: tuple[str, ...] = CODECS
) -> list[dict[str, Any]]:
    """Per codec: wire size, encode/decode time, and the error it adds to ``x``."""
    mb = x.numel() * 4 / 1e6
    tokens = x[..., 0].numel()
    rms = x.pow(2).mean().sqrt().item()
    rows = []
    for codec in codecs:
        msg = tensor_to_proto(x, codec)
        enc = _best_seconds(partial(tensor_to_proto, x, codec), repeats)
        dec = _best_seconds(partial(tensor_from_proto, msg), repeats)
        err = tensor_from_proto(msg) - x
        nbytes = encoded_nbytes(x.shape, codec)
        rows.append(
            {
                "codec": codec,
                "wire_mb": round(nbytes / 1e6, 3),
                "bytes_per_value": round(nbytes / x.numel(), 4),
                "bytes_per_token": round(nbytes / tokens, 1),
                "encode_ms": round(enc * 1e3, 2),
                "decode_ms": round(dec * 1e3, 2),
                "encode_mb_s": round(mb / enc),
                "decode_mb_s": round(mb / dec),
                "max_abs_err": float(f"{err.abs().max().item():.3e}"),
                "rms_err_rel": float(f"{err.pow(2).mean().sqrt().item() / rms:.3e}"),
            }
        )
    return rows


def _input_gradient(m: SplitModel, ids: torch.Tensor, spec: str) -> tuple[float, torch.Tensor]:
    """(loss, gradient the head receives) of one step whose cut tensors use ``spec``.

    ``spec`` is a codec, or ``A/G``: activation and output in ``A``, both gradients in ``G``.
    """
    codec, _, grad_codec = spec.partition("/")
    grad_codec = grad_codec or codec
    with torch.no_grad():
        act = _coded(m.head(ids), codec)  # ACTIVATION, up
    act.requires_grad_(True)
    out = m.middle(act)
    received = _coded(out.detach(), codec).requires_grad_(True)  # OUTPUT, down
    loss_sum, tokens = m.tail(received, ids)
    loss = loss_sum / tokens
    loss.backward()
    assert received.grad is not None
    out.backward(_coded(received.grad, grad_codec))  # OUTPUT_GRAD, up
    assert act.grad is not None
    return float(loss.detach()), _coded(act.grad, grad_codec)  # INPUT_GRAD, down


def _step_bytes_per_value(spec: str) -> float:
    """Mean bytes per value over a step's four cut tensors (SmolLM2's width, 64-token groups)."""
    codec, _, grad_codec = spec.partition("/")
    shape = (1, 1024, 576)
    total = 2 * encoded_nbytes(shape, codec) + 2 * encoded_nbytes(shape, grad_codec or codec)
    return round(total / (4 * 1024 * 576), 4)


def step_rows(m: SplitModel, ids: torch.Tensor, codecs: tuple[str, ...]) -> list[dict[str, Any]]:
    """Per codec: the step's loss and the head's gradient against the lossless step's."""
    loss0, grad0 = _input_gradient(m, ids, "fp32")
    rows = [{"codec": "fp32", "bytes_per_value": 4.0, "loss": round(loss0, 5), "loss_rel_diff": 0}]
    for codec in codecs:
        if codec == "fp32":
            continue
        loss, grad = _input_gradient(m, ids, codec)
        rel = (grad - grad0).norm() / grad0.norm()
        cos = torch.nn.functional.cosine_similarity(grad.reshape(-1), grad0.reshape(-1), dim=0)
        rows.append(
            {
                "codec": codec,
                "bytes_per_value": _step_bytes_per_value(codec),
                "loss": round(loss, 5),
                "loss_rel_diff": float(f"{(loss - loss0) / loss0:.3e}"),
                "input_grad_rel_err": float(f"{rel.item():.3e}"),
                "input_grad_cos": round(cos.item(), 6),
            }
        )
        print(f"step with {codec}: loss {loss:.5f} (lossless {loss0:.5f})", file=sys.stderr)
    return rows


def head_report(args: argparse.Namespace, layers: int, codecs: tuple[str, ...]) -> dict[str, Any]:
    """Everything measured at one cut (after ``layers`` head blocks)."""
    m = load_split(args.model, layers, args.batch, args.seq_len)
    with torch.no_grad():
        x = m.head(m.ids).float()
    print(f"head {layers}: activation {tuple(x.shape)}", file=sys.stderr)
    loss, grad = output_gradient(m, m.ids)
    print(f"head {layers}: output gradient, loss {loss:.4f}", file=sys.stderr)
    step_ids = m.ids[: args.step_batch, : args.step_seq_len]
    return {
        "head_layers": layers,
        "shape": list(x.shape),
        "fp32_mb": round(x.numel() * 4 / 1e6, 3),
        "max_abs": round(x.abs().max().item(), 3),
        "rms": round(x.pow(2).mean().sqrt().item(), 4),
        "codecs": codec_rows(x, args.repeats, codecs),
        "output_grad": {
            "max_abs": float(f"{grad.abs().max().item():.3e}"),
            "rms": float(f"{grad.pow(2).mean().sqrt().item():.3e}"),
            "codecs": codec_rows(grad, args.repeats, codecs),
        },
        "step": {
            "shape": list(step_ids.shape),
            "codecs": step_rows(m, step_ids, codecs + tuple(args.steps)),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="model spec (default: bundled SmolLM2)")
    parser.add_argument("--head-layers", type=int, nargs="+", default=[1])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--codecs", default=",".join(BENCH_CODECS), help="comma-separated")
    parser.add_argument(
        "--steps",
        type=lambda s: [c for c in s.split(",") if c],
        default=list(BENCH_STEPS),
        help="comma-separated A/G pairs for the step run (forward codec / gradient codec)",
    )
    parser.add_argument("--step-batch", type=int, default=4, help="sequences of the step run")
    parser.add_argument("--step-seq-len", type=int, default=256, help="tokens of the step run")
    args = parser.parse_args()
    codecs = tuple(c.strip() for c in args.codecs.split(",") if c.strip())
    torch.set_num_threads(1)  # as the device and the server run (one torch thread each)
    report: dict[str, Any] = {
        "model": args.model,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "heads": [head_report(args, layers, codecs) for layers in args.head_layers],
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
