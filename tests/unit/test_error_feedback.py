"""Error feedback: each side's quantised gradients carry their residual to the next send."""

from __future__ import annotations

import pytest
import torch
from harness.close import assert_close_to_scale

from fedpipe.messages import Kind, StageMsg
from fedpipe.wire.stream_codec import StreamCodecs, StreamDecoder, StreamEncoder


def _sent_sum(codec: str, grads: list[torch.Tensor], *, feedback: bool) -> torch.Tensor:
    """The sum of what the receiver decodes when ``grads`` go up as microbatch 0, step by step."""
    encoder = StreamEncoder(StreamCodecs("fp32", codec, error_feedback=feedback), session_id="s")
    decoder = StreamDecoder()
    total = torch.zeros_like(grads[0])
    for step, g in enumerate(grads):
        msg = decoder.decode(encoder.encode(StageMsg(Kind.OUTPUT_GRAD, step, 0, tensor=g)))
        assert msg.tensor is not None
        total += msg.tensor
    return total


@pytest.mark.parametrize("codec", ["int2", "int4", "int8"])
def test_the_sum_over_steps_tracks_the_true_sum(codec: str) -> None:
    gen = torch.Generator().manual_seed(0)
    # A steady component (as a gradient has over nearby steps) plus noise: nearest rounding
    # makes the same error on the steady part every step, so without feedback it adds up.
    steady = torch.randn(2, 8, 64, generator=gen)
    grads = [steady + 0.1 * torch.randn(2, 8, 64, generator=gen) for _ in range(60)]
    truth = torch.stack(grads).sum(dim=0)
    with_ef = (_sent_sum(codec, grads, feedback=True) - truth).abs().max().item()
    without = (_sent_sum(codec, grads, feedback=False) - truth).abs().max().item()
    # With feedback the accumulated error is the last residual: at most half a step of one
    # send (steps: range / 3, / 15, / 254 of a group or row whose values lie within about +-5).
    half_step = {"int2": 10 / 3, "int4": 10 / 15, "int8": 10 / 254}[codec] / 2
    assert with_ef <= half_step
    assert without > 5 * with_ef


def test_residuals_are_kept_per_role_and_shape() -> None:
    encoder = StreamEncoder(StreamCodecs("fp32", "int2", error_feedback=True), session_id="s")
    g = torch.linspace(-1, 1, 128).reshape(1, 2, 64)
    for mb in (0, 1):
        encoder.encode(StageMsg(Kind.OUTPUT_GRAD, 0, mb, tensor=g * (mb + 1)))
    r0 = encoder.feedback.residual((int(Kind.OUTPUT_GRAD), 0))
    r1 = encoder.feedback.residual((int(Kind.OUTPUT_GRAD), 1))
    assert r0 is not None and r1 is not None and not torch.equal(r0 * 2, r0)
    assert_close_to_scale(r1, 2 * r0, rel=1e-5, atol=1e-6)  # each microbatch index keeps its own
    # Activations and lossless gradients keep nothing.
    encoder.encode(StageMsg(Kind.ACTIVATION, 0, 2, tensor=g))
    assert encoder.feedback.residual((int(Kind.ACTIVATION), 2)) is None
    # A gradient of another shape (a smaller last microbatch) starts afresh: no mismatched add.
    encoder.encode(StageMsg(Kind.OUTPUT_GRAD, 1, 0, tensor=torch.zeros(1, 1, 64)))
    r0_new = encoder.feedback.residual((int(Kind.OUTPUT_GRAD), 0))
    assert r0_new is not None and r0_new.shape == (1, 1, 64)
    assert torch.equal(r0_new, torch.zeros(1, 1, 64))  # zeros quantise exactly


def test_the_residual_is_exactly_what_the_receiver_missed() -> None:
    encoder = StreamEncoder(StreamCodecs("int4", error_feedback=True), session_id="s")
    g = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(2))
    decoded = StreamDecoder().decode(encoder.encode(StageMsg(Kind.INPUT_GRAD, 0, 0, tensor=g)))
    residual = encoder.feedback.residual((int(Kind.INPUT_GRAD), 0))
    assert decoded.tensor is not None and residual is not None
    assert torch.equal(residual, g - decoded.tensor)
    feedback_off = StreamEncoder(StreamCodecs("fp32", "fp32", error_feedback=True), session_id="")
    feedback_off.encode(StageMsg(Kind.INPUT_GRAD, 0, 0, tensor=g))
    assert feedback_off.feedback.nbytes == 0  # fp32 loses nothing: nothing to keep


def test_stochastic_rounding_is_seeded_and_decodes_within_one_step() -> None:
    g = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(5))
    frames = [
        StreamEncoder(StreamCodecs("int2", stochastic=True, seed=7), session_id="s").encode(
            StageMsg(Kind.OUTPUT_GRAD, 0, 0, tensor=g)
        )
        for _ in range(2)
    ]
    assert frames[0] == frames[1]  # the same seed rounds the same way
    y = StreamDecoder().decode(frames[0]).tensor
    assert y is not None
    step = (g.reshape(-1, 64).amax(1) - g.reshape(-1, 64).amin(1)) / 3  # (groups,)
    assert ((y - g).reshape(-1, 64).abs() < step[:, None] * (1 + 1e-5)).all()
