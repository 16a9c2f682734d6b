"""The deployment starter: `fedpipe server --superlink` (StageServer + Flower SuperLink) and N
`fedpipe client` devices (one SuperNode each), as a user starts them, each in its own home.

Every process gets its own ``FLWR_HOME`` and log under the test's folder and is stopped by
its own PID (:class:`~harness.processes.Started`). A run is launched with `fedpipe run`.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from fedpipe.launch.processes import free_port
from harness.processes import Started

__all__ = ["SMALL", "Deployment"]

SMALL = [
    "--model", "tiny-llama",
    "--set", "train.local_steps=2",
    "--set", "train.seq_len=64",
    "--set", "train.batch_size=4",
    "--set", "train.eval_batches=2",
    "--set", "pipeline.microbatches=2",
]  # fmt: skip


class Deployment:
    """A server host (secret, run folders, SuperLink) and its devices, under ``root``.

    ``settings`` are the command-line settings the server and each run get (tiny-llama,
    small sizes); ``one_flag`` starts the server as ``--superlink HOST:PORT --stage-server
    127.0.0.1:0 --workdir DIR`` instead of ``--port 0 --superlink --superlink-port P
    --superlink-dir DIR``.
    """

    def __init__(
        self,
        started: Started,
        root: Path,
        *,
        settings: Sequence[str] = tuple(SMALL),
        one_flag: bool = False,
    ) -> None:
        self.started, self.root = started, root
        self.settings = list(settings)
        self.one_flag = one_flag
        self.secret_file = root / "keys" / "secret"  # `fedpipe server` creates it
        self.port_file = root / "stage.port"
        self.link_port = free_port()
        self.superlink = f"127.0.0.1:{self.link_port}"
        self.stage = ""
        self.devices: list[str] = []

    def start_server(self, *extra: str, timeout_s: float = 180.0) -> str:
        """Start `fedpipe server` with the SuperLink; returns the StageServer's address."""
        if self.one_flag:
            where = ["--superlink", self.superlink, "--stage-server", "127.0.0.1:0"]
            where += ["--workdir", str(self.root / "superlink")]
        else:
            where = ["--port", "0", "--superlink", "--superlink-port", str(self.link_port)]
            where += ["--superlink-dir", str(self.root / "superlink")]
        self.started.spawn(
            "server",
            [
                "server", *self.settings, *where, "--port-file", str(self.port_file),
                "--secret-file", str(self.secret_file), *extra,
            ],
            flwr_home=self.root / "home-server",
        )  # fmt: skip
        self.started.wait_for("server", self.port_file.exists, timeout_s)
        self.stage = f"127.0.0.1:{self.port_file.read_text().strip()}"
        return self.stage

    def start_devices(
        self,
        count: int,
        *,
        args: Callable[[int], list[str]] | None = None,
        env: Callable[[int], dict[str, str]] | None = None,
        prefix: Sequence[str] = (),
        timeout_s: float = 180.0,
    ) -> list[str]:
        """Start ``count`` devices (`fedpipe client`) and wait until each is connected.

        Device ``i`` is told the SuperLink, the StageServer, its partition and a work folder
        of its own, unless ``args(i)`` gives its flags after the SuperLink's; ``env(i)`` is
        its whole environment (default: this one with a home of its own).
        """
        names = []
        for i in range(count):
            name = f"client{len(self.devices)}"
            flags = (
                args(i)
                if args is not None
                else [
                    "--stage-server", self.stage, "--partition-id", str(i),
                    "--num-partitions", str(count), "--workdir", str(self.root / f"node{i}"),
                ]
            )  # fmt: skip
            self.started.spawn(
                name,
                ["client", "--superlink", self.superlink, *flags],
                flwr_home=self.root / f"home-node{i}",
                env=env(i) if env is not None else None,
                prefix=prefix,
            )
            names.append(name)
            self.devices.append(name)
        for name in names:
            self.started.wait_for_text(name, "connected to", timeout_s)
        return names

    def run_args(self, name: str, *extra: str, rounds: int, devices: int) -> list[str]:
        """`fedpipe run` of ``rounds`` rounds on this deployment, its folder ``root/runs/name``."""
        return [
            "run", *self.settings, "--superlink", self.superlink, "--stage-server", self.stage,
            "--secret-file", str(self.secret_file), "--name", name,
            "--runs-dir", str(self.runs), "--rounds", str(rounds), "--devices", str(devices),
            *extra,
        ]  # fmt: skip

    def run(
        self, process: str, *extra: str, name: str, rounds: int, devices: int
    ) -> subprocess.Popen[bytes]:
        """Start `fedpipe run` of run ``name`` as process ``process`` (its own home)."""
        args = self.run_args(name, *extra, rounds=rounds, devices=devices)
        return self.started.spawn(process, args, flwr_home=self.root / f"home-{process}")

    @property
    def runs(self) -> Path:
        return self.root / "runs"

    def stop(self, grace_s: float = 30.0) -> dict[str, int | None]:
        """SIGTERM the runs, then the devices, then the server (each by its PID); exit codes."""
        order = [n for n in self.started.procs if n not in ("server", *self.devices)]
        return self.started.stop([*order, *self.devices, "server"], grace_s=grace_s)
