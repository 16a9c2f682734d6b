"""``fedpipe bench pipeline``: step times of every schedule at every reference link setting.

The StageServer runs in a child process and the device in this one; each is pinned to its own
core with one torch thread (two threads per process on two cores halved the speedup in the
prototype, notes/pipeline-bound.md). Links are emulated inside the device's transport. For
every link setting the benchmark measures the median step time of each schedule, the component
times inside the best pipelined run, and the bound computed from those components; it prints
``t_seq_s``, ``t_pipe_s``, ``t_bound_s``, ``speedup``, ``efficiency`` and ``ceiling``.
"""

from __future__ import annotations

import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch

from fedpipe.bench.bound import Components, pipeline_bound, sequential_model
from fedpipe.config import FedpipeConfig
from fedpipe.device import DeviceTrainer
from fedpipe.link import LinkProfile, parse_link
from fedpipe.pipeline.device_runtime import StepResult
from fedpipe.pipeline.trace import Tracer
from fedpipe.transport.client import StageClient, StageSession

__all__ = ["BENCH_SCHEDULES", "run_pipeline_bench"]

log = logging.getLogger(__name__)

BENCH_SCHEDULES = ("sequential", "gpipe", "1f1b", "greedy")


def _pin(cpus: list[int]) -> str:
    """Pin this (device) process to the first core, one torch thread; returns what was done."""
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set (or parallel work already ran) in this process
        pass
    if len(cpus) < 2:
        return f"one CPU available ({cpus}): device and server share it, 1 torch thread each"
    os.sched_setaffinity(0, {cpus[0]})
    return (
        f"device on CPU {cpus[0]}, server on CPU {cpus[1]} (sched_setaffinity), 1 torch thread each"
    )


def _start_server(
    config: FedpipeConfig, workdir: Path, cpus: list[int]
) -> tuple[subprocess.Popen[bytes], str]:
    port_file = workdir / "port"
    cmd = [
        sys.executable,
        "-m",
        "fedpipe.cli",
        "server",
        "--model",
        config.model.name,
        "--set",
        f"model.head_layers={config.model.head_layers}",
        "--set",
        f"model.tail_layers={config.model.tail_layers}",
        "--set",
        f"model.split={config.model.split}",
        "--set",
        "server.threads=1",
        "--device",
        "cpu",
        "--port",
        "0",
        "--port-file",
        str(port_file),
    ]
    if len(cpus) >= 2:
        cmd += ["--cpu", str(cpus[1])]
    log_path = workdir / "server.log"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log_path.open("wb"))
    deadline = time.monotonic() + 300
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"bench server did not start:\n{log_path.read_text()[-2000:]}")
        time.sleep(0.1)
    return proc, f"127.0.0.1:{port_file.read_text().strip()}"


def _batches(vocab: int, batch: int, seq: int, n: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, seq), generator=gen)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _run_schedule(
    trainer: DeviceTrainer,
    client: StageClient,
    link: LinkProfile,
    schedule: str,
    batches: list[dict[str, torch.Tensor]],
    warmup: int,
) -> tuple[list[StepResult], Tracer, StageSession]:
    cfg = trainer.config
    tracer = Tracer()
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=cfg.train.lr)
    session, runtime = trainer.connect(
        client, optimizer=optimizer, link=link, schedule=schedule, tracer=tracer
    )
    results = []
    with session:
        for step, batch in enumerate(batches):
            if step == warmup:
                tracer.clear()
                session.link.up.clear_records()
                session.link.down.clear_records()
            results.append(runtime.train_step(batch, step=step))
    return results[warmup:], tracer, session


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def _occupancy(tracer: Tracer, records: list[Any], lane: str) -> dict[str, float]:
    """Median wire occupancy per transfer kind (``a``, ``g`` up; ``o``, ``i`` down).

    The link's records and the tracer's events of a lane are appended in the same order by the
    same thread, so zipping them names each record's message kind.
    """
    names = [e.name for e in tracer.events if e.lane == lane]
    spans: dict[str, list[float]] = {}
    for name, record in zip(names, records, strict=False):
        spans.setdefault(name[:1], []).append(record.end - record.start)
    return {kind: _median(values) for kind, values in spans.items()}


