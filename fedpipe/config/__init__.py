"""fedpipe's settings tree: typed, validated dataclasses, and the names they accept.

The bottom of fedpipe's layers: it imports nothing else of fedpipe, so anything may read a
setting (and a typo fails before any model, server or process starts).

- :mod:`~fedpipe.config.settings`: the sections (``model``, ``pipeline``, ``train``, ``data``,
  ``server``, ``federated``, ``privacy``, ``device``) and loading them from TOML, ``--set``
  and Flower;
- :mod:`~fedpipe.config.codecs`: codec names (``fp32`` ... ``int4tg128``), parsed without torch;
- :mod:`~fedpipe.config.profiles` and :mod:`~fedpipe.config.profile_spec`: named device and
  link profiles and the inline specs (``100mbit-100ms``) that the emulation takes.
"""

from fedpipe.config.settings import (
    AGGREGATIONS,
    DEVICE_DTYPES,
    DEVICE_WEIGHTS,
    LOSS_ON,
    MAX_STALENESS,
    OVERLONG,
    SCHEDULE_NAMES,
    SERVER_WEIGHTS,
    DataConfig,
    DeviceConfig,
    FederatedConfig,
    FedpipeConfig,
    ModelConfig,
    PipelineConfig,
    PrivacyConfig,
    ServerConfig,
    TrainConfig,
    format_cut,
    format_cuts,
    is_loopback,
    list_text,
    load_config,
    parse_cuts,
    parse_overrides,
    parse_staleness,
)

__all__ = [
    "AGGREGATIONS",
    "DEVICE_DTYPES",
    "DEVICE_WEIGHTS",
    "MAX_STALENESS",
    "LOSS_ON",
    "OVERLONG",
    "SCHEDULE_NAMES",
    "SERVER_WEIGHTS",
    "DataConfig",
    "DeviceConfig",
    "FederatedConfig",
    "FedpipeConfig",
    "ModelConfig",
    "PipelineConfig",
    "PrivacyConfig",
    "ServerConfig",
    "is_loopback",
    "TrainConfig",
    "format_cut",
    "format_cuts",
    "list_text",
    "load_config",
    "parse_cuts",
    "parse_overrides",
    "parse_staleness",
]
