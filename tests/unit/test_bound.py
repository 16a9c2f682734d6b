"""The pipeline bound: its terms, and that it never exceeds a schedule's simulated time."""

import pytest

from fedpipe.bench.bound import Components, pipeline_bound, sequential_model


def _c(**kw: float) -> Components:
    base = dict(
        c_f=0.01,
        c_t=0.02,
        c_b=0.01,
        s_f=0.01,
        s_b=0.02,
        tau_up=0.001,
        tau_down=0.001,
        lat_up=0.0025,
        lat_down=0.0025,
    )
    return Components(**{**base, **kw})


def test_device_bound_dominates_on_a_fast_link() -> None:
    c = _c()
    bound, term = pipeline_bound(c, 8)
    assert term == "device"
    assert bound == pytest.approx(8 * (0.01 + 0.02 + 0.01))


def test_uplink_bound_dominates_on_a_slow_uplink() -> None:
    c = _c(tau_up=0.1)
    bound, term = pipeline_bound(c, 8)
    assert term == "uplink"
    assert bound >= 8 * 2 * 0.1


def test_latency_shows_in_the_critical_path_for_one_microbatch() -> None:
    c = _c(lat_up=0.5, lat_down=0.5)
    bound, term = pipeline_bound(c, 1)
    assert term in ("critical-path", "tail-phase")
    assert bound >= 4 * 0.5


@pytest.mark.parametrize("m", [1, 2, 8])
def test_sequential_never_beats_the_bound(m: int) -> None:
    for c in (_c(), _c(tau_up=0.1), _c(lat_up=0.05, lat_down=0.05), _c(s_f=0.2, s_b=0.3)):
        assert sequential_model(c, m) >= pipeline_bound(c, m)[0] - 1e-12


def test_optimizer_tail_is_added() -> None:
    assert pipeline_bound(_c(t_opt=0.5), 4)[0] == pytest.approx(pipeline_bound(_c(), 4)[0] + 0.5)


def test_gradients_in_another_codec_count_on_their_own() -> None:
    """int8 activations with bf16 gradients: the uplink row carries one of each per microbatch."""
    c = _c(tau_up=0.05, tau_up_grad=0.1)
    bound, term = pipeline_bound(c, 8)
    assert term == "uplink"
    assert bound >= 8 * (0.05 + 0.1)
    assert bound < pipeline_bound(_c(tau_up=0.1), 8)[0]  # cheaper than bf16 both ways
    assert "tau_up_grad" in c.as_dict() and "tau_down_grad" not in c.as_dict()
