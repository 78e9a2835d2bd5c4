"""Every stage's swap figures on each rank of a pipeline, gathered only when some changed.

The figures go in each iteration record (``swap.stages``). Gathering them is a collective,
so the ranks of the pipeline must agree whether to gather, and a rank knows only whether
its own figures changed. So each step the ranks take the maximum of one flag, "mine changed
since the last gather" (an 8-byte all-reduce, nothing pickled), and gather the figures
(``all_gather_object``: pickling, two collectives) only when it is set; otherwise the
figures of the last gather are every stage's current ones. The first call gathers on every
rank (nothing gathered yet), so the ranks agree from the start.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class StageFigures:
    """One rank's view of its pipeline's figures (``group``: the pipeline, ``size`` stages;
    None or one stage: this rank's figures alone)."""

    def __init__(self, group: dist.ProcessGroup | None, size: int) -> None:
        self.group, self.size = group, size
        self._sent: dict[str, Any] | None = None
        """This rank's figures at the last gather."""
        self._stages: list[dict[str, Any]] = []

    def gather(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        """Every stage's figures, first stage first (collective over the pipeline)."""
        if self.group is None or self.size <= 1:
            return [mine]
        device = torch.cuda.current_device() if dist.get_backend(self.group) == "nccl" else "cpu"
        changed = torch.tensor([int(mine != self._sent)], device=device)
        dist.all_reduce(changed, op=dist.ReduceOp.MAX, group=self.group)
        if changed.item():
            stages: list[Any] = [None] * self.size
            dist.all_gather_object(stages, mine, group=self.group)
            self._sent, self._stages = dict(mine), stages
        return [dict(s) for s in self._stages]
