"""Typed, validated settings, and the one place that maps TOML, CLI flags and Flower keys to them.

Every setting has a dotted name (``section.key``, e.g. ``pipeline.microbatches``); the same
names are used in TOML files (``[pipeline] microbatches = 8``), in ``--set`` flags
(``--set pipeline.microbatches=8``) and in Flower's run config, so a value means the same
thing wherever it is given.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from fedpipe.config.codecs import check_codec, codec_bits, codec_help, codec_token_groups
from fedpipe.config.privacy_spec import MECHANISMS, parse_privacy_spec, parse_privacy_specs
from fedpipe.config.profile_spec import join_specs, parse_device_profile, split_specs

__all__ = [
    "AGGREGATIONS",
    "DEVICE_DTYPES",
    "DEVICE_WEIGHTS",
    "FREEZE_MODES",
    "LOSS_ON",
    "OVERLONG",
    "SCHEDULE_NAMES",
    "SERVER_WEIGHTS",
    "LIST_SETTINGS",
    "DataConfig",
    "DeviceConfig",
    "FedpipeConfig",
    "FederatedConfig",
    "ModelConfig",
    "PipelineConfig",
    "PrivacyConfig",
    "ServerConfig",
    "TrainConfig",
    "canonical_list_text",
    "coerce_value",
    "format_cut",
    "format_cuts",
    "list_text",
    "load_config",
    "parse_cuts",
    "parse_device_weights",
    "parse_overrides",
    "parse_profiles",
]

AGGREGATIONS = ("separate", "exact", "ffa", "stack")  # see fedpipe.lora.aggregation
# Flower strategies that combine adapters robustly (fedpipe.fl.strategies, fedpipe.lora.robust).
ROBUST_STRATEGIES = ("fedmedian", "fedtrimmedavg", "krum", "multikrum")
# The device schedules (fedpipe.edge.schedules builds them; a test keeps the two in step).
SCHEDULE_NAMES = ("sequential", "gpipe", "1f1b", "greedy")
FREEZE_MODES = ("off", "progressive")  # pipeline.freeze (fedpipe.fl.freeze)
LOSS_ON = ("answers", "all")  # data.loss_on (fedpipe.data.masks)
OVERLONG = ("truncate", "drop")  # data.overlong (fedpipe.data.rows)
# device.weights: how a device stores its frozen weights (fedpipe.split.quant)
DEVICE_WEIGHTS = ("fp32", "bf16", "int8", "int4")
# device.dtype: what the device's head and tail compute in (fedpipe.edge.runtime)
DEVICE_DTYPES = ("fp32", "bf16")
# server.weights: how the server stores its frozen middle blocks' linears (the same formats)
SERVER_WEIGHTS = DEVICE_WEIGHTS
_BOOLS = {"1": True, "true": True, "yes": True, "on": True}
_BOOLS |= {"0": False, "false": False, "no": False, "off": False}


def _is_codec(name: str) -> bool:
    try:
        check_codec(name)
    except ValueError:
        return False
    return True


MAX_STALENESS = 100  # versions a StageServer admits sessions of (one adapter copy each)
STALENESS_RULES = ("constant", "poly", "hinge")


def parse_staleness(text: str) -> tuple[str, float, float]:
    """``federated.staleness``: ``constant``, ``poly:a`` or ``hinge:a,b`` -> (rule, a, b)."""
    name, _, args = str(text).strip().partition(":")
    numbers: list[float] = []
    try:
        numbers = [float(x) for x in args.split(",")] if args.strip() else []
    except ValueError:
        numbers = [-1.0]
    want = {"constant": 0, "poly": 1, "hinge": 2}.get(name)
    ok = want is not None and len(numbers) == want and all(x >= 0 for x in numbers)
    _check(
        ok,
        f"federated.staleness {text!r} unknown: write constant, poly:A (weight 1/(1+s)^A) or "
        "hinge:A,B (1 up to B versions, then 1/(1 + A (s - B))), with A, B >= 0",
    )
    a = numbers[0] if numbers else 0.0
    b = numbers[1] if len(numbers) > 1 else 0.0
    return name, a, b


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _entries(value: Any, key: str) -> list[Any]:
    """The entries of a list setting given as a list or tuple (a TOML array, a built config)."""
    if isinstance(value, (list, tuple)):
        return list(value)
    raise ValueError(f"{key} must be a list or a comma-separated string, got {value!r}")


def _cut(item: Any, key: str) -> tuple[int, int]:
    """One cut: ``"2+1"`` (a bare ``"2"``: no tail blocks) or a (head, tail) pair."""
    pair = isinstance(item, (list, tuple)) and len(item) == 2
    if pair and all(isinstance(v, int) and not isinstance(v, bool) for v in item):
        cut, text = (item[0], item[1]), f"{item[0]}+{item[1]}"
    else:
        text = item.strip() if isinstance(item, str) else repr(item)
        head, _, tail = text.partition("+")
        try:
            cut = (int(head), int(tail or 0))
        except ValueError:
            raise ValueError(
                f"{key}: {text!r} is not a cut; write head+tail block counts such as 2+1"
            ) from None
    _check(cut[0] >= 1 and cut[1] >= 0, f"{key}: cut {text!r} needs head >= 1 and tail >= 0 blocks")
    return cut


def parse_cuts(value: str | Sequence[Any], key: str) -> tuple[tuple[int, int], ...]:
    """``"1+1, 2+2"`` or ``["1+1", "2+2"]`` -> ((1, 1), (2, 2)); a bare ``"2"`` means no tail
    blocks (mode "two"); blank entries of a string are skipped."""
    if isinstance(value, str):
        return tuple(_cut(c, key) for c in value.split(",") if c.strip())
    return tuple(_cut(c, key) for c in _entries(value, key))


def format_cut(cut: tuple[int, int]) -> str:
    """(2, 1) -> ``"2+1"``, the form ``model.cuts`` and ``federated.device_cuts`` take."""
    return f"{cut[0]}+{cut[1]}"


def format_cuts(cuts: Sequence[tuple[int, int]]) -> str:
    """((2, 1), (1, 1)) -> ``"2+1,1+1"``: a cut list as it is written (:func:`parse_cuts`)."""
    return ",".join(format_cut(c) for c in cuts)


def parse_profiles(value: str | Sequence[Any], key: str = "federated.profiles") -> tuple[str, ...]:
    """Device profile entries (names and inline specs, :mod:`fedpipe.config.profile_spec`),
    each checked. A string is split as ``split_specs`` does (an inline spec keeps its commas);
    each entry of a list is one profile, commas and all."""
    if isinstance(value, str):
        entries = split_specs(value)
    else:
        entries = []
        for item in _entries(value, key):
            parts = split_specs(item) if isinstance(item, str) else []
            _check(
                len(parts) == 1,
                f"{key}: entry {item!r} is not one device profile (a name or one inline spec "
                "such as 'up=10,down=25,rtt=50ms')",
            )
            entries.append(parts[0])
    try:  # names and inline specs, checked here so a typo fails before any process starts
        for entry in entries:
            parse_device_profile(entry)
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None
    return tuple(entries)


@dataclass(frozen=True)
class ModelConfig:
    """Which model, where it is cut, and the LoRA adapters trained on it."""

    name: str = "tiny-llama"  # tiny-llama | tiny-gpt2 | small-llama | default | HF folder | .gguf
    head_layers: int = 1
    tail_layers: int = 1
    split: str = "u"  # "u": labels stay on the device; "two": the server computes the loss
    # Cuts the StageServer offers besides head_layers+tail_layers: "H+T" pairs, a list or
    # comma-separated (e.g. "1+1,2+2"); the server holds every block they need, each device
    # picks one.
    cuts: tuple[tuple[int, int], ...] = ()
    lora_r: int = 8
    lora_alpha: int = 16
    lora_targets: str = ""  # comma-separated module names; "" = the family's default
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self.split in ("u", "two"), f"model.split must be 'u' or 'two', got {self.split!r}")
        _check(self.head_layers >= 1, f"model.head_layers must be >= 1, got {self.head_layers}")
        _check(self.tail_layers >= 0, f"model.tail_layers must be >= 0, got {self.tail_layers}")
        _check(self.lora_r >= 1, f"model.lora_r must be >= 1, got {self.lora_r}")
        object.__setattr__(self, "cuts", parse_cuts(self.cuts, "model.cuts"))

    @property
    def offered_cuts(self) -> tuple[tuple[int, int], ...]:
        """(head, tail) pairs the server offers: head_layers+tail_layers first, then ``cuts``."""
        return tuple(dict.fromkeys(((self.head_layers, self.tail_layers), *self.cuts)))


@dataclass(frozen=True)
class PipelineConfig:
    """How a step is cut into microbatches and scheduled, and how tensors are encoded."""

    microbatches: int = 4
    schedule: str = "greedy"  # sequential | gpipe | 1f1b | greedy
    max_in_flight: int = 0  # 0 = no cap (greedy) or min(M, 4) (1f1b)
    uplink_codec: str = "fp32"
    downlink_codec: str = "fp32"
    gradient_codec: str = ""  # "" = each direction's codec; e.g. int8 activations, bf16 grads
    error_feedback: bool = False  # gradients: each side adds what its last send lost to the next
    stochastic_rounding: bool = False  # int4/int2 gradients round stochastically (unbiased)
    delta: bool = False  # activations: send the change since the sample's last send (AQ-SGD)
    delta_cache_mb: float = 64.0  # with delta: decoded samples kept, on both sides
    delta_resume: bool = True  # with delta: the caches outlive the round (false: one session)
    delta_codec: str = ""  # with delta: codec of activations sent all as differences ("": uplink's)
    timeout_s: float = 120.0
    # false: frozen-device mode: the device's head and tail train nothing, the head runs
    # forward only and the server sends no input gradient down (LoRA trains on the server).
    device_trains: bool = True
    # true: the head's forward keeps no graph; its backward recomputes it (device memory:
    # per microbatch in flight only the head's output is stashed, not its activations).
    recompute_head: bool = False
    # fixed: the settings above; auto: each device measures its compute and link and picks its
    # microbatches, schedule and codecs (fedpipe.edge.planner), among plan_codecs (lossy only if
    # listed), re-planning when the link's RTT or a rate moves by more than replan_drift;
    # memory_cap_mb (0: none) bounds the device's parameters plus stashed activations.
    plan: str = "fixed"
    plan_codecs: str = "fp32"
    replan_drift: float = 0.25
    memory_cap_mb: float = 0.0
    # off, or progressive: after each round the ServerApp freezes the lowest blocks whose
    # adapters have converged, on the devices and the StageServer (fedpipe.fl.freeze); a
    # device whose head blocks are all frozen runs its head forward only from the next round.
    freeze: str = "off"
    # progressive: a block has converged when its adapter's relative change in a round fell to
    # this fraction of the largest change it made in a round so far.
    freeze_ratio: float = 0.5
    # progressive: the first decision is taken after this round, so blocks freeze from round
    # freeze_after + 1 on at the earliest.
    freeze_after: int = 2
    # progressive: at most this fraction of the model's blocks ever freeze (rounded down).
    freeze_max: float = 0.5

    def __post_init__(self) -> None:
        _check(
            self.microbatches >= 1, f"pipeline.microbatches must be >= 1, got {self.microbatches}"
        )
        _check(
            self.schedule in SCHEDULE_NAMES,
            f"pipeline.schedule {self.schedule!r} unknown; "
            f"choose one of {', '.join(SCHEDULE_NAMES)}",
        )
        for name in ("uplink_codec", "downlink_codec", "gradient_codec", "delta_codec"):
            value = getattr(self, name)
            _check(
                _is_codec(value) or (name in ("gradient_codec", "delta_codec") and value == ""),
                f"pipeline.{name} {value!r} unknown; choose one of {codec_help()}",
            )
        _check(
            not self.stochastic_rounding or self.plan == "auto" or self._low_bit_gradients(),
            "pipeline.stochastic_rounding applies to int4/int2 gradients, but they go as "
            f"{self.gradient_codec or self.uplink_codec} up and "
            f"{self.gradient_codec or self.downlink_codec} down; set pipeline.gradient_codec "
            "to int4 or int2, or turn stochastic_rounding off",
        )
        _check(
            self.delta_cache_mb > 0,
            f"pipeline.delta_cache_mb must be > 0, got {self.delta_cache_mb}; to turn delta "
            "coding off set pipeline.delta = false",
        )
        _check(
            self.plan in ("fixed", "auto"),
            f"pipeline.plan must be fixed or auto, got {self.plan!r}",
        )
        bad = [c for c in self.codec_choices if not _is_codec(c)]
        _check(
            bool(self.codec_choices) and not bad,
            f"pipeline.plan_codecs {self.plan_codecs!r}: unknown {bad}; list some of "
            f"{codec_help()}",
        )
        _check(self.replan_drift > 0, f"pipeline.replan_drift must be > 0, got {self.replan_drift}")
        _check(
            self.memory_cap_mb >= 0,
            f"pipeline.memory_cap_mb must be >= 0, got {self.memory_cap_mb}",
        )
        _check(
            self.freeze in FREEZE_MODES,
            f"pipeline.freeze must be {' or '.join(FREEZE_MODES)}, got {self.freeze!r}",
        )
        _check(
            0 < self.freeze_ratio < 1,
            f"pipeline.freeze_ratio must be in (0, 1), got {self.freeze_ratio}",
        )
        _check(
            self.freeze_after >= 1, f"pipeline.freeze_after must be >= 1, got {self.freeze_after}"
        )
        _check(
            0 < self.freeze_max < 1,
            f"pipeline.freeze_max must be in (0, 1) (a fraction of the model's blocks), "
            f"got {self.freeze_max}",
        )

    def _low_bit_gradients(self) -> bool:
        """Whether the gradients go as int4/int2 in at least one direction."""
        ups = self.gradient_codec or self.uplink_codec
        downs = self.gradient_codec or self.downlink_codec
        return codec_bits(ups) > 0 or codec_bits(downs) > 0

    @property
    def codec_choices(self) -> tuple[str, ...]:
        """``plan_codecs`` as a tuple; fp32 (lossless) is always a choice."""
        listed = [c.strip() for c in self.plan_codecs.split(",") if c.strip()]
        return tuple(dict.fromkeys(["fp32", *listed]))


@dataclass(frozen=True)
class TrainConfig:
    """Local training on each device."""

    batch_size: int = 8
    seq_len: int = 128
    local_steps: int = 4
    lr: float = 2e-3
    weight_decay: float = 0.0
    eval_batches: int = 4
    # Tokens whose logits the tail's loss holds at once: the LM head and cross-entropy run over
    # chunks of this many (fedpipe.split.loss), the same loss and gradients; 0: the full logits.
    loss_chunk: int = 256

    def __post_init__(self) -> None:
        _check(self.batch_size >= 1, f"train.batch_size must be >= 1, got {self.batch_size}")
        _check(
            self.loss_chunk == 0 or self.loss_chunk >= 32,
            f"train.loss_chunk must be 0 (the full logits) or >= 32 tokens, got "
            f"{self.loss_chunk}: shorter chunks take the matrix library's small-product path, "
            "whose logits differ from the full product's in the last digit",
        )
        _check(self.seq_len >= 2, f"train.seq_len must be >= 2, got {self.seq_len}")
        _check(self.local_steps >= 1, f"train.local_steps must be >= 1, got {self.local_steps}")
        _check(self.lr > 0, f"train.lr must be > 0, got {self.lr}")


@dataclass(frozen=True)
class DataConfig:
    """How instruction examples (chats, prompt/completion pairs) become rows; plain text is
    cut into blocks whatever these say (fedpipe.data)."""

    # "answers": only assistant turns / completions count in the loss; "all": every token
    loss_on: str = "answers"
    overlong: str = "truncate"  # an example longer than train.seq_len: "truncate" or "drop"
    # true: several whole examples share a row, attending only within themselves at positions
    # restarting per example (the server learns each example's length); false: one per row
    packing: bool = False

    def __post_init__(self) -> None:
        _check(
            self.loss_on in LOSS_ON,
            f"data.loss_on must be one of {', '.join(LOSS_ON)}, got {self.loss_on!r}",
        )
        _check(
            self.overlong in OVERLONG,
            f"data.overlong must be one of {', '.join(OVERLONG)}, got {self.overlong!r}",
        )
        _check(
            isinstance(self.packing, bool),
            f"data.packing must be true or false, got {self.packing!r}",
        )


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
        _check(
            self.device in ("auto", "cpu", "cuda"),
            f"server.device must be auto, cpu or cuda, got {self.device!r}",
        )
        _check(
            self.dtype in ("auto", "float32", "bfloat16"),
            f"server.dtype must be auto, float32 or bfloat16, got {self.dtype!r}",
        )
        _check(
            self.offload in ("off", "auto"),
            f"server.offload must be off or auto, got {self.offload!r}",
        )
        _check(
            self.weights in SERVER_WEIGHTS,
            f"server.weights {self.weights!r} unknown; choose one of {', '.join(SERVER_WEIGHTS)}",
        )
        _check(
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
            _check(
                getattr(self, name) >= 1, f"server.{name} must be >= 1, got {getattr(self, name)}"
            )
        _check(self.max_seq_len >= 0, f"server.max_seq_len must be >= 0, got {self.max_seq_len}")
        _check(self.batch_tokens >= 1, f"server.batch_tokens must be >= 1, got {self.batch_tokens}")
        _check(
            self.batch_wait_ms >= 0, f"server.batch_wait_ms must be >= 0, got {self.batch_wait_ms}"
        )
        for name in (
            "memory_budget_mb",
            "max_pending_mb",
            "max_learning_rate",
            "session_idle_s",
            "stream_idle_s",
        ):
            _check(getattr(self, name) > 0, f"server.{name} must be > 0, got {getattr(self, name)}")
        _check(self.max_weight_decay >= 0, "server.max_weight_decay must be >= 0")
        _check(
            self.max_delta_cache_mb >= 0,
            f"server.max_delta_cache_mb must be >= 0 (0: no delta coding), "
            f"got {self.max_delta_cache_mb}",
        )
        _check(
            self.delta_store_mb >= 0,
            f"server.delta_store_mb must be >= 0 (0: no delta cache outlives its session), "
            f"got {self.delta_store_mb}",
        )
        _check(
            bool(self.tls_cert) == bool(self.tls_key),
            "server.tls_cert and server.tls_key go together: give both or neither",
        )
        _check(
            bool(self.tls_client_cert) == bool(self.tls_client_key),
            "server.tls_client_cert and server.tls_client_key go together: give both or neither",
        )
        _check(
            not self.tls_client_ca or bool(self.tls_cert),
            "server.tls_client_ca (mutual TLS) needs server.tls_cert and server.tls_key too",
        )
        self._check_replicas()

    def _check_replicas(self) -> None:
        _check(self.replicas >= 1, f"server.replicas must be >= 1, got {self.replicas}")
        _check(
            0 <= self.replica_port <= 65535 - self.replicas,
            f"server.replica_port must be 0 (free ports) or a base port with room for "
            f"{self.replicas} replicas (<= {65535 - self.replicas}), got {self.replica_port}",
        )
        _check(
            not (self.ray_address and self.replicas > 1 and self.replica_port == 0),
            "server.replica_port: replicas on a Ray cluster (server.ray_address) need a base "
            "port (replica i listens on it + i on its node, so a restarted replica keeps its "
            "address); set e.g. server.replica_port = 50100",
        )
        _check(
            self.replica_start_s > 0,
            f"server.replica_start_s must be > 0, got {self.replica_start_s}",
        )
        _check(
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


@dataclass(frozen=True)
class FederatedConfig:
    """Flower rounds, devices and their data."""

    rounds: int = 3
    strategy: str = "fedavg"  # fedavg | fedprox | fedadam | ... | fedmedian | krum (fl.strategies)
    fraction_train: float = 1.0
    num_devices: int = 4
    # Device profiles cycled over devices: names and inline specs, a list or comma-separated
    profiles: tuple[str, ...] = ("jetson-ethernet", "rpi-wifi", "phone-lte", "laptop-wifi")
    # "H+T" cuts cycled over simulated devices, a list or comma-separated; none: the model's cut
    device_cuts: tuple[tuple[int, int], ...] = ()
    data: str = ""  # "" = the bundled public-domain corpus; else a file or folder
    partition: str = "by-source"  # iid | by-source | dirichlet
    device_blocks: int = 0  # > 0: each device keeps only this many blocks (small local data)
    dirichlet_alpha: float = 0.5
    eval_fraction: float = 0.1
    # > 0: each round's evaluation also generates greedy answers to this many held-out
    # prompt/completion examples and scores them as `fedpipe eval` does (exact match, contains)
    eval_generate: int = 0
    # Evaluate the global adapters (held-out loss, the round's record, a checkpoint) after
    # every `eval_every`-th round or version and after the last; 1: after every one. Async
    # versions come often and an evaluation on the server's host is not free.
    eval_every: int = 1
    proximal_mu: float = 0.01
    server_lr: float = 0.1
    # Robust strategies (fedmedian, fedtrimmedavg, krum, multikrum) run on both sides.
    trim_beta: float = 0.2  # fedtrimmedavg: the fraction cut from each end, per element
    malicious_devices: int = 0  # krum, multikrum: the hostile devices they assume (f)
    krum_select: int = 1  # multikrum: the updates it keeps and averages
    update_norm_bound: float = 0.0  # > 0: every update's L2 norm clipped to it, on both sides
    # How LoRA adapters are aggregated on both sides: separate | exact | ffa | stack
    # (fedpipe.lora.aggregation); exact and stack need a FedAvg-style strategy.
    aggregation: str = "separate"
    # Device adapters through Flower (fedpipe.fl.adapter_codec): fp32 sends them as they are;
    # another stage-link codec (int8, int4, ...) sends each device's update (its adapters minus
    # the round's global ones) in that codec, keeping what the codec dropped on the device for
    # its next round (error feedback).
    adapter_codec: str = "fp32"
    # The global adapters sent to the devices: fp32 as they are; in another codec, each device
    # trains from what it decoded and sends its update, added to the exact global adapters.
    adapter_downlink_codec: str = "fp32"
    # Round policy: wait up to connect_wait_s for num_devices to connect, then start with
    # those connected if there are at least min_devices; wait at most round_deadline_s for
    # replies, and (straggler_s > 0) at most straggler_s after the first device replied; say
    # whom the round waits for every report_every_s; stop the run (non-zero exit) once more
    # than max_failures devices have failed (-1: no limit).
    min_devices: int = 1
    connect_wait_s: float = 120.0
    round_deadline_s: float = 1800.0
    straggler_s: float = 0.0
    report_every_s: float = 30.0
    max_failures: int = -1
    # Buffered asynchronous rounds (fedpipe.fl.buffered): mode = async pushes work to every
    # free device and aggregates every `buffer` replies as they come, each aggregation a new
    # version (federated.rounds counts versions); a reply s versions stale weighs its examples
    # times `staleness` (constant | poly:a = 1/(1+s)^a | hinge:a,b) and one staler than
    # max_staleness is refused; the global moves by buffer_lr x the weighted mean update.
    mode: str = "sync"  # sync | async
    buffer: int = 2
    max_staleness: int = 4
    staleness: str = "poly:0.5"
    buffer_lr: float = 1.0

    def __post_init__(self) -> None:
        _check(self.rounds >= 1, f"federated.rounds must be >= 1, got {self.rounds}")
        self._check_async()
        _check(
            self.eval_every >= 1,
            f"federated.eval_every must be >= 1 (1: after every round), got {self.eval_every}",
        )
        _check(
            self.eval_generate >= 0,
            f"federated.eval_generate must be >= 0 (0: off), got {self.eval_generate}",
        )
        _check(
            1 <= self.min_devices <= self.num_devices,
            f"federated.min_devices must be in 1..num_devices ({self.num_devices}), "
            f"got {self.min_devices}",
        )
        _check(
            self.round_deadline_s > 0
            and self.report_every_s > 0
            and self.connect_wait_s >= 0
            and self.straggler_s >= 0,
            "federated.round_deadline_s and report_every_s must be > 0, connect_wait_s and "
            "straggler_s >= 0",
        )
        _check(self.max_failures >= -1, "federated.max_failures must be >= 0, or -1 (no limit)")
        _check(
            self.device_blocks >= 0,
            f"federated.device_blocks must be >= 0 (0: the whole partition), "
            f"got {self.device_blocks}",
        )
        _check(self.num_devices >= 1, f"federated.num_devices must be >= 1, got {self.num_devices}")
        _check(0 < self.fraction_train <= 1, "federated.fraction_train must be in (0, 1]")
        _check(
            self.partition in ("iid", "by-source", "dirichlet"),
            f"federated.partition must be iid, by-source or dirichlet, got {self.partition!r}",
        )
        _check(
            self.aggregation in AGGREGATIONS,
            f"federated.aggregation {self.aggregation!r} unknown; choose one of "
            f"{', '.join(AGGREGATIONS)}",
        )
        _check(
            0 <= self.trim_beta < 0.5,
            f"federated.trim_beta must be in [0, 0.5), got {self.trim_beta}",
        )
        _check(
            self.malicious_devices >= 0 and self.krum_select >= 1,
            "federated.malicious_devices must be >= 0 and federated.krum_select >= 1",
        )
        _check(
            self.update_norm_bound >= 0,
            f"federated.update_norm_bound must be >= 0 (0: off), got {self.update_norm_bound}",
        )
        _check(
            self.strategy not in ROBUST_STRATEGIES
            and self.update_norm_bound == 0
            or self.aggregation in ("separate", "ffa"),
            f"federated.strategy = {self.strategy!r} with federated.update_norm_bound = "
            f"{self.update_norm_bound:g} combines adapters robustly, which "
            f"federated.aggregation = {self.aggregation!r} cannot (it folds a weighted mean); "
            "use separate or ffa",
        )
        _check(
            self.aggregation not in ("exact", "stack") or self.strategy in ("fedavg", "fedprox"),
            f"federated.aggregation = {self.aggregation!r} averages the devices' models itself; "
            f"it needs federated.strategy fedavg or fedprox, got {self.strategy!r}",
        )
        for name in ("adapter_codec", "adapter_downlink_codec"):
            value = getattr(self, name)
            _check(
                _is_codec(value) and not codec_token_groups(value),
                f"federated.{name} {value!r} unknown; choose one of {codec_help()}, "
                "without t (an adapter has no tokens to group along)",
            )
        object.__setattr__(
            self, "device_cuts", parse_cuts(self.device_cuts, "federated.device_cuts")
        )
        object.__setattr__(self, "profiles", parse_profiles(self.profiles, "federated.profiles"))

    def _check_async(self) -> None:
        """mode = async: its own settings, and the settings it cannot hold, said by name."""
        _check(
            self.mode in ("sync", "async"),
            f"federated.mode must be sync or async, got {self.mode!r}",
        )
        parse_staleness(self.staleness)
        _check(
            0 <= self.max_staleness <= MAX_STALENESS,
            f"federated.max_staleness must be in 0..{MAX_STALENESS} (the StageServer keeps a "
            f"copy of the server adapter per version it admits), got {self.max_staleness}",
        )
        _check(self.buffer_lr > 0, f"federated.buffer_lr must be > 0, got {self.buffer_lr:g}")
        if self.mode != "async":
            return
        _check(
            1 <= self.buffer <= self.num_devices,
            f"federated.buffer = {self.buffer} with mode = async waits for more replies than "
            f"the {self.num_devices} devices (federated.num_devices) can ever send at once; "
            "set it in 1..num_devices",
        )
        cannot = [
            (self.strategy not in ("fedavg", "fedprox"), f"federated.strategy = {self.strategy}"),
            (self.aggregation != "separate", f"federated.aggregation = {self.aggregation}"),
            (self.update_norm_bound > 0, "federated.update_norm_bound > 0"),
            (self.adapter_codec != "fp32", f"federated.adapter_codec = {self.adapter_codec}"),
            (
                self.adapter_downlink_codec != "fp32",
                f"federated.adapter_downlink_codec = {self.adapter_downlink_codec}",
            ),
            (self.fraction_train < 1, "federated.fraction_train < 1"),
            (self.straggler_s > 0, "federated.straggler_s > 0"),
        ]
        for bad, what in cannot:
            _check(
                not bad,
                f"federated.mode = async cannot hold {what}: it merges each update against "
                "its own version by the weighted mean (fedavg/fedprox, separate aggregation, "
                "fp32 adapters, every free device working); set it back or use mode = sync",
            )


@dataclass(frozen=True)
class PrivacyConfig:
    """Defences on what a device sends (fedpipe.privacy); all off by default.

    Stage link, by ``mechanism``:

    - ``clip``: each token's vector of the activations (and of the output gradients) a device
      sends up is clipped to L2 norm ``*_clip``, then Gaussian noise of standard deviation
      ``*_noise * *_clip`` is added to every coordinate. The (epsilon, delta) guarantee is per
      sample (one training sequence) and is reported per device and round.
    - ``token``: no clipping; every coordinate of a token's vector gets Gaussian noise of
      standard deviation ``*_noise`` times the token's own norm (the same signal-to-noise ratio
      for every token). An empirical defence: no (epsilon, delta).
    - ``token-dim``: as ``token``, with the same noise energy spread over the dimensions as the
      microbatch's own energy is (a dimension that carries more signal gets more noise).

    ``decorrelation`` > 0 trains the device's head to hide which token it read: a distance-
    correlation penalty (NoPeek) between the tokens and the activations sent up, added to the
    task loss with this weight. ``label_resample`` = r: the gradient sent up is taken against
    labels a share r of which are drawn from the device's own prediction (randomized response;
    unbiased, the tail trains on the true labels). ``devices``: per-device overrides of the
    device-side keys (fedpipe.config.privacy_spec). Adapters: Flower's fixed-clipping DP
    wrappers (``adapter_dp`` = server | client) with ``adapter_noise`` and ``adapter_clip``.
    """

    mechanism: str = "clip"  # clip | token | token-dim: how the link's noise is calibrated
    activation_clip: float = 0.0  # per-token L2 norm bound of activations sent up; 0 = off
    activation_noise: float = 0.0  # std = noise * clip (clip) or * the token's norm (token)
    gradient_clip: float = 0.0  # per-token L2 norm bound of output gradients sent up; 0 = off
    gradient_noise: float = 0.0  # as activation_noise, on the output gradients
    decorrelation: float = 0.0  # weight of the head's distance-correlation penalty; 0 = off
    label_resample: float = 0.0  # share of positions whose upward gradient uses a drawn label
    devices: str = ""  # per-device overrides, cycled over simulated devices ("" = the run's)
    delta: float = 1e-5  # the delta of the reported (epsilon, delta)
    adapter_dp: str = "off"  # off | server | client: Flower's fixed-clipping DP on adapters
    adapter_noise: float = 1.0  # Flower's noise_multiplier (with adapter_dp)
    adapter_clip: float = 1.0  # Flower's clipping_norm of a device's adapter update

    def __post_init__(self) -> None:
        _check(
            self.mechanism in MECHANISMS,
            f"privacy.mechanism must be one of {', '.join(MECHANISMS)}, got {self.mechanism!r}",
        )
        for name in ("activation", "gradient"):
            clip, noise = getattr(self, f"{name}_clip"), getattr(self, f"{name}_noise")
            _check(clip >= 0, f"privacy.{name}_clip must be >= 0 (0 = off), got {clip}")
            _check(noise >= 0, f"privacy.{name}_noise must be >= 0, got {noise}")
            if self.mechanism == "clip":
                _check(
                    noise == 0 or clip > 0,
                    f"privacy.{name}_noise = {noise} needs privacy.{name}_clip > 0: the noise "
                    "is calibrated to the clipping norm (or set privacy.mechanism = token)",
                )
            else:
                _check(
                    clip == 0,
                    f"privacy.mechanism = {self.mechanism} scales the noise to each token's own "
                    f"norm and clips nothing, but privacy.{name}_clip = {clip}: set it to 0",
                )
        _check(
            self.decorrelation >= 0,
            f"privacy.decorrelation must be >= 0 (0 = off), got {self.decorrelation}",
        )
        _check(
            0 <= self.label_resample < 1,
            f"privacy.label_resample must be in [0, 1) (0 = off), got {self.label_resample}",
        )
        for entry in parse_privacy_specs(self.devices, "privacy.devices"):
            try:
                replace(self, devices="", **entry)
            except ValueError as exc:
                raise ValueError(f"privacy.devices entry {entry}: {exc}") from None
        _check(0 < self.delta < 1, f"privacy.delta must be in (0, 1), got {self.delta}")
        _check(
            self.adapter_dp in ("off", "server", "client"),
            f"privacy.adapter_dp must be off, server or client, got {self.adapter_dp!r}",
        )
        _check(
            self.adapter_noise >= 0, f"privacy.adapter_noise must be >= 0, got {self.adapter_noise}"
        )
        _check(self.adapter_clip > 0, f"privacy.adapter_clip must be > 0, got {self.adapter_clip}")

    @property
    def link_defended(self) -> bool:
        """Whether anything is done to the tensors a device sends up (noise or clipping)."""
        if self.mechanism == "clip":
            return self.activation_clip > 0 or self.gradient_clip > 0
        return self.activation_noise > 0 or self.gradient_noise > 0

    def for_device(self, spec: str | dict[str, Any]) -> PrivacyConfig:
        """The run's settings with a device's own overrides (a spec string or parsed)."""
        entry = parse_privacy_spec(spec, "--privacy") if isinstance(spec, str) else spec
        return replace(self, devices="", **entry) if entry else self


def parse_device_weights(
    value: str | Sequence[Any], key: str = "device.weights"
) -> tuple[str, ...]:
    """``"int4, fp32"`` or ``["int4", "fp32"]`` -> ("int4", "fp32"); each one of
    :data:`DEVICE_WEIGHTS`."""
    if isinstance(value, str):
        entries = tuple(w.strip() for w in value.split(",") if w.strip())
    else:
        entries = tuple(w.strip() if isinstance(w, str) else w for w in _entries(value, key))
    _check(bool(entries), f"{key} is empty; choose one of {', '.join(DEVICE_WEIGHTS)}")
    for entry in entries:
        _check(
            entry in DEVICE_WEIGHTS,
            f"{key} {entry!r} unknown; choose one of {', '.join(DEVICE_WEIGHTS)}",
        )
    return entries


@dataclass(frozen=True)
class DeviceConfig:
    """What each device holds of the model, whatever the server runs (fedpipe.split.quant)."""

    # How a device stores its frozen token embedding, block linears and LM head: fp32 as read,
    # or bf16, int8 (per output channel) or int4 (groups of 64, two per byte), dequantized
    # slab by slab into fp32 compute; LoRA, its gradients and AdamW stay fp32. Several, a list
    # or comma-separated ("int4,fp32"), are dealt to simulated devices in turn; `fedpipe client
    # --weights` sets a deployed device's own.
    weights: tuple[str, ...] = ("fp32",)
    # What the head's and tail's forwards (and so their backwards) compute in: fp32, or bf16
    # under torch.autocast (CPUs with native bf16 matmuls: AMX, avx512_bf16). LoRA, its
    # gradients, AdamW, the loss and the tensors sent to the server stay fp32.
    dtype: str = "fp32"

    def __post_init__(self) -> None:
        object.__setattr__(self, "weights", parse_device_weights(self.weights))
        _check(
            self.dtype in DEVICE_DTYPES,
            f"device.dtype {self.dtype!r} unknown; choose one of {', '.join(DEVICE_DTYPES)}",
        )

    @property
    def stored(self) -> str:
        """The storage of a device built from this config: the first entry (a device's own
        config carries one; ``FedpipeConfig.with_device_weights`` makes it)."""
        return self.weights[0]


@dataclass(frozen=True)
class FedpipeConfig:
    """All settings of a run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    federated: FederatedConfig = field(default_factory=FederatedConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)  # defences, all off by default
    device: DeviceConfig = field(default_factory=DeviceConfig)  # what a device stores

    def __post_init__(self) -> None:
        _check(
            self.pipeline.microbatches <= self.train.batch_size,
            f"pipeline.microbatches ({self.pipeline.microbatches}) must not exceed "
            f"train.batch_size ({self.train.batch_size})",
        )
        if self.model.split == "two":
            _check(self.model.tail_layers == 0, "model.split='two' needs model.tail_layers=0")
        self._check_cuts()
        _check(
            self.pipeline.freeze == "off" or self.federated.aggregation != "stack",
            "pipeline.freeze = progressive reads how far each block's global adapter moved in "
            "a round, but federated.aggregation = stack restarts the adapters every round "
            "(nothing to read); use separate, exact or ffa, or set pipeline.freeze = off",
        )
        for bad, what in (
            (self.pipeline.freeze != "off", f"pipeline.freeze = {self.pipeline.freeze}"),
            (self.privacy.adapter_dp != "off", f"privacy.adapter_dp = {self.privacy.adapter_dp}"),
        ):
            _check(
                self.federated.mode != "async" or not bad,
                f"federated.mode = async cannot hold {what}: it decides per round what every "
                "device trains or adds; set it off or use mode = sync",
            )
        for entry in ({}, *parse_privacy_specs(self.privacy.devices, "privacy.devices")):
            self._check_device_privacy(self.privacy.for_device(entry))
        stored = [w for w in self.device.weights if w != "fp32"] or [""]
        _check(
            not stored[0] or self.federated.aggregation not in ("exact", "stack"),
            f"device.weights = {stored[0]} stores the device's frozen weights rounded, but "
            f"federated.aggregation = {self.federated.aggregation} folds each round's base "
            "deltas into them, which a rounded weight cannot hold; use aggregation separate or "
            "ffa, or device.weights = fp32",
        )
        _check(
            self.server.weights == "fp32" or self.federated.aggregation not in ("exact", "stack"),
            f"server.weights = {self.server.weights} stores the server's frozen block weights "
            f"rounded, but federated.aggregation = {self.federated.aggregation} folds each "
            "round's base deltas into them, which a rounded weight cannot hold; use aggregation "
            "separate or ffa, or server.weights = fp32",
        )

    def _check_device_privacy(self, privacy: PrivacyConfig) -> None:
        """The device-side defences a device runs (the run's, or its own) fit its pipeline."""
        clipped = privacy.mechanism == "clip" and privacy.activation_clip > 0
        _check(
            not (self.pipeline.recompute_head and clipped),
            "pipeline.recompute_head = true cannot be combined with privacy.activation_clip > 0: "
            "the recomputed head would not see the clipping and noise that were sent; "
            "turn one of them off",
        )
        _check(
            not (self.pipeline.recompute_head and privacy.decorrelation > 0),
            "pipeline.recompute_head = true cannot be combined with privacy.decorrelation > 0: "
            "the penalty needs the head's forward graph, which recompute drops; "
            "turn one of them off",
        )
        _check(
            not (self.data.packing and privacy.label_resample > 0),
            "data.packing = true cannot be combined with privacy.label_resample > 0: the "
            "resampled tail step runs the tail without the packed rows' boundaries; turn one "
            "of them off",
        )
        _check(
            self.model.split == "u" or privacy.label_resample == 0,
            "privacy.label_resample > 0 resamples the labels of the gradient a device's tail "
            f"sends up, but model.split = {self.model.split!r} sends the labels themselves to "
            "the server: use model.split = u or set label_resample = 0",
        )
        _check(
            self.pipeline.device_trains or privacy.decorrelation == 0,
            "privacy.decorrelation > 0 trains the device's head, but pipeline.device_trains = "
            "false freezes it: turn one of them off",
        )
        _check(
            self.device.dtype == "fp32" or privacy.label_resample == 0,
            f"device.dtype = {self.device.dtype} runs the tail's forward under autocast, but "
            "privacy.label_resample > 0 runs the tail's forward and backward in one call, which "
            "fedpipe does not autocast: set device.dtype = fp32 or label_resample = 0",
        )

    def for_device_privacy(self, spec: str | dict[str, Any]) -> FedpipeConfig:
        """A copy whose ``privacy`` has a device's own overrides (checked against the pipeline)."""
        privacy = self.privacy.for_device(spec)
        return self if privacy == self.privacy else replace(self, privacy=privacy)

    def device_privacy(self, partition: int) -> dict[str, Any]:
        """Simulated device ``partition``'s overrides: ``privacy.devices`` cycled ({} = none)."""
        entries = parse_privacy_specs(self.privacy.devices, "privacy.devices")
        if partition < 0 or not entries:
            return {}
        return entries[partition % len(entries)]

    def _check_cuts(self) -> None:
        """Mode "two" varies only the head; every simulated device's cut must be offered."""
        offered = self.model.offered_cuts
        if self.model.split == "two":
            tails = [format_cut(c) for c in offered if c[1] != 0]
            _check(
                not tails,
                f"model.cuts {tails} keep tail blocks, but model.split='two' runs everything "
                "after the head on the server: write each cut as head+0",
            )
        _check(
            len(offered) == 1 or self.privacy.adapter_dp == "off",
            f"model.cuts {format_cuts(self.model.cuts)!r} lets devices hold different blocks, "
            "which "
            f"privacy.adapter_dp = {self.privacy.adapter_dp!r} does not account for (a device's "
            "update would reach the blocks others lack); offer one cut or set adapter_dp = off",
        )
        missing = [format_cut(c) for c in self.federated.device_cuts if c not in offered]
        _check(
            not missing,
            f"federated.device_cuts names {missing}, which the server does not offer "
            f"({', '.join(format_cut(c) for c in offered)}): add them to model.cuts",
        )

    def device_weights(self, partition: int) -> str:
        """The storage simulated device ``partition`` uses: ``device.weights`` cycled (the
        evaluator beside the server, partition -1, keeps fp32)."""
        entries = self.device.weights
        return "fp32" if partition < 0 else entries[partition % len(entries)]

    def with_device_weights(self, weights: str) -> FedpipeConfig:
        """A copy whose devices store their frozen weights as ``weights`` (one entry)."""
        entries = parse_device_weights(weights, "--weights")
        if entries == self.device.weights:
            return self
        return replace(self, device=replace(self.device, weights=entries))

    def device_cut(self, partition: int) -> tuple[int, int]:
        """The cut simulated device ``partition`` uses: ``federated.device_cuts`` cycled."""
        cuts = self.federated.device_cuts
        if partition < 0 or not cuts:
            return (self.model.head_layers, self.model.tail_layers)
        return cuts[partition % len(cuts)]

    def with_cut(self, cut: tuple[int, int]) -> FedpipeConfig:
        """A copy whose device side is built with ``cut`` (the server's offer is unchanged)."""
        if cut == (self.model.head_layers, self.model.tail_layers):
            return self
        offered = self.model.offered_cuts
        model = replace(self.model, head_layers=cut[0], tail_layers=cut[1], cuts=offered)
        return replace(self, model=model)

    def to_flat(self) -> dict[str, Any]:
        """``{"section.key": value}`` for every setting (Flower run config, summaries): scalars
        only, a list setting as the string it is written as (:func:`list_text`), which
        :meth:`with_overrides` reads back to the same entries."""
        out = {}
        for section in fields(self):
            for f in fields(getattr(self, section.name)):
                key, value = (
                    f"{section.name}.{f.name}",
                    getattr(getattr(self, section.name), f.name),
                )
                out[key] = list_text(key, value) if isinstance(value, tuple) else value
        return out

    def with_overrides(self, flat: dict[str, Any]) -> FedpipeConfig:
        """A copy with ``{"section.key": value}`` applied (strings are converted to the type)."""
        sections = {s.name: dataclasses.asdict(getattr(self, s.name)) for s in fields(self)}
        for key, value in flat.items():
            section, _, name = key.partition(".")
            if section not in sections or name not in sections[section]:
                raise ValueError(_unknown_setting(key, list(self.to_flat())))
            sections[section][name] = _coerce(type(self), section, name, value)
        types = get_type_hints(type(self))
        return replace(self, **{k: types[k](**v) for k, v in sections.items()})


