"""StageServer replicas beyond one machine: each a Ray Core actor holding the whole middle.

A :class:`ReplicaSet` starts ``server.replicas`` StageServers as Ray actors, on a local Ray
instance of its own or on a Ray cluster (``server.ray_address``), each asking Ray for what it
needs (``server.threads`` CPUs, one GPU when it computes on CUDA), so Ray places them across
nodes. Each replica serves the stage link and round control on its own address; nothing of the
data path goes through Ray. The ServerApp assigns every device to one replica per round and
merges the server adapters across replicas at commit (:mod:`fedpipe.fl.replica_control`), over gRPC.

A replica listens on a port the driver fixed (``server.replica_port`` + i, or a free port
picked here on a local Ray), so that when its process dies and Ray restarts the actor
(``server.replica_restarts``) it comes back at the same address, empty: the ServerApp finds it
so at the next BeginRound and loads the global adapter into it.

The replicas' secret (when the StageServers have one) is an argument of the actors, which the
Ray cluster's GCS holds: run replicas on a Ray cluster only its operators can reach.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fedpipe.config import FedpipeConfig
from fedpipe.errors import FedpipeError

__all__ = ["ReplicaInfo", "ReplicaSet", "ReplicaStartError", "replica_resources"]

log = logging.getLogger(__name__)

_WILDCARDS = ("0.0.0.0", "::", "[::]", "")
_OBJECT_STORE_BYTES = 128 * 2**20  # nothing large crosses Ray: the stage link is gRPC
_STOP_S = 15.0  # a replica's own graceful stop, before Ray kills it


class ReplicaStartError(FedpipeError):
    """Replicas could not be placed or did not start; the message says which, in one line."""


@dataclass(frozen=True)
class ReplicaInfo:
    """One replica as it serves: where devices reach it, where it runs, what it asked for."""

    index: int
    address: str  # host:port that devices and the ServerApp dial
    node_ip: str
    pid: int
    device: str  # where its stage computes: cpu, cuda:0 (of the GPUs Ray gave it)
    resources: dict[str, float] = field(default_factory=dict)  # asked of Ray: CPU, GPU
    cpus: tuple[int, ...] = ()  # the cores its process may run on (sched_getaffinity)

    def line(self) -> str:
        """One line for the operator: ``replica 0: 10.0.0.5:50100 (node ..., pid ..., ...)``."""
        asked = ", ".join(f"{v:g} {k}" for k, v in sorted(self.resources.items()) if v)
        cores = f", cores {_ranges(self.cpus)}" if self.cpus else ""
        return (
            f"replica {self.index}: {self.address} (node {self.node_ip}, pid {self.pid}, "
            f"{self.device}; asked Ray for {asked or 'nothing'}{cores})"
        )


def replica_resources(config: FedpipeConfig, cluster_gpus: float) -> dict[str, float]:
    """What one replica asks Ray for: ``server.threads`` CPUs, and one GPU when it computes on
    CUDA (``server.device`` cuda, or auto on a cluster that has GPUs)."""
    device = config.server.device
    gpu = device == "cuda" or (device == "auto" and cluster_gpus >= 1)
    return {"CPU": float(config.server.threads), "GPU": 1.0 if gpu else 0.0}


class StageReplica:
    """The Ray actor: one StageServer, built and started in the actor's process.

    Ray restarts a dead actor by calling this constructor again with the same arguments: the
    same port, hence the same address, and an empty StageServer (no run's adapter).
    """

    def __init__(
        self,
        config: FedpipeConfig,
        secret: str | None,
        *,
        index: int,
        bind: str,
        port: int,
        advertise: str,
        cpus: Sequence[int] = (),
    ) -> None:
        from fedpipe.server.build import build_stage_server  # deferred: torch, in the actor

        if cpus:
            os.sched_setaffinity(0, set(cpus))
        _replica_logging(index)
        self.index = index
        host = advertise or _node_ip()
        config = config.with_overrides({"server.host": bind})
        self.server = build_stage_server(config, secret=secret, port=port).start()
        self.address = f"{_bracket(host)}:{self.server.port}"
        log.info("replica %d serving on %s (bound to %s)", index, self.address, self.server.address)

    def info(self) -> dict[str, Any]:
        import torch  # deferred: loaded already by the StageServer

        device = str(self.server.runtime.device)
        if device.startswith("cuda"):
            name = torch.cuda.get_device_name(self.server.runtime.device)
            device = f"{device} ({name})"
        return {
            "address": self.address,
            "node_ip": _node_ip(),
            "pid": os.getpid(),
            "device": device,
            "cpus": sorted(os.sched_getaffinity(0)),
        }

    def stop(self) -> None:
        self.server.stop(grace=1.0)


class ReplicaSet:
    """``server.replicas`` StageServer replicas on Ray; ``start()`` places and starts them,
    ``stop()`` ends them (and the local Ray it started), leaving no process behind.

    ``cpus`` pins replica i to the cores ``cpus[i]`` (benchmarks); ``log_to_driver`` forwards
    the replicas' log lines to this process's stderr (``fedpipe server``).
    """

    def __init__(
        self,
        config: FedpipeConfig,
        *,
        secret: str | None = None,
        cpus: Sequence[Sequence[int]] | None = None,
        log_to_driver: bool = False,
    ) -> None:
        self.config = config
        self.secret = secret
        self.cpus = [tuple(c) for c in cpus] if cpus else []
        if self.cpus and len(self.cpus) != config.server.replicas:
            raise ValueError(f"cpus: one set per replica ({config.server.replicas}), got {cpus}")
        self.log_to_driver = log_to_driver
        self.replicas: list[ReplicaInfo] = []
        self._actors: list[Any] = []
        self._pids: set[int] = set()  # every replica process seen, for the check at stop

    # -- start ----------------------------------------------------------------------------------
    def start(self) -> ReplicaSet:
        """Start Ray (or join the cluster), create every replica, wait until each serves.

        A replica that Ray cannot place (no node has what it asks for) or that fails to start
        within ``server.replica_start_s`` is reported in one line, and nothing is left running.
        """
        import ray  # deferred: Ray is heavy and only replicas need it

        self._init_ray(ray)
        try:
            resources = replica_resources(self.config, ray.cluster_resources().get("GPU", 0.0))
            self._check_capacity(ray, resources)
            self._actors = [self._create(ray, i, resources) for i in range(self._count)]
            infos = self._wait_serving(ray, resources)
        except BaseException:
            self.stop()
            raise
        self.replicas = infos
        return self

    @property
    def _count(self) -> int:
        return self.config.server.replicas

    @property
    def _cluster(self) -> bool:
        return bool(self.config.server.ray_address)

    def _init_ray(self, ray: Any) -> None:
        if ray.is_initialized():
            raise RuntimeError("Ray is initialised in this process already: one replica set each")
        # ray.init makes SIGTERM exit the process at once; the caller's own handler (stop the
        # replicas and what else it started, then exit) is put back.
        main = threading.current_thread() is threading.main_thread()
        handler = signal.getsignal(signal.SIGTERM) if main else None
        try:
            with warnings.catch_warnings():  # Ray's notice of a future default: not ours to act on
                warnings.simplefilter("ignore", FutureWarning)
                self._init(ray)
        finally:
            if handler is not None:
                signal.signal(signal.SIGTERM, handler)

    def _init(self, ray: Any) -> None:
        address = self.config.server.ray_address
        if address:
            ray.init(address=address, log_to_driver=self.log_to_driver, configure_logging=False)
            return
        # address "local": a Ray of our own, never one found through RAY_ADDRESS or
        # /tmp/ray/ray_current_cluster (nor Flower's simulation engine's: it starts its own).
        cores = os.cpu_count() or 1
        wanted = self._count * self.config.server.threads
        if wanted > cores:
            print(
                f"fedpipe: {self._count} replicas x {self.config.server.threads} thread(s) on "
                f"{cores} cores: they share cores",
                file=sys.stderr,
                flush=True,
            )
        self._init_local(ray, max(cores, wanted))

    def _init_local(self, ray: Any, cpus: int) -> None:
        ray.init(
            address="local",
            num_cpus=cpus,
            include_dashboard=False,
            log_to_driver=self.log_to_driver,
            configure_logging=False,
            object_store_memory=_OBJECT_STORE_BYTES,
        )

    def _check_capacity(self, ray: Any, resources: dict[str, float]) -> None:
        """Fail at once, one line, when the cluster as a whole cannot hold the replicas."""
        total = ray.cluster_resources()
        for name, each in resources.items():
            have = float(total.get(name, 0.0))
            fits = math.floor(have / each) if each else self._count
            if fits < self._count:
                raise ReplicaStartError(
                    f"replica {fits} of {self._count} cannot be placed: each asks Ray for "
                    f"{each:g} {name}, the cluster has {have:g} ({_where(self.config)}); "
                    "add nodes, or lower server.replicas"
                    + (" or server.threads" if name == "CPU" else "")
                )

    def _create(self, ray: Any, index: int, resources: dict[str, float]) -> Any:
        server = self.config.server
        if self._cluster:  # on whichever node Ray picks: all interfaces, the node's address
            bind, advertise, port = "0.0.0.0", "", server.replica_port + index
        else:
            bind = server.host
            advertise = "" if bind in _WILDCARDS else bind
            port = server.replica_port + index if server.replica_port else _free_port(bind)
        actor = ray.remote(StageReplica).options(
            num_cpus=resources["CPU"],
            num_gpus=resources["GPU"],
            max_restarts=server.replica_restarts,
            max_task_retries=0,
        )
        cpus = self.cpus[index] if self.cpus else ()
        return actor.remote(
            self.config,
            self.secret,
            index=index,
            bind=bind,
            port=port,
            advertise=advertise,
            cpus=cpus,
        )

    def _wait_serving(self, ray: Any, resources: dict[str, float]) -> list[ReplicaInfo]:
        refs = {actor.info.remote(): i for i, actor in enumerate(self._actors)}
        deadline = time.monotonic() + self.config.server.replica_start_s
        got: dict[int, ReplicaInfo] = {}
        pending = list(refs)
        while pending and (left := deadline - time.monotonic()) > 0:
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            for ref in ready:
                index = refs[ref]
                try:
                    got[index] = self._info(index, ray.get(ref), resources)
                except Exception as exc:  # its constructor raised: the StageServer's error
                    raise ReplicaStartError(
                        f"replica {index} failed to start: {_first_line(exc)}"
                    ) from None
        if pending:
            missing = sorted(refs[r] for r in pending)
            raise ReplicaStartError(
                "; ".join(self._unplaced_line(ray, i, resources) for i in missing)
            )
        return [got[i] for i in range(self._count)]

    def _unplaced_line(self, ray: Any, index: int, resources: dict[str, float]) -> str:
        asked = ", ".join(f"{v:g} {k}" for k, v in resources.items() if v)
        free = ", ".join(
            f"{ray.available_resources().get(k, 0.0):g} {k}" for k, v in resources.items() if v
        )
        return (
            f"replica {index} not serving after {self.config.server.replica_start_s:g} s "
            f"(server.replica_start_s): it asks Ray for {asked}, free now {free or 'nothing'} "
            f"({_where(self.config)})"
        )

    def _info(self, index: int, raw: dict[str, Any], resources: dict[str, float]) -> ReplicaInfo:
        info = ReplicaInfo(
            index=index,
            address=str(raw["address"]),
            node_ip=str(raw["node_ip"]),
            pid=int(raw["pid"]),
            device=str(raw["device"]),
            resources=dict(resources),
            cpus=tuple(raw["cpus"]),
        )
        self._pids.add(info.pid)
        return info

    # -- while serving --------------------------------------------------------------------------
    @property
    def addresses(self) -> list[str]:
        return [r.address for r in self.replicas]

    @property
    def stage_address(self) -> str:
        """The replicas' addresses, comma-separated: the run's ``run.stage-address``."""
        return ",".join(self.addresses)

    @property
    def pids(self) -> set[int]:
        """Every replica process seen so far (restarted ones included)."""
        return set(self._pids)

    def refresh(self, index: int, timeout_s: float | None = None) -> ReplicaInfo:
        """Ask replica ``index`` where it runs now (after Ray restarted it: a new pid)."""
        import ray  # deferred: Ray is heavy and only replicas need it

        timeout = self.config.server.replica_start_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        while True:  # a task sent while Ray restarts the actor fails: ask again
            try:
                left = max(deadline - time.monotonic(), 0.1)
                raw = ray.get(self._actors[index].info.remote(), timeout=left)
                break
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)
        info = self._info(index, raw, self.replicas[index].resources)
        self.replicas[index] = info
        return info

    def kill(self, index: int, *, restart: bool = True) -> None:
        """End replica ``index``'s process at once; Ray restarts it (``restart``) at its address."""
        import ray  # deferred: Ray is heavy and only replicas need it

        ray.kill(self._actors[index], no_restart=not restart)

    # -- stop -----------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop every replica (gracefully, then by Ray), and the local Ray this set started."""
        import ray  # deferred: Ray is heavy and only replicas need it

        if not ray.is_initialized():
            return
        actors, self._actors = self._actors, []
        stops = [a.stop.remote() for a in actors]
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=_STOP_S)
        for actor in actors:
            ray.kill(actor, no_restart=True)
        ray.shutdown()
        _wait_gone(self._pids)

    def __enter__(self) -> ReplicaSet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _wait_gone(pids: set[int], timeout_s: float = 15.0) -> None:
    """Wait until the replica processes have exited (a local Ray's shutdown ends them)."""
    import psutil  # deferred: only needed here

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for proc in alive:
        log.warning("replica process %d still runs %.0f s after its stop", proc.pid, timeout_s)


def _replica_logging(index: int) -> None:
    """A replica's log lines (round begun, committed, warnings) name it."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"replica {index}: %(levelname)s %(message)s"))
    root = logging.getLogger("fedpipe")
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    logging.getLogger("fedpipe.server.stage_server").setLevel(logging.INFO)
    logging.getLogger(__name__).setLevel(logging.INFO)


def _node_ip() -> str:
    import ray  # deferred: in the actor, Ray is loaded already

    return str(ray.util.get_node_ip_address())


def _free_port(host: str) -> int:
    """A port free a moment ago on ``host`` (the replica binds it; fixed across its restarts)."""
    bind = "" if host in _WILDCARDS else host.strip("[]")
    with socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET) as sock:
        sock.bind((bind, 0))
        return int(sock.getsockname()[1])


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _where(config: FedpipeConfig) -> str:
    address = config.server.ray_address
    return f"Ray cluster at {address}" if address else "the local Ray of this machine"


def _ranges(cpus: Sequence[int]) -> str:
    return ",".join(str(c) for c in cpus)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__
