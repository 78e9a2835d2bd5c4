"""The training worker of the recovery tests: ``pretrain_gpt`` plus a state dump.

    python tests/resilience/recovery_worker.py --dump DIR --iters N [--pace-s S]
        [--oom-at RANK:ITERATION] [--stall-at RANK:ITERATION:SECONDS] [--fused te|apex]
        [--precision-aware bf16|bf16-remainders|fp16] <trainer flags>

Trains like ``chameleon_megatron.pretrain_gpt`` (under chameleon-run, or alone for the
failure-free reference) with one more plugin: a rank that holds part of the model when
training finishes writes, to ``DIR/<launch rank>.json``, its per-parameter sums of squares
of weights and Adam moments (keyed by state unit and name) and Adam's step count; a spare
at the end of the job writes ``{"spare": true}``. ``--oom-at`` makes that launch rank run out
of device memory once, after the forward-backward of that step (without fault tolerance,
whose ``kind=oom`` faults fire anywhere); ``--stall-at`` makes it stop that long, once, at the
start of that step (a slow rank, not a failed one); ``--fused`` makes megatron-core build
that family's fused optimizers (``fused_standins``: CPU stand-ins of Transformer Engine's or
apex's); ``--precision-aware`` makes it megatron's ``--use-precision-aware-optimizer`` over
Transformer Engine's (bf16 moments, with or without ``--store-param-remainders``). Only the
standard library is imported at the top: checkpoint writers spawn helpers that re-import
this file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any


def state_sums(ctx: Any) -> dict:
    import torch

    from chameleon_megatron.resilience.dist_opt import is_distributed
    from chameleon_megatron.resilience.model_state import (
        ModelState, megatron_leaves, unit_parameters)

    model = ctx.model
    leaf = next(megatron_leaves(ctx.extra["optimizer"])).optimizer
    inner = type(leaf).__name__
    moments = str(getattr(leaf, "exp_avg_dtype", torch.float32))  # the fused Adams' storage
    if is_distributed(ctx.extra["optimizer"]):
        return {"tp_rank": ctx.tp_rank, "dp_rank": ctx.dp_rank, "pieces": True,
                "optimizer": inner, "moments": moments,
                "sums": shard_sums(model, ctx.extra["optimizer"])}
    view = ModelState(model, ctx.extra["optimizer"], role="source")
    sums: dict[str, dict] = {}
    for unit, params in unit_parameters(model).items():
        optim = view.tensors(unit, "optimizer")
        for name, p in params.items():
            state = {key.rpartition("/")[2]: t for key, t in optim.items()
                     if key.rpartition("/")[0] == name}
            step = state.pop("step", None)  # Adam's; SGD keeps a momentum buffer only
            sums[f"{unit}|{name}"] = {
                "sharded": bool(getattr(p, "tensor_model_parallel", False)),
                "param": float(p.detach().double().pow(2).sum()),
                **{key: float(t.double().pow(2).sum()) for key, t in state.items()},
                "step": None if step is None else float(step),
            }
    sums.update(buffer_sums(model))
    return {"tp_rank": ctx.tp_rank, "dp_rank": ctx.dp_rank, "optimizer": inner,
            "moments": moments, "sums": sums}


def buffer_sums(model: list) -> dict:
    """The model's persistent buffers (the MoE router's ``expert_bias``), entries as a
    parameter's without optimizer state: the sum of squares and the plain sum."""
    from chameleon_megatron.resilience.model_state import unit_buffers

    return {f"{unit}|{name}": {"sharded": False, "step": None,
                               "param": float(b.double().pow(2).sum()),
                               "sum": float(b.double().sum())}
            for unit, named in unit_buffers(model).items() for name, b in named.items()}


def shard_sums(model: list, optimizer: Any) -> dict:
    """The sums of ``state_sums`` with a distributed optimizer: whole weights, and the
    optimizer state of the pieces this rank owns (the pieces of a data-parallel group add
    up to the whole)."""
    from chameleon_megatron.resilience.dist_opt import owned
    from chameleon_megatron.resilience.model_state import unit_parameters

    sums: dict[str, dict] = {
        f"{unit}|{name}": {"sharded": bool(getattr(p, "tensor_model_parallel", False)),
                           "param": float(p.detach().double().pow(2).sum()), "step": None}
        for unit, params in unit_parameters(model).items() for name, p in params.items()}
    for own in owned(model, optimizer):
        entry = sums[f"{own.piece.unit}|{own.piece.name}"]
        for key, t in own.state.items():
            if key == "step":
                entry["step"] = float(t)
            else:
                entry[key] = float(t.double().pow(2).sum())
    return sums


def dump_plugin(iters: int, pace_s: float = 0.0, oom_at: int | None = None,
                stall: tuple[int, float] | None = None) -> Any:
    """A plugin that keeps the last model built on this rank and sums it up at the end;
    ``pace_s``: it waits that long between two steps (so that a restarted worker has time to
    start up while the job still trains); ``oom_at``: the step whose forward-backward ends in
    an out-of-memory error on this rank (once)."""
    import contextlib
    import time

    import torch

    import torch.distributed as dist

    from chameleon_megatron.training.plugin import TrainerPlugin

    class DumpPlugin(TrainerPlugin):
        ctx: Any = None
        completed = 0
        oom_at: int | None = None
        stall: tuple[int, float] | None = None
        dump: dict | None = None

        def on_model_built(self, ctx: Any) -> None:
            self.ctx = ctx

        def on_model_dropped(self) -> None:
            self.ctx = None

        @contextlib.contextmanager
        def step_context(self, iteration: int, *, training: bool):
            if training:
                self.completed = iteration
                if self.stall and self.stall[0] == iteration:
                    time.sleep(self.stall[1])
                    self.stall = None
            yield
            if training and iteration == self.oom_at:
                self.oom_at = None
                raise torch.OutOfMemoryError(f"injected at step {iteration}")

        def between_steps(self, trainer: Any) -> None:
            time.sleep(pace_s)

        def on_train_end(self) -> None:
            # a spare has left the world; an active rank (any layout) holds its last model
            if self.completed == iters and dist.is_initialized():
                self.dump = state_sums(self.ctx)

    plugin = DumpPlugin()
    plugin.oom_at, plugin.stall = oom_at, stall
    return plugin


