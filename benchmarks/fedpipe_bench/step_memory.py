"""The device's peak memory over real training steps, against fine-tuning the whole model.

Each setting runs in a fresh child process (``python -m fedpipe_bench.step_memory SPEC``) and
reports its ``ru_maxrss``, the high-water mark of its resident memory: the device's stages
(random weights built from a model's published shape, nothing downloaded) with peft LoRA,
trained by the device runtime for a few steps (forward, backward, AdamW step) against a server
that answers with its input (the device computes and holds what it would against a real one);
and the whole model (``transformers``' LlamaForCausalLM) with peft LoRA, trained on the same
batch in the same microbatches, what a device needs without fedpipe.

A device spec's ``weights`` (``device.weights``) stores its frozen embedding, block linears and
LM head as fp32, bf16, int8 or int4 (fedpipe.split.quant): the stages are then made on the
meta device and each stored weight is packed from random rows a slab at a time, as
``build_device_stages`` packs a model's, so the fp32 weights are never held whole.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, cast

import torch

from fedpipe.config import FedpipeConfig
from fedpipe.edge.runtime import DeviceRuntime
from fedpipe.lora.base import apply_lora, lora_settings
from fedpipe.messages import Kind, StageMsg
from fedpipe.split import HeadStage, TailStage
from fedpipe.split.quant import StoredEmbedding, store_module, stored_modules
from fedpipe.split.stages import rotary_embedding

__all__ = ["MODEL_SHAPES", "WEIGHTS", "StepSpec", "step_memory_report"]

WEIGHTS = ("fp32", "bf16", "int8", "int4")  # device.weights measured (fedpipe.config)

# Published shapes (config.json of HuggingFaceTB/SmolLM2-135M and meta-llama/Llama-3.2-1B);
# rotary scaling left at the default, which changes no memory.
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
    },
    "llama-3.2-1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
    },
}


@dataclass(frozen=True)
class StepSpec:
    """One child's run: which model shape, which side, and the batch it trains on."""

    model: str
    what: str  # "device" (fedpipe's head + tail) or "whole" (the whole model, peft LoRA)
    loss_chunk: int  # train.loss_chunk of the device's tail (0: the full logits)
    head_layers: int
    tail_layers: int
    batch_size: int
    seq_len: int
    microbatches: int
    steps: int
    blocks: int | None = None  # the whole model's blocks (None: the shape's own)
    weights: str = "fp32"  # device.weights of the device's frozen weights


def model_config(spec: StepSpec) -> Any:
    """The Llama config of ``spec.model``'s shape (tied embedding, sdpa attention)."""
    from transformers import LlamaConfig

    shape = dict(MODEL_SHAPES[spec.model])
    if spec.blocks is not None:
        shape["num_hidden_layers"] = spec.blocks
    return LlamaConfig(  # type: ignore[call-arg]  # attn_implementation: a base-config kwarg
        **shape, tie_word_embeddings=True, rms_norm_eps=1e-5, attn_implementation="sdpa"
    )


class _EchoServer:
    """A StageChannel whose server is the identity: OUTPUT is the activation sent, INPUT_GRAD
    the output gradient sent, STEP_DONE comes at once. Replies are fresh tensors, as received."""

    _REPLY = {Kind.ACTIVATION: Kind.OUTPUT, Kind.OUTPUT_GRAD: Kind.INPUT_GRAD}

    def __init__(self) -> None:
        self.inbox: dict[tuple[Kind, int, int], StageMsg] = {}

    def send(self, msg: StageMsg) -> None:
        kind = self._REPLY.get(msg.kind, Kind.STEP_DONE)
        tensor = None if msg.tensor is None else msg.tensor.detach().clone()
        self.inbox[(kind, msg.step, msg.microbatch)] = StageMsg(
            kind, msg.step, msg.microbatch, tensor=tensor
        )

    def ready(self, kind: Kind, step: int, microbatch: int) -> bool:
        return (kind, step, microbatch) in self.inbox

    def receive(self, kind: Kind, step: int, microbatch: int) -> StageMsg:
        return self.inbox.pop((kind, step, microbatch))

    def wait_any(self, timeout: float) -> None:
        return None  # every reply is there as soon as its message is sent


