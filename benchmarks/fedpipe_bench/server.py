"""``fedpipe bench server``: N devices against one StageServer, multi-adapter batching on and off.

One real StageServer per column (batching off, batching on) runs in a process of its own, on
loopback gRPC (port 0), pinned to the cores the load generator does not use, with
``server.threads`` torch threads. Only one of them is loaded at a time. The devices are threads
of this process (:class:`fedpipe_bench.load.LoadDevice`): each opens a session through the real
stage link client (OpenSession, then one Exchange stream), sends right-shaped activations and
output gradients for the model's hidden size, emulates its own compute by sleeping and its link
with the stage link's own emulator (``fedpipe.emulation``), so that the server gets the cores. The
generators' CPU use is measured and reported (``loadgen_cpu``) to show they stay small.

For each N both columns are measured in this invocation, one after the other, their order
alternating from one N to the next, so drift on a shared machine hits both alike. A measurement:
N sessions open, start together (a barrier), run ``warmup`` then ``steps`` steps; figures come
from the window in which every device was past its warm-up and none had finished
(:func:`measurement_window`). The server side is measured on the server: its compute calls are
timed by a probe (:mod:`fedpipe_bench.server_probe`) and cut to the same window (the clock is
``time.monotonic``, shared by the processes of one machine).

``--offload`` adds a third column: the batched server with ``server.offload = "auto"``
(what a waiting microbatch keeps for its backward goes to host memory). Every column reports
the bytes of those stashes on the stage's device and offloaded, at their peak in the window of
each N (``peak_stash_bytes``, ``peak_offloaded_bytes``, and per session), counted in the server
by :class:`fedpipe.server.stash.StashMeter` (turned on by the probe).

``--real`` replaces the load generators by real devices: the model's head and tail stages run
in this process (one thread each, one torch thread in all) through the device runtime, for a
small N; it checks the same figures end to end.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
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

from fedpipe.emulation import LinkProfile, parse_link
from fedpipe.wire.backend import SessionRequest
from fedpipe.wire.link_client import StageClient
from fedpipe_bench.load import DeviceEmulation, LoadDevice, LoadShape, ServerProcess, device_split
from fedpipe_bench.server_probe import CallRecord, window_stats

__all__ = [
    "ServerBenchSettings",
    "knee",
    "measurement_window",
    "n_star_model",
    "run_server_bench",
]

log = logging.getLogger(__name__)

Span = tuple[float, float]  # one step of one device: (start, end) on time.monotonic
COLUMNS = ("unbatched", "batched")
OFFLOAD = "offload"  # --offload: the batched server with server.offload = "auto"
KNEE_FRACTION = 0.9  # the measured knee: the first N within 10% of the best throughput
STARVED_SHARE = 0.7  # a server given less CPU than this while busy marks the run noisy


@dataclass(frozen=True)
class ServerBenchSettings:
    """What one ``fedpipe bench server`` invocation measures."""

    model: str = "small-llama"
    head_layers: int = 2
    tail_layers: int = 2
    devices: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    steps: int = 3
    warmup: int = 1
    shape: LoadShape = field(default_factory=lambda: LoadShape(2, 2, 128, 256))
    emulation: DeviceEmulation = field(default_factory=lambda: DeviceEmulation(0.05, 0.15, 0.10))
    link: str = "100mbit-5ms"
    # The machine's cores (the "the server gets this machine's cores"): joined matmuls
    # of a batched call spread over threads where one microbatch's small ones do not.
    server_threads: int = field(default_factory=lambda: len(os.sched_getaffinity(0)))
    real: bool = False
    offload: bool = False  # a third column: batched with server.offload = "auto"

    @property
    def columns(self) -> tuple[str, ...]:
        """The columns measured for each N, in the order of the first N."""
        return (*COLUMNS, OFFLOAD) if self.offload else COLUMNS

    def __post_init__(self) -> None:
        if not self.devices or min(self.devices) < 1:
            raise ValueError(f"--devices must be numbers >= 1, got {list(self.devices)}")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(
                f"--steps must be >= 1 and warm-up >= 0, got {self.steps}, {self.warmup}"
            )
        if self.server_threads < 1:
            raise ValueError(f"--server-threads must be >= 1, got {self.server_threads}")
        parse_link(self.link)  # a typo fails now, not after the servers started


def _runtime_settings(batched: bool) -> tuple[dict[str, object], bool]:
    """The server settings that turn multi-adapter batching on or off; and whether it exists.

    The one place the bench selects batching. Batching is ``server.batching`` (with
    ``fedpipe.server.batch_policy`` behind it); on a build without them both columns run
    unbatched, and the report says ``batching_available: false``.
    """
    from fedpipe.config import ServerConfig

    try:
        importlib.import_module("fedpipe.server.batch_policy")
    except ImportError:
        return {}, False
    if "batching" not in {f.name for f in dataclasses.fields(ServerConfig)}:
        return {}, False
    return {"server.batching": batched}, True


# -- the model behind the figures ----------------------------------------------------------------
def measurement_window(spans: Sequence[Sequence[Span]], warmup: int) -> tuple[float, float, int]:
    """``(start, end, steps)``: the time every device was measuring, and the steps ended in it.

    It starts when the last device finished its warm-up and ends when the first device finished
    its last step, so every device is loading the server throughout. Where devices drifted so
    far apart that no step ends inside it, the whole measured span is taken instead (logged).
    """
    measured = [list(s[warmup:]) for s in spans]
    if not measured or any(not s for s in measured):
        raise ValueError("every device needs at least one measured step")
    start = max(s[0][0] for s in measured)
    end = min(s[-1][1] for s in measured)
    steps = sum(1 for s in measured for _, e in s if start < e <= end)
    if end > start and steps:
        return start, end, steps
    log.warning("devices drifted apart: the figures use the whole measured span instead")
    start, end = min(s[0][0] for s in measured), max(s[-1][1] for s in measured)
    return start, end, sum(len(s) for s in measured)


def n_star_model(t_alone_s: float, server_s_per_step: float) -> float:
    """The predicted saturation point N* = t_alone / s.

    ``t_alone_s``: a device's step time when it has the server to itself (its emulated or real
    compute, its link, and the server's work for it); ``server_s_per_step``: the server's
    compute time per device step, measured with one device. Each device asks for ``s`` of
    server time every ``t_alone`` seconds, so N devices ask for ``N * s`` per ``t_alone``: the
    server is saturated once ``N >= t_alone / s`` (the asymptote of a closed queueing network,
    think time plus demand over demand). Below N* throughput grows as ``N / t_alone``; above it
    the server caps it at ``1 / s`` steps per second and step times grow as ``N * s``. Batching
    lowers ``s`` per device as batches fill, which moves the knee to the right.
    """
    if t_alone_s <= 0 or server_s_per_step <= 0:
        raise ValueError(
            f"N* needs positive times, got t_alone {t_alone_s} s and server {server_s_per_step} s "
            "per step (did the server compute anything in the window?)"
        )
    return t_alone_s / server_s_per_step


def predicted_mb_per_s(n: int, t_alone_s: float, server_s_per_step: float, m: int) -> float:
    """Microbatches per second the N* model predicts for ``n`` devices of ``m`` microbatches."""
    return m * min(n / t_alone_s, 1.0 / server_s_per_step)


def knee(devices: Sequence[int], mb_per_s: Sequence[float]) -> int:
    """The measured knee: the smallest N whose throughput is within 10% of the best one."""
    best = max(mb_per_s)
    return min(n for n, rate in zip(devices, mb_per_s, strict=True) if rate >= KNEE_FRACTION * best)


# -- pinning -----------------------------------------------------------------------------------
def _pin(server_threads: int) -> tuple[list[int], dict[str, Any]]:
    """Pin this process (the load generator) to the first core; returns the server's cores.

    A server given as many threads as the machine has cores gets them all, and the load
    generator (a few percent of one core) shares them: nothing is pinned then.
    """
    import torch

    torch.set_num_threads(1)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 or server_threads >= len(cpus):
        server_cpus, loadgen_cpus = cpus, cpus
        text = f"load generator and server share CPU(s) {cpus}"
    else:
        os.sched_setaffinity(0, {cpus[0]})
        server_cpus, loadgen_cpus = cpus[1 : 1 + server_threads], cpus[:1]
        text = f"load generator on CPU {cpus[0]}, server on CPU(s) {server_cpus}"
    return server_cpus, {
        "machine_cpus": len(cpus),
        "server_cpus": server_cpus,
        "server_threads": server_threads,
        "server_processes": "2 (one per column, batching off / on; one loaded at a time)",
        "loadgen_cpus": loadgen_cpus,
        "loadgen": "this process: one thread per device, 1 torch thread",
        "text": f"{text} (sched_setaffinity); {server_threads} torch thread(s) in the server",
    }


def _start_servers(
    settings: ServerBenchSettings, cpus: list[int]
) -> tuple[dict[str, ServerProcess], bool]:
    """One StageServer process per column, started side by side."""
    most = max(settings.devices) + 8
    base: dict[str, object] = {
        "model.name": settings.model,
        "model.head_layers": settings.head_layers,
        "model.tail_layers": settings.tail_layers,
        "server.device": "cpu",
        "server.threads": settings.server_threads,
        "server.max_streams": max(64, most),  # one stream per device
    }
    available = _runtime_settings(True)[1]
    if not available:
        print(
            "fedpipe bench server: no multi-adapter batching in this build "
            "(fedpipe.server.batch_policy / server.batching missing): both columns run "
            "unbatched",
            file=sys.stderr,
        )

    def start(column: str) -> ServerProcess:
        extra = _runtime_settings(column != "unbatched")[0]
        if column == OFFLOAD:
            extra = extra | {"server.offload": "auto"}
        return ServerProcess(max_sessions=most, overrides=base | extra, cpus=cpus, probe=True)

    # From this (the main) thread, one after the other: a server started from another thread
    # would not get the parent-death signal, and would outlive a bench killed by SIGKILL.
    started = {column: start(column) for column in settings.columns}
    return started, available


# -- devices -------------------------------------------------------------------------------------
DeviceLoop = Callable[[str, str, int, int, threading.Barrier], list[Span]]


def _emulated_loop(settings: ServerBenchSettings, link: LinkProfile) -> DeviceLoop:
    shape = settings.shape
    split = device_split(settings.model, settings.head_layers, settings.tail_layers)
    total = settings.warmup + settings.steps

    def loop(
        address: str, device_id: str, seed: int, round_: int, barrier: threading.Barrier
    ) -> list[Span]:
        with StageClient(address) as client:
            session = client.open(
                SessionRequest(
                    device_id=device_id,
                    round=round_,
                    microbatch_size=shape.rows,
                    seq_len=shape.tokens,
                    split=split,
                    learning_rate=1e-3,
                ),
                link=link,
                link_seed=device_id,
            )
            return step_device(
                session, LoadDevice(session, seed, shape, settings.emulation), barrier, total
            )

    return loop


def step_device(
    session: Any, device: LoadDevice, barrier: threading.Barrier, total: int
) -> list[Span]:
    """Run ``total`` steps of an emulated ``device`` on its open ``session`` once every device
    is ready (``barrier``), then close the session; each step's (start, end)."""
    spans: list[Span] = []
    with session:
        barrier.wait(timeout=600)
        for step in range(total):
            start = time.monotonic()
            device.step(step)
            spans.append((start, time.monotonic()))
        device.confirm()
    return spans


