"""The stage-link defences on real traffic: one device over loopback gRPC, tapped at the server."""

from __future__ import annotations

import torch
from fedpipe_bench.privacy_traffic import RunResult, record_training

from fedpipe.config import FedpipeConfig, PrivacyConfig, load_config
from fedpipe.messages import Kind
from fedpipe.models import resolve_model


def _record(settings: dict[str, float], steps: int = 2) -> RunResult:
    """``steps`` steps of the tiny model on seeded random tokens, tapped at the server."""
    overrides = {
        "model.name": "tiny-llama",
        "train.batch_size": 4,
        "train.seq_len": 16,
        "pipeline.microbatches": 2,
        "pipeline.schedule": "gpipe",
        **settings,
    }
    cfg = load_config(None, overrides)
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(steps):
        ids = torch.randint(0, 256, (4, 16), generator=gen)
        batches.append({"input_ids": ids, "labels": ids.clone()})
    return record_training(cfg, resolve_model("tiny-llama"), batches, batches[0]["input_ids"])


def _tiny_run(privacy: dict[str, float]) -> dict[Kind, dict[tuple[int, int], torch.Tensor]]:
    tap = _record(privacy).tap
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


def test_token_noise_reaches_the_server_scaled_to_each_token() -> None:
    """The first step's activations come from the same adapters in both runs: what the server
    received differs from the undefended run's by noise of ``noise * |x_t|`` per coordinate,
    the first token's large vector included (nothing is clipped)."""
    default = _tiny_run({})
    noised = _tiny_run({"privacy.mechanism": "token", "privacy.activation_noise": 0.1})
    for mb in (0, 1):
        clean, sent = default[Kind.ACTIVATION][(0, mb)], noised[Kind.ACTIVATION][(0, mb)]
        norms = clean.norm(dim=-1)
        per_coord = (sent - clean).pow(2).mean(dim=(0, 2)).sqrt() / norms.mean(dim=0)
        assert torch.allclose(per_coord, torch.full_like(per_coord, 0.1), rtol=0.35), per_coord
    # the server computed on what it received: its outputs, and so the gradients, moved too
    assert not _same(noised[Kind.OUTPUT_GRAD], default[Kind.OUTPUT_GRAD])
    clear = _tiny_run({"privacy.mechanism": "token", "privacy.gradient_noise": 0.0})
    assert _same(clear[Kind.ACTIVATION], default[Kind.ACTIVATION])  # strength 0: untouched


def test_the_decorrelation_penalty_trains_the_head_through_the_pipelined_path() -> None:
    """Over loopback gRPC, the penalty's gradient joins the server's in the head's backward:
    the trained head's outputs tell its tokens apart less than an undefended run's head does."""
    from fedpipe.privacy import distance_correlation

    def run(extra: dict[str, float]) -> tuple[float, RunResult]:
        result = _record({"train.lr": 1e-2, **extra}, steps=4)
        ids = torch.cat([b["input_ids"] for b in result.batches])
        with torch.no_grad():
            hidden = result.released.head(ids)
        return float(distance_correlation(ids.reshape(-1), hidden.reshape(-1, 64))), result

    plain, plain_run = run({})
    hidden, hidden_run = run({"privacy.decorrelation": 10.0})
    assert plain_run.decorrelation is None  # nothing penalised, nothing reported
    assert hidden_run.decorrelation is not None and 0 < hidden_run.decorrelation <= 1
    assert hidden < plain - 0.1, (plain, hidden)


def test_resampled_labels_change_only_the_gradients_sent_up() -> None:
    """Step 0 runs on the same adapters in both runs: the activations and the server's outputs
    are bit for bit the undefended run's, the output gradients are not (some labels lie)."""
    default = _tiny_run({})
    resampled = _tiny_run({"privacy.label_resample": 0.5})
    for mb in (0, 1):
        key = (0, mb)
        assert torch.equal(resampled[Kind.ACTIVATION][key], default[Kind.ACTIVATION][key])
        assert torch.equal(resampled[Kind.OUTPUT][key], default[Kind.OUTPUT][key])
        assert not torch.equal(resampled[Kind.OUTPUT_GRAD][key], default[Kind.OUTPUT_GRAD][key])