def _batches(spec: StepSpec, vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shape = (spec.batch_size, spec.seq_len)
    return [torch.randint(0, vocab, shape, generator=gen) for _ in range(spec.steps)]


def _device_stages(spec: StepSpec, config: Any) -> tuple[HeadStage, TailStage]:
    """The device's head and tail with random weights, the tail's LM head the embedding."""
    if spec.weights != "fp32":
        head, tail = _stored_stages(spec, config)
    else:
        layers = int(config.num_hidden_layers)
        head = HeadStage(config, range(spec.head_layers))
        tail = TailStage(config, range(layers - spec.tail_layers, layers))
        with torch.no_grad():  # as transformers initialises it (nn.Embedding's N(0, 1) is far)
            head.embedding.weight.normal_(0.0, float(config.initializer_range))
        tail.lm_head.weight = head.embedding.weight  # tied: one tensor, as build_device_stages
    tail.loss_chunk = spec.loss_chunk
    settings = lora_settings(FedpipeConfig())
    for stage in (head, tail):
        stage.requires_grad_(False)
        apply_lora(stage, settings, "llama")
    return head, tail


def _stored_stages(spec: StepSpec, config: Any) -> tuple[HeadStage, TailStage]:
    """The device's stages with their frozen weights stored as ``spec.weights``: made on the
    meta device, each stored weight packed from random rows a slab at a time (the embedding
    N(0, initializer_range), a linear U(+-1/sqrt(in)) as nn.Linear draws it), norms 1."""
    layers = int(config.num_hidden_layers)
    with torch.device("meta"):
        head = HeadStage(config, range(spec.head_layers))
        tail = TailStage(config, range(layers - spec.tail_layers, layers))
    std = float(config.initializer_range)
    for stage in (head, tail):
        for name in stored_modules(stage):
            if stage is tail and name == "lm_head":  # tied: the head's packed embedding
                tied = cast(StoredEmbedding, head.embedding).stored()
                store_module(stage, name, spec.weights, None, tied=tied)
                continue
            module = stage.get_submodule(name)
            width = int(getattr(module, "in_features", getattr(module, "embedding_dim", 0)))
            scale = std if name in ("embed_tokens", "wte") else 1 / math.sqrt(width)
            uniform = name not in ("embed_tokens", "wte")
            store_module(stage, name, spec.weights, _random_rows(name, width, scale, uniform))
        for module in stage.modules():  # what is left on the meta device: norms
            for pname, param in list(module.named_parameters(recurse=False)):
                if param.is_meta:
                    fill = torch.ones if pname == "weight" else torch.zeros
                    setattr(module, pname, torch.nn.Parameter(fill(param.shape)))
        if stage.block_indices:
            stage.rotary_emb = rotary_embedding(config)  # computed buffers
    return head, tail


def _random_rows(
    name: str, width: int, scale: float, uniform: bool
) -> Callable[[int, int], torch.Tensor]:
    """Random fp32 rows [start:stop) of weight ``name``, the same for any slab size."""
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:6], "little")

    def rows(start: int, stop: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed + start)
        if uniform:
            return torch.rand(stop - start, width, generator=gen).mul_(2).sub_(1).mul_(scale)
        return torch.randn(stop - start, width, generator=gen).mul_(scale)

    return rows


def _train_device(spec: StepSpec) -> dict[str, Any]:
    """Train the device's stages for ``spec.steps`` steps: their parameter bytes (stored, the
    tied pair once, LoRA included) and the seconds the steps took."""
    config = model_config(spec)
    head, tail = _device_stages(spec, config)
    start = time.perf_counter()
    _device_steps(spec, head, tail, int(config.vocab_size))
    steps_s = time.perf_counter() - start
    unique = {p.data_ptr(): p for s in (head, tail) for p in s.parameters()}
    nbytes = sum(p.numel() * p.element_size() for p in unique.values())
    return {"param_bytes": nbytes, "steps_s": round(steps_s, 3)}


