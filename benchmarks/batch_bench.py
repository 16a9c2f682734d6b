"""Batched multi-adapter compute against peft adapter switching, on one server stage.

Forward + backward of N sessions' microbatches through the server's middle blocks:
``unbatched`` runs them one at a time on peft's AdapterBank (activate the session's adapter,
forward, backward: the server before batching); ``batched`` runs them in one call of the
BatchedAdapterBank (one frozen matmul over every session's tokens, each session's LoRA on its own
rows) and then each session's backward alone; ``batched_bwd`` runs the same forward and then ONE
batched backward over every session's tape (the server's path). Both with 1 and 2 torch threads,
repetitions
interleaved, medians reported. A second part measures what one session costs with 2 and with 64
present: adding and removing its adapter, switching to it, and one forward.

    python benchmarks/batch_bench.py [--model small-llama|smollm2] [--sessions 8] [--reps 5]

Prints one JSON object on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import LlamaConfig

from fedpipe.lora import AdapterBank, BatchedAdapterBank, Group, LoraSettings
from fedpipe.models import load_config, resolve_model
from fedpipe.split import MiddleStage, build_stage, split_layout

SETTINGS = LoraSettings(r=8, alpha=16, seed=0)


def _stage(model: str) -> torch.nn.Module:
    """The middle stage: small-llama's from the registry, or SmolLM2-sized random blocks."""
    if model == "small-llama":
        folder = resolve_model("small-llama")
        return build_stage(folder, split_layout(load_config(folder)), "middle")
    config = LlamaConfig(  # SmolLM2-135M's shapes; 4 of its 30 blocks (a middle slice)
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=2048,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return MiddleStage(config, [2, 3, 4, 5])


def _banks(stage: torch.nn.Module, n: int) -> tuple[AdapterBank, BatchedAdapterBank]:
    peft = AdapterBank(copy.deepcopy(stage), SETTINGS, family="llama")
    batched = BatchedAdapterBank(stage, SETTINGS, family="llama")
    for i in range(n):
        peft.add(f"s{i}")
        batched.add(f"s{i}")
    return peft, batched


def _inputs(n: int, width: int, tokens: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    rows = [1 + i % 2 for i in range(n)]  # microbatches of 1-2 x tokens
    return [
        (f"s{i}", torch.randn(b, tokens, width, generator=gen), torch.randn(b, tokens, width))
        for i, b in enumerate(rows)
    ]


def _unbatched(bank: AdapterBank, inputs: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
    for name, x, g in inputs:
        bank.activate(name)
        x = x.clone().requires_grad_(True)
        bank.stage(x).backward(g)


def _batched(
    bank: BatchedAdapterBank, inputs: list[tuple[str, torch.Tensor, torch.Tensor]]
) -> None:
    xs = [x.clone().requires_grad_(True) for _, x, _ in inputs]
    ys = bank.run([Group(name, x) for (name, _, _), x in zip(inputs, xs, strict=True)])
    for y, (_, _, g) in zip(ys, inputs, strict=True):
        y.backward(g)  # each session's own backward, as its OUTPUT_GRAD arrives


def _batched_bwd(
    bank: BatchedAdapterBank, inputs: list[tuple[str, torch.Tensor, torch.Tensor]]
) -> None:
    taped = bank.run_taped([Group(name, x) for name, x, _ in inputs])
    bank.backward([(tape, g) for (_, tape), (_, _, g) in zip(taped, inputs, strict=True)])


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _timed_both(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process): the CPU time is what load on a shared
    machine disturbs least (with one thread; with two it sums both threads)."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def _ratios(stage: torch.nn.Module, sessions: int, tokens: int, reps: int) -> list[dict]:
    peft, batched = _banks(stage, sessions)
    width = int(stage.config.hidden_size)  # type: ignore[union-attr]
    inputs = _inputs(sessions, width, tokens)
    out = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        _unbatched(peft, inputs)  # warm-up
        _batched(batched, inputs)
        _batched_bwd(batched, inputs)
        times: dict[str, list[tuple[float, float]]] = {
            "unbatched": [],
            "batched": [],
            "batched_bwd": [],
        }
        for rep in range(reps):  # interleaved, so that load on the machine hits both
            times["unbatched"].append(_timed_both(lambda: _unbatched(peft, inputs)))
            times["batched"].append(_timed_both(lambda: _batched(batched, inputs)))
            times["batched_bwd"].append(_timed_both(lambda: _batched_bwd(batched, inputs)))
            print(f"threads {threads} rep {rep}: {times}", file=sys.stderr)
        entry: dict[str, Any] = {"threads": threads}
        for i, clock in enumerate(("wall", "cpu")):
            un = statistics.median(t[i] for t in times["unbatched"])
            ba = statistics.median(t[i] for t in times["batched"])
            bb = statistics.median(t[i] for t in times["batched_bwd"])
            entry[f"unbatched_{clock}_s"] = round(un, 4)
            entry[f"batched_{clock}_s"] = round(ba, 4)
            entry[f"batched_bwd_{clock}_s"] = round(bb, 4)
            entry[f"ratio_{clock}"] = round(un / ba, 3)
            entry[f"ratio_bwd_{clock}"] = round(un / bb, 3)
        out.append(entry)
    return out


def _per_session(stage: torch.nn.Module, present: int, tokens: int) -> dict[str, dict]:
    """One more session's costs with ``present`` sessions already in the bank (ms)."""
    torch.set_num_threads(1)
    peft, batched = _banks(stage, present)
    width = int(stage.config.hidden_size)  # type: ignore[union-attr]
    x = torch.randn(1, tokens, width)
    old = {
        "add_ms": _timed(lambda: peft.add("new")) * 1e3,
        "switch_ms": statistics.median(
            _timed(lambda: (peft.activate("new"), peft.activate("s0"))) / 2 for _ in range(5)
        )
        * 1e3,
    }
    peft.activate("new")
    with torch.no_grad():
        old["forward_ms"] = statistics.median(_timed(lambda: peft.stage(x)) for _ in range(5)) * 1e3
    old["remove_ms"] = _timed(lambda: peft.remove("new")) * 1e3
    new = {"add_ms": _timed(lambda: batched.add("new")) * 1e3, "switch_ms": 0.0}
    with torch.no_grad():
        new["forward_ms"] = (
            statistics.median(_timed(lambda: batched.run([Group("new", x)])) for _ in range(5))
            * 1e3
        )
    new["remove_ms"] = _timed(lambda: batched.remove("new")) * 1e3
    return {
        "old": {k: round(v, 3) for k, v in old.items()},
        "new": {k: round(v, 3) for k, v in new.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["small-llama", "smollm2"], default="small-llama")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--present", default="2,64", help="sessions present for the cost scan")
    args = parser.parse_args()
    stage = _stage(args.model)
    result = {
        "model": args.model,
        "sessions": args.sessions,
        "microbatch": f"1-2 x {args.tokens}",
        "forward_backward": _ratios(stage, args.sessions, args.tokens, args.reps),
        "per_session": {
            n: _per_session(stage, int(n), args.tokens) for n in args.present.split(",")
        },
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