# How each list setting's entries are written as one string (the inverse of its parser).
_LIST_TEXT: dict[str, Callable[[Any], str]] = {
    "model.cuts": format_cuts,
    "federated.device_cuts": format_cuts,
    "federated.profiles": join_specs,  # with "; " where commas alone would regroup the specs
    "device.weights": ",".join,
}


# Each list setting's parser (a comma string or a list of entries -> the checked tuple).
_LIST_PARSE: dict[str, Callable[[Any, str], tuple[Any, ...]]] = {
    "model.cuts": parse_cuts,
    "federated.device_cuts": parse_cuts,
    "federated.profiles": parse_profiles,
    "device.weights": parse_device_weights,
}
LIST_SETTINGS = tuple(_LIST_TEXT)


def list_text(key: str, entries: tuple[Any, ...]) -> str:
    """A list setting's entries as the string a user writes (``"2+1,1+1"``), which its
    parser reads back to the same entries; for messages, summaries and Flower's run config."""
    return _LIST_TEXT[key](entries)


def canonical_list_text(key: str, value: Any) -> str:
    """A list setting's value (a string as written, or a list) as :meth:`FedpipeConfig.to_flat`
    writes it: ``"1+1, 2+2"`` -> ``"1+1,2+2"`` (raises ValueError naming ``key``)."""
    return list_text(key, _LIST_PARSE[key](value, key))


