"""The suite's float comparison rule (:mod:`harness.close`): close relative to the scale."""

from __future__ import annotations

import math

import pytest
import torch
from harness.close import assert_close_to_scale, assert_states_close_to_scale


def test_a_one_percent_difference_fails_at_rel_1e_4_naming_the_place_scale_and_tolerance() -> None:
    want = torch.linspace(-2.0, 3.0, 12).reshape(3, 4)
    got = want.clone()
    got[1, 2] *= 1.01
    with pytest.raises(AssertionError) as failed:
        assert_close_to_scale(got, want, rel=1e-4, msg="layers.0.q")
    text = str(failed.value)
    assert "layers.0.q" in text and "(1, 2)" in text
    assert "scale 3" in text and "tolerance 0.0003" in text


def test_a_small_element_far_off_per_element_but_tiny_to_the_scale_passes() -> None:
    """The AMD failure: an element near 0 moved by 1.9e-5 where the tensor reaches 155."""
    want = torch.zeros(128)
    want[0] = 155.0
    want[7] = 1e-6
    got = want.clone()
    got[7] += 1.9e-5  # 20x the element, 1.2e-7 of the scale
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)  # the per-element rule
    assert_close_to_scale(got, want, rel=1e-4, atol=1e-6)


def test_the_scale_is_either_tensors_largest_magnitude_and_atol_adds() -> None:
    want = torch.zeros(3)
    got = torch.tensor([0.0, 1e-3, 0.0])
    with pytest.raises(AssertionError):  # scale 1e-3 (got's): tolerance 1e-7
        assert_close_to_scale(got, want, rel=1e-4)
    assert_close_to_scale(got, want, rel=1e-4, atol=1e-3)
    assert_close_to_scale(torch.zeros(3), torch.zeros(3), rel=0.0)  # exact at 0, 0


def test_shape_and_dtype_mismatches_are_refused_saying_both() -> None:
    with pytest.raises(AssertionError, match=r"got shape \(2, 3\).*want shape \(3, 2\)"):
        assert_close_to_scale(torch.zeros(2, 3), torch.zeros(3, 2), rel=1e-4)
    with pytest.raises(AssertionError, match=r"dtype torch.float64.*dtype torch.float32"):
        assert_close_to_scale(torch.zeros(2, dtype=torch.float64), torch.zeros(2), rel=1e-4)


def test_empty_tensors_of_one_shape_are_close() -> None:
    assert_close_to_scale(torch.zeros(0, 4), torch.zeros(0, 4), rel=1e-4)
    with pytest.raises(AssertionError):
        assert_close_to_scale(torch.zeros(0, 4), torch.zeros(4, 0), rel=1e-4)


def test_nan_in_one_only_fails_and_equal_non_finite_values_pass() -> None:
    want = torch.tensor([1.0, math.nan, math.inf, -math.inf])
    assert_close_to_scale(want.clone(), want, rel=1e-6)
    with pytest.raises(AssertionError, match=r"NaN in one.*index \(0,\)"):
        assert_close_to_scale(torch.tensor([math.nan, math.nan, math.inf, -math.inf]), want, rel=1)
    with pytest.raises(AssertionError, match=r"infinities differ at index \(3,\)"):
        assert_close_to_scale(torch.tensor([1.0, math.nan, math.inf, math.inf]), want, rel=1)
    with pytest.raises(AssertionError, match="infinities differ"):
        assert_close_to_scale(torch.tensor([1.0, math.nan, 5.0, -math.inf]), want, rel=1)


def test_state_dicts_compare_key_by_key_naming_the_key_and_a_missing_one() -> None:
    want = {"a": torch.ones(2), "b": torch.full((2,), 100.0)}
    assert_states_close_to_scale({"a": torch.ones(2), "b": want["b"] + 1e-3}, want, rel=1e-4)
    with pytest.raises(AssertionError, match="server b: largest difference"):
        bad = {"a": torch.ones(2), "b": want["b"] * 1.01}
        assert_states_close_to_scale(bad, want, rel=1e-4, msg="server")
    with pytest.raises(AssertionError, match=r"missing \['b'\], extra \['c'\]"):
        assert_states_close_to_scale({"a": want["a"], "c": want["b"]}, want, rel=1e-4)
