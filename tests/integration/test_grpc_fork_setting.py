"""gRPC's fork handlers are off in every process fedpipe runs or starts, unless the user set them.

Ray forks (``subprocess.Popen`` with a ``preexec_fn``) in the process that starts it, and with
gRPC's default fork support a fork while a stage-link stream is live breaks that process's
gRPC: streams stall, a message arrives twice, the process can crash
(``benchmarks/stress_bench.py --forks``, docs/benchmarks/stress.md). The setting only counts
when it is in the environment before grpc is imported, so fedpipe sets it on import and in
every Flower process it starts, and tells a ServerApp whose process imported grpc first.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fedpipe.launch.processes import flower_env

_SHOW = (
    "import os, sys\n"
    "{first}\n"
    "import fedpipe\n"
    "print(os.environ['GRPC_ENABLE_FORK_SUPPORT'], fedpipe.GRPC_FORK_SETTING_LATE)\n"
)


def _python(first: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    out = subprocess.run(
        [sys.executable, "-c", _SHOW.format(first=first)],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.strip()


def test_importing_fedpipe_first_turns_grpc_fork_handlers_off() -> None:
    assert _python("") == "0 False"


def test_a_users_own_setting_stays() -> None:
    assert _python("", GRPC_ENABLE_FORK_SUPPORT="1") == "1 False"


def test_grpc_imported_before_fedpipe_without_the_setting_is_known_to_be_late() -> None:
    assert _python("import grpc") == "0 True"  # os.environ says 0; grpc read it unset
    assert _python("import grpc", GRPC_ENABLE_FORK_SUPPORT="0") == "0 False"


def test_every_flower_process_fedpipe_starts_gets_it_in_its_environment(tmp_path: Path) -> None:
    bare = {"PATH": os.environ.get("PATH", "")}
    assert flower_env(tmp_path, bare)["GRPC_ENABLE_FORK_SUPPORT"] == "0"
    assert (
        flower_env(tmp_path, {**bare, "GRPC_ENABLE_FORK_SUPPORT": "1"})["GRPC_ENABLE_FORK_SUPPORT"]
        == "1"
    )
