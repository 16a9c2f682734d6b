"""The stage link under stress: every reply, under an oversubscribed CPU, equals its unloaded run.

    python benchmarks/stress_bench.py [--devices 12] [--steps 3] [--seconds 600] [--forks 0]
                                      [--json]

One StageServer (its own process, loopback, tiny-llama) and ``--devices`` emulated devices
(threads with real :class:`StageClient` sessions), each on its own mix of the wire's codecs
(every codec of :data:`fedpipe.config.codecs.CODECS` and the token-grouped int4, up and down)
and, for every other device, an emulated link (its delay line and throttles). First each device
runs alone on an idle machine: the hash of every reply it gets (outputs, input gradients, an
evaluation forward after its last step) is its reference. Then, for ``--seconds``, round after
round, all devices run at once while ``--burners`` processes spin on the cores, and every
device's hash is compared with its reference. A corrupted, crossed, lost or reordered byte in
any reply changes the hash; a frame whose checksum does not match is refused by the receiver
(:class:`fedpipe.errors.CorruptMessageError`), and is counted as such.

``--forks N``: N threads in the devices' process start short-lived processes one after another
the way Ray starts its own (``subprocess.Popen`` with a ``preexec_fn``: a real ``fork()`` with
Python running in the child before ``exec``), as Ray does in the ServerApp's process of
Flower's simulation while the evaluator streams. gRPC's fork handlers follow
``GRPC_ENABLE_FORK_SUPPORT`` as this process found it when grpc was imported (fedpipe sets it
to 0 unless it is set): run once with ``GRPC_ENABLE_FORK_SUPPORT=`` (empty: gRPC's own
default, its C core's handlers on) beside a run without it to see what a fork does to live
streams (docs/benchmarks/stress.md).

Prints one JSON object with ``--json``: ``rounds``, ``messages`` (stage-link messages both
ways), ``payload_mb`` (encoded bytes both ways), ``mismatched`` (device runs whose
hash differed from the reference), ``corrupted`` (runs that failed on a refused frame),
``failed`` (runs that failed otherwise, with their errors), ``seconds``, ``forks`` and
``forks_hung`` (forked children that never reached ``exec``: within 20 s, or by the end of
the rounds; killed) and ``clean``.
Messages and bytes are the devices' sessions' own counts of encoded frames.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import psutil

from fedpipe.config.codecs import CODECS
from fedpipe.errors import CorruptMessageError
from fedpipe.launch.processes import with_parent_death_signal
from fedpipe.messages import Kind, StageMsg
from fedpipe.wire.backend import SessionRequest
from fedpipe.wire.link_client import StageClient
from fedpipe_bench.load import LoadDevice, LoadShape, ServerProcess, _tensor, device_split

__all__ = ["DeviceMix", "Forkers", "StressReport", "device_mixes", "run_stress"]

# What grpc read when this module (and so fedpipe, which sets a default first) was imported.
_GRPC_FORK_SUPPORT = os.environ.get("GRPC_ENABLE_FORK_SUPPORT", "")

log = logging.getLogger(__name__)

WIRE_CODECS: tuple[str, ...] = (*CODECS, "int4t")
# A fast emulated link: its delay line and throttles run, without making the rounds long.
EMULATED_LINK = "up=400,down=800,rtt=4ms"


@dataclass(frozen=True)
class DeviceMix:
    """One emulated device's wire: its codecs each way and its link (None: no emulation)."""

    uplink: str
    downlink: str
    link: str | None


def device_mixes(devices: int) -> list[DeviceMix]:
    """``devices`` mixes that cover every codec up and down, half of them over a link."""
    n = len(WIRE_CODECS)
    return [
        DeviceMix(WIRE_CODECS[i % n], WIRE_CODECS[(i + 2) % n], EMULATED_LINK if i % 2 else None)
        for i in range(devices)
    ]


