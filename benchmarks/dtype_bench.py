"""device.dtype: a device step in fp32 and in bf16 (CPU autocast), side by side in one run.

    python benchmarks/dtype_bench.py [--model smollm2-135m] [--steps 3] [--threads 1]

A step is the device runtime's (fedpipe.edge.runtime): the head's forward, the tail's forward,
chunked loss and backward, the head's backward and AdamW on the LoRA weights, against a server
that answers with its input (fedpipe_bench.step_memory's echo; the middle is not the device's
work). The stages have random weights in a published model's shape (nothing downloaded), the
same for both dtypes. Each dtype runs one warm-up step, then the steps alternate fp32, bf16 so
that a change in the machine's load falls on both. Prints one JSON object: the median seconds
of a step per dtype, their ratio (fp32 / bf16), the losses, and whether the CPU reports native
bf16 matmuls (amx_bf16, avx512_bf16 in /proc/cpuinfo). No limits are asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from fedpipe_bench.step_memory import (
    MODEL_SHAPES,
    StepSpec,
    _batches,
    _device_stages,
    _EchoServer,
    model_config,
)

from fedpipe.config import DEVICE_DTYPES, FedpipeConfig
from fedpipe.edge.runtime import DeviceRuntime


def _cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    return sorted({f for f in ("amx_bf16", "avx512_bf16") if f in text.split()})


def dtype_report(spec: StepSpec) -> dict[str, Any]:
    """Seconds of a device step at each ``device.dtype`` (median of ``spec.steps``)."""
    config = model_config(spec)
    defaults = FedpipeConfig()
    runtimes = {}
    for dtype in DEVICE_DTYPES:
        torch.manual_seed(0)  # the same LoRA initialisation for both
        head, tail = _device_stages(spec, config)
        params = [p for s in (head, tail) for p in s.parameters() if p.requires_grad]
        runtimes[dtype] = DeviceRuntime(
            head,
            tail,
            _EchoServer(),
            optimizer=torch.optim.AdamW(params, lr=defaults.train.lr),
            schedule=defaults.pipeline.schedule,
            microbatches=spec.microbatches,
            dtype=dtype,
        )
    batches = _batches(spec, int(config.vocab_size))
    seconds: dict[str, list[float]] = {d: [] for d in DEVICE_DTYPES}
    losses: dict[str, list[float]] = {d: [] for d in DEVICE_DTYPES}
    for step, ids in enumerate([batches[0], *batches]):
        for dtype, runtime in runtimes.items():
            start = time.perf_counter()
            result = runtime.train_step({"input_ids": ids, "labels": ids}, step=step)
            runtime.finish()
            if step > 0:  # step 0: the warm-up
                seconds[dtype].append(time.perf_counter() - start)
                losses[dtype].append(round(result.loss, 5))
    median = {d: statistics.median(s) for d, s in seconds.items()}
    return {
        "model": spec.model,
        "head_layers": spec.head_layers,
        "tail_layers": spec.tail_layers,
        "batch_size": spec.batch_size,
        "seq_len": spec.seq_len,
        "microbatches": spec.microbatches,
        "loss_chunk": spec.loss_chunk,
        "threads": torch.get_num_threads(),
        "steps": spec.steps,
        "cpu_bf16_flags": _cpu_flags(),
        "step_s": {d: round(s, 4) for d, s in median.items()},
        "all_step_s": {d: [round(x, 4) for x in s] for d, s in seconds.items()},
        "fp32_over_bf16": round(median["fp32"] / median["bf16"], 3),
        "losses": losses,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--head-layers", type=int, default=2)
    parser.add_argument("--tail-layers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = StepSpec(
        model=args.model,
        what="device",
        loss_chunk=FedpipeConfig().train.loss_chunk,
        head_layers=args.head_layers,
        tail_layers=args.tail_layers,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        microbatches=args.microbatches,
        steps=args.steps,
    )
    report = dtype_report(spec)
    s = report["step_s"]
    print(
        f"device step, {args.threads} thread(s): fp32 {s['fp32']:.3f} s, bf16 {s['bf16']:.3f} s, "
        f"fp32/bf16 = {report['fp32_over_bf16']:.2f}x",
        file=sys.stderr,
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
