"""Error and throughput of each tensor codec on a real SmolLM2 activation at the cut.

    python benchmarks/codec_bench.py [--model default] [--head-layers 1 2] [--batch 8]
                                     [--seq-len 512] [--repeats 10]

(with fedpipe installed, or from the repo root with ``PYTHONPATH=.``). Prints one JSON object.

The activation is what the device really sends: the head (embedding and the first blocks) of
the bundled model run on real text from the bundled corpus. Random noise understates the
error: real hidden states have a few large outlier channels, and bf16/fp16/int8 error grows
with magnitude (issue 11 measured 0.88 max abs error for bf16 on a head-2 output, against
1.6e-2 on noise). MB/s counts the fp32 tensor's bytes; ``wire_mb`` is the encoded payload.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from fedpipe.data.blocks import tokenize_blocks
from fedpipe.data.documents import default_corpus
from fedpipe.models import load_config, resolve_model
from fedpipe.models.loading import load_tokenizer
from fedpipe.split import plan_split
from fedpipe.split.build import build_device_stages
from fedpipe.transport.codec import CODECS, encoded_nbytes, tensor_from_proto, tensor_to_proto


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@torch.no_grad()
def head_output(model: str, head_layers: int, batch: int, seq_len: int) -> torch.Tensor:
    """(batch, seq_len, hidden): the first ``head_layers`` blocks run on corpus text."""
    folder = resolve_model(model)
    plan = plan_split(load_config(folder), head_layers=head_layers, tail_layers=1)
    head, _ = build_device_stages(folder, plan)
    ids = tokenize_blocks(default_corpus(), load_tokenizer(folder), seq_len, max_blocks=batch)
    if ids.shape[0] < batch:
        raise ValueError(
            f"the bundled corpus gave {ids.shape[0]} blocks of {seq_len} tokens, fewer than "
            f"--batch {batch}; lower --batch or --seq-len"
        )
    return head(ids).float()


def codec_rows(x: torch.Tensor, repeats: int) -> list[dict[str, Any]]:
    """Per codec: wire size, encode/decode throughput, and the error it adds to ``x``."""
    mb = x.numel() * 4 / 1e6
    rms = x.pow(2).mean().sqrt().item()
    rows = []
    for codec in CODECS:
        msg = tensor_to_proto(x, codec)
        enc = _best_seconds(partial(tensor_to_proto, x, codec), repeats)
        dec = _best_seconds(partial(tensor_from_proto, msg), repeats)
        err = tensor_from_proto(msg) - x
        rows.append(
            {
                "codec": codec,
                "wire_mb": round(encoded_nbytes(x.shape, codec) / 1e6, 3),
                "encode_mb_s": round(mb / enc),
                "decode_mb_s": round(mb / dec),
                "max_abs_err": float(f"{err.abs().max().item():.3e}"),
                "rms_err_rel": float(f"{err.pow(2).mean().sqrt().item() / rms:.3e}"),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="model spec (default: bundled SmolLM2)")
    parser.add_argument("--head-layers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the device and the server run (one torch thread each)
    report: dict[str, Any] = {"model": args.model, "heads": []}
    for layers in args.head_layers:
        x = head_output(args.model, layers, args.batch, args.seq_len)
        print(f"head {layers}: activation {tuple(x.shape)}", file=sys.stderr)
        report["heads"].append(
            {
                "head_layers": layers,
                "shape": list(x.shape),
                "fp32_mb": round(x.numel() * 4 / 1e6, 3),
                "max_abs": round(x.abs().max().item(), 3),
                "rms": round(x.pow(2).mean().sqrt().item(), 4),
                "codecs": codec_rows(x, args.repeats),
            }
        )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
