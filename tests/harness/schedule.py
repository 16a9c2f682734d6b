"""How pytest-xdist shares the suite between its workers (``--dist loadscope``).

A unit or integration module is one work unit (its module-scoped servers and models are
built once, on one worker). In ``tests/system`` a test is a unit of its own, so independent
simulations and deployments overlap, unless it belongs to a class: a class's tests share a
run (a class- or module-scoped fixture) and go to one worker together.

A worker is given its next unit only when it is down to its last test (xdist's own loadscope
keeps up to three queued, which can leave one worker idle at the end while another still
holds several long system tests). Units start in collection order: tests/conftest.py puts
the longest first.
"""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling
from xdist.workermanage import WorkerController

__all__ = ["TierScheduling"]


class TierScheduling(LoadScopeScheduling):
    """xdist's loadscope with the suite's units, handed out one at a time."""

    def _split_scope(self, nodeid: str) -> str:
        path, _, rest = nodeid.partition("::")
        if not path.startswith("tests/system/"):
            return path
        names = rest.split("::")
        return nodeid if len(names) == 1 else f"{path}::{names[0]}"

    def _reschedule(self, node: WorkerController) -> None:
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        if self._pending_of(self.assigned_work[node]) > 1:
            return  # the worker holds back its last test until it knows the next one
        self._assign_work_unit(node)