@dataclass
class StressReport:
    devices: int
    steps: int
    rounds: int = 0
    messages: int = 0
    payload_mb: float = 0.0
    mismatched: list[str] = field(default_factory=list)
    corrupted: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    seconds: float = 0.0
    burners: int = 0
    cores: int = 0
    forks: int = 0  # processes forked in the devices' process during the loaded rounds
    forks_hung: int = 0  # of them, children stuck before exec (killed)
    grpc_fork_support: str = ""  # GRPC_ENABLE_FORK_SUPPORT as grpc found it

    @property
    def clean(self) -> bool:
        return not (self.mismatched or self.corrupted or self.failed or self.forks_hung)

    def as_dict(self) -> dict[str, object]:
        return {**self.__dict__, "clean": self.clean}


@dataclass
class _Run:
    digest: str = ""
    messages: int = 0
    payload_bytes: int = 0


def _device_run(address: str, mix: DeviceMix, seed: int, steps: int, round_: int) -> _Run:
    """One device's session: ``steps`` steps and an evaluation forward, every reply hashed."""
    digest, shape = hashlib.sha256(), LoadShape()
    with StageClient(address) as client:
        session = client.open(
            SessionRequest(
                device_id=f"stress-{seed}-r{round_}",
                round=round_,
                learning_rate=1e-2,
                uplink_codec=mix.uplink,
                downlink_codec=mix.downlink,
                gradient_codec=mix.downlink,
                microbatch_size=shape.rows,
                seq_len=shape.tokens,
                split=device_split(),
            ),
            link=mix.link,
            link_seed=seed,
        )
        with session:
            device = LoadDevice(session, seed, shape, digest=digest)
            for step in range(steps):
                device.step(step)
                device.confirm()
            probe = _tensor(shape, seed, -1)
            session.send(StageMsg(Kind.ACTIVATION, steps, 0, tensor=probe, forward_only=True))
            device._hash(session.receive(Kind.OUTPUT, steps, 0))
            stats = session.stats  # as the session counted them on the wire
    return _Run(
        digest.hexdigest(),
        stats.messages_up + stats.messages_down,
        stats.bytes_up + stats.bytes_down,
    )


def _burn() -> None:  # pragma: no cover - runs in the burner processes
    while True:
        pass


class Burners:
    """``count`` processes that spin on the cores until stopped (by their PIDs)."""

    def __init__(self, count: int) -> None:
        code = "from fedpipe_bench.stress import _burn; _burn()"
        self.procs = [
            subprocess.Popen(with_parent_death_signal([sys.executable, "-c", code]))
            for _ in range(count)
        ]

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


FORK_TIMEOUT_S = 20.0  # a forked child that has not exec'd a trivial program by then is stuck


def _exec_at_once() -> None:  # pragma: no cover - runs in the forked child
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # what Ray's preexec_fn does


