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

A role may be any hashable name: a device's adapter updates, sent once a round through Flower
(:mod:`fedpipe.fl.adapter_codec`), carry each adapter tensor's residual under its key into the
device's next round, the residuals kept between rounds with :meth:`ErrorFeedback.residuals`.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import torch

__all__ = ["ErrorFeedback", "Role"]

Role = tuple[int, int]  # (message kind, microbatch index): the stage link's gradients


class ErrorFeedback:
    """The residual of each role's last quantised gradient, on the gradient's device."""

    def __init__(self, residuals: Mapping[Hashable, torch.Tensor] | None = None) -> None:
        self._residual: dict[Hashable, torch.Tensor] = dict(residuals or {})

    def compensate(self, role: Hashable, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` plus the residual left by the last send of ``role`` (fp32, a new tensor)."""
        grad = grad.detach().to(torch.float32)
        residual = self._residual.pop(role, None)
        if residual is None or residual.shape != grad.shape:
            return grad
        return grad + residual.to(grad.device)

    def remember(self, role: Hashable, sent: torch.Tensor, decoded: torch.Tensor) -> None:
        """Keep ``sent - decoded``: what the receiver of ``sent`` will not see."""
        self._residual[role] = sent - decoded.to(sent.device)

    def residual(self, role: Hashable) -> torch.Tensor | None:
        """The residual ``role`` carries into its next send (None if it has none)."""
        return self._residual.get(role)

    def residuals(self) -> dict[Hashable, torch.Tensor]:
        """Every role's residual (to keep them past this object: ``ErrorFeedback(them)``)."""
        return dict(self._residual)

    @property
    def nbytes(self) -> int:
        return sum(r.numel() * r.element_size() for r in self._residual.values())
