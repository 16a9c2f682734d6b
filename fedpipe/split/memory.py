"""How much memory the device side of a split needs, compared with the whole model.

Parameter bytes come from the stage definitions (built on the meta device, so free). Resident
memory is measured honestly: each variant is built in a fresh subprocess, every tensor is touched
(so memory-mapped weights are paged in, as a forward pass would), and the growth of its RSS is
reported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import torch
from transformers.pytorch_utils import Conv1D

from fedpipe.models.loading import load_config
from fedpipe.models.weights import WeightFiles
from fedpipe.split.layout import SplitLayout
from fedpipe.split.quant import stored_bytes, stored_modules
from fedpipe.split.stages import HeadStage, TailStage

__all__ = ["device_memory_report", "device_param_bytes", "device_param_report"]

_PROBE = r"""
import gc, json, resource, sys
import torch
from pathlib import Path
torch.set_num_threads(1)
from fedpipe.models import load_causal_lm
from fedpipe.split import SplitLayout, build_device_stages

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0

folder, what, layout = Path(sys.argv[1]), sys.argv[2], SplitLayout(**json.loads(sys.argv[3]))
gc.collect()
before = rss()
built = build_device_stages(folder, layout) if what == "device" else load_causal_lm(folder)
modules = [m for m in (built if isinstance(built, tuple) else (built,)) if m is not None]
with torch.no_grad():  # touch every tensor: memory-mapped weights count once paged in
    for module in modules:
        for tensor in module.state_dict().values():
            tensor.float().sum()
gc.collect()
after = rss()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"rss_growth": after - before, "peak_growth": max(0, peak - before)}))
"""


def device_param_report(folder: Path, layout: SplitLayout) -> dict[str, Any]:
    """Device-side vs whole-model fp32 parameter bytes (from the stage definitions and the
    weight files' headers: nothing is loaded)."""
    folder = Path(folder)
    device_bytes = device_param_bytes(folder, layout)
    model_bytes = _file_param_bytes(folder)
    return {
        "plan": str(layout),
        "device_param_bytes": device_bytes,
        "model_param_bytes": model_bytes,
        "param_fraction": device_bytes / model_bytes,
    }


def device_memory_report(folder: Path, layout: SplitLayout) -> dict[str, Any]:
    """Device-side vs whole-model memory: fp32 parameter bytes and measured RSS growth."""
    folder = Path(folder)
    params = device_param_report(folder, layout)  # first: a broken weight file says so here
    device = _measure(folder, layout, "device")
    whole = _measure(folder, layout, "model")
    return {
        **params,
        "device_rss_bytes": device["rss_growth"],
        "model_rss_bytes": whole["rss_growth"],
        "rss_fraction": device["rss_growth"] / max(1, whole["rss_growth"]),
        "device_peak_rss_bytes": device["peak_growth"],
        "model_peak_rss_bytes": whole["peak_growth"],
    }


def device_param_bytes(folder: Path, layout: SplitLayout, weights: str = "fp32") -> int:
    """Bytes of the device's head (+ tail) parameters, a tied embedding counted once: fp32, or
    with the embedding, block linears and LM head stored as ``weights`` (``device.weights``,
    scales included; fedpipe.split.quant)."""
    config = load_config(folder)
    with torch.device("meta"):
        stages: list[torch.nn.Module] = [HeadStage(config, layout.head_blocks)]
        if layout.mode == "u":
            stages.append(TailStage(config, layout.tail_blocks))
    tied = layout.mode == "u" and _tied(folder, config)
    if weights != "fp32":
        return _stored_param_bytes(stages, weights, tied=tied)
    numel = sum(p.numel() for s in stages for p in s.parameters())
    if tied:
        numel -= cast(TailStage, stages[1]).lm_head.weight.numel()  # shares the head's embedding
    return numel * 4


def _stored_param_bytes(stages: list[torch.nn.Module], weights: str, *, tied: bool) -> int:
    """``device_param_bytes`` of meta ``stages`` whose frozen weights are stored as ``weights``."""
    total = 0
    for index, stage in enumerate(stages):
        stored = set(stored_modules(stage))
        for name, module in stage.named_modules():
            own = module.named_parameters(recurse=False)
            for pname, param in own:
                if name in stored and pname == "weight":
                    if tied and index == 1 and name == "lm_head":
                        continue  # the head's embedding, stored once
                    rows, width = param.shape
                    if isinstance(module, Conv1D):  # GPT-2 stores (in, out)
                        rows, width = width, rows
                    total += stored_bytes(int(rows), int(width), weights)
                else:
                    total += param.numel() * 4
    return total


def _file_param_bytes(folder: Path) -> int:
    """fp32 bytes of every tensor in model.safetensors (a tied LM head is stored once)."""
    files = WeightFiles(folder)
    return sum(int(torch.Size(files.shape(key)).numel()) for key in files.keys()) * 4


def _tied(folder: Path, config: Any) -> bool:
    if getattr(config, "tie_word_embeddings", False):
        return True
    return "lm_head.weight" not in WeightFiles(folder).keys()


def _measure(folder: Path, layout: SplitLayout, what: str) -> dict[str, int]:
    fields = {k: getattr(layout, k) for k in ("num_layers", "head_layers", "tail_layers", "mode")}
    repo_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo_root, env.get("PYTHONPATH")]))
    args = [sys.executable, "-c", _PROBE, str(folder), what, json.dumps(fields)]
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"memory probe ({what}) failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
