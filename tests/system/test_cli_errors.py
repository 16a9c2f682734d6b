"""Failures of running commands end in one line that says what to do (real processes).

Ctrl-C in a simulation: where it stopped, and a command that resumes it (which then works).
(A device whose key the SuperLink does not know, and one that does not give the CA of a TLS
SuperLink: test_deployment_tls, which shares its TLS SuperLink.)
"""

from __future__ import annotations

import shlex
import signal
import subprocess
from pathlib import Path

from harness.processes import FEDPIPE
from harness.waits import wait_for

TINY = [
    "--set", "train.local_steps=1",
    "--set", "train.seq_len=32",
    "--set", "train.batch_size=2",
    "--set", "train.eval_batches=1",
    "--set", "pipeline.microbatches=2",
    "--devices", "2",
    "--profiles", "loopback",
    "--no-progress",
]  # fmt: skip


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_says_where_the_run_stopped_and_how_to_resume(tmp_path: Path) -> None:
    argv = ["simulate", *TINY, "--rounds", "3", "--runs-dir", str(tmp_path), "--name", "r"]
    first_checkpoint = tmp_path / "r" / "checkpoints" / "round-0001"
    with (tmp_path / "err.txt").open("w+") as err:
        # Ctrl-C as a terminal sends it: a process started from a background job (CI scripts,
        # `cmd &`) inherits SIGINT ignored, and Python then keeps it ignored.
        proc = subprocess.Popen(  # noqa: S603
            [*FEDPIPE, *argv], stdout=subprocess.DEVNULL, stderr=err, preexec_fn=_default_sigint
        )
        try:

            def checkpointed() -> bool:
                assert proc.poll() is None, (tmp_path / "err.txt").read_text()
                return first_checkpoint.is_dir()

            wait_for(checkpointed, "a checkpoint of round 1", timeout=400, interval=0.5)
            proc.send_signal(signal.SIGINT)
            rc = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    stderr = (tmp_path / "err.txt").read_text()
    assert rc == 130, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("fedpipe: interrupted after round "), stderr
    command = last.split("resume with: ", 1)[1]
    assert command.endswith("--resume") and "--name r" in command
    resumed = subprocess.run(  # noqa: S603 - the command the user is told to run
        [*FEDPIPE, *shlex.split(command)[1:]], capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (tmp_path / "r" / "checkpoints" / "round-0003").is_dir()
