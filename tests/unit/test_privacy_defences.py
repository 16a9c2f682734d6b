"""The defences beyond clip-and-noise: token-scaled noise, the head's decorrelation penalty, and
each device's own defences (``privacy.devices``, ``fedpipe client --privacy``)."""

from __future__ import annotations

import pytest
import torch
from harness.close import assert_close_to_scale

from fedpipe.config import FedpipeConfig, PrivacyConfig, load_config
from fedpipe.config.privacy_spec import OFF, parse_privacy_spec, parse_privacy_specs
from fedpipe.messages import Kind
from fedpipe.privacy import (
    Decorrelation,
    LabelResample,
    LinkAccountant,
    LinkDefence,
    TokenNoise,
    distance_correlation,
)
from fedpipe.split.stages import shifted_loss_sum


# -- settings ----------------------------------------------------------------------------------
def test_the_mechanism_is_checked_with_both_values_named() -> None:
    with pytest.raises(ValueError, match="privacy.mechanism must be one of clip, token, token-dim"):
        load_config(None, {"privacy.mechanism": "laplace"})
    with pytest.raises(ValueError, match="mechanism = token .* privacy.activation_clip = 2.0"):
        load_config(
            None,
            {
                "privacy.mechanism": "token",
                "privacy.activation_clip": 2,
                "privacy.activation_noise": 1,
            },
        )
    with pytest.raises(ValueError, match="privacy.decorrelation must be >= 0"):
        load_config(None, {"privacy.decorrelation": -1})
    # token noise needs no clip; the clip mechanism still does
    cfg = load_config(None, {"privacy.mechanism": "token-dim", "privacy.gradient_noise": 0.1})
    assert cfg.privacy.link_defended and not PrivacyConfig().link_defended
    with pytest.raises(ValueError, match="set privacy.mechanism = token"):
        load_config(None, {"privacy.gradient_noise": 0.1})


def test_decorrelation_is_refused_where_the_head_has_no_graph_to_train() -> None:
    with pytest.raises(ValueError, match="recompute_head .* privacy.decorrelation > 0"):
        load_config(None, {"pipeline.recompute_head": True, "privacy.decorrelation": 1})
    with pytest.raises(ValueError, match="pipeline.device_trains = false freezes it"):
        load_config(None, {"pipeline.device_trains": False, "privacy.decorrelation": 1})
    # token noise is a constant added to the head's output: recompute gives the same gradient
    load_config(
        None,
        {
            "pipeline.recompute_head": True,
            "privacy.mechanism": "token",
            "privacy.activation_noise": 0.1,
        },
    )


def test_a_device_spec_names_the_bad_key_or_value() -> None:
    assert parse_privacy_spec("", "--privacy") == {}
    assert parse_privacy_spec(" off ", "--privacy") == OFF
    assert parse_privacy_spec("mechanism=token, activation_noise=0.1", "--privacy") == {
        "mechanism": "token",
        "activation_noise": 0.1,
    }
    with pytest.raises(ValueError, match="unknown key 'activation_nose'.*'activation_noise'"):
        parse_privacy_spec("activation_nose=0.1", "--privacy")
    with pytest.raises(ValueError, match="activation_noise must be a number, got 'lots'"):
        parse_privacy_spec("activation_noise=lots", "--privacy")
    with pytest.raises(ValueError, match="mechanism must be one of .* got 'laplace'"):
        parse_privacy_spec("mechanism=laplace", "--privacy")
    with pytest.raises(ValueError, match="'decorrelation' is not key=value"):
        parse_privacy_spec("decorrelation", "--privacy")
    with pytest.raises(ValueError, match="'decorrelation' is given twice"):
        parse_privacy_spec("decorrelation=1,decorrelation=2", "--privacy")
    assert parse_privacy_specs("off; decorrelation=1;", "privacy.devices") == (
        OFF,
        {"decorrelation": 1.0},
        {},
    )


