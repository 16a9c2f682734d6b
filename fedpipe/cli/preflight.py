"""Checks that run before any process starts, so a bad setting costs a second, not a run.

Each command calls its `check_*` function right after its settings are loaded. A failed check
raises `SettingsError` with one line that names the setting, the value and what to change;
`fedpipe.cli.main` prints that line and exits with status 2. Without these checks the same
mistakes surface 30 s later inside Flower's processes, as tracebacks in their logs, while the
run itself reports "0.0% lower" and exits 0.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedpipe.cli.probes import (
    check_port_free,
    check_stage_secret,
    check_tls_matches,
    split_address,
)
from fedpipe.config import FedpipeConfig, PrivacyConfig, parse_cuts
from fedpipe.config.device import parse_device_weights
from fedpipe.config.privacy_spec import parse_privacy_spec
from fedpipe.data import default_corpus, load_documents, partition, train_eval_split
from fedpipe.emulation import link_names, parse_device_profile, parse_link
from fedpipe.errors import SettingsError

__all__ = [
    "SettingsError",
    "check_client",
    "check_data",
    "check_examples",
    "check_file",
    "check_model",
    "check_profiles",
    "check_run",
    "check_server",
    "check_simulate",
    "check_strategy",
    "did_you_mean",
]

log = logging.getLogger(__name__)


def did_you_mean(value: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest choice, or ``""`` when none is close."""
    close = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_file(path: str | Path, flag: str, what: str) -> Path:
    """``path`` as a resolved Path that exists, or a SettingsError naming ``flag``."""
    resolved = Path(path).expanduser()
    if not resolved.is_file():
        raise SettingsError(f"{flag}: {what} {path} does not exist or is not a file")
    return resolved.resolve()


# -- names --------------------------------------------------------------------------------------
def check_profiles(names: Sequence[str], setting: str) -> None:
    """Every entry is a device profile, a link name or an inline spec (`up=10,rtt=50ms`)."""
    for name in names:
        try:
            parse_device_profile(name)
        except ValueError as exc:
            raise SettingsError(f"{setting}: {exc}".replace("\n", " ")) from None


def check_links(names: Sequence[str]) -> None:
    """Every entry is a named link or an inline spec (`up=10,down=25,rtt=50ms`)."""
    for name in names:
        try:
            parse_link(name)
        except ValueError as exc:
            hint = did_you_mean(name, link_names())
            raise SettingsError(f"--links: {exc}{hint}".replace("\n", " ")) from None


def check_strategy(name: str) -> None:
    """``federated.strategy`` is one fedpipe knows how to build."""
    from fedpipe.fl.strategies import STRATEGIES  # deferred: imports Flower (about 0.4 s)

    if name.strip().lower() not in STRATEGIES:
        raise SettingsError(
            f"federated.strategy: unknown strategy {name!r}{did_you_mean(name, STRATEGIES)}; "
            f"choose from {', '.join(STRATEGIES)}"
        )


# -- data ---------------------------------------------------------------------------------------
def check_data(path: str, setting: str) -> list[Any]:
    """The documents at ``path`` ("" = the bundled corpus); missing or empty data is an error."""
    if not path:
        return default_corpus()
    if not Path(path).expanduser().exists():
        raise SettingsError(f"{setting}: {path} does not exist; give a text/JSONL file or folder")
    try:
        docs = load_documents(Path(path).expanduser())
    except ValueError as exc:
        raise SettingsError(f"{setting}: {exc}") from None
    if not docs:
        raise SettingsError(f"{setting}: {path} holds no text (empty file or only blank records)")
    return docs


def check_partition(config: FedpipeConfig, docs: Sequence[Any], devices: int) -> None:
    """The held-out split and the partition of the rest over ``devices`` both work."""
    fed, where = config.federated, config.federated.data or "the bundled corpus"
    try:
        train, _ = train_eval_split(docs, eval_fraction=fed.eval_fraction, seed=config.model.seed)
        partition(
            train,
            devices,
            scheme=fed.partition,  # type: ignore[arg-type]  # validated by FederatedConfig
            alpha=fed.dirichlet_alpha,
            seed=config.model.seed,
        )
    except ValueError as exc:
        raise SettingsError(_partition_advice(config, docs, devices, where, exc)) from None


def _partition_advice(
    config: FedpipeConfig, docs: Sequence[Any], devices: int, where: str, exc: ValueError
) -> str:
    sources = len({d.source for d in docs})
    if config.federated.partition == "by-source" and sources < devices:
        return (
            f"{where} has {sources} source(s) (files, books or records' 'source') for {devices} "
            f"devices under federated.partition=by-source, which gives each device whole "
            f"sources; use --devices {sources} or fewer, or --set federated.partition=iid "
            "(or dirichlet), or one file per device in a folder"
        )
    return f"{where} cannot be split over {devices} devices: {exc}"


