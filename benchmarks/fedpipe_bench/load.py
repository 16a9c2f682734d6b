"""Many emulated devices against one StageServer: exactness under load, step times, memory.

    python -m fedpipe_bench.load --devices 32 --steps 20 [--json]

The StageServer runs in its own process (so its memory is measured alone) on loopback with the
tiny test model. Each emulated device is a thread with a real :class:`StageClient` session that
sends deterministic activations and output gradients (seeded by the device) and hashes every
reply it gets: outputs, input gradients, and after its last step one evaluation forward whose
output depends on everything its server-side adapter learned. Each device first runs solo, then
all run together; a lost, crossed or reordered microbatch changes the hash, so equal hashes
prove each device's server-side computation under load equals its solo run, bit for bit.

Server memory is sampled from ``/proc/<pid>/status``: its resident size when the slowest device
has finished step 5, the largest after that, and the peak (``VmHWM``).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from fedpipe.launch.processes import with_parent_death_signal
from fedpipe.messages import Kind, StageMsg
from fedpipe.split.agreement import SplitTerms
from fedpipe.wire.backend import SessionRequest
from fedpipe.wire.control_client import StageControlClient
from fedpipe.wire.link_client import StageClient, StageSession

__all__ = [
    "DeviceEmulation",
    "DeviceRun",
    "LoadDevice",
    "LoadReport",
    "LoadShape",
    "ServerProcess",
    "device_split",
    "run_device",
    "run_load",
]

log = logging.getLogger(__name__)

BASELINE_STEP = 5


@dataclass(frozen=True)
class LoadShape:
    """What an emulated device sends per step: ``microbatches`` tensors (rows, tokens, hidden)."""

    microbatches: int = 2
    rows: int = 2
    tokens: int = 16
    hidden: int = 64  # tiny-llama

    @property
    def tokens_per_microbatch(self) -> int:
        return self.rows * self.tokens


@dataclass(frozen=True)
class DeviceEmulation:
    """A device's own compute per microbatch, emulated by sleeping (the server gets the cores)."""

    head_forward_s: float = 0.0
    tail_s: float = 0.0  # tail forward + loss + tail backward
    head_backward_s: float = 0.0

    @property
    def per_microbatch_s(self) -> float:
        return self.head_forward_s + self.tail_s + self.head_backward_s


@dataclass
class DeviceRun:
    """What one emulated device saw: a hash of every reply, and its step times."""

    digest: str
    step_s: list[float] = field(default_factory=list)


@dataclass
class LoadReport:
    devices: int
    steps: int
    exact: bool
    mismatched: list[str]
    step_p50_s: float
    step_p95_s: float
    rss_mb_at_step5: float
    rss_mb_max_after_step5: float
    rss_growth_mb: float
    peak_rss_mb: float
    wall_s: float