def _real_loop(settings: ServerBenchSettings, link: LinkProfile) -> DeviceLoop:
    import torch

    from fedpipe.config import load_config
    from fedpipe.edge.runtime import DeviceRuntime
    from fedpipe.edge.trainer import DeviceTrainer

    shape = settings.shape
    config = load_config(
        None,
        {
            "model.name": settings.model,
            "model.head_layers": settings.head_layers,
            "model.tail_layers": settings.tail_layers,
            "train.batch_size": shape.rows * shape.microbatches,
            "train.seq_len": shape.tokens,
            "pipeline.microbatches": shape.microbatches,
        },
    )
    total = settings.warmup + settings.steps

    def loop(
        address: str, device_id: str, seed: int, round_: int, barrier: threading.Barrier
    ) -> list[Span]:
        trainer = DeviceTrainer(config, device_id=device_id)
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 256, (total, config.train.batch_size, shape.tokens), generator=gen)
        spans: list[Span] = []
        with StageClient(address) as client:
            session = client.open(
                SessionRequest(
                    device_id=device_id,
                    round=round_,
                    learning_rate=config.train.lr,
                    microbatch_size=shape.rows,
                    seq_len=shape.tokens,
                    split=trainer.split,
                ),
                link=link,
                link_seed=device_id,
            )
            with session:
                optimizer = torch.optim.AdamW(trainer.parameters(), lr=config.train.lr)
                runtime = DeviceRuntime(
                    trainer.head,
                    trainer.tail,
                    session,
                    optimizer=optimizer,
                    schedule="gpipe",
                    microbatches=shape.microbatches,
                )
                barrier.wait(timeout=600)
                for step in range(total):
                    start = time.monotonic()
                    runtime.train_step({"input_ids": ids[step], "labels": ids[step]}, step=step)
                    spans.append((start, time.monotonic()))
                runtime.finish()
        return spans

    return loop