def _device_steps(spec: StepSpec, head: HeadStage, tail: TailStage, vocab: int) -> list[float]:
    """``spec.steps`` steps of the device runtime (the default schedule, AdamW); their losses."""
    params = [p for s in (head, tail) for p in s.parameters() if p.requires_grad]
    defaults = FedpipeConfig()
    runtime = DeviceRuntime(
        head,
        tail,
        _EchoServer(),
        optimizer=torch.optim.AdamW(params, lr=defaults.train.lr),
        schedule=defaults.pipeline.schedule,
        microbatches=spec.microbatches,
    )
    batches = _batches(spec, vocab)
    losses = [
        runtime.train_step({"input_ids": ids, "labels": ids}, step=step).loss
        for step, ids in enumerate(batches)
    ]
    runtime.finish()
    return losses


def _train_whole(spec: StepSpec) -> dict[str, Any]:
    """Train the whole model with peft LoRA on the same batches and microbatches."""
    from peft import get_peft_model
    from transformers import LlamaForCausalLM

    config = model_config(spec)
    model = get_peft_model(
        LlamaForCausalLM(config), lora_settings(FedpipeConfig()).peft_config("llama")
    )
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=FedpipeConfig().train.lr)
    start = time.perf_counter()
    for ids in _batches(spec, int(config.vocab_size)):
        for part in ids.chunk(spec.microbatches):  # gradient accumulation, mean over the batch
            loss = model(input_ids=part, labels=part).loss
            (loss / spec.microbatches).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    steps_s = time.perf_counter() - start
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"param_bytes": nbytes, "steps_s": round(steps_s, 3)}


def _rss() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _child(spec: StepSpec) -> dict[str, Any]:
    """Run ``spec`` in this (fresh) process: its resident baseline, parameter bytes, peak and
    the seconds its steps took."""
    gc.collect()
    baseline = _rss()  # python, torch and transformers imported, nothing built
    trained = _train_device(spec) if spec.what == "device" else _train_whole(spec)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return {"baseline_rss_bytes": baseline, **trained, "peak_bytes": peak}


def _measure(spec: StepSpec) -> dict[str, Any]:
    """``spec`` run in a fresh child process (its ru_maxrss is its own)."""
    out = subprocess.run(
        [sys.executable, "-m", "fedpipe_bench.step_memory", json.dumps(asdict(spec))],
        check=True,
        capture_output=True,
        text=True,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def step_memory_report(
    specs: list[StepSpec], *, loss_chunk: int, weights: tuple[str, ...] = WEIGHTS
) -> dict[str, Any]:
    """One row per model and device ``weights``: the device's step peak (with the full logits
    too, at fp32), and the whole model's with peft LoRA (measured once per model, the same in
    each of its rows), from the device specs in ``specs`` (one per model)."""
    rows = []
    for spec in specs:
        whole = _measure(_replace(spec, what="whole", loss_chunk=0))
        full = None
        if "fp32" in weights:
            full = _measure(_replace(spec, what="device", loss_chunk=0, weights="fp32"))
        for stored in weights:
            chunked = _measure(_replace(spec, what="device", loss_chunk=loss_chunk, weights=stored))
            rows.append(
                {
                    "model": spec.model,
                    "weights": stored,
                    "device_param_bytes": chunked["param_bytes"],
                    "device_step_peak_bytes": chunked["peak_bytes"],
                    "device_step_peak_full_logits_bytes": (
                        full["peak_bytes"] if full is not None and stored == "fp32" else None
                    ),
                    "whole_param_bytes": whole["param_bytes"],
                    "whole_lora_step_peak_bytes": whole["peak_bytes"],
                    "baseline_rss_bytes": chunked["baseline_rss_bytes"],
                    "whole_blocks": spec.blocks or MODEL_SHAPES[spec.model]["num_hidden_layers"],
                    "device_steps_s": chunked["steps_s"],
                    "whole_steps_s": whole["steps_s"],
                }
            )
    first = specs[0]
    settings = {
        k: getattr(first, k)
        for k in ("head_layers", "tail_layers", "batch_size", "seq_len", "microbatches", "steps")
    }
    return {"loss_chunk": loss_chunk, **settings, "rows": rows}


def _replace(spec: StepSpec, **changes: Any) -> StepSpec:
    return StepSpec(**{**asdict(spec), **changes})


if __name__ == "__main__":
    print(json.dumps(_child(StepSpec(**json.loads(sys.argv[1])))))
