"""Light modules stay light: each imported alone in a fresh interpreter (a real process).

`fedpipe --help` (every command) imports no torch, transformers, Flower or gRPC; the batch
policy and the planner import no torch; the run plots import no matplotlib until they plot.
"""

from __future__ import annotations

import subprocess
import sys

COMMANDS = [
    ["simulate"],
    ["server"],
    ["client"],
    ["run"],
    ["register-node"],
    ["export"],
    ["generate"],
    ["eval"],
    ["bench", "pipeline"],
    ["bench", "memory"],
    ["bench", "server"],
    ["bench", "plan"],
]


def test_help_of_every_command_imports_no_torch() -> None:
    script = f"""
import contextlib, io, sys
from fedpipe.cli.main import main
for argv in [[], *{COMMANDS!r}]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([*argv, "--help"])
    assert "usage: fedpipe" in out.getvalue(), argv
heavy = [m for m in ("torch", "transformers", "flwr", "grpc") if m in sys.modules]
print(heavy)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def test_the_policy_module_does_not_import_torch() -> None:
    code = "import sys, fedpipe.server.batch_policy; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_planner_needs_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, fedpipe.edge.planner; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_plots_module_imports_no_matplotlib() -> None:
    import subprocess

    code = "import fedpipe.runs.plots, sys; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