def test_privacy_devices_cycle_over_partitions_on_top_of_the_run() -> None:
    cfg = load_config(
        None,
        {
            "privacy.mechanism": "token",
            "privacy.activation_noise": 0.05,
            "privacy.devices": "off; ; decorrelation=2,activation_noise=0.2",
        },
    )
    assert cfg.device_privacy(0) == OFF and cfg.device_privacy(1) == {}
    assert cfg.device_privacy(3) == OFF  # cycled
    assert cfg.device_privacy(-1) == {}  # the evaluator
    off = cfg.for_device_privacy(cfg.device_privacy(0)).privacy
    assert not off.link_defended and off.decorrelation == 0
    assert cfg.for_device_privacy(cfg.device_privacy(1)) is cfg  # the run's own
    own = cfg.for_device_privacy(cfg.device_privacy(2)).privacy
    assert (own.mechanism, own.activation_noise, own.decorrelation) == ("token", 0.2, 2.0)
    assert own.devices == ()  # a device's settings hold no list of others
    # an entry that does not fit the run is refused before anything starts
    with pytest.raises(ValueError, match="privacy.devices entry .*activation_clip"):
        load_config(None, {"privacy.mechanism": "token", "privacy.devices": "activation_clip=1"})
    with pytest.raises(ValueError, match="recompute_head .* privacy.decorrelation"):
        load_config(None, {"pipeline.recompute_head": True, "privacy.devices": "; decorrelation=1"})
    # a deployed device's own spec (`fedpipe client --privacy`) is checked the same way
    with pytest.raises(ValueError, match="unknown key 'noise'"):
        FedpipeConfig().for_device_privacy("noise=1")


def test_fedpipe_client_privacy_flag_reaches_the_node_config_and_is_checked() -> None:
    from fedpipe.cli.client import client_setup, node_config
    from fedpipe.cli.parser import build_parser
    from fedpipe.cli.preflight import SettingsError, check_client

    base = ["client", "--superlink", "127.0.0.1:9"]
    args = build_parser().parse_args([*base, "--privacy", "decorrelation=0.5"])
    assert node_config(client_setup(args))["privacy"] == "decorrelation=0.5"
    assert "privacy" not in node_config(client_setup(build_parser().parse_args(base)))
    args = build_parser().parse_args([*base, "--privacy", "mechanism=token,activation_clip=1"])
    with pytest.raises(SettingsError, match="--privacy .*: privacy.mechanism = token .* clip"):
        check_client(client_setup(args))


def test_fedpipe_clients_start_up_line_names_its_own_settings() -> None:
    """A device's --privacy (and cut, profile) is said when it starts: nothing else confirms a
    defence that reports no figure (label_resample alone)."""
    from fedpipe.cli.client import client_setup, own_settings
    from fedpipe.cli.parser import build_parser

    base = ["client", "--superlink", "127.0.0.1:9"]
    assert own_settings(client_setup(build_parser().parse_args(base))) == ""
    args = [*base, "--privacy", "label_resample=0.5", "--cut", "2+1", "--profile", "phone-lte"]
    assert own_settings(client_setup(build_parser().parse_args(args))) == (
        "profile phone-lte, cut 2+1, privacy label_resample=0.5"
    )


# -- token-scaled noise ------------------------------------------------------------------------
def test_token_noise_is_scaled_to_each_token_and_clips_nothing() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, 32, generator=gen) * torch.logspace(-2, 2, 64).reshape(1, 64, 1)
    channel = TokenNoise(0.1, gen, per_dim=False)
    noise = channel(x) - x
    ratio = noise.std(dim=(0, 2)) / x.norm(dim=-1).mean(dim=0)  # per position: std / norm
    assert torch.allclose(ratio, torch.full_like(ratio, 0.1), rtol=0.15)
    assert TokenNoise(0.0, gen, per_dim=False)(x) is x


def test_token_dim_noise_follows_the_energy_of_each_dimension() -> None:
    gen = torch.Generator().manual_seed(0)
    scales = torch.tensor([10.0, 1.0, 1.0, 0.1] * 8)  # (32,) dimensions of unequal energy
    x = torch.randn(16, 64, 32, generator=gen) * scales
    shaped = TokenNoise(0.1, gen, per_dim=True)(x) - x
    flat = TokenNoise(0.1, gen, per_dim=False)(x) - x
    signal = x.std(dim=(0, 1))
    snr_shaped = signal / shaped.std(dim=(0, 1))  # per dimension
    snr_flat = signal / flat.std(dim=(0, 1))
    assert float(snr_shaped.max() / snr_shaped.min()) < 1.5  # about the same in every dimension
    assert float(snr_flat.max() / snr_flat.min()) > 50  # flat noise drowns the quiet ones
    # the same energy as `token` in all: sum over dimensions of the variance
    assert float(shaped.pow(2).mean()) == pytest.approx(float(flat.pow(2).mean()), rel=0.1)


