"""The server stage on one GPU: tokens/s at 1, 8 and 32 devices, batched and unbatched.

    python benchmarks/gpu_check.py [--devices 1,8,32] [--steps 3] [--budget-s 240]
                                   [--offload] [--memory-gb 16]

(with fedpipe installed, or from the repo root with ``PYTHONPATH=.``). Prints one JSON object:
``results`` holds, per model, number of devices and column (``batched``, ``unbatched``, and
``batched-looped``: the batched bank with each session's LoRA term in its own small matmuls
instead of one ``grouped_mm`` per linear, so the grouped kernel's share of the gain shows),
``tokens_per_s`` (tokens through the middle stage's forward and backward per second),
``peak_gpu_mb`` (``torch.cuda.max_memory_allocated``) and ``idle`` (1 - GPU time inside compute
calls / wall; the GPU time comes from CUDA events recorded at each call's start and end, so
launch gaps inside a call count as busy and the idle fraction is the host time between calls).
Without CUDA it prints ``{"skipped": "no CUDA device"}`` and exits 0. Under 5 minutes on one GPU.

``--offload`` adds a column ``batched-offload``: the batched bank with ``server.offload =
"auto"`` (the tapes of a waiting microbatch in pinned host memory, copied on a side stream).
Both batched columns then also report ``peak_stash_mb`` (the stash on the GPU at its peak,
:class:`~fedpipe.server.stash.StashMeter`), and ``offload`` holds, per model, the devices each
serves at a fixed GPU memory (``--memory-gb``): the peak memory's line over N
(``peak_gpu_mb = base + per_device * N``, fitted to the measured rows) solved for the budget,
and the step time of offload over batched at every N (what the copies cost).

Models: SmolLM2-135M (the bundled ``default``, split 2 + 2, 26 middle blocks) and a random
Llama-family model of about 1B parameters (hidden 2048, 16 blocks, 32 heads, 8 KV heads; random
init, nothing downloaded; 12 middle blocks). Both compute in bf16 (``server.dtype``).

No gRPC: N sessions are opened on a real :class:`~fedpipe.server.runtime.StageRuntime`
built as ``fedpipe server`` builds it (batched: the batched adapter bank and policy; unbatched:
peft's bank, one message per call) and driven in-process, step by step: every session's
activations, then every session's output gradients, then the step ends, so the runtime always
holds N sessions' work (a saturated server: what batching can gain at most). Each message
carries a fresh fp32 CPU tensor, as the transport decodes it, so the runtime's copy path runs
(``fedpipe.server.device_copies``: pinned buffers, uploads on a side stream started at
submit, replies copied back on it); ``copies`` counts what it did in the timed steps
(``prefetch_hits``: uploads done ahead of the worker; ``uploads_on_worker``: the rest).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from fedpipe.wire.backend import SessionRequest

ROWS, TOKENS, MICROBATCHES = 2, 128, 2  # per device step: 2 microbatches of 2 x 128 tokens
LLAMA_1B: dict[str, Any] = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "attn_implementation": "sdpa",
}
COLUMNS = ("unbatched", "batched", "batched-looped")
OFFLOAD = "batched-offload"  # --offload: the batched bank with server.offload = "auto"

log = logging.getLogger("gpu_check")


Build = Callable[[torch.device, torch.dtype], tuple[torch.nn.Module, Any]]


def _folder_stage(name: str) -> Build:
    """The middle stage (split 2 + 2) of a model fedpipe resolves by ``name``."""

    def build(device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, Any]:
        from fedpipe.cli.preflight import default_split
        from fedpipe.models import load_config, resolve_model
        from fedpipe.split import build_stage, split_layout

        folder = resolve_model(name)
        config = load_config(folder)
        side = default_split(int(config.num_hidden_layers))
        plan = split_layout(config, head_layers=side, tail_layers=side)
        return build_stage(folder, plan, "middle", dtype=dtype, device=device), config

    return build


def _llama_1b_stage(device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, Any]:
    """The middle 12 blocks of a random ~1B Llama, built straight on the device (no files)."""
    from transformers import LlamaConfig

    from fedpipe.split import split_layout
    from fedpipe.split.stages import MiddleStage, rotary_embedding

    config = LlamaConfig(**LLAMA_1B)
    plan = split_layout(config, head_layers=2, tail_layers=2)
    torch.manual_seed(0)
    with torch.device(device):
        stage = MiddleStage(config, plan.server_blocks).to(dtype)
    stage.rotary_emb = rotary_embedding(config).to(device)  # computed buffers stay fp32
    stage.requires_grad_(False)
    return stage.eval(), config


MODELS: dict[str, Build] = {
    "SmolLM2-135M": _folder_stage("default"),
    "llama-1b-random": _llama_1b_stage,
    "tiny-llama": _folder_stage("tiny-llama"),  # for a CPU smoke test of this script
}
GPU_MODELS = ("SmolLM2-135M", "llama-1b-random")


def _runtime(
    build: Build,
    batched: bool,
    device: torch.device,
    grouped: str = "auto",
    *,
    offload: bool = False,
    stash: bool = False,
) -> tuple[Any, Any]:
    """A StageRuntime over the built stage as ``fedpipe server`` builds it, and its probe.

    Batched: the batched adapter bank and the batching policy on; unbatched: peft's bank, one
    message per call (``server.batching = false``). ``grouped`` sets the batched bank's LoRA
    terms (``auto``: ``grouped_mm`` where it applies; ``off``: a loop over sessions).
    ``offload``: ``server.offload = "auto"``; ``stash``: the probe counts the stash. All copy
    through the runtime's
    :class:`~fedpipe.server.device_copies.DeviceCopies` (pinned buffers, side stream).
    """
    from fedpipe_bench.server_probe import ComputeProbe

    from fedpipe.config import load_config
    from fedpipe.lora import adapter_bank, lora_settings
    from fedpipe.models.loading import model_family
    from fedpipe.server.batch_policy import BatchPolicy
    from fedpipe.server.runtime import StageRuntime, StageSettings
    from fedpipe.server.sessions import RuntimeLimits

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    stage, config = build(device, dtype)
    settings = lora_settings(load_config(None, {}))
    bank = adapter_bank(stage, settings, family=model_family(config), batched=batched)
    runner = getattr(bank, "_runner", None)
    if runner is not None:
        runner.grouped = grouped
    settings = StageSettings(
        mode="u",
        hidden_size=int(config.hidden_size),
        device=device,
        dtype=dtype,
        limits=RuntimeLimits(max_sessions=80, max_microbatch_size=ROWS),
        max_positions=int(config.max_position_embeddings),
        policy=BatchPolicy(enabled=batched),
        offload=offload,
    )
    runtime = StageRuntime(bank, settings)
    probe = ComputeProbe(runtime, cuda_events=device.type == "cuda", stash=stash).install()
    return runtime, probe


def _take(handle: Any, kind: Any) -> None:
    from fedpipe.messages import StageMsg

    reply = handle.next_reply(timeout=300)
    if not isinstance(reply, StageMsg) or reply.kind is not kind:
        raise RuntimeError(f"expected {kind.name}, the runtime answered {reply!r}")


Inputs = list[tuple[list[torch.Tensor], list[torch.Tensor]]]  # per session: (xs, grads)


def _inputs(n: int, hidden: int) -> Inputs:
    """Each session's microbatches as the transport decodes them: fresh fp32 CPU tensors."""
    gen = torch.Generator().manual_seed(n)
    shape = (ROWS, TOKENS, hidden)
    return [
        (
            [torch.randn(shape, generator=gen) for _ in range(MICROBATCHES)],
            [torch.randn(shape, generator=gen) * 1e-3 for _ in range(MICROBATCHES)],
        )
        for _ in range(n)
    ]