def _components(tracer: Tracer, session: StageSession, link: LinkProfile, m: int) -> Components:
    up = _occupancy(tracer, session.link.up.records(), "uplink")
    down = _occupancy(tracer, session.link.down.records(), "downlink")

    c_opt = _median(tracer.durations("O", "device"))
    s_opt = _median(tracer.durations("So", "server"))
    lat = link.one_way_s + link.overhead_s
    return Components(
        c_f=_median(tracer.durations("F", "device")),
        c_t=_median(tracer.durations("T", "device")),
        c_b=_median(tracer.durations("B", "device")),
        s_f=_median(tracer.durations("Sf", "server")),
        s_b=_median(tracer.durations("Sb", "server")),
        tau_up=up.get("a", 0.0),
        tau_down=down.get("o", 0.0),
        tau_up_grad=up.get("g", 0.0),
        tau_down_grad=down.get("i", 0.0),
        lat_up=lat,
        lat_down=lat,
        t_opt=max(c_opt, 2 * lat + s_opt),
    )


def _bench_link(
    trainer: DeviceTrainer,
    client: StageClient,
    link: LinkProfile,
    schedules: Sequence[str],
    batches: list[dict[str, torch.Tensor]],
    warmup: int,
) -> dict[str, Any]:
    m = trainer.config.pipeline.microbatches
    times: dict[str, float] = {}
    runs: dict[str, tuple[Tracer, StageSession]] = {}
    for name in schedules:
        results, tracer, session = _run_schedule(trainer, client, link, name, batches, warmup)
        times[name] = _median([r.wall_s for r in results])
        runs[name] = (tracer, session)
        print(f"  {link.name:>18} {name:>10}: {times[name]:.3f} s/step", file=sys.stderr)
    pipelined = [s for s in schedules if s != "sequential"] or list(schedules)
    best = min(pipelined, key=times.__getitem__)
    comps = _components(*runs[best], link, m)
    bound, term = pipeline_bound(comps, m)
    t_seq = times.get("sequential", float("nan"))
    t_pipe = times[best]
    return {
        "link": link.name,
        "microbatches": m,
        "t_seq_s": round(t_seq, 4),
        "t_pipe_s": round(t_pipe, 4),
        "best_schedule": best,
        "t_bound_s": round(bound, 4),
        "bound_term": term,
        "speedup": round(t_seq / t_pipe, 3),
        "efficiency": round(bound / t_pipe, 3),
        "ceiling": round(t_seq / bound, 3),
        "t_seq_model_s": round(sequential_model(comps, m), 4),
        "components": comps.as_dict(),
        "schedules": {k: round(v, 4) for k, v in times.items()},
    }


def run_pipeline_bench(
    config: FedpipeConfig,
    *,
    links: Sequence[str],
    schedules: Sequence[str] = BENCH_SCHEDULES,
    steps: int = 4,
    warmup: int = 1,
) -> dict[str, Any]:
    """Measure every schedule at every link; returns the JSON-ready report."""
    cpus = sorted(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="fedpipe-bench-") as tmp:
        server, address = _start_server(config, Path(tmp), cpus)
        pinning = _pin(cpus)
        try:
            trainer = DeviceTrainer(config, device_id="bench")
            vocab = (
                int(cast(torch.nn.Embedding, trainer.head.embed_tokens).num_embeddings)
                if hasattr(trainer.head, "embed_tokens")
                else 256
            )
            batches = _batches(
                min(vocab, 256), config.train.batch_size, config.train.seq_len, warmup + steps
            )
            entries = []
            with StageClient(address) as client:
                for name in links:
                    entries.append(
                        _bench_link(trainer, client, parse_link(name), schedules, batches, warmup)
                    )
        finally:
            server.terminate()
            server.wait(timeout=30)
    return {
        "model": config.model.name,
        "split": f"{config.model.split}: head {config.model.head_layers}, "
        f"tail {config.model.tail_layers}",
        "batch": [config.train.batch_size, config.train.seq_len],
        "microbatches": config.pipeline.microbatches,
        "codec": config.pipeline.uplink_codec,
        "gradient_codec": config.pipeline.gradient_codec or config.pipeline.uplink_codec,
        "steps": steps,
        "warmup": warmup,
        "pinning": pinning,
        "bound": "max over device/uplink/server/downlink rows, one microbatch's critical path, "
        "and the tail phase, + optimizer tail (fedpipe.bench.bound)",
        "links": entries,
    }
