"""A small process that stops a Flower process tree when the fedpipe process that owns it dies.

`fedpipe client` and `fedpipe server` stop their SuperNode or SuperLink themselves on SIGTERM,
SIGHUP and Ctrl-C. A SIGKILL (or a crash) gives them no chance, and Flower's processes would
go on as orphans that keep training. So each managed Flower process gets this watchdog:
``python -m fedpipe.launch.watchdog OWNER_PID ROOT_PID``. Every 0.2 s it records ROOT_PID's
descendants (Flower detaches some into their own sessions, so process groups do not cover
them); once OWNER_PID is gone, or ROOT_PID has ended, it stops every recorded process still
running: SIGTERM, then SIGKILL after a grace period. Its owner stops it (SIGTERM) after a normal
shutdown. Processes are matched by PID and start time (psutil), never by name.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil

POLL_S = 0.2
GRACE_S = 5.0


def _tree(root: psutil.Process) -> list[psutil.Process]:
    try:
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _stop(procs: list[psutil.Process]) -> None:
    for proc in procs:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=GRACE_S)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass


def watch(owner_pid: int, root_pid: int) -> None:
    """Follow ``root_pid``'s tree while ``owner_pid`` lives; then stop what is left of it."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the owner's normal shutdown
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the owner's business
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        root = psutil.Process(root_pid)
    except psutil.NoSuchProcess:
        return
    known: dict[int, psutil.Process] = {}
    while True:
        tree = _tree(root)
        known.update({p.pid: p for p in tree})
        if not tree or os.getppid() != owner_pid:  # reparented: the owner is gone
            break
        time.sleep(POLL_S)
    _stop([p for p in known.values() if _running(p)])


if __name__ == "__main__":
    watch(int(sys.argv[1]), int(sys.argv[2]))