def _run_devices(loop: DeviceLoop, address: str, n: int, round_: int) -> list[list[Span]]:
    """N devices at once, started together; a device that fails releases the others."""
    barrier = threading.Barrier(n)

    def one(i: int) -> list[Span]:
        try:
            return loop(address, f"bench-{round_}-{i}", i, round_, barrier)
        except BaseException:
            barrier.abort()
            raise

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


# -- one measurement -----------------------------------------------------------------------------
def _measure(
    server: ServerProcess, loop: DeviceLoop, n: int, round_: int, settings: ServerBenchSettings
) -> dict[str, Any]:
    """One column of one row: N devices on ``server``; the server's figures from its probe."""
    before = server.probe_stats()
    t0, cpu0 = time.monotonic(), _cpu_s()
    spans = _run_devices(loop, server.address, n, round_)
    wall, loadgen_cpu = time.monotonic() - t0, _cpu_s() - cpu0
    after = server.probe_stats()
    server.discard_round(round_)  # the sessions go; the next measurement starts afresh
    calls: list[CallRecord] = [tuple(c) for c in after["calls"]]  # type: ignore[misc]
    figures = column_figures(
        spans,
        calls,
        settings,
        server_cpu=(after["cpu_s"] - before["cpu_s"]) / wall,
        loadgen_cpu=loadgen_cpu / wall,
    )
    return figures | stash_figures(after.get("stash"), n)


