"""``[server]``: the StageServer, its limits, TLS files and the serve-without-a-secret rule."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

from fedpipe.config.checks import check
from fedpipe.config.device import DEVICE_WEIGHTS

__all__ = ["SERVER_WEIGHTS", "ServerConfig", "is_loopback"]

# server.weights: how the server stores its frozen middle blocks' linears (the same formats)
SERVER_WEIGHTS = DEVICE_WEIGHTS


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable only from this machine (no one else on the path)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


@dataclass(frozen=True)
class ServerConfig:
    """The StageServer: where it listens, on what hardware, and its limits."""

    host: str = "127.0.0.1"
    port: int = 50051
    device: str = "auto"  # auto | cpu | cuda
    # The server stage's compute dtype: auto | float32 | bfloat16. auto: bfloat16 on CUDA,
    # float32 on CPUs (bfloat16 there is opt-in: see fedpipe.server.build.pick_device).
    dtype: str = "auto"
    max_message_mb: float = 64.0
    max_sessions: int = 64
    max_in_flight: int = 64  # per session: microbatches forwarded, gradients not yet received
    # Per session: messages waiting for compute plus replies its stream has not yet taken.
    max_pending: int = 64
    max_pending_mb: float = 256.0
    max_streams: int = 64  # Exchange streams served at once (each holds a gRPC thread)
    max_device_streams: int = 4  # streams one device holds open at once, live or ending
    max_echoes: int = 64  # link probes (ECHO) one session may send (a planner needs about 10)
    # Everything devices make the server hold, all sessions together: queued messages, unread
    # replies, link probes, decodes in progress, delta caches (fedpipe.server.budget).
    memory_budget_mb: float = 4096.0
    max_delta_cache_mb: float = 256.0  # per session: the largest delta cache a device may ask
    delta_store_mb: float = 1024.0  # devices' delta caches kept between rounds, all together
    max_microbatch_size: int = 64  # rows of one tensor a session may declare and send
    max_seq_len: int = 0  # tokens of one tensor; 0 = the model's positions
    max_learning_rate: float = 1e-2  # bounds on the server-side optimizer a device may ask for
    max_weight_decay: float = 0.1
    session_idle_s: float = 120.0  # an open session with no traffic this long is dropped
    stream_idle_s: float = 60.0  # a stream with nothing sent or pending this long is ended
    threads: int = 1  # torch threads for the server's compute
    # Batching: several sessions' ready microbatches in one call of the frozen stage (false:
    # one message at a time with peft adapters, the server before batching).
    batching: bool = True
    batch_tokens: int = 2048  # tokens (rows x seq) per call: 8 microbatches of 2 x 128
    batch_wait_ms: float = 5.0  # cap on waiting to fill a call (25% of a measured call below it)
    # Activation offload (PipeOffload): off | auto. auto: the saved tensors of a microbatch that
    # waits for its gradient go to host memory (pinned, a side stream on CUDA) and come back
    # when the gradient arrives; the same losses and gradients, less device memory per session.
    offload: str = "off"
    # How the server stores the frozen linears of its blocks: fp32 as read, or bf16, int8 (per
    # output channel) or int4 (groups of 64), dequantized slab by slab into server.dtype
    # compute (fedpipe.split.quant, the device's formats); norms, the LM head of split "two"
    # and every LoRA adapter with its AdamW state stay as they were. Not with
    # federated.aggregation exact or stack, which fold deltas into those weights.
    weights: str = "fp32"
    # Input gradient first (zero-bubble's B/W split, batched bank): the reply to OUTPUT_GRAD
    # goes out once the input gradient is known; the adapters' weight gradients follow when the
    # worker is idle, before the session's STEP_END. The same gradients either way.
    input_grad_first: bool = False
    # Serve without a secret on an address others can reach (sessions and round control need
    # no token): only for a closed network. On loopback a server may always run without one.
    allow_unauthenticated: bool = False
    tls_cert: str = ""  # the StageServer's certificate (PEM); with tls_key, serves TLS
    tls_key: str = ""
    tls_ca: str = ""  # CA that devices and the ServerApp verify the StageServer with
    # Mutual TLS: the StageServer admits only clients whose certificate this CA signed ...
    tls_client_ca: str = ""
    tls_client_cert: str = ""  # ... and the ServerApp (control, evaluator) presents this one
    tls_client_key: str = ""
    # Replicas (fedpipe.server.ray_replicas): this many StageServers, each a Ray actor holding the
    # whole middle; devices are assigned to one per round. 1: one StageServer, no Ray.
    replicas: int = 1
    ray_address: str = ""  # the Ray cluster the replicas start on; "" = a local Ray of their own
    # Replica i listens on replica_port + i (on a cluster: on the node Ray places it, all
    # interfaces); 0 = free ports on this machine (local Ray only). Fixed, so that a replica
    # Ray restarts comes back at the same address.
    replica_port: int = 0
    replica_start_s: float = 120.0  # a replica not placed and serving by then fails the start
    replica_restarts: int = 8  # times Ray restarts a replica that died (-1: without limit)

    def __post_init__(self) -> None:
        check(
            self.device in ("auto", "cpu", "cuda"),
            f"server.device must be auto, cpu or cuda, got {self.device!r}",
        )
        check(
            self.dtype in ("auto", "float32", "bfloat16"),
            f"server.dtype must be auto, float32 or bfloat16, got {self.dtype!r}",
        )
        check(
            self.offload in ("off", "auto"),
            f"server.offload must be off or auto, got {self.offload!r}",
        )
        check(
            self.weights in SERVER_WEIGHTS,
            f"server.weights {self.weights!r} unknown; choose one of {', '.join(SERVER_WEIGHTS)}",
        )
        check(
            self.max_message_mb >= 0.5,
            f"server.max_message_mb must be >= 0.5 (round control moves adapters in pieces of "
            f"256 KiB), got {self.max_message_mb}",
        )
        for name in (
            "max_sessions",
            "max_in_flight",
            "max_pending",
            "max_streams",
            "max_device_streams",
            "max_echoes",
            "max_microbatch_size",
        ):
            check(
                getattr(self, name) >= 1, f"server.{name} must be >= 1, got {getattr(self, name)}"
            )
        check(self.max_seq_len >= 0, f"server.max_seq_len must be >= 0, got {self.max_seq_len}")
        check(self.batch_tokens >= 1, f"server.batch_tokens must be >= 1, got {self.batch_tokens}")
        check(
            self.batch_wait_ms >= 0, f"server.batch_wait_ms must be >= 0, got {self.batch_wait_ms}"
        )
        for name in (
            "memory_budget_mb",
            "max_pending_mb",
            "max_learning_rate",
            "session_idle_s",
            "stream_idle_s",
        ):
            check(getattr(self, name) > 0, f"server.{name} must be > 0, got {getattr(self, name)}")
        check(self.max_weight_decay >= 0, "server.max_weight_decay must be >= 0")
        check(
            self.max_delta_cache_mb >= 0,
            f"server.max_delta_cache_mb must be >= 0 (0: no delta coding), "
            f"got {self.max_delta_cache_mb}",
        )
        check(
            self.delta_store_mb >= 0,
            f"server.delta_store_mb must be >= 0 (0: no delta cache outlives its session), "
            f"got {self.delta_store_mb}",
        )
        check(
            bool(self.tls_cert) == bool(self.tls_key),
            "server.tls_cert and server.tls_key go together: give both or neither",
        )
        check(
            bool(self.tls_client_cert) == bool(self.tls_client_key),
            "server.tls_client_cert and server.tls_client_key go together: give both or neither",
        )
        check(
            not self.tls_client_ca or bool(self.tls_cert),
            "server.tls_client_ca (mutual TLS) needs server.tls_cert and server.tls_key too",
        )
        self._check_replicas()

    def _check_replicas(self) -> None:
        check(self.replicas >= 1, f"server.replicas must be >= 1, got {self.replicas}")
        check(
            0 <= self.replica_port <= 65535 - self.replicas,
            f"server.replica_port must be 0 (free ports) or a base port with room for "
            f"{self.replicas} replicas (<= {65535 - self.replicas}), got {self.replica_port}",
        )
        check(
            not (self.ray_address and self.replicas > 1 and self.replica_port == 0),
            "server.replica_port: replicas on a Ray cluster (server.ray_address) need a base "
            "port (replica i listens on it + i on its node, so a restarted replica keeps its "
            "address); set e.g. server.replica_port = 50100",
        )
        check(
            self.replica_start_s > 0,
            f"server.replica_start_s must be > 0, got {self.replica_start_s}",
        )
        check(
            self.replica_restarts >= -1,
            f"server.replica_restarts must be >= -1 (-1: without limit), got "
            f"{self.replica_restarts}",
        )

    def secret_refusal(self, host: str, secret: str | None) -> str:
        """Why a StageServer bound to ``host`` may not serve with ``secret`` ("" when it may):
        one that others can reach needs a secret, unless ``allow_unauthenticated``. The one
        rule, for ``fedpipe server``'s check and for the StageServer's construction."""
        if secret or self.allow_unauthenticated or is_loopback(host):
            return ""
        return (
            f"a StageServer on {host}, which others can reach, needs a secret (anyone who "
            "reaches it could open sessions and change the run's adapters): give it "
            "--secret-file FILE (the ServerApp gets the same file), or set "
            "server.allow_unauthenticated = true (--set server.allow_unauthenticated=true) on "
            "a closed network"
        )

    def root_certificates(self, override: str = "") -> bytes | None:
        """The CA to verify the StageServer with (``override`` first), or None for plaintext."""
        path = override or self.tls_ca
        return Path(path).read_bytes() if path else None

    def client_identity(self) -> tuple[bytes | None, bytes | None]:
        """The ServerApp's client certificate and key for a mutual-TLS StageServer, if set."""
        if not self.tls_client_cert:
            return None, None
        return Path(self.tls_client_cert).read_bytes(), Path(self.tls_client_key).read_bytes()

    @property
    def max_message_bytes(self) -> int:
        return int(self.max_message_mb * 1024 * 1024)

    @property
    def max_pending_bytes(self) -> int:
        return int(self.max_pending_mb * 1024 * 1024)
