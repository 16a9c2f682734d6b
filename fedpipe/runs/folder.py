"""A run's folder, ``runs/<name>/``: metrics, checkpoints of both sides, summary, traces, plots.

Layout::

    runs/<name>/
      settings.json                  the run's resolved settings (what --resume continues)
      metrics.jsonl                  one JSON record per line, appended as the run goes
      checkpoints/round-0003/        device.safetensors, server.safetensors, state.json
      summary.json                   written at the end (atomically)
      tensorboard/                   TensorBoard event files, written as the run goes
      traces/<name>.json             Chrome traces (see fedpipe.trace)
      plots/<name>.png

A checkpoint is written into a hidden temporary folder next to the final one, its files and
the folder are fsynced, and it is renamed into place (then the parent folder is fsynced), so a
crash or power loss leaves either a complete ``round-NNNN`` or a ``.tmp-*`` folder that
readers ignore; never a half checkpoint that looks complete.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fedpipe.models.cache import fsync_path, write_atomic

__all__ = ["FINGERPRINT_KEY", "Checkpoint", "RunFolder"]

logger = logging.getLogger(__name__)

_ROUND_DIR = re.compile(r"^round-(\d+)$")
_FILES = ("device.safetensors", "server.safetensors", "state.json")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# The key of a checkpoint's state.json that holds the fingerprint of the base model its
# adapters were trained on (fedpipe.models.fingerprint): what `fedpipe export` checks.
FINGERPRINT_KEY = "model_fingerprint"


@dataclass(frozen=True)
class Checkpoint:
    """Both sides' trainable weights and the round state, as saved after ``round``."""

    round: int
    device: dict[str, torch.Tensor]
    server: dict[str, torch.Tensor]
    state: dict
    path: Path


