"""Running Flower's commands: an interrupted command kills its child at once (a real process)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from fedpipe.launch.engines import _run_logged


def test_an_interrupted_command_is_killed_not_left_running(tmp_path: Path) -> None:
    """Ctrl-C (or SIGTERM turned into KeyboardInterrupt) kills the child: rc -2, at once."""

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGUSR1, interrupt)
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGUSR1)).start()
    started = time.monotonic()
    try:
        sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
        returncode, _ = _run_logged(sleeper, dict(os.environ), tmp_path / "log", 120)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert returncode == -2
    assert time.monotonic() - started < 30
