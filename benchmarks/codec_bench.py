"""Encode/decode throughput of each tensor codec on one SmolLM2-135M microbatch activation.

    python benchmarks/codec_bench.py [--shape 8 512 576] [--repeats 20]

(with fedpipe installed, or from the repo root with ``PYTHONPATH=.``).

MB/s counts the fp32 tensor's bytes (what the codec consumes or produces), so codecs compare
on the same work; "wire" is the encoded payload size.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch

from fedpipe.transport.codec import CODECS, encoded_nbytes, tensor_from_proto, tensor_to_proto


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs="+", default=[8, 512, 576])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    x = torch.randn(args.shape, generator=torch.Generator().manual_seed(0))  # (B, T, C)
    mb = x.numel() * 4 / 1e6
    print(f"shape {tuple(x.shape)}, fp32 {mb:.1f} MB, torch threads {torch.get_num_threads()}")
    print(
        f"{'codec':<6} {'wire MB':>8} {'encode MB/s':>12} {'decode MB/s':>12} {'max abs err':>12}"
    )
    for codec in CODECS:
        msg = tensor_to_proto(x, codec)
        enc = _best_seconds(partial(tensor_to_proto, x, codec), args.repeats)
        dec = _best_seconds(partial(tensor_from_proto, msg), args.repeats)
        err = (tensor_from_proto(msg) - x).abs().max().item()
        wire = encoded_nbytes(x.shape, codec) / 1e6
        print(f"{codec:<6} {wire:>8.2f} {mb / enc:>12.0f} {mb / dec:>12.0f} {err:>12.2e}")


if __name__ == "__main__":
    main()