class RunFolder:
    """Everything one run writes, under ``base/name``. One process writes a run folder at a time."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._tail_checked = False

    # -- opening ------------------------------------------------------------------------------
    @classmethod
    def open(cls, base: Path, name: str, *, resume: bool = False) -> RunFolder:
        """Create (or reuse) ``base/name``; refuse to overwrite a run that has checkpoints.

        A folder that exists but holds no checkpoint (an empty folder, or a run that crashed
        before its first checkpoint) is reused. With ``resume=True`` an existing run is reopened
        and `latest_checkpoint` says where to continue from.
        """
        if not _NAME.match(name):
            raise ValueError(
                f"run name {name!r} is not a plain folder name; use letters, digits, '.', '_' "
                "and '-' (e.g. --name tiny-4dev)"
            )
        run = cls(Path(base) / name)
        rounds = run._round_dirs()
        if rounds and not resume:
            raise ValueError(
                f"run folder {run.path} already has checkpoints (rounds {min(rounds)}.."
                f"{max(rounds)}); pass --resume to continue it, or pick another --name"
            )
        run.checkpoints_dir.mkdir(parents=True, exist_ok=True)
        return run

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / "checkpoints"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def summary_path(self) -> Path:
        return self.path / "summary.json"

    @property
    def settings_path(self) -> Path:
        return self.path / "settings.json"

    # -- settings -----------------------------------------------------------------------------
    def save_settings(self, flat: dict[str, Any]) -> Path:
        """Record the run's resolved settings (``{"section.key": value}``), atomically."""
        write_atomic(self.settings_path, json.dumps(flat, indent=2, sort_keys=True) + "\n")
        return self.settings_path

    def load_settings(self) -> dict[str, Any] | None:
        """The recorded settings, or None for a run that has none (an older run folder)."""
        if not self.settings_path.is_file():
            return None
        data = json.loads(self.settings_path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError(f"{self.settings_path} holds {type(data).__name__}, not settings")
        return data

    def trace_path(self, name: str) -> Path:
        """Where a Chrome trace called ``name`` goes (``traces/<name>.json``); the folder exists."""
        return self._artifact_path("traces", name, ".json")

    def plot_path(self, name: str) -> Path:
        """Where a plot called ``name`` goes (``plots/<name>.png``); the folder exists."""
        return self._artifact_path("plots", name, ".png")

    def _artifact_path(self, sub: str, name: str, suffix: str) -> Path:
        if not name or "/" in name or "\\" in name or name in (".", ".."):
            raise ValueError(f"{sub[:-1]} name {name!r} must be a plain file name, not a path")
        folder = self.path / sub
        folder.mkdir(parents=True, exist_ok=True)
        return folder / (name if Path(name).suffix else name + suffix)

    # -- metrics ------------------------------------------------------------------------------
    def log_metrics(self, record: dict) -> None:
        """Append ``record`` as one JSON line, with ``time`` (unix seconds) unless it has one."""
        line = json.dumps({"time": time.time(), **record}, default=_json_default)
        with self._lock, self.metrics_path.open("a", encoding="utf-8") as f:
            if not self._tail_checked:
                # A crash can leave a torn last line; start on a fresh line so ours stays whole.
                if not self._ends_with_newline():
                    f.write("\n")
                self._tail_checked = True
            f.write(line + "\n")
            f.flush()

    def _ends_with_newline(self) -> bool:
        try:
            with self.metrics_path.open("rb") as f:
                f.seek(0, os.SEEK_END)
                if f.tell() == 0:
                    return True
                f.seek(-1, os.SEEK_END)
                return f.read(1) == b"\n"
        except FileNotFoundError:
            return True

    def history(self) -> list[dict]:
        """The records of metrics.jsonl in order; a torn (unparseable) line is skipped."""
        if not self.metrics_path.exists():
            return []
        lines = self.metrics_path.read_text(encoding="utf-8").splitlines()
        records = []
        for i, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                if i != len(lines):  # the last line is torn by a crash mid-write; others are odd
                    logger.warning("%s line %d is not JSON; skipped", self.metrics_path, i)
        return records

    # -- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(
        self,
        round_: int,
        *,
        device: dict[str, torch.Tensor],
        server: dict[str, torch.Tensor],
        state: dict,
    ) -> Path:
        """Write ``checkpoints/round-NNNN/`` atomically; return its path.

        Saving a round that already exists replaces it (a resumed run repeating a round).
        """
        if round_ < 0:
            raise ValueError(f"round must be >= 0, got {round_}")
        state_text = _state_json(state)  # fail before touching the disk
        final = self._round_path(round_)
        self.checkpoints_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=self.checkpoints_dir))
        try:
            save_file(_to_cpu(device, "device"), str(tmp / "device.safetensors"))
            save_file(_to_cpu(server, "server"), str(tmp / "server.safetensors"))
            (tmp / "state.json").write_text(state_text, encoding="utf-8")
            for name in _FILES:
                fsync_path(tmp / name)
            fsync_path(tmp)  # the folder's entries
            _replace_dir(tmp, final)
            fsync_path(self.checkpoints_dir)  # the rename
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def load_checkpoint(self, round_: int) -> Checkpoint:
        """The checkpoint of ``round_``: FileNotFoundError if absent, ValueError if corrupt."""
        path = self._round_path(round_)
        if not path.is_dir():
            have = sorted(self._round_dirs())
            raise FileNotFoundError(
                f"no checkpoint for round {round_} in {self.checkpoints_dir} (have rounds {have})"
            )
        missing = [f for f in _FILES if not (path / f).is_file()]
        if missing:
            raise ValueError(f"checkpoint {path} is incomplete: missing {', '.join(missing)}")
        try:
            state = json.loads((path / "state.json").read_text(encoding="utf-8"))
            device = load_file(str(path / "device.safetensors"), device="cpu")
            server = load_file(str(path / "server.safetensors"), device="cpu")
        except Exception as e:  # safetensors raises its own error types for torn files
            raise ValueError(f"checkpoint {path} is corrupt: {e}") from e
        if not isinstance(state, dict):
            raise ValueError(
                f"checkpoint {path}: state.json holds {type(state).__name__}, not dict"
            )
        return Checkpoint(round=round_, device=device, server=server, state=state, path=path)

    def latest_checkpoint(self) -> Checkpoint | None:
        """The highest round whose checkpoint loads; incomplete or corrupt ones are skipped."""
        for round_ in sorted(self._round_dirs(), reverse=True):
            try:
                return self.load_checkpoint(round_)
            except (ValueError, FileNotFoundError) as e:
                logger.warning("skipping checkpoint of round %d: %s", round_, e)
        return None

    def rounds(self) -> list[int]:
        """Rounds that have a checkpoint folder (complete or not), in order."""
        return sorted(self._round_dirs())

    def _round_path(self, round_: int) -> Path:
        return self.checkpoints_dir / f"round-{round_:04d}"

    def _round_dirs(self) -> list[int]:
        """Rounds that have a ``round-NNNN`` folder (complete or not); tmp folders excluded."""
        if not self.checkpoints_dir.is_dir():
            return []
        rounds = []
        for p in self.checkpoints_dir.iterdir():
            m = _ROUND_DIR.match(p.name)
            if m and p.is_dir():
                rounds.append(int(m.group(1)))
        return rounds

    # -- summary ------------------------------------------------------------------------------
    def write_summary(self, summary: dict) -> Path:
        """Write summary.json (indented) atomically; return its path."""
        text = json.dumps(summary, indent=2, default=_json_default) + "\n"
        write_atomic(self.summary_path, text)
        return self.summary_path

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"


def _to_cpu(tensors: dict[str, torch.Tensor], side: str) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU copies; copies also untie tensors that share storage."""
    out = {}
    for key, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{side} checkpoint entry {key!r} is {type(t).__name__}, not a tensor")
        out[key] = t.detach().to("cpu").clone(memory_format=torch.contiguous_format)
    return out


def _state_json(state: dict) -> str:
    try:
        return json.dumps(state, indent=2, default=_json_default) + "\n"
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"checkpoint state must be JSON-serialisable (numbers, strings, lists, dicts): {e}"
        ) from e


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``; an existing ``dst`` is moved aside first, then deleted."""
    if not dst.exists():
        os.replace(src, dst)
        return
    old = Path(tempfile.mkdtemp(prefix=f".tmp-old-{dst.name}-", dir=dst.parent))
    os.replace(dst, old / dst.name)
    os.replace(src, dst)
    shutil.rmtree(old, ignore_errors=True)


def _json_default(value: Any) -> Any:
    """JSON for values training code tends to log: 0-d tensors, numpy scalars, paths."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")