class Forkers:
    """``count`` threads forking short-lived processes as Ray starts its own, until stopped."""

    def __init__(self, count: int) -> None:
        self.started = 0
        self.finished = 0
        self.timed_out = 0  # children that exec'd nothing within FORK_TIMEOUT_S (killed)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        program = shutil.which("true") or sys.executable
        self._argv = [program] if program != sys.executable else [program, "-c", ""]
        self._threads = [threading.Thread(target=self._fork, daemon=True) for _ in range(count)]
        for thread in self._threads:
            thread.start()

    def _fork(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                self.started += 1
            try:  # the child's output nowhere once it runs (it may hang before it does)
                subprocess.run(
                    self._argv,
                    preexec_fn=_exec_at_once,
                    check=False,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    timeout=FORK_TIMEOUT_S,
                )
            except subprocess.TimeoutExpired:
                with self._lock:
                    self.timed_out += 1
            with self._lock:
                self.finished += 1

    def stop(self) -> tuple[int, int]:
        """(processes forked, of them stuck before exec): a child stuck in the fork itself
        keeps its thread in ``Popen`` (no timeout reaches it); it is killed here, found as a
        child of this process still running this process's own command line."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=2 * FORK_TIMEOUT_S)
        me = psutil.Process()
        for child in me.children():
            try:
                if child.cmdline() == me.cmdline():
                    child.kill()
            except psutil.Error:
                pass
        for thread in self._threads:
            thread.join(timeout=FORK_TIMEOUT_S)
        with self._lock:
            return self.started, self.timed_out + (self.started - self.finished)


def _round(
    address: str, mixes: list[DeviceMix], steps: int, round_: int, report: StressReport
) -> dict[int, _Run]:
    """Every device at once in ``round_``; the runs that finished, failures recorded."""
    runs: dict[int, _Run] = {}
    with ThreadPoolExecutor(len(mixes)) as pool:
        futures = {
            i: pool.submit(_device_run, address, mix, i, steps, round_)
            for i, mix in enumerate(mixes)
        }
        for i, future in futures.items():
            try:
                runs[i] = future.result(timeout=600)
            except CorruptMessageError as exc:
                report.corrupted.append(f"round {round_} device {i}: {exc}")
            except Exception as exc:  # noqa: BLE001 - the report names every failure
                cause = exc.__cause__ if isinstance(exc.__cause__, CorruptMessageError) else None
                target = report.corrupted if cause or "corrupted in transit" in str(exc) else None
                (target if target is not None else report.failed).append(
                    f"round {round_} device {i}: {type(exc).__name__}: {exc}"
                )
    return runs


def run_stress(
    devices: int = 12,
    steps: int = 3,
    seconds: float = 600.0,
    burners: int | None = None,
    forks: int = 0,
) -> StressReport:
    """References on an idle machine, then loaded rounds for ``seconds`` (at least one), with
    ``forks`` threads forking in this process during them."""
    cores = multiprocessing.cpu_count()
    burners = 2 * cores if burners is None else burners
    report = StressReport(devices, steps, burners=burners, cores=cores)
    report.grpc_fork_support = _GRPC_FORK_SUPPORT
    mixes = device_mixes(devices)
    server = ServerProcess(max_sessions=2 * devices + 8)
    try:
        solo = {
            i: _device_run(server.address, mix, i, steps, 0).digest for i, mix in enumerate(mixes)
        }
        server.discard_round(0)  # the global adapter stays as it was for every round
        load = Burners(burners)
        forkers = Forkers(forks)
        start = time.monotonic()
        try:
            while report.rounds == 0 or time.monotonic() - start < seconds:
                round_ = report.rounds + 1
                runs = _round(server.address, mixes, steps, round_, report)
                server.discard_round(round_)
                report.rounds = round_
                _tally(report, round_, solo, runs)
        finally:
            report.forks, report.forks_hung = forkers.stop()
            load.stop()
        report.seconds = round(time.monotonic() - start, 1)
    finally:
        server.stop()
    return report


def _tally(report: StressReport, round_: int, solo: dict[int, str], runs: dict[int, _Run]) -> None:
    for i, run in runs.items():
        report.messages += run.messages
        report.payload_mb = round(report.payload_mb + run.payload_bytes / 1e6, 3)
        if run.digest != solo[i]:
            report.mismatched.append(f"round {round_} device {i}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=12)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=600.0, help="how long to keep loading")
    parser.add_argument("--burners", type=int, default=None, help="spinning processes (2x cores)")
    parser.add_argument(
        "--forks", type=int, default=0, help="threads forking as Ray does, in the devices' process"
    )
    parser.add_argument(
        "--report-unclean",
        action="store_true",
        help="exit 0 when a reply differs or a run fails (the report says so): to record a "
        "setting known to fail",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    report = run_stress(args.devices, args.steps, args.seconds, args.burners, args.forks)
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        for key, value in report.as_dict().items():
            print(f"{key:12s} {value}")
    kinds = Counter(line.split(":")[0].split()[-1] for line in report.failed)
    if kinds:
        log.error("failed runs by device: %s", dict(kinds))
    sys.exit(0 if report.clean or args.report_unclean else 1)


if __name__ == "__main__":
    main()
