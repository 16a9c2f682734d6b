"""Shared test settings: offline, a private model cache, quiet Flower."""

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("FEDPIPE_CACHE", os.path.join(tempfile.gettempdir(), "fedpipe-test-cache"))