def freed_check() -> Any:
    """A plugin that, after each step, takes weak references to the layout being trained
    (engine, runtime, model chunks, a parameter, optimizer, DDP gradient buffers), and a
    ``check`` that lists those still alive: called as the next layout's model is built."""
    import weakref

    from chameleon_megatron.training.plugin import TrainerPlugin

    class FreedCheck(TrainerPlugin):
        def __init__(self) -> None:
            self.refs: list = []
            self.checks: list[list[str]] = []

        def between_steps(self, trainer: Any) -> None:
            engine = trainer.engine
            runtime = getattr(engine, "rt", None)
            ddps = [*trainer.model, *(runtime.parts if runtime is not None else [])]
            named = [("engine", engine), ("runtime", runtime), ("optimizer", trainer.optimizer),
                     ("parameter", next(trainer.model[0].parameters())),
                     *((f"chunk {i}", c) for i, c in enumerate(trainer.model)),
                     *((f"grad buffer {i}", b.grad_data)
                       for i, b in enumerate(b for d in ddps for b in _ddp_buffers(d)))]
            self.refs = [(name, weakref.ref(obj)) for name, obj in named if obj is not None]

        def check(self) -> None:
            if self.refs:
                self.checks.append([name for name, ref in self.refs if ref() is not None])

    return FreedCheck()


def _ddp_buffers(module: Any) -> list:
    """megatron DDP's parameter-and-gradient buffers (a list attribute: other modules have
    the ``Module.buffers`` method there)."""
    buffers = getattr(module, "buffers", None)
    return buffers if isinstance(buffers, list) else []


def check_before_builds(plugin: Any) -> None:
    """Run ``plugin.check`` as a megatron layout's chunks or a plan's stage are built."""
    from chameleon_megatron.resilience.execution import runtime
    from chameleon_megatron.training import model

    for module, name in ((model, "build_model_chunks"), (runtime, "build_stage_model")):
        def checked(*args: Any, _build: Any = getattr(module, name), **kwargs: Any) -> Any:
            plugin.check()
            return _build(*args, **kwargs)
        setattr(module, name, checked)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dump", type=Path, required=True)
    parser.add_argument("--iters", type=int, required=True)
    parser.add_argument("--pace-s", type=float, default=0.0)
    parser.add_argument("--oom-at", default=None, metavar="RANK:ITERATION")
    parser.add_argument("--stall-at", default=None, metavar="RANK:ITERATION:SECONDS")
    parser.add_argument("--fused", default=None, choices=["te", "apex"])
    parser.add_argument("--precision-aware", default=None,
                        choices=["bf16", "bf16-remainders", "fp16"])
    parser.add_argument("--check-freed", action="store_true",
                        help="write DIR/<rank>.freed.json: what of the old layout was alive "
                             "when each new one was built")
    ours, rest = parser.parse_known_args(argv)
    me = int(os.environ.get("RANK", "0"))
    oom_at = stall = None
    if ours.oom_at is not None:
        oom_rank, oom_iteration = map(int, ours.oom_at.split(":"))
        oom_at = oom_iteration if me == oom_rank else None
    if ours.stall_at is not None:
        rank, iteration, seconds = ours.stall_at.split(":")
        stall = (int(iteration), float(seconds)) if me == int(rank) else None
    if "RANK" in os.environ:  # under a launcher: leave when it is gone
        sys.path.insert(0, str(Path(__file__).parent))
        from rt_support import guard_worker

        # a last resort against leaked workers, beyond the longest job (the soak's, up to its
        # 1800 s test timeout): 400 s killed the last original worker of a soak job that had
        # waited out a hang (seed 479296), and the job with it
        guard_worker(1500)
    if ours.fused is not None:
        sys.path.insert(0, str(Path(__file__).parent))
        from fused_standins import install

        install(ours.fused)
    if ours.precision_aware is not None:
        sys.path.insert(0, str(Path(__file__).parent))
        import torch
        from fused_standins import install_precision_aware

        moments = torch.float16 if ours.precision_aware == "fp16" else torch.bfloat16
        install_precision_aware(moments, ours.precision_aware.endswith("remainders"))
    from chameleon_megatron import pretrain_gpt
    from chameleon_megatron.logs import setup_logging

    plugin = dump_plugin(ours.iters, ours.pace_s, oom_at, stall)
    extra = [plugin]
    if ours.check_freed:
        extra.append(freed := freed_check())
        check_before_builds(freed)
    build = pretrain_gpt.build_plugins
    pretrain_gpt.build_plugins = lambda cfg: [*build(cfg), *extra]
    setup_logging(int(os.environ.get("RANK", 0)))
    pretrain_gpt.run([*rest, "--train-iters", str(ours.iters)])
    rank = os.environ.get("CHAMELEON_FT_JOIN_ID") or os.environ.get("RANK", "0")
    (ours.dump / f"{rank}.json").write_text(json.dumps(plugin.dump or {"spare": True}))
    if ours.check_freed:
        (ours.dump / f"{rank}.freed").write_text(json.dumps(freed.checks))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