def _step(handles: list[Any], step: int, inputs: Inputs) -> None:
    """One step of every session: all activations, then all gradients, then the step end."""
    from fedpipe.messages import Kind, StageMsg

    for kind, reply, part in (
        (Kind.ACTIVATION, Kind.OUTPUT, 0),
        (Kind.OUTPUT_GRAD, Kind.INPUT_GRAD, 1),
    ):
        for h, tensors in zip(handles, inputs, strict=True):
            for mb, tensor in enumerate(tensors[part]):
                h.submit(StageMsg(kind, step, mb, tensor=tensor))
        for h in handles:
            for _ in range(MICROBATCHES):
                _take(h, reply)
    for h in handles:
        h.submit(StageMsg(Kind.STEP_END, step))
    for h in handles:
        _take(h, Kind.STEP_DONE)


def _copy_counts(runtime: Any) -> dict[str, int]:
    stats = runtime.copies.stats
    return {
        "prefetch_hits": stats.prefetch_hits,
        "uploads_on_worker": stats.uploads_on_worker,
        "downloads": stats.downloads,
        "pool_waits": stats.pool_waits,
    }


def measure(runtime: Any, probe: Any, n: int, round_: int, steps: int) -> dict[str, Any]:
    """``n`` sessions, one warm-up step, then ``steps`` timed steps."""
    from fedpipe_bench.server_probe import window_stats

    cuda = runtime.device.type == "cuda"
    handles = []
    for i in range(n):
        sid = runtime.open(
            SessionRequest(device_id=f"d{i}", round=round_, microbatch_size=ROWS, seq_len=TOKENS)
        )
        handles.append(runtime.attach(sid))
    inputs = _inputs(n, runtime.hidden_size)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    _step(handles, 0, inputs)
    probe.snapshot()  # forget the warm-up's records ...
    if cuda:
        probe.gpu_busy_s()  # ... and its GPU time
    copies_before = _copy_counts(runtime)
    start = time.monotonic()
    for step in range(1, steps + 1):
        _step(handles, step, inputs)
    if cuda:
        torch.cuda.synchronize()
    end = time.monotonic()
    wall = end - start
    gpu = probe.gpu_busy_s() if cuda else 0.0
    snapshot = probe.snapshot()
    server = window_stats(snapshot["calls"], start, end)
    copies = {k: v - copies_before[k] for k, v in _copy_counts(runtime).items()}
    runtime.commit_round(round_, {})  # drops the sessions
    tokens = n * steps * MICROBATCHES * ROWS * TOKENS
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else 0.0
    stash = snapshot.get("stash")
    extra = {} if stash is None else {"peak_stash_mb": round(stash["peak_stash_bytes"] / 2**20, 2)}
    return extra | {
        "tokens_per_s": round(tokens / wall, 1),
        "step_s": round(wall / steps, 4),
        "peak_gpu_mb": round(peak, 1) if cuda else None,
        "idle": round(max(0.0, 1.0 - gpu / wall), 3) if cuda else None,
        "busy_host": round(server["busy"], 3),
        "mean_batch": round(server["mean_batch"], 2),
        "copies": copies,
    }


