"""fedpipe's settings tree: typed, validated dataclasses, and the names they accept.

The bottom of fedpipe's layers: it imports nothing else of fedpipe, so anything may read a
setting (and a typo fails before any model, server or process starts).

- one module per section (:mod:`~fedpipe.config.model`, :mod:`~fedpipe.config.pipeline`,
  :mod:`~fedpipe.config.train`, :mod:`~fedpipe.config.data`, :mod:`~fedpipe.config.server`,
  :mod:`~fedpipe.config.federated`, :mod:`~fedpipe.config.privacy`,
  :mod:`~fedpipe.config.device`), each its dataclass and the checks within it;
- :mod:`~fedpipe.config.fedpipe_config`: :class:`FedpipeConfig`, the sections together and the
  checks across them; :mod:`~fedpipe.config.lists`: how list settings are parsed and written;
  :mod:`~fedpipe.config.convert`: values to a setting's type; :mod:`~fedpipe.config.loading`:
  TOML files and ``--set``; :mod:`~fedpipe.config.flower_keys`: Flower's run and node config;
- :mod:`~fedpipe.config.codecs`: codec names (``fp32`` ... ``int4tg128``), parsed without torch;
- :mod:`~fedpipe.config.profiles` and :mod:`~fedpipe.config.profile_spec`: named device and
  link profiles and the inline specs (``100mbit-100ms``) that the emulation takes.
"""

from fedpipe.config.cuts import format_cut, format_cuts, parse_cuts
from fedpipe.config.data import LOSS_ON, OVERLONG, DataConfig
from fedpipe.config.device import DEVICE_DTYPES, DEVICE_WEIGHTS, DeviceConfig
from fedpipe.config.federated import (
    AGGREGATIONS,
    MAX_STALENESS,
    FederatedConfig,
    parse_staleness,
)
from fedpipe.config.fedpipe_config import FedpipeConfig
from fedpipe.config.lists import list_text
from fedpipe.config.loading import load_config, parse_overrides
from fedpipe.config.model import ModelConfig
from fedpipe.config.pipeline import SCHEDULE_NAMES, PipelineConfig
from fedpipe.config.privacy import PrivacyConfig
from fedpipe.config.server import SERVER_WEIGHTS, ServerConfig, is_loopback
from fedpipe.config.train import TrainConfig

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