def _unknown_setting(key: str, known: list[str]) -> str:
    """One line naming the closest known setting to a mistyped ``key``, else the choices."""
    section, _, name = key.partition(".")
    in_section = [k for k in known if k.startswith(section + ".")]
    if in_section:  # a known section: compare the key names alone
        names = [k.partition(".")[2] for k in in_section]
        close = [f"{section}.{n}" for n in difflib.get_close_matches(name, names, n=1)]
    else:
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
    if close:
        return f"unknown setting {key!r}; did you mean {close[0]!r}?"
    choices = in_section or sorted({k.partition(".")[0] for k in known})
    return f"unknown setting {key!r}; known here: {', '.join(choices)}"


def _coerce(cls: type, section: str, name: str, value: Any) -> Any:
    kind = get_type_hints(get_type_hints(cls)[section])[name]
    return coerce_value(f"{section}.{name}", kind, value)


def coerce_value(key: str, kind: Any, value: Any) -> Any:
    """``value`` as a ``kind`` (bool, int, float or str), from a string or a number; a value
    of another type is refused in one line naming ``key``.

    A list setting (``kind`` a tuple type) takes a list of entries, made a tuple, or one
    comma-separated string, kept whole: the setting's own section splits it (an inline
    profile spec keeps its commas there) and checks every entry."""
    if get_origin(kind) is tuple:
        return _coerce_list(key, kind, value)
    if isinstance(value, str) and kind is not str:
        text = value.strip()
        if kind is bool:
            if text.lower() not in _BOOLS:
                raise ValueError(f"{key} must be true or false, got {value!r}")
            return _BOOLS[text.lower()]
        try:
            return kind(text)
        except ValueError:
            raise ValueError(f"{key} must be {kind.__name__}, got {value!r}") from None
    if kind is float and isinstance(value, int):
        return float(value)
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, kind):
        raise ValueError(f"{key} must be {kind.__name__}, got {value!r}")
    return value