def run(
    devices: list[int],
    steps: int,
    *,
    models: tuple[str, ...] = GPU_MODELS,
    device: torch.device | None = None,
    budget_s: float = 0.0,
    offload: bool = False,
    memory_gb: float = 16.0,
) -> dict[str, Any]:
    """Every model at every N, both columns interleaved per N; the JSON-ready report.

    ``budget_s`` > 0: a row not started by then is reported as skipped, so a slow GPU still
    prints its report in time (the rows already measured are kept). ``offload``: the
    ``batched-offload`` column and the ``offload`` figures at ``memory_gb`` (see the module).
    """
    columns = (*COLUMNS, OFFLOAD) if offload else COLUMNS
    device = device or torch.device("cuda")
    began = time.monotonic()
    results: list[dict[str, Any]] = []
    rounds = iter(range(1, 10_000))
    for name in models:
        try:
            built = {
                c: _runtime(
                    MODELS[name],
                    c != "unbatched",
                    device,
                    grouped="off" if c == "batched-looped" else "auto",
                    offload=c == OFFLOAD,
                    stash=offload and c in ("batched", OFFLOAD),
                )
                for c in columns
            }
        except Exception as exc:  # e.g. SmolLM2's wheel missing on this machine
            results.append({"model": name, "error": f"{type(exc).__name__}: {exc}"})
            continue
        try:
            for n in devices:
                row: dict[str, Any] = {"model": name, "devices": n}
                if budget_s and time.monotonic() - began > budget_s:
                    results.append({**row, "skipped": f"past the time budget ({budget_s:g} s)"})
                    continue
                for column in columns:  # interleaved per N, so drift hits both
                    runtime, probe = built[column]
                    row[column] = measure(runtime, probe, n, next(rounds), steps)
                    print(f"{name} N={n} {column}: {row[column]}", file=sys.stderr)
                results.append(row)
        finally:
            for runtime, _ in built.values():
                runtime.stop()
            del built
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "none (cpu)",
        "dtype": "bfloat16" if device.type == "cuda" else "float32",
        "microbatch": [ROWS, TOKENS],
        "microbatches": MICROBATCHES,
        "steps": steps,
        "batching_available": True,  # kept for readers of older reports
        "grouped_lora": _grouped_here(device),
        "results": results,
    }
    if offload:
        report["offload"] = offload_figures(results, models, memory_gb)
    return report


