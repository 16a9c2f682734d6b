"""``fedpipe bench scale``: the ``fedpipe bench server`` load generator against 1 and 2 replicas.

Two StageServer replicas start as Ray actors on a local Ray (:class:`ReplicaSet`), each pinned
to a core of its own (``sched_setaffinity`` in the actor) with ``server.threads = 1``. The
devices are threads of this process (:class:`fedpipe_bench.load.LoadDevice`: right-shaped
tensors through the real stage link client, their own compute emulated by sleeping, on
loopback), each assigned to a replica by the ServerApp's own assignment
(:meth:`fedpipe.fl.replica_control.ReplicaControl.routes`).

One row per replica count. ``replicas = 1``: every device on replica 0, committed as the
ServerApp commits one StageServer (CommitRound: the merge happens on the server, nothing
crosses). ``replicas = 2``: the devices spread over both, committed as the ServerApp commits
replicas (:class:`fedpipe.fl.replica_control.ReplicaControl`: CollectRound from each, the merge, and
LoadAdapter into each). A row measures ``rounds`` rounds of ``warmup`` + ``steps`` steps per
device: throughput and step times from the window in which every device was past its warm-up
and none had finished (:func:`fedpipe_bench.server.measurement_window`), summed over rounds;
``commit_s`` and ``commit_bytes`` per round (bytes: the adapter tensors collected from the
replicas and the global adapter loaded into each). The load generator is not pinned: with two
replicas on a two-core machine it shares their cores, which the report says.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch

from fedpipe.config import load_config
from fedpipe.fl.replica_control import ReplicaControl
from fedpipe.server.ray_replicas import ReplicaSet
from fedpipe.wire.backend import SessionRequest
from fedpipe.wire.control_client import StageControlClient
from fedpipe.wire.link_client import StageClient
from fedpipe_bench.load import DeviceEmulation, LoadDevice, LoadShape, device_split
from fedpipe_bench.server import measurement_window, step_device

__all__ = ["QUICK", "ScaleSettings", "run_scale_bench"]

log = logging.getLogger(__name__)

Span = tuple[float, float]
_SHARED = " (it shares the replicas' cores)"


@dataclass(frozen=True)
class ScaleSettings:
    """What one ``fedpipe bench scale`` invocation measures."""

    model: str = "small-llama"
    head_layers: int = 2
    tail_layers: int = 2
    devices: int = 16
    replicas: tuple[int, ...] = (1, 2)
    rounds: int = 2
    steps: int = 4
    warmup: int = 1
    shape: LoadShape = field(default_factory=lambda: LoadShape(2, 2, 128, 256))
    emulation: DeviceEmulation = field(default_factory=lambda: DeviceEmulation(0.05, 0.15, 0.10))

    def __post_init__(self) -> None:
        if self.devices < 1 or self.rounds < 1 or self.steps < 1 or self.warmup < 0:
            raise ValueError(
                f"--devices, --rounds and --steps must be >= 1 and warm-up >= 0, got "
                f"{self.devices}, {self.rounds}, {self.steps}, {self.warmup}"
            )
        if not self.replicas or min(self.replicas) < 1:
            raise ValueError(f"--replicas must be numbers >= 1, got {list(self.replicas)}")


# --quick (CI): tiny-llama, 4 devices, 2 x 16 tokens, a few ms of device compute.
QUICK = ScaleSettings(
    model="tiny-llama",
    head_layers=1,
    tail_layers=1,
    devices=4,
    rounds=1,
    steps=2,
    shape=LoadShape(2, 2, 16, 64),
    emulation=DeviceEmulation(0.005, 0.01, 0.005),
)


def _pinning(replicas: int) -> tuple[list[list[int]], dict[str, Any]]:
    """Replica i on core i (cycled when there are fewer cores); the load generator unpinned."""
    cores = sorted(os.sched_getaffinity(0))
    per = [[cores[i % len(cores)]] for i in range(replicas)]
    shared = replicas >= len(cores)
    text = ", ".join(f"replica {i} on CPU {c[0]}" for i, c in enumerate(per))
    return per, {
        "machine_cpus": len(cores),
        "replicas": [{"index": i, "cpus": c} for i, c in enumerate(per)],
        "server_threads": 1,
        "loadgen": "this process, unpinned: one thread per device, 1 torch thread",
        "loadgen_shares_replica_cores": shared,
        "text": f"{text} (sched_setaffinity in each Ray actor), 1 torch thread each; load "
        f"generator unpinned{_SHARED if shared else ''}",
    }


def _device_loop(settings: ScaleSettings) -> Callable[..., list[Span]]:
    shape = settings.shape
    split = device_split(settings.model, settings.head_layers, settings.tail_layers)
    total = settings.warmup + settings.steps

    def loop(address: str, device_id: str, seed: int, round_: int, barrier: threading.Barrier):  # type: ignore[no-untyped-def]
        with StageClient(address) as client:
            session = client.open(
                SessionRequest(
                    device_id=device_id,
                    round=round_,
                    microbatch_size=shape.rows,
                    seq_len=shape.tokens,
                    split=split,
                    learning_rate=1e-3,
                )
            )
            device = LoadDevice(session, seed, shape, settings.emulation)
            return step_device(session, device, barrier, total)

    return loop


class _Commit:
    """Round control of 1 replica (CommitRound, as for one StageServer) or several
    (ReplicaControl: CollectRound, merge, LoadAdapter); times and counts each commit."""

    def __init__(self, addresses: list[str], lora_scale: float) -> None:
        self.one = StageControlClient(addresses[0], "") if len(addresses) == 1 else None
        self.many = (
            ReplicaControl(addresses, "", run_id="scale", lora_scale=lora_scale)
            if len(addresses) > 1
            else None
        )
        self.addresses = addresses
        if self.one is not None:
            self.one.reset_adapter()
        else:
            assert self.many is not None
            self.many.reset_adapter()

    def begin(self, round_: int, devices: list[str]) -> dict[str, int]:
        """Begin ``round_``; each device's replica (the ServerApp's assignment)."""
        if self.one is not None:
            self.one.begin_round(round_, "scale", "separate")
            return dict.fromkeys(devices, 0)
        assert self.many is not None
        self.many.begin_round(round_, "scale", "separate")
        return {d: r.replica for d, r in self.many.routes(devices).items()}

    def commit(self, round_: int, devices: list[str]) -> tuple[float, int]:
        """(seconds, adapter bytes moved) of committing ``round_`` with every device finished."""
        weights = dict.fromkeys(devices, 1.0)
        start = time.perf_counter()
        if self.one is not None:
            self.one.commit_round(round_, weights)
            return time.perf_counter() - start, 0
        assert self.many is not None
        self.many.collect(round_, weights)
        collected = sum(
            _bytes(s) for part in self.many.round.collected.values() for s in part.states
        )
        self.many.commit_round(round_, weights)
        seconds = time.perf_counter() - start
        loaded = _bytes(self.many.global_state) * len(self.many.round.live)
        return seconds, collected + loaded

    def close(self) -> None:
        if self.one is not None:
            self.one.close()
        if self.many is not None:
            self.many.close()


def _bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _run_round(
    loop: Callable[..., list[Span]], addresses: dict[str, str], round_: int
) -> list[list[Span]]:
    """Every device at once on its replica, started together (a barrier)."""
    devices = sorted(addresses)
    barrier = threading.Barrier(len(devices))

    def one(i: int) -> list[Span]:
        try:
            return loop(addresses[devices[i]], devices[i], i, round_, barrier)  # type: ignore[no-any-return]
        except BaseException:
            barrier.abort()
            raise

    with ThreadPoolExecutor(len(devices)) as pool:
        return list(pool.map(one, range(len(devices))))


def _cpu_s(pids: Sequence[int]) -> list[float]:
    """CPU seconds each process (a replica, or this one) has used so far."""
    out = []
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        out.append(times.user + times.system)
    return out


def _measure(
    settings: ScaleSettings,
    replica_addresses: list[str],
    replica_pids: list[int],
    rounds: Sequence[int],
    scale: float,
) -> dict[str, Any]:
    """One row: ``len(replica_addresses)`` replicas, every round's figures joined."""
    loop = _device_loop(settings)
    control = _Commit(replica_addresses, scale)
    devices = [f"scale-{i}" for i in range(settings.devices)]
    steps = 0
    window = wall = 0.0
    times: list[float] = []
    commits: list[tuple[float, int]] = []
    pids = [*replica_pids, os.getpid()]
    used = [0.0] * len(pids)
    try:
        for round_ in rounds:
            assigned = control.begin(round_, devices)
            where = {d: replica_addresses[k] for d, k in assigned.items()}
            t0, cpu0 = time.monotonic(), _cpu_s(pids)
            spans = _run_round(loop, where, round_)
            wall += time.monotonic() - t0
            used = [u + b - a for u, a, b in zip(used, cpu0, _cpu_s(pids), strict=True)]
            start, end, in_window = measurement_window(spans, settings.warmup)
            steps, window = steps + in_window, window + (end - start)
            times += [e - s for device in spans for s, e in device[settings.warmup :]]
            commits.append(control.commit(round_, devices))
    finally:
        control.close()
    counts = [list(assigned.values()).count(k) for k in range(len(replica_addresses))]
    mb_per_s = steps * settings.shape.microbatches / window
    times.sort()
    return {
        "replicas": len(replica_addresses),
        "devices": settings.devices,
        "mb_per_s": round(mb_per_s, 3),
        "tokens_per_s": round(mb_per_s * settings.shape.tokens_per_microbatch, 1),
        "step_p50_s": round(_quantile(times, 0.50), 4),
        "step_p95_s": round(_quantile(times, 0.95), 4),
        "sessions_per_replica": counts,
        "commit_s": round(sum(c[0] for c in commits) / len(commits), 4),
        "commit_bytes": int(sum(c[1] for c in commits) / len(commits)),
        "window_s": round(window, 3),
        "steps_in_window": steps,
        # cores each replica process, and the load generator (this process), used while the
        # devices stepped: a replica well under 1.0 did not get its core
        "replica_cpu": [round(u / wall, 3) for u in used[:-1]],
        "loadgen_cpu": round(used[-1] / wall, 3),
    }


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """The nearest-rank quantile (``q`` in [0, 1]) of already sorted values."""
    return sorted_values[min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1)]