def test_token_noise_is_a_constant_in_the_graph_and_has_no_epsilon() -> None:
    cfg = load_config(
        None,
        {
            "privacy.mechanism": "token",
            "privacy.activation_noise": 0.3,
            "privacy.gradient_noise": 0.3,
        },
    ).privacy
    defence = LinkDefence.from_config(cfg, seed=0)
    assert defence is not None and set(defence.channels) == {Kind.ACTIVATION, Kind.OUTPUT_GRAD}
    h = torch.randn(2, 4, 8, requires_grad=True)
    defence(Kind.ACTIVATION, h).sum().backward()
    assert h.grad is not None and torch.equal(h.grad, torch.ones_like(h))  # identity backward
    assert LinkAccountant.from_config(cfg, seq_len=16) is None  # nothing bounded: no guarantee
    # the attacker's reproduction (its own seed) draws other noise than the device's
    other = LinkDefence.from_config(cfg, seed=1)
    assert other is not None
    x = torch.randn(2, 4, 8)
    assert not torch.equal(defence(Kind.ACTIVATION, x), other(Kind.ACTIVATION, x))


# -- the head's decorrelation penalty ----------------------------------------------------------
def test_distance_correlation_is_one_for_a_lookup_and_zero_without_spread() -> None:
    ids = torch.randint(0, 50, (200,), generator=torch.Generator().manual_seed(0))
    table = torch.nn.functional.one_hot(torch.arange(50)).float()  # orthogonal rows
    assert float(distance_correlation(ids, table[ids])) == pytest.approx(1.0, abs=1e-4)
    same = torch.zeros(30, dtype=torch.long)
    assert float(distance_correlation(same, torch.randn(30, 8))) == 0.0
    noise = torch.randn(200, 50, generator=torch.Generator().manual_seed(1))
    independent = float(distance_correlation(ids, noise))  # the sample statistic's bias
    assert independent < 0.7 < float(distance_correlation(ids, table[ids] * 3 + noise * 0.1))
    with pytest.raises(ValueError, match="3 token ids for 4 hidden states"):
        distance_correlation(ids[:3], noise[:4])


def test_the_penalty_has_a_gradient_that_lowers_it() -> None:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8, (2, 32), generator=gen)
    table = torch.randn(8, 16, generator=gen)
    mix = torch.zeros(16, 16, requires_grad=True)  # a trainable map, as an adapter would be
    penalty = Decorrelation(1.0, seed=0)
    noise = torch.randn(2, 32, 16, generator=gen)
    values = []
    optimizer = torch.optim.Adam([mix], lr=0.1)
    for _ in range(40):
        hidden = table[ids] + noise @ mix  # the token's row plus what the map adds
        loss = penalty(ids, hidden, 1.0)
        optimizer.zero_grad()
        loss.backward()
        assert mix.grad is not None and bool(torch.isfinite(mix.grad).all())
        optimizer.step()
        values.append(float(loss.detach()))
    assert values[-1] < 0.5 * values[0]
    assert penalty.take_mean() == pytest.approx(sum(values) / len(values))
    assert penalty.take_mean() is None  # reset by the call before
    with pytest.raises(ValueError, match="weight > 0"):
        Decorrelation(0.0)


# -- resampled labels --------------------------------------------------------------------------
class _ToyTail(torch.nn.Module):
    """A tail with the stage's interface: ``logits(x)``, and the loss through ``forward``."""

    def __init__(self, width: int = 8, vocab: int = 5) -> None:
        super().__init__()
        self.head = torch.nn.Linear(width, vocab)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


def test_resampled_labels_replace_the_asked_share_with_draws_from_the_prediction() -> None:
    resample = LabelResample(0.7, seed=0)
    logits = torch.full((64, 33, 5), -20.0)
    logits[..., 3] = 20.0  # the model is sure of token 3 everywhere
    labels = torch.randint(0, 3, (64, 33), generator=torch.Generator().manual_seed(1))
    labels[:, 20:] = -100  # padding: never a label, never resampled
    out = resample.relabel(logits, labels)
    assert torch.equal(out[:, 0], labels[:, 0]) and bool((out[:, 20:] == -100).all())
    changed = out[:, 1:20] != labels[:, 1:20]
    assert float(changed.float().mean()) == pytest.approx(0.7, abs=0.05)
    assert bool((out[:, 1:20][changed] == 3).all())  # drawn from the prediction
    with pytest.raises(ValueError, match="0 < rate < 1"):
        LabelResample(1.0)


