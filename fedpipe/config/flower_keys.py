"""The keys fedpipe's apps read from Flower besides the settings, each declared once, typed.

Flower hands a ClientApp or ServerApp two flat dicts of scalars:

- the **run config**: every setting by its dotted name (``pipeline.microbatches``, see
  :mod:`fedpipe.config.fedpipe_config`) plus the run's own keys, ``run.*`` (:class:`RunSettings`:
  the run folder, the StageServer's address, the secret file, the run's id);
- the **node config** of a device's SuperNode (:class:`NodeSettings`: its partition, its
  own profile, data, cut, defences and TLS files; ``fedpipe client`` writes it).

Each class writes its keys (``to_run_config`` / ``to_node_config``) and reads them back
(``from_run_config`` / ``from_node_config``), converting strings to the field's type; a key
it does not know, or a value of the wrong type, is refused in one line naming the key.
:func:`settings_from_run_config` reads a whole run config into the two typed halves.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, get_type_hints

from fedpipe.config.convert import coerce_value
from fedpipe.config.fedpipe_config import FedpipeConfig

__all__ = [
    "NodeSettings",
    "RunSettings",
    "run_config_of",
    "settings_from_run_config",
]

RUN_PREFIX = "run."


@dataclass(frozen=True)
class RunSettings:
    """The run's own keys (``run.*``), not model or training settings.

    ``secret`` is no key: only the ServerApp fills it, from ``secret_file`` (a path on the
    server host that devices see but never open; ``fl.device_work.server_run_settings``).
    """

    dir: str = ""  # run.dir: the run folder (on the server host)
    resume: bool = False  # run.resume
    stage_address: str = "127.0.0.1:50051"  # run.stage-address
    secret_file: str = ""  # run.secret-file
    secret: str = ""
    run_id: str = "run"  # run.id
    round_timeout_s: float = 1800.0  # run.round-timeout

    # field -> run-config key; a field not named here does not cross Flower
    KEYS: ClassVar[dict[str, str]] = {
        "dir": "run.dir",
        "resume": "run.resume",
        "stage_address": "run.stage-address",
        "secret_file": "run.secret-file",
        "run_id": "run.id",
        "round_timeout_s": "run.round-timeout",
    }

    def to_run_config(self) -> dict[str, Any]:
        """``{"run.dir": ..., ...}``: every run key, never the secret."""
        return {key: getattr(self, name) for name, key in self.KEYS.items()}

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> RunSettings:
        """The ``run.*`` keys of a run config (the defaults for those absent)."""
        return cls(**_read(cls, cls.KEYS, run_config, "run key"))


@dataclass(frozen=True)
class NodeSettings:
    """A device's node config: what its SuperNode says about it (``fedpipe client`` flags).

    Empty strings and ``num_partitions`` 0 mean "not given": the run's settings decide
    (``federated.profiles``, ``federated.device_cuts``, ... cycled over partitions).
    """

    partition_id: int = 0  # partition-id (Flower's simulation sets it and num-partitions)
    num_partitions: int = 0  # num-partitions; 0: federated.num_devices
    profile: str = ""  # --profile; "": federated.profiles cycled
    data: str = ""  # --data: the device's own data, all of it its partition
    cut: str = ""  # --cut; "": federated.device_cuts cycled
    privacy: str = ""  # --privacy; "": privacy.devices cycled
    weights: str = ""  # --weights; "": device.weights cycled
    stage_address: str = ""  # --stage-server; "": the train order's or run.stage-address
    stage_ca: str = ""  # the StageServer's CA, a file on the device
    stage_cert: str = ""  # mutual TLS: the device's certificate and key
    stage_key: str = ""
    delta_dir: str = ""  # where the delta cache outlives a round ("": see client_app)

    KEYS: ClassVar[dict[str, str]] = {
        "partition_id": "partition-id",
        "num_partitions": "num-partitions",
        "profile": "profile",
        "data": "data",
        "cut": "cut",
        "privacy": "privacy",
        "weights": "weights",
        "stage_address": "stage-address",
        "stage_ca": "stage-ca",
        "stage_cert": "stage-cert",
        "stage_key": "stage-key",
        "delta_dir": "delta-dir",
    }

    def to_node_config(self) -> dict[str, Any]:
        """The partition keys always, the others where given (a node config Flower parses)."""
        out: dict[str, Any] = {}
        for name, key in self.KEYS.items():
            value = getattr(self, name)
            if name in ("partition_id", "num_partitions") or value:
                out[key] = value
        return out

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any]) -> NodeSettings:
        """A SuperNode's node config; a key fedpipe does not read is refused, not ignored."""
        known = set(cls.KEYS.values())
        for key in node_config:
            if key not in known:
                raise ValueError(_unknown(f"node config key {key!r}", key, known))
        return cls(**_read(cls, cls.KEYS, node_config, "node config key"))


def _read(cls: type, keys: dict[str, str], given: Mapping[str, Any], what: str) -> dict[str, Any]:
    """``{field: value}`` of the keys present in ``given``, each converted to its field's type."""
    types = get_type_hints(cls)
    return {
        name: coerce_value(f"{what} {key!r}", types[name], given[key])
        for name, key in keys.items()
        if key in given
    }


def _unknown(what: str, key: str, known: set[str]) -> str:
    """One line: the unknown key, and the closest known one (else all of them)."""
    close = difflib.get_close_matches(key, sorted(known), n=1)
    if close:
        return f"{what} unknown; did you mean {close[0]!r}?"
    return f"{what} unknown; known: {', '.join(sorted(known))}"


def run_config_of(config: FedpipeConfig, run: RunSettings | None = None) -> dict[str, Any]:
    """The flat run config of a run: every setting, then the run keys (defaults without ``run``)."""
    return {**config.to_flat(), **(run or RunSettings()).to_run_config()}


def settings_from_run_config(
    run_config: Mapping[str, Any],
) -> tuple[FedpipeConfig, RunSettings]:
    """A run config (Flower's, flat) as the run's settings and its run keys, both validated.

    A ``run.*`` key that :class:`RunSettings` does not declare is refused in one line, as
    :meth:`FedpipeConfig.with_overrides` refuses an unknown setting.
    """
    known = set(RunSettings.KEYS.values())
    run_keys = {k: v for k, v in run_config.items() if k.startswith(RUN_PREFIX)}
    for key in run_keys:
        if key not in known:
            raise ValueError(_unknown(f"run key {key!r}", key, known))
    settings = {k: v for k, v in run_config.items() if k not in run_keys}
    return FedpipeConfig().with_overrides(settings), RunSettings.from_run_config(run_keys)