def devices_at_memory(rows: list[tuple[int, float]], memory_mb: float) -> dict[str, Any] | None:
    """The devices one GPU serves within ``memory_mb``: ``peak = base + per_device * N`` fitted
    (least squares) to the measured ``(N, peak_gpu_mb)``; None with fewer than two N."""
    if len({n for n, _ in rows}) < 2:
        return None
    mean_n = sum(n for n, _ in rows) / len(rows)
    mean_p = sum(p for _, p in rows) / len(rows)
    slope = sum((n - mean_n) * (p - mean_p) for n, p in rows) / sum(
        (n - mean_n) ** 2 for n, _ in rows
    )
    base = mean_p - slope * mean_n
    devices = int((memory_mb - base) // slope) if slope > 0 else None
    return {"base_mb": round(base, 1), "per_device_mb": round(slope, 2), "devices": devices}


def offload_figures(
    results: list[dict[str, Any]], models: tuple[str, ...], memory_gb: float
) -> dict[str, Any]:
    """Per model: devices served at ``memory_gb`` with and without offload, and the step time
    offload costs at each N (its step_s over the batched column's)."""
    out: dict[str, Any] = {"memory_gb": memory_gb}
    for name in models:
        rows = [r for r in results if r.get("model") == name and OFFLOAD in r]
        if not rows:
            continue
        fits = {}
        for column in ("batched", OFFLOAD):
            peaks = [(r["devices"], r[column]["peak_gpu_mb"]) for r in rows]
            known = [(n, p) for n, p in peaks if p is not None]
            fits[column] = devices_at_memory(known, memory_gb * 1024)
        out[name] = {
            "devices_at_memory": fits,
            "step_s_offload_over_batched": {
                str(r["devices"]): round(r[OFFLOAD]["step_s"] / r["batched"]["step_s"], 3)
                for r in rows
            },
        }
    return out


def _grouped_here(device: torch.device) -> str:
    """Whether the ``batched`` column's LoRA terms ran in ``grouped_mm`` here, and if not why."""
    from fedpipe.config import load_config
    from fedpipe.lora import lora_settings
    from fedpipe.lora.kernels import grouped_lora_supported

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rank = lora_settings(load_config(None, {})).r
    why = grouped_lora_supported(torch.empty(1, 576, device=device, dtype=dtype), rank, 576)
    return why or "used"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="1,8,32", help="comma-separated N")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per measurement")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=240.0,
        help="start no new row after this many seconds (0: no limit); keeps it under 5 minutes",
    )
    parser.add_argument(
        "--offload",
        action="store_true",
        help='a batched-offload column (server.offload = "auto") and devices served at '
        "--memory-gb with and without it",
    )
    parser.add_argument(
        "--memory-gb", type=float, default=16.0, help="the fixed GPU memory of --offload"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    devices = [int(n) for n in args.devices.split(",") if n.strip()]
    report = run(
        devices, args.steps, budget_s=args.budget_s, offload=args.offload, memory_gb=args.memory_gb
    )
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