def run_scale_bench(settings: ScaleSettings) -> dict[str, Any]:
    """Every replica count of ``settings.replicas`` against one set of replicas on Ray."""
    torch.set_num_threads(1)
    load_start, began = os.getloadavg(), time.monotonic()
    most = max(settings.replicas)
    cpus, pinning = _pinning(most)
    config = load_config(
        None,
        {
            "model.name": settings.model,
            "model.head_layers": settings.head_layers,
            "model.tail_layers": settings.tail_layers,
            "server.device": "cpu",
            "server.threads": 1,
            "server.replicas": most,
            "server.max_sessions": settings.devices + 8,
            "server.max_streams": max(64, settings.devices + 8),
        },
    )
    scale = config.model.lora_alpha / config.model.lora_r
    rows: list[dict[str, Any]] = []
    replicas = ReplicaSet(config, cpus=cpus).start()
    rounds = iter(range(1, 1 + settings.rounds * len(settings.replicas)))
    try:
        for count in settings.replicas:
            wanted = [next(rounds) for _ in range(settings.rounds)]
            pids = [r.pid for r in replicas.replicas[:count]]
            row = _measure(settings, replicas.addresses[:count], pids, wanted, scale)
            rows.append(row)
            _progress(row)
    finally:
        replicas.stop()
    return _report(settings, rows, pinning, load_start, time.monotonic() - began)


