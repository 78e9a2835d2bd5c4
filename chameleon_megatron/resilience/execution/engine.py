"""A plan's runtime as the trainer's step engine (``training/engine.py``): heterogeneous
pipelines run ``runtime``, a kept layout with dead ranks runs ``rerouted``."""

from __future__ import annotations

from typing import Any

import torch

from chameleon_megatron.resilience.execution.rerouted import reroute_eval, reroute_train
from chameleon_megatron.resilience.execution.runtime import (
    PlanRuntime,
    hetero_eval,
    hetero_train,
    microbatch_source,
)
from chameleon_megatron.training.step import Applied, share_loss


class PlanEngine:
    """Trains (and evaluates) this rank's slot of ``rt.plan``."""

    vpp_size = 1
    checkpointable = False
    """dist_checkpointing shards by megatron's parallel state, which a plan has none of."""

    def __init__(self, rt: PlanRuntime, device: torch.device) -> None:
        self.rt, self.device = rt, device
        self.model = [rt.model]
        self.optimizer = rt.optimizer
        self.config = rt.model.config

    def _batches(self, dataset: Any, consumed: int, gbs: int):
        planned = self.rt.plan.microbatches * self.rt.args.micro_batch_size
        if gbs != planned:
            raise ValueError(f"global batch {gbs}: the plan {self.rt.plan.describe()} was made "
                             f"for {planned} samples")
        return microbatch_source(dataset, consumed, self.rt.args.micro_batch_size, self.device)

    def train_step(self, dataset: Any, consumed: int, gbs: int) -> Applied:
        batches = self._batches(dataset, consumed, gbs)
        if self.rt.reroute is not None:
            return reroute_train(self.rt, batches)
        return hetero_train(self.rt, batches)

    def global_loss(self, reports: list[dict]) -> tuple[float | None, int]:
        return share_loss(reports)

    def evaluate(self, dataset: Any, start: int, gbs: int) -> tuple[float | None, int]:
        batches = self._batches(dataset, start, gbs)
        if self.rt.reroute is not None:
            return reroute_eval(self.rt, batches)
        return hetero_eval(self.rt, batches)

    def position(self) -> dict[str, int]:
        slot = self.rt.slot
        return {"pp_rank": slot.stage, "pp_size": self.rt.plan.pipelines[slot.pipeline].depth,
                "dp_rank": slot.pipeline, "tp_rank": slot.tp_index}

    def pipeline_group(self) -> Any:
        return self.rt.groups.pipeline if self.rt.reroute is None else None

    def layout(self) -> dict[str, Any]:
        plan = self.rt.plan
        out: dict[str, Any] = {"tp": plan.tp, "pp": max(plan.depths), "vpp": 1,
                               "dp": len(plan.pipelines), "plan": plan.describe()}
        if self.rt.reroute is not None:
            out["rerouted"] = list(self.rt.reroute.failed_ranks)
        return out