class ServerProcess:
    """A StageServer (U-shaped split) in a child process; stopped by its PID.

    ``overrides`` are settings on top of tiny-llama's defaults (model, split, ``server.*``);
    ``cpus`` pins the child (``sched_setaffinity``). With ``probe`` the child times its compute
    calls (:class:`fedpipe_bench.server_probe.ComputeProbe`) and answers :meth:`probe_stats`
    over its stdin and stdout.
    """

    def __init__(
        self,
        *,
        max_sessions: int = 128,
        overrides: dict[str, object] | None = None,
        cpus: list[int] | None = None,
        probe: bool = False,
    ) -> None:
        spec = {"max_sessions": max_sessions, "overrides": overrides or {}, "cpus": cpus or []}
        code = f"from fedpipe_bench.load import _serve; _serve({json.dumps(spec)!r}, probe={probe})"
        self.proc = subprocess.Popen(  # it dies with the bench, even one killed by SIGKILL
            with_parent_death_signal([sys.executable, "-c", code]),
            stdout=subprocess.PIPE,
            stdin=subprocess.PIPE if probe else None,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.startswith("listening "):
            self.stop()
            raise RuntimeError(f"the StageServer process did not start: {line!r}")
        self.address = line.removeprefix("listening ")

    def probe_stats(self) -> dict[str, Any]:
        """The child's compute calls since the last ask, its CPU seconds and its clock."""
        if self.proc.stdin is None or self.proc.stdout is None:
            raise RuntimeError("this StageServer process was started without probe=True")
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the StageServer process ended (exit {self.proc.poll()})")
        return dict(json.loads(line))

    def discard_round(self, round_: int) -> None:
        """Commit ``round_`` with no finished device: its sessions are dropped, nothing merged."""
        control = StageControlClient(self.address, "")
        try:  # as a ServerApp does: the run's adapter set (a fresh one), the round begun, then
            # committed; a StageServer refuses to commit a round it was not told of.
            control.reset_adapter()
            control.begin_round(round_, run_id="load")
            control.commit_round(round_, {})
        finally:
            control.close()

    def rss_kb(self, field_name: str = "VmRSS") -> int:
        with open(f"/proc/{self.proc.pid}/status") as fh:
            for line in fh:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
        raise RuntimeError(f"no {field_name} in /proc/{self.proc.pid}/status")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def _serve(spec_json: str, *, probe: bool = False) -> None:
    """Child process: serve until killed (or, with ``probe``, until stdin closes).

    Prints the address on the first line; with ``probe`` each ``stats`` line on stdin is
    answered with one JSON line (see :meth:`ServerProcess.probe_stats`).
    """
    from fedpipe.config import load_config
    from fedpipe.server.build import build_stage_server

    spec = json.loads(spec_json)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if spec["cpus"]:
        os.sched_setaffinity(0, set(spec["cpus"]))
    overrides = {"model.name": "tiny-llama", "server.max_sessions": spec["max_sessions"]}
    overrides |= spec["overrides"]
    server = build_stage_server(load_config(None, overrides), port=0).start()
    if not probe:
        print(f"listening {server.address}", flush=True)
        server.wait()
        return
    from fedpipe_bench.server_probe import ComputeProbe

    stats = ComputeProbe(server.runtime, stash=True).install()
    print(f"listening {server.address}", flush=True)
    for line in sys.stdin:
        if line.strip() == "stats":
            print(json.dumps(stats.snapshot()), flush=True)
    server.stop()


@functools.cache
def device_split(model: str = "tiny-llama", head: int = 0, tail: int = 0) -> SplitTerms:
    """The split an emulated device declares: the server's (``head``/``tail`` 0: the default)."""
    from fedpipe.config import load_config
    from fedpipe.edge.trainer import split_terms
    from fedpipe.models import resolve_model

    overrides: dict[str, object] = {"model.name": model}
    if head:
        overrides |= {"model.head_layers": head, "model.tail_layers": tail}
    return split_terms(load_config(None, overrides), resolve_model(model))


def _tensor(shape: LoadShape, *seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(hash(seed) & 0x7FFF_FFFF)
    return torch.randn(shape.rows, shape.tokens, shape.hidden, generator=gen)  # (b, T, C)


class LoadDevice:
    """One emulated device's steps on an open session: right-shaped tensors, sleeps for compute.

    A step sends every microbatch's activation (after its emulated head forward), answers each
    output with an output gradient (after its emulated tail), takes the input gradients (then
    its emulated head backward) and ends with ``STEP_END``. Like the device runtime, it collects
    ``STEP_DONE`` lazily, before the next step's first output. With a ``digest`` every tensor is
    fresh (seeded by device, step and microbatch) and every reply is hashed; without one the
    tensors are made once and reused, so the generator spends almost no CPU.
    """

    def __init__(
        self,
        session: StageSession,
        seed: int,
        shape: LoadShape,
        emulation: DeviceEmulation | None = None,
        digest: Any = None,
    ) -> None:
        self.session = session
        self.seed = seed
        self.shape = shape
        self.emulation = emulation or DeviceEmulation()
        self.digest = digest
        self._unconfirmed: int | None = None
        fixed = [_tensor(shape, seed, -2, mb) for mb in range(shape.microbatches)]
        self._fixed = (fixed, _tensor(shape, seed, -3) * 1e-3)

    def _activation(self, step: int, mb: int) -> torch.Tensor:
        return _tensor(self.shape, self.seed, step, mb) if self.digest else self._fixed[0][mb]

    def _gradient(self, step: int, mb: int) -> torch.Tensor:
        if self.digest:
            return _tensor(self.shape, self.seed, step, mb, 1) * 1e-3
        return self._fixed[1]

    def step(self, step: int) -> None:
        session, emu, m = self.session, self.emulation, self.shape.microbatches
        for mb in range(m):
            _sleep(emu.head_forward_s)
            session.send(StageMsg(Kind.ACTIVATION, step, mb, tensor=self._activation(step, mb)))
        self.confirm()
        for mb in range(m):
            self._hash(session.receive(Kind.OUTPUT, step, mb))
            _sleep(emu.tail_s)
            session.send(StageMsg(Kind.OUTPUT_GRAD, step, mb, tensor=self._gradient(step, mb)))
        for mb in range(m):
            self._hash(session.receive(Kind.INPUT_GRAD, step, mb))
            _sleep(emu.head_backward_s)
        session.send(StageMsg(Kind.STEP_END, step))
        self._unconfirmed = step

    def confirm(self) -> None:
        """Take the last step's ``STEP_DONE`` if it is still out."""
        if self._unconfirmed is not None:
            self.session.receive(Kind.STEP_DONE, self._unconfirmed, 0)
            self._unconfirmed = None

    def _hash(self, msg: StageMsg) -> None:
        if self.digest is not None:
            assert msg.tensor is not None
            self.digest.update(msg.tensor.contiguous().numpy().tobytes())


def _sleep(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


def run_device(
    address: str,
    device_id: str,
    seed: int,
    steps: int,
    *,
    round_: int = 0,
    progress: dict[str, int] | None = None,
) -> DeviceRun:
    """One emulated device (tiny shapes, no sleeps): ``steps`` steps, one evaluation forward."""
    run = DeviceRun("")
    digest = hashlib.sha256()
    shape = LoadShape()
    with StageClient(address) as client:
        session = client.open(
            SessionRequest(
                device_id=device_id,
                round=round_,
                learning_rate=1e-2,
                microbatch_size=shape.rows,
                seq_len=shape.tokens,
                split=device_split(),
            )
        )
        with session:
            device = LoadDevice(session, seed, shape, digest=digest)
            for step in range(steps):
                start = time.perf_counter()
                device.step(step)
                device.confirm()
                run.step_s.append(time.perf_counter() - start)
                if progress is not None:
                    progress[device_id] = step + 1
            probe = StageMsg(
                Kind.ACTIVATION, steps, 0, tensor=_tensor(shape, seed, -1), forward_only=True
            )
            session.send(probe)
            device._hash(session.receive(Kind.OUTPUT, steps, 0))
    run.digest = digest.hexdigest()
    return run


def run_load(devices: int, steps: int) -> LoadReport:
    """Solo runs, then all devices at once; compare hashes, time steps, watch server memory."""
    if steps <= BASELINE_STEP:
        raise ValueError(f"need more than {BASELINE_STEP} steps to see memory after step 5")
    server = ServerProcess(max_sessions=2 * devices + 8)
    try:
        solo = {i: run_device(server.address, f"solo-{i}", i, steps).digest for i in range(devices)}
        server.discard_round(0)  # the solo sessions go; the global adapter stays as it was
        start = time.perf_counter()
        progress: dict[str, int] = {}
        samples: list[tuple[int, int]] = []  # (steps every device has finished, RSS kB)
        done = threading.Event()
        sampler = threading.Thread(
            target=_sample, args=(server, progress, devices, samples, done), daemon=True
        )
        sampler.start()
        with ThreadPoolExecutor(devices) as pool:
            futures = {
                i: pool.submit(
                    run_device, server.address, f"load-{i}", i, steps, round_=1, progress=progress
                )
                for i in range(devices)
            }
            runs = {i: f.result(timeout=600) for i, f in futures.items()}
        done.set()
        sampler.join(timeout=5)
        wall = time.perf_counter() - start
        peak = server.rss_kb("VmHWM")
    finally:
        server.stop()
    return _report(devices, steps, solo, runs, samples, peak, wall)


def _sample(
    server: ServerProcess,
    progress: dict[str, int],
    devices: int,
    samples: list[tuple[int, int]],
    done: threading.Event,
) -> None:
    while not done.wait(0.02):
        slowest = min(progress.values()) if len(progress) == devices else 0
        samples.append((slowest, server.rss_kb()))


def _report(
    devices: int,
    steps: int,
    solo: dict[int, str],
    runs: dict[int, DeviceRun],
    samples: list[tuple[int, int]],
    peak_kb: int,
    wall: float,
) -> LoadReport:
    mismatched = [f"load-{i}" for i in range(devices) if runs[i].digest != solo[i]]
    times = sorted(t for run in runs.values() for t in run.step_s)
    after = [rss for slowest, rss in samples if slowest >= BASELINE_STEP]
    if not after:
        raise RuntimeError("no memory sample after step 5; the run was too short to measure")
    base, top = after[0] / 1024, max(after) / 1024
    return LoadReport(
        devices=devices,
        steps=steps,
        exact=not mismatched,
        mismatched=mismatched,
        step_p50_s=round(_quantile(times, 0.50), 4),
        step_p95_s=round(_quantile(times, 0.95), 4),
        rss_mb_at_step5=round(base, 1),
        rss_mb_max_after_step5=round(top, 1),
        rss_growth_mb=round(top - base, 1),
        peak_rss_mb=round(peak_kb / 1024, 1),
        wall_s=round(wall, 2),
    )


def _quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    report = run_load(args.devices, args.steps)
    if args.json:
        print(json.dumps(report.__dict__))
    else:
        for key, value in report.__dict__.items():
            print(f"{key:24s} {value}")


if __name__ == "__main__":
    main()