def _progress(row: dict[str, Any]) -> None:
    print(
        f"  {row['replicas']} replica(s), {row['devices']} devices: {row['mb_per_s']:8.2f} mb/s, "
        f"step p50 {row['step_p50_s']:.3f} s p95 {row['step_p95_s']:.3f} s, sessions "
        f"{row['sessions_per_replica']}, commit {row['commit_s']:.3f} s / "
        f"{row['commit_bytes']} B; cores used: replicas {row['replica_cpu']}, load generator "
        f"{row['loadgen_cpu']}",
        file=sys.stderr,
    )


def _report(
    settings: ScaleSettings,
    rows: list[dict[str, Any]],
    pinning: dict[str, Any],
    load_start: tuple[float, float, float],
    wall: float,
) -> dict[str, Any]:
    shape = settings.shape
    by_count = {row["replicas"]: row for row in rows}
    speedup = (
        round(by_count[2]["mb_per_s"] / by_count[1]["mb_per_s"], 3)
        if 1 in by_count and 2 in by_count
        else None
    )
    return {
        "model": settings.model,
        "split": f"u: head {settings.head_layers}, tail {settings.tail_layers}",
        "microbatch": [shape.rows, shape.tokens],
        "hidden": shape.hidden,
        "microbatches": shape.microbatches,
        "link": "loopback",
        "device_compute_s": dataclasses.asdict(settings.emulation),
        "devices": settings.devices,
        "rounds": settings.rounds,
        "steps": settings.steps,
        "warmup": settings.warmup,
        "pinning": pinning,
        "speedup_2_over_1": speedup,
        "load_average": {"start": list(load_start), "end": list(os.getloadavg())},
        "wall_s": round(wall, 1),
        "rows": rows,
    }


def make_settings(
    *,
    model: str | None = None,
    devices: int | None = None,
    rounds: int | None = None,
    steps: int | None = None,
    warmup: int | None = None,
    quick: bool = False,
) -> ScaleSettings:
    """The defaults (or ``--quick``'s sizes), then the flags given."""
    from fedpipe.cli.preflight import default_split
    from fedpipe.models import load_config as load_hf_config
    from fedpipe.models import resolve_model

    base = QUICK if quick else ScaleSettings()
    name = model or base.model
    hf = load_hf_config(resolve_model(name))
    side = default_split(int(hf.num_hidden_layers))
    shape = dataclasses.replace(base.shape, hidden=int(hf.hidden_size))
    return dataclasses.replace(
        base,
        model=name,
        head_layers=side,
        tail_layers=side,
        devices=devices or base.devices,
        rounds=rounds or base.rounds,
        steps=steps or base.steps,
        warmup=base.warmup if warmup is None else warmup,
        shape=shape,
    )
