"""The collectives and host reads each steady-state training step issues.

A 2-rank gloo job, every torch.distributed call and every host read of a tensor (``item``,
``float``, ``tolist``) counted per step by wrappers:

* the plan runtime (two depth-1 pipelines holding the whole model, 5 microbatches each):
  every step the same calls; the gradient norm one all-reduce and one host read (not one
  per parameter); the gradient sync no host read (the token count divides on the device);
  megatron's vocabulary-parallel cross entropy its three all-reduces per microbatch over
  the stage's tensor-parallel group (this rank alone), as in a megatron layout;
* the swap plugin's stage figures over a 2-stage group: one flag all-reduce per step, the
  figures gathered (``all_gather_object``) only in the first step and the step where a
  stage's figures changed, every rank's record holding both stages' current figures.

Run as a script, this file is the worker program of the test.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hetero_support import launch, parse  # noqa: E402
from rt_support import guard_worker  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]

STEPS = 3
MICROBATCHES = 5
"""Each pipeline's microbatches per step."""
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "barrier",
               "reduce_scatter", "all_gather_into_tensor", "reduce_scatter_tensor",
               "batch_isend_irecv", "isend", "irecv", "send", "recv")
READS = ("item", "__float__", "tolist")
FIGURES = [{"blocking_swapins": 0}, {"blocking_swapins": 0}, {"blocking_swapins": 0},
           {"blocking_swapins": 2}, {"blocking_swapins": 2}]
"""Stage 1's figures per call; stage 0's never change."""


@pytest.fixture(scope="module")
def counts(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("collectives")
    launch(__file__, 2, out, timeout_s=170)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_the_plan_runtime_issues_the_same_calls_every_step(counts: list[dict]) -> None:
    for rank, got in enumerate(counts):
        steps = got["steps"]
        assert len(steps) == STEPS and steps[1] == steps[2], (rank, steps)
        # the sync: its groups, the token count, the tied embedding's copies; no host read
        sync = got["rounds"] + 1 + got["tied"]
        assert got["tied"] and steps[2]["sync"] == {"all_reduce": sync}, (rank, steps[2])
        assert steps[2]["norm"] == {"all_reduce": 1, "__float__": 1}, (rank, steps[2])
        # the cross entropy, and the loss; torch's CPU Adam reads each parameter's step
        # count (``item``: not counted; megatron's optimizer on GPUs is fused)
        calls = {k: v for k, v in steps[2]["calls"].items() if k != "item"}
        entropy = 3 * MICROBATCHES
        assert calls == {"all_reduce": sync + 2 + entropy, "__float__": 1, "tolist": 1}, (
            rank, calls)


def test_stage_figures_are_gathered_only_when_they_change(counts: list[dict]) -> None:
    for rank, got in enumerate(counts):
        calls = got["figures"]
        assert [c.get("all_reduce") for c in calls] == [1] * len(FIGURES), (rank, calls)
        assert [c.get("all_gather_object", 0) for c in calls] == [1, 0, 0, 1, 0], (rank, calls)
        for k, stages in enumerate(got["records"]):
            assert [s["stage"] for s in stages] == [0, 1]
            assert stages[1]["blocking_swapins"] == FIGURES[k]["blocking_swapins"], (rank, k)


class Recorder:
    """Counts calls of torch.distributed's collectives and of host reads, by name."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self._inside = False
        """In a counted call (torch's ``__torch_function__`` calls the method again)."""

    def install(self) -> None:
        import torch
        import torch.distributed as dist

        for name in COLLECTIVES:
            setattr(dist, name, self._counted(name, getattr(dist, name)))
        for name in READS:
            setattr(torch.Tensor, name, self._counted(name, getattr(torch.Tensor, name)))

    def _counted(self, name: str, fn: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._inside:
                return fn(*args, **kwargs)
            self.counts[name] += 1
            self._inside = True
            try:
                return fn(*args, **kwargs)
            finally:
                self._inside = False
        return wrapper

    def during(self, fn: Callable[[], Any]) -> tuple[Any, dict[str, int]]:
        before = Counter(self.counts)
        result = fn()
        return result, dict(self.counts - before)


def around(rec: Recorder, obj: Any, name: str, into: list) -> None:
    """Record the calls inside ``obj.name`` into ``into`` (one dict per call)."""
    inner = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result, calls = rec.during(lambda: inner(*args, **kwargs))
        into.append(calls)
        return result
    setattr(obj, name, wrapper)


def worker(out: Path) -> int:
    guard_worker(170)
    from chameleon_megatron.megatron.platform import CpuPlatform

    CpuPlatform().apply()
    import datetime
    import os

    import torch
    import torch.distributed as dist

    from chameleon_megatron.resilience.decision.layout import Pipeline, Plan, Stage
    from chameleon_megatron.resilience.decision.restorer import allreduce_groups, allreduce_rounds
    from chameleon_megatron.resilience.execution.runtime import (
        build_runtime, microbatch_source, run_hetero_step,
    )
    from chameleon_megatron.swap.stage_figures import StageFigures
    from chameleon_megatron.training import data
    from chameleon_megatron.training.stage_builder import trainer_stages
    from dc_helpers import make_profile

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    args = parse(4)
    plan = Plan(num_layers=4, pipelines=tuple(
        Pipeline(stages=(Stage(tuple(range(4)), (r,)),), microbatches=MICROBATCHES) for r in (0, 1)))
    profile = make_profile(4, gbs=10)
    rt = build_runtime(args, plan, rank, sync_groups=allreduce_groups(plan, profile),
                       sync_rounds=allreduce_rounds(plan, profile), world={0: 0, 1: 1},
                       builder=trainer_stages(args), timeout_s=60)
    rec = Recorder()
    rec.install()
    norm: list = []
    sync: list = []
    around(rec, rt.sync, "grad_norm", norm)
    around(rec, rt.sync, "__call__", sync)
    rt.model.config.finalize_model_grads_func = rt.sync.__call__  # the wrapped one
    datasets = data.build_datasets(args)
    steps = []
    for it in range(STEPS):
        batches = microbatch_source(datasets.train, it * args.global_batch_size,
                                    args.micro_batch_size, torch.device("cpu"))
        _, calls = rec.during(lambda: run_hetero_step(rt, batches))
        steps.append({"calls": calls, "norm": norm[-1], "sync": sync[-1]})
    figures = StageFigures(dist.group.WORLD, 2)
    calls, records = [], []
    for k, mine in enumerate(FIGURES):
        stages, c = rec.during(lambda: figures.gather(
            {"stage": rank, "rank": rank, **(mine if rank == 1 else FIGURES[0])}))
        calls.append(c)
        records.append(stages)
    (out / f"rank{rank}.json").write_text(json.dumps({
        "steps": steps, "rounds": len(rt.sync.performed), "tied": len(rt.sync.spec.tied),
        "figures": calls,
        "records": records}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(worker(Path(sys.argv[1])))
