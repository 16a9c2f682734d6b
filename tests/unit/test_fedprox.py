"""FedProx on the device: the proximal term's gradient is added before each optimizer step."""

import torch
from harness.close import FLOAT32_ATOL, FLOAT32_REL, assert_close_to_scale

from fedpipe.edge.trainer import _add_proximal_term


def test_proximal_term_pulls_towards_the_round_start() -> None:
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = torch.optim.SGD([w], lr=0.1)
    _add_proximal_term(opt, [w], mu=0.5)
    with torch.no_grad():
        w.add_(torch.tensor([1.0, 1.0]))  # drift away from the anchor (1, -2)
    w.grad = torch.zeros(2)
    opt.step()
    # grad = mu * (w - anchor) = 0.5 * (1, 1); w <- w - 0.1 * grad
    assert_close_to_scale(
        w.detach(), torch.tensor([2.0 - 0.05, -1.0 - 0.05]), rel=FLOAT32_REL, atol=FLOAT32_ATOL
    )


def test_no_proximal_gradient_at_the_anchor() -> None:
    w = torch.nn.Parameter(torch.tensor([3.0]))
    opt = torch.optim.SGD([w], lr=1.0)
    _add_proximal_term(opt, [w], mu=10.0)
    w.grad = torch.tensor([0.25])
    opt.step()
    assert_close_to_scale(w.detach(), torch.tensor([2.75]), rel=FLOAT32_REL, atol=FLOAT32_ATOL)
