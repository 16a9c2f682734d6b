"""The stage-link defences on real traffic: one device over loopback gRPC, tapped at the server."""

from __future__ import annotations

import torch
from fedpipe_bench.privacy_traffic import record_training

from fedpipe.config import FedpipeConfig, PrivacyConfig, load_config
from fedpipe.messages import Kind
from fedpipe.models import resolve_model


def _tiny_run(privacy: dict[str, float]) -> dict[Kind, dict[tuple[int, int], torch.Tensor]]:
    overrides = {
        "model.name": "tiny-llama",
        "train.batch_size": 4,
        "train.seq_len": 16,
        "pipeline.microbatches": 2,
        "pipeline.schedule": "gpipe",
        **privacy,
    }
    cfg = load_config(None, overrides)
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, 256, (4, 16), generator=gen)
        batches.append({"input_ids": ids, "labels": ids.clone()})
    run = record_training(cfg, resolve_model("tiny-llama"), batches, batches[0]["input_ids"])
    tap = run.tap
    return {
        Kind.ACTIVATION: tap.activations,
        Kind.OUTPUT: tap.outputs,
        Kind.OUTPUT_GRAD: tap.output_grads,
    }


def _same(a: dict, b: dict) -> bool:  # type: ignore[type-arg]
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_defaults_off_traffic_is_bit_identical_and_defences_reach_the_server() -> None:
    default = _tiny_run({})
    assert FedpipeConfig().privacy == PrivacyConfig()  # nothing on unless asked
    # A defence that never bites (clip far above every norm, no noise): the hook runs and the
    # traffic is still bit for bit what an undefended device sends.
    inert = _tiny_run({"privacy.activation_clip": 1e9, "privacy.gradient_clip": 1e9})
    for kind in (Kind.ACTIVATION, Kind.OUTPUT, Kind.OUTPUT_GRAD):
        assert len(default[kind]) == 4  # 2 steps x 2 microbatches
        assert _same(default[kind], inert[kind]), kind
    # Clipping that bites: the server sees the bound.
    clip_a = 0.5 * float(
        torch.cat([a.norm(dim=-1).flatten() for a in default[Kind.ACTIVATION].values()]).median()
    )
    clip_g = 0.5 * float(
        torch.cat([g.norm(dim=-1).flatten() for g in default[Kind.OUTPUT_GRAD].values()]).median()
    )
    clipped = _tiny_run({"privacy.activation_clip": clip_a, "privacy.gradient_clip": clip_g})
    for kind, clip in ((Kind.ACTIVATION, clip_a), (Kind.OUTPUT_GRAD, clip_g)):
        top = max(float(t.norm(dim=-1).max()) for t in clipped[kind].values())
        assert top <= clip * (1 + 1e-5)
    # Noise: the server sees other values than the undefended device sent.
    noised = _tiny_run({"privacy.activation_clip": clip_a, "privacy.activation_noise": 1.0})
    assert not _same(noised[Kind.ACTIVATION], default[Kind.ACTIVATION])
