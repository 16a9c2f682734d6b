"""The server's middle at each ``server.weights``, side by side in one process.

For each setting the StageServer's runtime is built from settings (``build_runtime``, the
server's own code path), a few sessions are opened on its bank, and training steps run through
its executor: every session's microbatch forward in one call, every output gradient in one
call, then each session's optimizer step (the device's side is a fixed loss on the output,
its mean square). Reported per setting: the bytes of the stage's frozen parameters
(``server_param_bytes``, LoRA excluded), the median step time, and how far the first step's
outputs (before any update) are from fp32's (``output_rel_error``: ||y - y_fp32|| / ||y_fp32||).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from fedpipe.config import FedpipeConfig
from fedpipe.messages import Kind, StageMsg
from fedpipe.models import load_config
from fedpipe.server.build import build_runtime
from fedpipe.server.sessions import SessionInfo
from fedpipe.split import build_device_stages, split_layout

__all__ = ["server_weights_report"]


def server_weights_report(
    config: FedpipeConfig,
    folder: Path,
    weights: tuple[str, ...],
    *,
    sessions: int = 2,
    batch_size: int = 2,
    seq_len: int = 128,
    steps: int = 3,
    warmup: int = 1,
) -> dict[str, Any]:
    """One row per setting in ``weights``: every setting is built first, then each step runs
    every setting in turn, so that a machine's changing load falls on all of them alike. The
    sessions' inputs are the device head's activations of random token ids (a middle's real
    inputs, not noise); each setting trains on the same ones."""
    inputs = _head_activations(config, folder, sessions, batch_size, seq_len)
    servers = {
        w: _Server(config.with_overrides({"server.weights": w}), folder, inputs) for w in weights
    }
    for step in range(warmup + steps):
        for server in servers.values():
            server.step(step, measured=step >= warmup)
    reference = servers["fp32"].first if "fp32" in servers else None
    rows = []
    for setting, server in servers.items():
        error = None if reference is None else _relative(server.first, reference)
        rows.append({"weights": setting, **server.figures(), "output_rel_error": error})
    return {
        "model": config.model.name,
        "split": f"{config.model.head_layers}+{config.model.tail_layers}",
        "sessions": sessions,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "steps": steps,
        "threads": config.server.threads,
        "batching": config.server.batching,
        "rows": rows,
    }


def _head_activations(
    config: FedpipeConfig, folder: Path, sessions: int, batch_size: int, seq_len: int
) -> list[torch.Tensor]:
    """What ``sessions`` devices' heads send for random token ids: (batch, seq, hidden) each."""
    hf = load_config(folder)
    layout = split_layout(
        hf,
        head_layers=config.model.head_layers,
        tail_layers=config.model.tail_layers,
        mode=config.model.split,  # type: ignore[arg-type]
    )
    head, _ = build_device_stages(folder, layout)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        ids = [
            torch.randint(int(hf.vocab_size), (batch_size, seq_len), generator=gen)
            for _ in range(sessions)
        ]
        out = [head(x) for x in ids]
    del head
    return out


class _Server:
    """One setting's runtime (built from settings) with its sessions, stepped by the report."""

    def __init__(self, config: FedpipeConfig, folder: Path, inputs: list[torch.Tensor]) -> None:
        runtime, _ = build_runtime(config, folder=folder)
        self.bank, self.executor = runtime.bank, runtime.executor
        self.stage = getattr(self.bank, "stage")  # noqa: B009
        self.inputs = inputs
        self.infos = []
        for i, x in enumerate(inputs):
            name = f"s{i}"
            self.bank.add(name)
            opt = torch.optim.AdamW(self.bank.parameters(name), lr=config.train.lr)
            self.infos.append(SessionInfo(name, f"dev-{i}", 1, opt, x.shape[0], x.shape[1]))
        self.first: list[torch.Tensor] = []
        self.times: list[float] = []

    def step(self, step: int, *, measured: bool) -> None:
        start = time.perf_counter()
        outputs = _step(self.executor, self.infos, self.inputs, step)
        if measured:
            self.times.append(time.perf_counter() - start)
        if step == 0:
            self.first = outputs

    def figures(self) -> dict[str, Any]:
        params = self.stage.parameters()
        frozen = sum(p.numel() * p.element_size() for p in params if not p.requires_grad)
        adapter = self.bank.parameters(self.infos[0].session_id)
        return {
            "server_param_bytes": frozen,
            "adapter_bytes_per_session": sum(p.numel() * p.element_size() for p in adapter),
            "step_s": statistics.median(self.times),
            "step_s_min": min(self.times),
            "step_s_all": self.times,
        }


def _step(
    executor: Any, infos: list[SessionInfo], inputs: list[torch.Tensor], step: int
) -> list[torch.Tensor]:
    """One training step of every session, batched: forwards, output gradients, step ends."""
    acts = [
        (info, StageMsg(Kind.ACTIVATION, step, 0, tensor=x.clone()))
        for info, x in zip(infos, inputs, strict=True)
    ]
    outs = _replies(executor.compute_batch(acts))
    grads = [
        (info, StageMsg(Kind.OUTPUT_GRAD, step, 0, tensor=y * (2.0 / y.numel())))  # d mean(y^2)
        for info, y in zip(infos, outs, strict=True)
    ]
    _replies(executor.compute_batch(grads))
    ends = executor.compute_batch([(info, StageMsg(Kind.STEP_END, step)) for info in infos])
    for reply in ends:
        if isinstance(reply, Exception):
            raise reply
    return outs


def _replies(results: list[Any]) -> list[torch.Tensor]:
    out = []
    for reply in results:
        if isinstance(reply, Exception):
            raise reply
        out.append(reply.tensor)
    return out


def _relative(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    num = sum(float((g - w).pow(2).sum()) for g, w in zip(got, want, strict=True))
    den = sum(float(w.pow(2).sum()) for w in want)
    return (num / den) ** 0.5
