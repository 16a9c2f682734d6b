"""Processes a test starts, and the check that none of them outlives it (by PID, never by name).

:class:`Started` runs fedpipe commands (``python -m fedpipe.cli ...``) as real processes, each
with its own log file and its own ``FLWR_HOME``, and stops them by their own PIDs: SIGTERM in
the order given, then SIGKILL for whatever of their process trees is left.
:func:`assert_gone` is the one process-tree check: every recorded PID ends within a bound.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import psutil

from fedpipe.launch.processes import flower_processes_under

__all__ = [
    "FEDPIPE",
    "GONE_WITHIN_S",
    "Started",
    "alive",
    "assert_gone",
    "assert_no_flower_under",
    "kill_all",
    "kill_flower_under",
    "process_tree",
]

FEDPIPE = [sys.executable, "-m", "fedpipe.cli"]
GONE_WITHIN_S = 30.0


def process_tree(pid: int) -> list[psutil.Process]:
    """``pid`` and all its descendants now ([] if it is gone)."""
    try:
        parent = psutil.Process(pid)
        return [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def alive(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    """Those still running (a zombie has ended: it holds nothing and cannot be killed)."""
    running = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                running.append(proc)
        except psutil.NoSuchProcess:
            pass
    return running


def kill_all(procs: Iterable[psutil.Process]) -> None:
    """SIGKILL each process still running (matched by PID and start time)."""
    for proc in alive(procs):
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def assert_gone(procs: Sequence[psutil.Process], within_s: float = GONE_WITHIN_S) -> None:
    """Every one of ``procs`` ends within ``within_s``; those left are killed and named."""
    deadline = time.monotonic() + within_s
    while alive(procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = alive(procs)
    described = [(p.pid, _cmdline(p)) for p in left]
    kill_all(left)
    assert not described, f"left behind after {within_s:.0f} s: {described}"


def assert_no_flower_under(root: Path, within_s: float = GONE_WITHIN_S) -> None:
    """No process whose ``FLWR_HOME`` lies under ``root`` is running after ``within_s``.

    Every Flower process fedpipe starts gets a private ``FLWR_HOME`` that its helpers (SuperExec,
    ClientApps, Ray workers) inherit, so this finds exactly what a test's run started.
    """
    deadline = time.monotonic() + within_s
    while (left := flower_processes_under(root)) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert_gone([p for pid in left if (p := _process(pid)) is not None], within_s=0)


def kill_flower_under(root: Path, within_s: float = 15.0) -> None:
    """Wait up to ``within_s`` for the Flower processes under ``root`` to end; kill the rest.

    For what a test leaves on purpose: a SuperNode it killed with SIGKILL may leave its
    ClientApp behind until its watchdog notices.
    """
    deadline = time.monotonic() + within_s
    while (left := flower_processes_under(root)) and time.monotonic() < deadline:
        time.sleep(0.3)
    kill_all(p for pid in left if (p := _process(pid)) is not None)


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline()[:4])
    except psutil.Error:
        return "?"


class Started:
    """fedpipe commands a test started, by name, each with its log file under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}

    def spawn(
        self,
        name: str,
        args: Sequence[str],
        *,
        flwr_home: Path | None = None,
        env: dict[str, str] | None = None,
        prefix: Sequence[str] = (),
        **popen: object,
    ) -> subprocess.Popen[bytes]:
        """Start ``fedpipe args`` (after ``prefix``, a command that execs it) as ``name``.

        Its environment is ``env`` (default: this one) with ``FLWR_HOME`` (default: a home of
        its own under ``root``) and unbuffered output.
        """
        home = str(flwr_home or self.root / f"home-{name}")
        env = dict(os.environ, FLWR_HOME=home) if env is None else {"FLWR_HOME": home, **env}
        env["PYTHONUNBUFFERED"] = "1"
        self.logs[name] = self.root / f"{name}.out"
        with self.logs[name].open("wb") as log:
            proc = subprocess.Popen(  # noqa: S603 - fixed argv
                [*prefix, *FEDPIPE, *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                **popen,  # type: ignore[arg-type]
            )
        self.procs[name] = proc
        return proc

    def text(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace")

    def wait_for(self, name: str, ready: Callable[[], bool], timeout_s: float) -> None:
        """Until ``ready()``; fail with ``name``'s log if it exits first or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ready():
                return
            if self.procs[name].poll() is not None:
                raise AssertionError(f"{name} exited early:\n{self.text(name)[-4000:]}")
            time.sleep(0.3)
        tail = self.text(name)[-4000:]
        raise AssertionError(f"{name} not ready after {timeout_s:.0f} s:\n{tail}")

    def wait_for_text(self, name: str, text: str, timeout_s: float) -> None:
        self.wait_for(name, lambda: text in self.text(name), timeout_s)

    def stop(
        self, names: Sequence[str] | None = None, grace_s: float = 30.0
    ) -> dict[str, int | None]:
        """SIGTERM in this order (each stops its own Flower children), then SIGKILL the rest.

        Returns each one's exit status (None: it ignored SIGTERM for ``grace_s``). Whatever is
        left of their process trees, recorded before the signals, is killed by PID.
        """
        names = [n for n in (names or list(self.procs)) if n in self.procs]
        tree: list[psutil.Process] = []
        for name in names:
            tree += process_tree(self.procs[name].pid)
        for name in names:
            if self.procs[name].poll() is None:
                self.procs[name].send_signal(signal.SIGTERM)
        codes: dict[str, int | None] = {}
        for name in names:
            try:
                codes[name] = self.procs[name].wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                codes[name] = None
        psutil.wait_procs(alive(tree), timeout=5.0)
        kill_all(tree)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return codes