def check_examples(config: FedpipeConfig, docs: Sequence[Any], setting: str) -> None:
    """Instruction data renders and masks with the model's tokenizer (its chat template), so a
    template that cannot be masked fails here, not inside the devices; plain text: nothing."""
    examples = [d for d in docs if d.is_example][:_EXAMPLES_CHECKED]
    if not examples:
        return
    from fedpipe.data import encode_example  # deferred: tokenizers, transformers
    from fedpipe.models import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(config.model.name))
    try:
        for doc in examples:
            encode_example(doc, tokenizer, loss_on=config.data.loss_on)  # type: ignore[arg-type]
    except ValueError as exc:
        raise SettingsError(f"{setting}: {config.model.name}'s tokenizer: {exc}") from None


_EXAMPLES_CHECKED = 8  # the first few: a template fails on the shape of a chat, not its text


# -- model --------------------------------------------------------------------------------------
def model_layers(name: str) -> tuple[int, int]:
    """(blocks, max positions) of model ``name`` (built or converted once into the cache); a
    model fedpipe cannot split (mixture-of-experts, hybrid attention, ...) is refused here,
    before anything starts."""
    from fedpipe.models import load_config, model_family, resolve_model  # deferred: torch

    try:
        hf = load_config(resolve_model(name))
        model_family(hf)
    except (ValueError, OSError) as exc:
        raise SettingsError(f"model.name: {exc}".replace("\n", " ")) from None
    positions = getattr(hf, "max_position_embeddings", None) or getattr(hf, "n_positions", 0)
    return int(hf.num_hidden_layers), int(positions or 0)


def check_model(config: FedpipeConfig) -> int:
    """The split fits the model (the server keeps >= 1 block) and seq_len fits its positions."""
    model = config.model
    layers, positions = model_layers(model.name)
    tail = 0 if model.split == "two" else model.tail_layers
    if model.head_layers + tail > layers - 1:
        raise SettingsError(
            f"model.head_layers ({model.head_layers}) + model.tail_layers ({tail}) leave no "
            f"block of {model.name}'s {layers} for the server; keep their sum <= {layers - 1}, "
            f"e.g. --set model.head_layers=1 --set model.tail_layers=1"
        )
    if positions and config.train.seq_len > positions:
        raise SettingsError(
            f"train.seq_len ({config.train.seq_len}) exceeds {model.name}'s {positions} "
            f"positions; use --set train.seq_len={positions} or less"
        )
    return layers