def _coerce_list(key: str, kind: Any, value: Any) -> str | tuple[Any, ...]:
    """A list setting's value: a comma string as it is, a list or tuple as a tuple."""
    if isinstance(value, str):
        return value.strip()
    entry = get_args(kind)[0]  # str, or tuple[int, int] (a cut, also written "2+1")
    ok = (str,) if entry is str else (str, list, tuple)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, ok) for v in value):
        raise ValueError(
            f"{key} must be a list of strings or a comma-separated string, got {value!r}"
        )
    return tuple(tuple(v) if isinstance(v, list) else v for v in value)


def parse_overrides(items: list[str]) -> dict[str, str]:
    """``["pipeline.microbatches=8"]`` -> ``{"pipeline.microbatches": "8"}``."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set expects section.key=value, got {item!r}")
        out[key.strip()] = value.strip().strip('"')
    return out


def load_config(
    path: str | Path | None = None, overrides: dict[str, Any] | None = None
) -> FedpipeConfig:
    """Defaults, then a TOML file's tables, then overrides (CLI flags win)."""
    flat: dict[str, Any] = {}
    if path is not None:
        if not Path(path).is_file():
            raise FileNotFoundError(f"--config: settings file {path} does not exist")
        with open(path, "rb") as fh:
            try:
                data = tomllib.load(fh)
            except tomllib.TOMLDecodeError as exc:
                raise ValueError(f"{path}: not valid TOML ({exc})") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ValueError(f"{path}: top-level key {section!r} must be a [table]")
            flat.update({f"{section}.{k}": v for k, v in table.items()})
    flat.update(overrides or {})
    return FedpipeConfig().with_overrides(flat)