def stash_figures(stash: dict[str, int] | None, n: int) -> dict[str, Any]:
    """The stash peaks of one measurement (the probe's meter, reset at its start), in all and
    per session; None where the server has no meter (a build without ``server.offload``).

    ``peak_stash_bytes``: on the stage's device (waiting, or brought back for the backward that
    runs); ``peak_waiting_bytes``: waiting on the device; ``peak_offloaded_bytes``: waiting in
    host memory (``server.offload = "auto"``)."""
    keys = ("peak_stash_bytes", "peak_waiting_bytes", "peak_offloaded_bytes")
    if stash is None:
        return dict.fromkeys(keys)
    return {k: stash[k] for k in keys} | {f"{k}_per_session": round(stash[k] / n) for k in keys}


def column_figures(
    spans: Sequence[Sequence[Span]],
    calls: Sequence[CallRecord],
    settings: ServerBenchSettings,
    *,
    server_cpu: float,
    loadgen_cpu: float,
) -> dict[str, Any]:
    """A column's figures (the contract's keys first) from device spans and server calls."""
    start, end, steps = measurement_window(spans, settings.warmup)
    window = end - start
    server = window_stats(calls, start, end)
    m = settings.shape.microbatches
    mb_per_s = steps * m / window
    times = sorted(e - s for device in spans for s, e in device[settings.warmup :])
    return {
        "mb_per_s": round(mb_per_s, 3),
        "tokens_per_s": round(mb_per_s * settings.shape.tokens_per_microbatch, 1),
        "step_p50_s": round(_quantile(times, 0.50), 4),
        "step_p95_s": round(_quantile(times, 0.95), 4),
        "busy": round(server["busy"], 3),
        "mean_batch": round(server["mean_batch"], 2),
        "server_s_per_step": round(server["busy_s"] / steps, 5),
        "server_cpu": round(server_cpu, 3),
        "loadgen_cpu": round(loadgen_cpu, 3),
        "window_s": round(window, 3),
        "steps_in_window": steps,
    }


