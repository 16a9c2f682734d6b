"""TensorBoard event files of a run, written as the run goes (``runs/<name>/tensorboard/``).

The ServerApp feeds every metrics record it logs to :class:`Board`; ``tensorboard --logdir
runs/`` then shows the run live. Steps are rounds. Tags:

- ``eval/loss``, ``eval/perplexity``: held-out loss of the global model after each round;
- ``train/loss``, ``round/devices_trained``, ``round/devices_failed``, ``round/wall_s``,
  ``round/bytes_up``, ``round/bytes_down``: one point per round;
- ``device/<name>/step_time_s``, ``.../bytes_up``, ``.../bytes_down``, ``.../train_loss``: per
  device (``<name>`` is ``p<partition>-<profile>``);
- ``failures/total``: failed devices so far (with the reasons as text under ``failures``);
- with StageServer replicas, ``replica/<k>/mb_per_s`` and ``replica/<k>/sessions``: each
  replica's training microbatches per second in the round and the sessions it held (its own
  counts).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

__all__ = ["Board", "device_tag"]

log = logging.getLogger(__name__)

# metrics.jsonl key of a round (eval) record -> TensorBoard tag
_ROUND_TAGS = {
    "eval_loss": "eval/loss",
    "eval_ppl": "eval/perplexity",
    "eval_exact_match": "eval/exact_match",  # federated.eval_generate
    "eval_contains": "eval/contains",
    "train_loss": "train/loss",
    "devices_trained": "round/devices_trained",
    "devices_failed": "round/devices_failed",
    "wall_s": "round/wall_s",
    "bytes_up": "round/bytes_up",
    "bytes_down": "round/bytes_down",
}
_DEVICE_TAGS = {
    "step_time_median_s": "step_time_s",
    "bytes_up": "bytes_up",
    "bytes_down": "bytes_down",
    "train_loss": "train_loss",
}


def device_tag(partition: Any, profile: Any) -> str:
    """``p3-phone-lte``: a device's name as a TensorBoard tag component."""
    name = f"p{partition}" + (f"-{profile}" if profile else "")
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


class Board:
    """Writes scalars from metrics records; a no-op (with one warning) without tensorboard."""

    def __init__(self, log_dir: Path) -> None:
        self.failures = 0
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # tensorboard is a dependency; this is a broken install
            log.warning("no TensorBoard event files: %s (pip install tensorboard)", exc)
            self.writer = None
            return
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        """Add the scalars of one record and flush, so a live TensorBoard sees them."""
        if self.writer is None:
            return
        event, step = record.get("event"), int(record.get("round", 0))
        if event == "eval":
            for key, tag in _ROUND_TAGS.items():
                if isinstance(record.get(key), int | float):
                    self.writer.add_scalar(tag, float(record[key]), step)
            for key, name in (
                ("replica_mb_per_s", "mb_per_s"),
                ("sessions_per_replica", "sessions"),
            ):
                for k, value in enumerate(record.get(key) or ()):
                    self.writer.add_scalar(f"replica/{k}/{name}", float(value), step)
        elif event == "train":
            device = device_tag(record.get("partition", "?"), record.get("profile"))
            for key, tag in _DEVICE_TAGS.items():
                if isinstance(record.get(key), int | float):
                    self.writer.add_scalar(f"device/{device}/{tag}", float(record[key]), step)
        elif event == "failure":
            self.failures += 1
            self.writer.add_scalar("failures/total", self.failures, step)
            self.writer.add_text(
                "failures", f"round {step}: {record.get('device')}: {record.get('reason')}", step
            )
        else:
            return
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