def default_split(layers: int, wanted: int = 2) -> int:
    """Blocks per device side (head and tail alike) that leave the server at least one."""
    return max(1, min(wanted, (layers - 1) // 2))


# -- per command ---------------------------------------------------------------------------------
def _check_common(config: FedpipeConfig) -> None:
    check_profiles(list(config.federated.profiles), "federated.profiles")
    check_strategy(config.federated.strategy)


def check_simulate(config: FedpipeConfig) -> None:
    """Names, data, partition feasibility, model and split of a simulation."""
    _check_common(config)
    docs = check_data(config.federated.data, "federated.data")
    check_partition(config, docs, config.federated.num_devices)
    check_model(config)
    check_examples(config, docs, "federated.data")


@dataclass(frozen=True)
class RunTarget:
    """Where `fedpipe run` sends its run, and with which credentials."""

    superlink: str
    stage_server: str
    secret_file: Path | None
    superlink_ca: str | None
    stage_ca: str | None


def check_run(config: FedpipeConfig, target: RunTarget) -> None:
    """Like a simulation, plus: the SuperLink and StageServer answer, in the right protocol,
    and the StageServer accepts the secret."""
    _check_common(config)
    docs = check_data(config.federated.data, "federated.data")
    try:  # devices without --data take partition i of this data
        check_partition(config, docs, config.federated.num_devices)
    except SettingsError as exc:
        log.warning("devices started without --data will fail: %s", exc)
    check_model(config)
    if target.secret_file is not None:
        check_file(target.secret_file, "--secret-file", "secret file")
    for ca in (target.superlink_ca, target.stage_ca):
        if ca:
            check_file(ca, "--tls-ca", "CA certificate")
    # one StageServer, or each of its replicas (a comma-separated list)
    for address in [a.strip() for a in target.stage_server.split(",") if a.strip()]:
        check_tls_matches(address, target.stage_ca, "--stage-server", "StageServer", required=True)
        check_stage_secret(
            address,
            target.secret_file,
            target.stage_ca,
            config.server.client_identity(),
        )
    check_tls_matches(
        target.superlink, target.superlink_ca, "--superlink", "SuperLink", required=True
    )


@dataclass(frozen=True)
class ServerSetup:
    """What `fedpipe server` is about to start."""

    stage_host: str
    stage_port: int
    superlink: str | None  # host:port of a SuperLink to start, or None
    tls_ca: str | None
    tls_cert: str | None
    tls_key: str | None
    node_auth: bool


def check_secret_needed(config: FedpipeConfig, host: str, secret: str | None) -> None:
    """A StageServer that others can reach needs a secret, unless the operator opts out
    (:meth:`~fedpipe.config.ServerConfig.secret_refusal`, the StageServer's own rule)."""
    if refusal := config.server.secret_refusal(host, secret):
        raise SettingsError(f"--stage-server {host}: {refusal}")


def check_server(config: FedpipeConfig, setup: ServerSetup) -> None:
    """Ports free, TLS files present and complete, node auth only with TLS, model and split."""
    for flag, path in (("--tls-ca", setup.tls_ca), ("--tls-cert", setup.tls_cert)):
        if path:
            check_file(path, flag, "certificate")
    if setup.tls_key:
        check_file(setup.tls_key, "--tls-key", "private key")
    if bool(setup.tls_cert) != bool(setup.tls_key):
        raise SettingsError("--tls-cert and --tls-key go together: give both or neither")
    if setup.superlink is not None and setup.tls_cert and not setup.tls_ca:
        raise SettingsError(
            "a TLS SuperLink needs its CA too: add --tls-ca FILE (the CA that signed --tls-cert)"
        )
    if setup.node_auth and not setup.tls_cert:
        raise SettingsError(
            "--node-auth needs TLS (Flower refuses node auth in plaintext): add --tls-ca, "
            "--tls-cert and --tls-key"
        )
    if config.server.device == "cuda" and not config.server.ray_address:  # else on Ray's nodes
        import torch

        if not torch.cuda.is_available():
            raise SettingsError(
                "--device cuda: torch sees no CUDA GPU here; use --device auto (CUDA when "
                "present, else CPU) or --device cpu"
            )
    _check_stage_ports(config, setup)
    if setup.superlink is not None:
        host, port = split_address(setup.superlink, "--superlink")
        check_port_free(host, port, "--superlink")
    check_model(config)


def _check_stage_ports(config: FedpipeConfig, setup: ServerSetup) -> None:
    """The StageServer's port is free; with replicas on this machine, each replica's."""
    server = config.server
    if server.replicas == 1:
        check_port_free(setup.stage_host, setup.stage_port, "--stage-server")
    elif not server.ray_address and server.replica_port:  # on a cluster: other nodes' ports
        for index in range(server.replicas):
            check_port_free(setup.stage_host, server.replica_port + index, "--replica-port")


@dataclass(frozen=True)
class ClientSetup:
    """What `fedpipe client` is about to start."""

    superlink: str
    stage_server: str | None
    partition_id: int
    num_partitions: int
    profile: str
    data: str | None
    supernode_port: int | None
    superlink_ca: str | None
    stage_ca: str | None
    auth_key: str | None
    stage_cert: str | None = None  # mutual TLS on the stage link: this device's certificate
    stage_key: str | None = None
    cut: str = ""  # this device's head+tail blocks ("" = the run's)
    privacy: str = ""  # this device's own defences over the run's [privacy] ("" = the run's)
    weights: str = ""  # how this device stores its frozen weights ("" = device.weights)


def _check_cut(cut: str) -> None:
    try:
        if len(parse_cuts(cut, "--cut")) > 1:
            raise ValueError(f"--cut {cut!r}: a device runs one cut, such as 2+1")
    except ValueError as exc:
        raise SettingsError(str(exc)) from None


def _check_privacy(spec: str) -> None:
    """The spec's keys and values alone; how they fit the run is checked when it starts."""
    try:
        entry = parse_privacy_spec(spec, "--privacy")  # its messages name the flag and spec
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
    try:
        PrivacyConfig().for_device(entry)
    except ValueError as exc:
        raise SettingsError(f"--privacy {spec!r}: {exc}") from None


def _check_weights(weights: str) -> None:
    if not weights:
        return
    try:
        entries = parse_device_weights(weights, "--weights")
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
    if len(entries) > 1:
        raise SettingsError(f"--weights {weights!r}: a device stores its weights one way")


def check_client(setup: ClientSetup) -> None:
    """Partition, profile, data, key and CA files, its own port, and the servers' protocols."""
    if not 0 <= setup.partition_id < setup.num_partitions:
        raise SettingsError(
            f"--partition-id {setup.partition_id} is outside 0..{setup.num_partitions - 1} "
            f"(--num-partitions {setup.num_partitions})"
        )
    check_profiles([setup.profile], "--profile")
    _check_cut(setup.cut)
    _check_privacy(setup.privacy)
    _check_weights(setup.weights)
    if setup.data:
        check_data(setup.data, "--data")
    for ca in (setup.superlink_ca, setup.stage_ca):
        if ca:
            check_file(ca, "--tls-ca", "CA certificate")
    if setup.auth_key:
        check_file(setup.auth_key, "--auth-key", "private key")
    if bool(setup.stage_cert) != bool(setup.stage_key):
        raise SettingsError("--tls-cert and --tls-key go together: give both or neither")
    if setup.stage_cert:
        check_file(setup.stage_cert, "--tls-cert", "client certificate")
        check_file(setup.stage_key or "", "--tls-key", "private key")
    split_address(setup.superlink, "--superlink")
    if setup.supernode_port:
        check_port_free("127.0.0.1", setup.supernode_port, "--supernode-port")
    check_tls_matches(setup.superlink, setup.superlink_ca, "--superlink", "SuperLink")
    if setup.stage_server:
        check_tls_matches(setup.stage_server, setup.stage_ca, "--stage-server", "StageServer")