def _cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """The nearest-rank quantile (``q`` in [0, 1]) of already sorted values."""
    return sorted_values[min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1)]


# -- the whole bench -----------------------------------------------------------------------------
def _row_order(index: int, columns: tuple[str, ...] = COLUMNS) -> tuple[str, ...]:
    """Columns in measuring order for the ``index``-th N: alternating, so drift hits both."""
    return columns if index % 2 == 0 else columns[::-1]


def run_server_bench(settings: ServerBenchSettings) -> dict[str, Any]:
    """Measure every N with batching off and on; returns the JSON-ready report."""
    link = parse_link(settings.link)
    load_start, began = os.getloadavg(), time.monotonic()
    server_cpus, pinning = _pin(settings.server_threads)
    loop = (_real_loop if settings.real else _emulated_loop)(settings, link)
    servers, available = _start_servers(settings, server_cpus)
    rows: list[dict[str, Any]] = []
    rounds = itertools.count(1)  # a round per measurement: its sessions are discarded after
    try:
        for index, n in enumerate(settings.devices):
            order = _row_order(index, settings.columns)
            row: dict[str, Any] = {"devices": n, "order": list(order)}
            for column in order:
                row[column] = _measure(servers[column], loop, n, next(rounds), settings)
                _progress(n, column, row[column])
            rows.append(row)
    finally:
        for server in servers.values():
            server.stop()
    return _report(settings, rows, pinning, available, load_start, time.monotonic() - began)


def _progress(n: int, column: str, figures: dict[str, Any]) -> None:
    print(
        f"  N={n:>3} {column:>9}: {figures['mb_per_s']:8.2f} mb/s, step p50 "
        f"{figures['step_p50_s']:.3f} s p95 {figures['step_p95_s']:.3f} s, busy "
        f"{figures['busy']:.2f}, batch {figures['mean_batch']:.2f}, load generator "
        f"{figures['loadgen_cpu']:.2f} cores, stash peak {figures['peak_stash_bytes']} B "
        f"(offloaded {figures['peak_offloaded_bytes']} B)",
        file=sys.stderr,
    )