def test_the_gradient_sent_up_is_unbiased_and_the_tail_trains_on_the_true_labels() -> None:
    torch.manual_seed(0)
    tail = _ToyTail()
    x0 = torch.randn(4, 6, 8)
    labels = torch.randint(0, 5, (4, 6))
    tokens = 4 * 5
    # the true gradients, by plain autograd
    x = x0.clone().requires_grad_(True)
    loss, _ = shifted_loss_sum(tail.logits(x), labels)
    (loss / tokens).backward()
    true_x, true_w = x.grad.clone(), tail.head.weight.grad.clone()
    tail.zero_grad()
    resample = LabelResample(0.5, seed=0)
    sent_sum = torch.zeros_like(x0)
    draws = 2000
    for _ in range(draws):
        x = x0.clone().requires_grad_(True)
        loss_sum, sent = resample(tail, x, labels, tokens)
        sent_sum += sent
        true_loss = float(loss.detach())
        assert float(loss_sum.detach()) == pytest.approx(true_loss, rel=1e-6)
    # the tail's own gradient: the true one, every call
    assert_close_to_scale(tail.head.weight.grad / draws, true_w, rel=1e-4, atol=1e-6)
    mean = sent_sum / draws
    assert float((mean - true_x).norm() / true_x.norm()) < 0.05  # unbiased, up to sampling
    assert not torch.allclose(sent, true_x)  # one draw lies about some labels


def test_label_resampling_needs_the_u_split_and_a_rate_below_one() -> None:
    with pytest.raises(ValueError, match=r"privacy.label_resample must be in \[0, 1\)"):
        load_config(None, {"privacy.label_resample": 1.0})
    with pytest.raises(ValueError, match="model.split = 'two' sends the labels themselves"):
        load_config(
            None,
            {"model.split": "two", "model.tail_layers": 0, "privacy.label_resample": 0.5},
        )
    assert load_config(None, {"privacy.label_resample": 0.5}).privacy.label_resample == 0.5


def test_resampled_labels_on_a_real_tail_never_hold_the_full_logits_and_train_the_same() -> None:
    """A tail stage with ``loss_chunk`` > 0: the true loss and the tail's gradients are the
    chunked loss's (the full logits' to fp32 rounding), and the gradient sent up is the loss's
    against exactly the labels drawn, computed here over the full logits."""
    from fedpipe.models import load_config, resolve_model
    from fedpipe.split import build_device_stages, split_layout

    folder = resolve_model("tiny-llama")
    _, tail = build_device_stages(
        folder, split_layout(load_config(folder), head_layers=1, tail_layers=2)
    )
    assert tail is not None and tail.loss_chunk > 0
    tail.loss_chunk = 16  # several chunks of the 2 x 39 positions
    for p in tail.parameters():
        p.requires_grad_(True)
    gen = torch.Generator().manual_seed(11)
    x0 = torch.randn(2, 40, tail.config.hidden_size, generator=gen)
    labels = torch.randint(0, tail.config.vocab_size, (2, 40), generator=gen)
    labels[1, 30:] = -100
    tokens = int((labels[:, 1:] != -100).sum())

    tail.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_(True)
    loss_sum, sent = LabelResample(0.5, seed=3)(tail, x, labels, tokens)
    got_grads = {n: p.grad.clone() for n, p in tail.named_parameters() if p.grad is not None}

    # The same seed draws the same lies; the references run over the full logits.
    x = x0.clone().requires_grad_(True)
    lies = LabelResample(0.5, seed=3).relabel_chunked(tail.normed(x), labels, tail.project, 16)
    assert 0 < int((lies != labels).sum()) and bool((lies[1, 30:] == -100).all())
    tail.zero_grad(set_to_none=True)
    logits = tail.logits(x)
    told, _ = shifted_loss_sum(logits, lies)
    (want_sent,) = torch.autograd.grad(told / tokens, x, retain_graph=True)
    true_loss, _ = shifted_loss_sum(logits, labels)
    (true_loss / tokens).backward()
    assert_close_to_scale(loss_sum, true_loss.detach(), rel=1e-6, atol=1e-5)
    assert_close_to_scale(sent, want_sent / 0.5, rel=1e-5, atol=1e-7)
    for name, grad in got_grads.items():
        assert_close_to_scale(grad, tail.get_parameter(name).grad, rel=1e-5, atol=1e-7)
