"""``SwapPlugin``: the swap subsystem as a trainer plugin (and for the Megatron-LM hook).

    plugins.append(SwapPlugin(cfg.swap))   # when cfg.swap.enabled

``on_model_built`` builds tracker, executor and manager for this rank and installs the
megatron seams; ``step_context`` runs one training step under the manager (evaluation
saves no tensors and is left alone); ``metrics`` returns ``{"swap": {...}}``;
``on_step_failed`` asks the trainer to redo a step that ran out of device memory once the
budget is lowered; ``on_train_end`` logs the per-rank summary and removes the seams.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, ContextManager

import torch

from chameleon_megatron.configurable import check
from chameleon_megatron.megatron.swap_seams import SwapSeams
from chameleon_megatron.swap.budget import BudgetSpec
from chameleon_megatron.swap.config import CPU_BANDWIDTH_BPS, SwapConfig
from chameleon_megatron.swap.copier import copier_for, measure_bandwidth
from chameleon_megatron.swap.cost import measure_profiler_cost
from chameleon_megatron.swap.executor import SwapExecutor
from chameleon_megatron.swap.hostpool import HostPool
from chameleon_megatron.swap.manager import SwapManager
from chameleon_megatron.swap.stage import StageTracker
from chameleon_megatron.swap.stage_figures import StageFigures
from chameleon_megatron.swap.summary import summary_table
from chameleon_megatron.swap.threshold import bandwidth_threshold
from chameleon_megatron.training.plugin import (
    StepAction,
    TrainContext,
    TrainerHandle,
    TrainerPlugin,
)
from chameleon_megatron.training.rng import rng_state, set_rng_state

logger = logging.getLogger(__name__)

def budget_spec(config: SwapConfig, *, pp_rank: int, pp_size: int, device: torch.device,
                launch_pp_size: int | None = None,
                planned_fraction: float | None = None) -> BudgetSpec:
    """This rank's budget from the config (ValueError on a bad combination).
    ``launch_pp_size``: the pipeline depth the job started with, when this is a rebuild;
    ``planned_fraction``: the decision center made this stage fit device memory by swapping
    down to this share of its no-swap peak (a recovery's plan): that budget holds."""
    if planned_fraction is not None:
        return BudgetSpec(fraction=planned_fraction)
    per_stage = config.budget_bytes_per_stage
    if per_stage and launch_pp_size is not None and pp_size != launch_pp_size:
        # A recovery re-planned the pipelines (fault tolerance): the configured stages no
        # longer exist, so the tightest of their budgets holds on every stage.
        return BudgetSpec(absolute_bytes=min(per_stage))
    if per_stage:
        check(len(per_stage) == pp_size, "swap.budget_bytes_per_stage", per_stage,
              f"needs one budget per pipeline stage ({pp_size})")
        return BudgetSpec(absolute_bytes=per_stage[pp_rank])
    if config.budget_bytes is not None:
        return BudgetSpec(absolute_bytes=config.budget_bytes)
    if config.budget_device_fraction is not None:
        check(device.type == "cuda", "swap.budget_device_fraction",
              config.budget_device_fraction, f"needs a CUDA device (this rank runs on {device})")
        total = torch.cuda.get_device_properties(device).total_memory
        return BudgetSpec(device_fraction=config.budget_device_fraction,
                          device_total_bytes=total)
    return BudgetSpec(fraction=config.budget_fraction)


STAGE_FIELDS = ("mode", "plan_version", "budget_bytes", "min_tensor_bytes", "recompute_layers",
                "peak_resident_saved_bytes", "peak_saved_bytes", "swapped_out_bytes",
                "blocking_swapins", "expected_stall_s")
"""Figures of each pipeline stage in an iteration record (``swap.stages``)."""


def block_recompute(config: Any) -> Callable[[int], None] | None:
    """Sets megatron's block recompute of the first k transformer layers of each chunk on
    this rank's model config (read at every forward); None when the run recomputes already
    (``--recompute-granularity``) or the model has no such config."""
    if config is None or getattr(config, "recompute_granularity", "x") is not None:
        return None

    def recompute(layers: int) -> None:
        config.recompute_granularity = "full" if layers else None
        config.recompute_method = "block" if layers else None
        config.recompute_num_layers = layers or None

    return recompute


def first_threshold(config: SwapConfig, bandwidth_bps: float) -> int:
    """The size threshold until the first plan (then the plan's, ``threshold.py``)."""
    if config.min_tensor_bytes is not None:
        return config.min_tensor_bytes
    return bandwidth_threshold(bandwidth_bps)


class SwapPlugin(TrainerPlugin):
    """One rank's swap subsystem, driven by the trainer's hooks."""

    def __init__(self, config: SwapConfig) -> None:
        self.config = config
        self.manager: SwapManager | None = None
        self.seams: SwapSeams | None = None
        self.rank = 0
        self._stage = 0
        self._figures: StageFigures | None = None
        self._step_rng: dict[str, Any] | None = None
        self._launch_pp_size: int | None = None
        """Pipeline depth of the first build (a recovery may change it later)."""
        self._oom_factor = 1.0
        """What out-of-memory errors taught, kept over a dropped model."""

    def on_model_built(self, ctx: TrainContext) -> None:
        """Build tracker, executor and manager for this rank's model (again after a rebuild,
        keeping what out-of-memory errors taught)."""
        oom_factor = self.manager.oom_factor if self.manager is not None else self._oom_factor
        self._teardown()
        cfg, device = self.config, ctx.device
        spec = budget_spec(cfg, pp_rank=ctx.pp_rank, pp_size=ctx.pp_size, device=device,
                           launch_pp_size=self._launch_pp_size,
                           planned_fraction=ctx.extra.get("swap_budget_fraction"))
        if self._launch_pp_size is None:
            self._launch_pp_size = ctx.pp_size
        if cfg.bandwidth_gbps is not None:
            bandwidth = cfg.bandwidth_gbps * 1e9
        else:
            bandwidth = measure_bandwidth(device) if device.type == "cuda" else CPU_BANDWIDTH_BPS
        tracker = StageTracker()  # its granularity is the manager's to set
        # DDP wrappers shadow Module.buffers with a list attribute: call the method itself.
        held = [t for chunk in ctx.model
                for t in (*chunk.parameters(), *torch.nn.Module.buffers(chunk))]
        executor = SwapExecutor(tracker, copier=copier_for(device),
                                pool=HostPool(pin=device.type == "cuda",
                                              cache_bytes=cfg.host_cache_bytes),
                                min_bytes=first_threshold(cfg, bandwidth), exclude=held)
        self.rank = ctx.rank
        self._stage = ctx.pp_rank
        self._figures = StageFigures(ctx.pipeline_group, ctx.pp_size)
        # One rank per stage logs its records: the others of the stage have the same.
        speaks = ctx.dp_rank == 0 and ctx.tp_rank == 0
        self.manager = SwapManager(cfg, executor, budget=spec, bandwidth_bps=bandwidth,
                                   cost=measure_profiler_cost(), rank=ctx.rank,
                                   oom_factor=oom_factor, recompute=block_recompute(ctx.config),
                                   speaks=speaks)
        # Auto starts per layer, so the seams install the layer hooks it may need later.
        self.seams = SwapSeams(tracker, ctx.model)
        self.seams.install()
        if speaks:
            logger.info({"event": "swap_ready", "rank": ctx.rank, "stage": ctx.pp_rank,
                         "bandwidth_gbps": bandwidth / 1e9, "budget": spec})

    def on_model_dropped(self) -> None:
        """The seams and the executor hold the old model's modules and parameters."""
        if self.manager is not None:
            self._oom_factor = self.manager.oom_factor
        self._teardown()

    def step_context(self, iteration: int, *, training: bool) -> ContextManager[None]:
        if not training or self.manager is None:
            return contextlib.nullcontext()
        # A step redone after an OOM must draw the same dropout masks as the first attempt.
        self._step_rng = rng_state()
        return self.manager.step(iteration)

    def metrics(self) -> dict[str, Any]:
        """This rank's figures, with every stage's of its pipeline under ``stages`` (the
        budgets are per stage; gathered over the pipeline when some changed,
        ``stage_figures``)."""
        if self.manager is None or not self.manager.last_metrics or self._figures is None:
            return {}
        figures = dict(self.manager.last_metrics)
        mine = {"stage": self._stage, "rank": self.rank,
                **{k: figures[k] for k in STAGE_FIELDS}}
        return {"swap": {**figures, "stages": self._figures.gather(mine)}}

    def on_step_failed(self, exc: BaseException,
                       trainer: TrainerHandle) -> StepAction | None:
        """A step that ran out of device memory can be redone when the lowered budget can
        help: by every rank together (the trainer sees to that)."""
        if isinstance(exc, torch.OutOfMemoryError) and self.manager is not None \
                and self.manager.oom_retry and self._step_rng is not None:
            set_rng_state(self._step_rng)
            return "abandon"
        return None

    def on_train_end(self) -> None:
        self._teardown()

    def _teardown(self) -> None:
        if self.seams is not None:
            self.seams.remove()
            self.seams = None
        if self.manager is not None:
            if self.manager.speaks:
                logger.info("swap summary (rank %d, stage %d)\n%s", self.rank, self._stage,
                            summary_table([(self.rank, self.manager.totals)]))
            self.manager.executor.pool.clear()
            self.manager = None