def _model_figures(settings: ServerBenchSettings, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """N* from the smallest N's unbatched column, its predictions, and the measured knees."""
    first = rows[0]["unbatched"]
    t_alone, s_step = first["step_p50_s"], first["server_s_per_step"]
    n_star = n_star_model(t_alone, s_step)
    m = settings.shape.microbatches
    for row in rows:
        row["predicted_mb_per_s"] = round(predicted_mb_per_s(row["devices"], t_alone, s_step, m), 3)
    ns = [row["devices"] for row in rows]
    return {
        "n_star": round(n_star, 2),
        "n_star_model": {
            "from_devices": rows[0]["devices"],
            "t_alone_s": t_alone,
            "server_s_per_step": s_step,
            "formula": "N* = t_alone / server_s_per_step (see fedpipe_bench.server.n_star_model)",
        },
        "knee": {c: knee(ns, [row[c]["mb_per_s"] for row in rows]) for c in COLUMNS},
    }


def cpu_share(rows: Sequence[dict[str, Any]]) -> float:
    """The smallest ``server_cpu / busy`` of any column: the CPU the server got while computing.

    Near 1 (or above: the server also decodes and runs gRPC) on a quiet machine; well below it,
    other processes took the server's core and the columns' figures differ by noise alone.
    """
    return min(
        row[c]["server_cpu"] / max(row[c]["busy"], 1e-9)
        for row in rows
        for c in (*COLUMNS, OFFLOAD)
        if c in row
    )


def _report(
    settings: ServerBenchSettings,
    rows: list[dict[str, Any]],
    pinning: dict[str, Any],
    available: bool,
    load_start: tuple[float, float, float],
    wall: float,
) -> dict[str, Any]:
    shape, emu = settings.shape, settings.emulation
    loadgen = [row[c]["loadgen_cpu"] for row in rows for c in settings.columns]
    for row in rows:
        row["batched_over_unbatched"] = round(
            row["batched"]["mb_per_s"] / row["unbatched"]["mb_per_s"], 3
        )
        if OFFLOAD in row:
            row["offload_over_batched"] = offload_ratios(row["batched"], row[OFFLOAD])
    share = cpu_share(rows)
    if share < STARVED_SHARE:
        print(
            f"  warning: the server got {share:.0%} of a core while busy (server_cpu / busy): "
            "other processes share its core; rerun on a quiet machine before trusting the figures",
            file=sys.stderr,
        )
    return {
        "mode": "real" if settings.real else "emulated",
        "model": settings.model,
        "split": f"u: head {settings.head_layers}, tail {settings.tail_layers}",
        "microbatch": [shape.rows, shape.tokens],
        "hidden": shape.hidden,
        "microbatches": shape.microbatches,
        "link": settings.link,
        "device_compute_s": None if settings.real else dataclasses.asdict(emu),
        "steps": settings.steps,
        "warmup": settings.warmup,
        "batching_available": available,
        "offload": settings.offload,
        "pinning": pinning,
        **_model_figures(settings, rows),
        "loadgen_cpu_max": max(loadgen),
        "server_cpu_share": round(share, 3),
        "noisy": share < STARVED_SHARE,
        "load_average": {"start": list(load_start), "end": list(os.getloadavg())},
        "wall_s": round(wall, 1),
        "rows": rows,
    }


def offload_ratios(batched: dict[str, Any], offload: dict[str, Any]) -> dict[str, Any]:
    """The offload column against the batched one: device stash, throughput, step time."""

    def ratio(key: str) -> float | None:
        return round(offload[key] / batched[key], 3) if batched.get(key) else None

    return {
        "peak_stash_bytes": ratio("peak_stash_bytes"),
        "peak_waiting_bytes": ratio("peak_waiting_bytes"),
        "mb_per_s": round(offload["mb_per_s"] / batched["mb_per_s"], 3),
        "step_p50_s": round(offload["step_p50_s"] / batched["step_p50_s"], 3),
    }


# -- settings from the command line --------------------------------------------------------------
MODEL_ALIASES = {"smollm2": "default", "small": "small-llama", "tiny": "tiny-llama"}
# --quick (CI): tiny-llama, 2 x 16 tokens, a few ms of device compute, no link emulation.
QUICK = ServerBenchSettings(
    model="tiny-llama",
    devices=(1, 2, 4),
    steps=2,
    shape=LoadShape(2, 2, 16, 64),
    emulation=DeviceEmulation(0.005, 0.01, 0.005),
    link="loopback",
)
REAL_DEVICES = (1, 2, 4)


def make_settings(
    *,
    model: str | None = None,
    devices: Sequence[int] | None = None,
    steps: int | None = None,
    warmup: int | None = None,
    quick: bool = False,
    real: bool = False,
    link: str | None = None,
    server_threads: int | None = None,
    microbatches: int = 2,
    microbatch_size: int = 2,
    seq_len: int | None = None,
    offload: bool = False,
) -> ServerBenchSettings:
    """Settings for one invocation: the defaults, ``--quick``'s sizes, then the flags given."""
    from fedpipe.cli.preflight import default_split
    from fedpipe.models import load_config, resolve_model

    base = QUICK if quick else ServerBenchSettings()
    name = model or base.model
    name = MODEL_ALIASES.get(name.lower(), name)
    hf = load_config(resolve_model(name))
    side = default_split(int(hf.num_hidden_layers))
    tokens = seq_len or base.shape.tokens
    return ServerBenchSettings(
        model=name,
        head_layers=side,
        tail_layers=side,
        devices=tuple(devices or (REAL_DEVICES if real and not quick else base.devices)),
        steps=steps or base.steps,
        warmup=base.warmup if warmup is None else warmup,
        shape=LoadShape(microbatches, microbatch_size, tokens, int(hf.hidden_size)),
        emulation=base.emulation,
        link=link or base.link,
        server_threads=base.server_threads if server_threads is None else server_threads,
        real=real,
        offload=offload,
    )
