"""Building a StageServer from settings: model, server stage, adapters, runtime, gRPC."""

from __future__ import annotations

import logging
import secrets
from pathlib import Path

import torch

from fedpipe.auth.calls import ControlVerifier
from fedpipe.auth.secret_files import warn_if_readable
from fedpipe.auth.tokens import InvalidTokenError, TokenLedger, check_secret, verify_token
from fedpipe.config import FedpipeConfig, ServerConfig, is_loopback
from fedpipe.errors import AuthError
from fedpipe.lora import BatchedAdapterBank, adapter_bank, lora_settings
from fedpipe.models import load_config, model_family, model_fingerprint, resolve_model
from fedpipe.server.batch_policy import BatchPolicy
from fedpipe.server.runtime import StageRuntime, StageSettings
from fedpipe.server.sessions import RuntimeLimits
from fedpipe.server.stage_server import StageServer
from fedpipe.split import TailStage, build_stage, split_layout
from fedpipe.split.agreement import SplitInfo

__all__ = [
    "build_runtime",
    "build_stage_server",
    "cpu_has_native_bf16",
    "pick_device",
    "runtime_limits",
]

log = logging.getLogger(__name__)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of native bf16 matmuls


def pick_device(name: str, dtype: str = "auto") -> tuple[torch.device, torch.dtype]:
    """Where and in which dtype the server stage computes.

    ``name`` ``auto``: CUDA when a GPU is present, else the CPU. ``dtype`` ``auto``: bfloat16
    on CUDA, float32 on a CPU. bfloat16 on a CPU is opt-in (``server.dtype = "bfloat16"``):
    it is about 2x faster only where the CPU has native bf16 (:func:`cpu_has_native_bf16`),
    and it moves the loss by up to about 1% (README), which would break the split model's
    parity with the unsplit one that fp32 keeps to 1e-5.
    """
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "--device cuda was asked for, but torch sees no CUDA GPU; use auto or cpu"
        )
    if dtype not in ("auto", *_DTYPES):
        raise ValueError(f"server.dtype must be auto, float32 or bfloat16, got {dtype!r}")
    cuda = name == "cuda" or (name == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    if dtype == "auto":
        return device, torch.bfloat16 if cuda else torch.float32
    if dtype == "bfloat16" and not cuda and not cpu_has_native_bf16():
        log.warning(
            "server.dtype = bfloat16 on a CPU without native bf16 (flags %s): torch emulates "
            "it, usually slower than float32",
            " or ".join(_BF16_CPU_FLAGS),
        )
    return device, _DTYPES[dtype]


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes bf16 matmuls natively (AVX512-BF16 or AMX), from its flags."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:  # not Linux: ask torch (AMX shows as its best capability)
            return torch.backends.cpu.get_cpu_capability().startswith("AMX")
    flags = {f for line in cpuinfo.splitlines() if line.startswith("flags") for f in line.split()}
    return any(flag in flags for flag in _BF16_CPU_FLAGS)


def build_runtime(
    config: FedpipeConfig, *, folder: Path | None = None
) -> tuple[StageRuntime, SplitInfo]:
    """The server's stage (only its own layers) with an adapter bank, in a runtime."""
    folder = folder or resolve_model(config.model.name)
    hf_config = load_config(folder)
    family = model_family(hf_config)
    offered = config.model.offered_cuts
    for head, tail in offered:  # each offered cut must leave the server a block
        try:
            split_layout(hf_config, head_layers=head, tail_layers=tail, mode=config.model.split)  # type: ignore[arg-type]
        except ValueError as exc:
            raise ValueError(f"model.cuts: cut {head}+{tail} does not fit: {exc}") from None
    # The stage holds the union of the blocks every offered cut leaves to the server.
    layout = split_layout(
        hf_config,
        head_layers=min(h for h, _ in offered),
        tail_layers=min(t for _, t in offered),
        mode=config.model.split,  # type: ignore[arg-type]
    )
    device, dtype = pick_device(config.server.device, config.server.dtype)
    part = "middle" if layout.mode == "u" else "server_loss"
    weights = config.server.weights  # how its blocks' frozen linears are stored
    stage = build_stage(folder, layout, part, dtype=dtype, device=device, weights=weights)  # type: ignore[arg-type]
    if isinstance(stage, TailStage):  # mode "two": the server computes the loss
        stage.loss_chunk = config.train.loss_chunk
    if device.type == "cpu":
        torch.set_num_threads(config.server.threads)
    max_positions = int(
        getattr(hf_config, "max_position_embeddings", 0) or getattr(hf_config, "n_positions", 0)
    )
    server = config.server
    bank = adapter_bank(stage, lora_settings(config), family=family, batched=server.batching)
    if server.input_grad_first and not isinstance(bank, BatchedAdapterBank):
        log.info("server.input_grad_first: peft's adapters compute both gradients together")
    settings = StageSettings(
        mode=layout.mode,
        hidden_size=int(hf_config.hidden_size),
        device=device,
        dtype=dtype,
        limits=runtime_limits(config.server),
        max_positions=max_positions,
        policy=batch_policy(server),
        offload=server.offload == "auto",
        input_grad_first=server.input_grad_first,
    )
    runtime = StageRuntime(bank, settings)
    split = SplitInfo(
        model=config.model.name,
        num_layers=layout.num_layers,
        head_layers=config.model.head_layers,
        tail_layers=config.model.tail_layers,
        mode=layout.mode,
        hidden_size=int(hf_config.hidden_size),
        dtype=str(dtype).removeprefix("torch."),
        fingerprint=model_fingerprint(folder),
        max_positions=max_positions,
        vocab_size=int(hf_config.vocab_size),
        cuts=offered if len(offered) > 1 else (),
    )
    log.info("server stage: %s on %s (%s, weights %s)", layout, device, split.dtype, weights)
    if len(offered) > 1:
        log.info("server offers cuts %s (head+tail)", ", ".join(f"{h}+{t}" for h, t in offered))
    return runtime, split


def batch_policy(server: ServerConfig) -> BatchPolicy:
    """The runtime's batching policy from the ``server.batch*`` settings."""
    return BatchPolicy(
        enabled=server.batching,
        batch_tokens=server.batch_tokens,
        max_wait_s=server.batch_wait_ms / 1000,
    )


def runtime_limits(server: ServerConfig) -> RuntimeLimits:
    """The runtime's bounds from the ``server.*`` settings."""
    return RuntimeLimits(
        max_sessions=server.max_sessions,
        max_in_flight=server.max_in_flight,
        max_pending=server.max_pending,
        max_pending_bytes=server.max_pending_bytes,
        max_microbatch_size=server.max_microbatch_size,
        max_seq_len=server.max_seq_len,
        max_learning_rate=server.max_learning_rate,
        max_weight_decay=server.max_weight_decay,
        session_idle_s=server.session_idle_s,
        stream_idle_s=server.stream_idle_s,
        max_device_streams=server.max_device_streams,
        max_echoes=server.max_echoes,
        memory_budget_bytes=int(server.memory_budget_mb * 2**20),
    )


def _authenticator(secret: str):  # type: ignore[no-untyped-def]
    """Token checks for OpenSession: MAC, run, round, device, expiry, and one use each."""
    check_secret(secret)  # a bad secret fails here, at start-up, not on every OpenSession
    ledger = TokenLedger()

    def authenticate(token: str, round_: int, device_id: str, run_id: str, begun: float) -> None:
        try:
            if not run_id:
                raise InvalidTokenError(
                    "no run has begun on this StageServer yet: the ServerApp begins each round "
                    "before devices open sessions (a StageServer restarted mid-round waits for "
                    "the next round or `fedpipe run --resume`)"
                )
            claims = verify_token(
                secret, token, round=round_, run_id=run_id, device_id=device_id, not_before=begun
            )
            ledger.claim(claims, epoch=begun)
        except InvalidTokenError as exc:
            raise AuthError(f"session token refused for device {device_id!r}: {exc}") from None

    return authenticate


def _tls_files(server: ServerConfig) -> tuple[tuple[bytes, bytes] | None, bytes | None]:
    """(certificate, key) the StageServer serves TLS with, and the CA of client certificates."""
    if not server.tls_cert:
        return None, None
    warn_if_readable(Path(server.tls_key), "the StageServer's TLS key")
    tls = (Path(server.tls_cert).read_bytes(), Path(server.tls_key).read_bytes())
    client_ca = Path(server.tls_client_ca).read_bytes() if server.tls_client_ca else None
    return tls, client_ca


def build_stage_server(
    config: FedpipeConfig,
    *,
    secret: str | None = None,
    port: int | None = None,
    folder: Path | None = None,
) -> StageServer:
    """A ready-to-start StageServer; with ``secret``, sessions need tokens issued for the round.

    Without a secret anyone who reaches the server may open sessions and call round control:
    that is refused on an address others can reach unless ``server.allow_unauthenticated``.
    """
    host = config.server.host
    if refusal := config.server.secret_refusal(host, secret):
        raise ValueError(refusal)
    if not secret and not is_loopback(host):
        log.warning("no secret on %s: sessions and round control need no token", host)
    runtime, split = build_runtime(config, folder=folder)
    tls, client_ca = _tls_files(config.server)
    server_id = secrets.token_hex(8)
    return StageServer(
        runtime,
        split,
        host=config.server.host,
        port=config.server.port if port is None else port,
        authenticate=_authenticator(secret) if secret else None,
        control_auth=ControlVerifier(secret, server_id=server_id) if secret else None,
        max_message_bytes=config.server.max_message_bytes,
        tls=tls,
        client_ca=client_ca,
        max_streams=config.server.max_streams,
        max_delta_cache_bytes=int(config.server.max_delta_cache_mb * 2**20),
        delta_store_bytes=int(config.server.delta_store_mb * 2**20),
        server_id=server_id,
    )
