"""A megatron layout as the trainer's step engine: megatron's schedules over megatron's
parallel state (``step.py``), each data-parallel rank reading its part of the batch."""

from __future__ import annotations

import argparse
from typing import Any

import torch
from megatron.core import parallel_state

from chameleon_megatron.training import data
from chameleon_megatron.training.step import Applied, eval_step, global_loss, train_step


class MegatronEngine:
    """This rank's chunks of a uniform TP x PP (x VPP) x DP layout."""

    checkpointable = True

    def __init__(self, args: argparse.Namespace, config: Any, model: list[torch.nn.Module],
                 optimizer: Any, device: torch.device) -> None:
        self.args, self.config, self.model, self.optimizer = args, config, model, optimizer
        self.device = device
        self.vpp_size = args.virtual_pipeline_model_parallel_size or 1

    def _schedule(self, gbs: int) -> dict[str, int]:
        a = self.args
        return {"num_microbatches": gbs // (a.micro_batch_size * a.data_parallel_size),
                "seq_length": a.seq_length, "micro_batch_size": a.micro_batch_size}

    def _iterators(self, dataset: Any, consumed: int, num_microbatches: int) -> list:
        a = self.args
        return [
            data.step_iterator(dataset, consumed, micro=a.micro_batch_size,
                               dp=a.data_parallel_size,
                               dp_rank=parallel_state.get_data_parallel_rank(),
                               num_microbatches=num_microbatches, device=self.device)
            for _ in self.model
        ]

    def train_step(self, dataset: Any, consumed: int, gbs: int) -> Applied:
        schedule = self._schedule(gbs)
        iterators = self._iterators(dataset, consumed, schedule["num_microbatches"])
        return train_step(self.model, self.optimizer, iterators, **schedule)

    def global_loss(self, reports: list[dict]) -> tuple[float | None, int]:
        return global_loss(reports)

    def evaluate(self, dataset: Any, start: int, gbs: int) -> tuple[float | None, int]:
        schedule = self._schedule(gbs)
        iterators = self._iterators(dataset, start, schedule["num_microbatches"])
        result = eval_step(self.model, iterators, **schedule)
        return result.loss, result.tokens

    def position(self) -> dict[str, int]:
        return {"tp_rank": parallel_state.get_tensor_model_parallel_rank(),
                "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
                "pp_size": parallel_state.get_pipeline_model_parallel_world_size(),
                "dp_rank": parallel_state.get_data_parallel_rank()}

    def pipeline_group(self) -> Any:
        return parallel_state.get_pipeline_model_parallel_group()

    def layout(self) -> dict[str, Any]:
        a = self.args
        return {"tp": a.tensor_model_parallel_size, "pp": a.pipeline_model_parallel_size,
                "vpp": self.vpp_size, "dp": a.data_parallel_size}
