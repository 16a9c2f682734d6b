"""Error feedback for quantised gradients: what one send lost is added to the next.

A gradient ``g`` quantised to ``Q(g)`` loses ``g - Q(g)``. Without feedback these errors are
independent draws whose sum over ``n`` steps grows like ``sqrt(n)`` (and, with nearest
rounding, can be biased, growing like ``n``); the optimizer sees a drifted sum of gradients.
With feedback the sender keeps the residual ``e = (g + e_prev) - Q(g + e_prev)`` and sends
``Q(g_next + e)`` next time, so the sum of what the receiver decoded over ``n`` steps differs
from the sum of the true gradients by exactly the last residual: bounded by one quantisation
error, whatever ``n`` is (EF-SGD; Seide et al. 2014, Karimireddy et al. 2019).

**Same role.** A residual is added to the next gradient that plays the same part in the
computation: the same message kind (``OUTPUT_GRAD`` up, ``INPUT_GRAD`` down) and the same
microbatch index, i.e. the gradient of microbatch ``m`` of step ``s`` carries over to
microbatch ``m`` of step ``s + 1`` of the same session. Within a step the microbatches hold
different samples, so keeping roles apart keeps each residual next to gradients of its
shape and scale; across steps the batches differ but the rows' roles (position in the
pipeline) are the same, which is all EF needs. A residual whose shape no longer matches (the
last microbatch of a smaller batch) is dropped rather than added.
"""

from __future__ import annotations

import torch

__all__ = ["ErrorFeedback", "Role"]

Role = tuple[int, int]  # (message kind, microbatch index)


class ErrorFeedback:
    """The residual of each role's last quantised gradient, on the gradient's device."""

    def __init__(self) -> None:
        self._residual: dict[Role, torch.Tensor] = {}

    def compensate(self, role: Role, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` plus the residual left by the last send of ``role`` (fp32, a new tensor)."""
        grad = grad.detach().to(torch.float32)
        residual = self._residual.pop(role, None)
        if residual is None or residual.shape != grad.shape:
            return grad
        return grad + residual.to(grad.device)

    def remember(self, role: Role, sent: torch.Tensor, decoded: torch.Tensor) -> None:
        """Keep ``sent - decoded``: what the receiver of ``sent`` will not see."""
        self._residual[role] = sent - decoded.to(sent.device)

    def residual(self, role: Role) -> torch.Tensor | None:
        """The residual ``role`` carries into its next send (None if it has none)."""
        return self._residual.get(role)

    @property
    def nbytes(self) -> int:
        return sum(r.numel() * r.element_size() for r in self._residual.values())
