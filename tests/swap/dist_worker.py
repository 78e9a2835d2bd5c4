"""Worker of the multi-process swap tests (run as a script, one process per rank).

For each layout it trains the same tiny GPT twice through the project's trainer, without
and with ``--chameleon-swap``, in one process group, and writes this rank's per-iteration
loss, gradient norm and swap metrics to ``<out>/rank<R>.json``.

    torchrun --standalone --nproc-per-node=2 tests/swap/dist_worker.py OUT_DIR LAYOUTS_JSON
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "128",
        "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", "3", "--lr", "1e-3", "--log-interval", "100",
        "--distributed-timeout-minutes", "1", "--seed", "7"]


def train(argv: list[str], env) -> list[dict]:
    from megatron.core import parallel_state

    from chameleon_megatron.config import config_from_args
    from chameleon_megatron.pretrain_gpt import build_plugins
    from chameleon_megatron.training.arguments import parse_args
    from chameleon_megatron.training.trainer import Trainer
    from chameleon_megatron.training.validate import validate_args

    args = validate_args(parse_args(argv), env.world_size)
    cfg = config_from_args(args)
    trainer = Trainer(args, cfg, build_plugins(cfg), env)
    try:
        trainer.setup()
        history = trainer.train()
    finally:
        trainer.close()
        parallel_state.destroy_model_parallel()
    return [{"loss": r["loss"], "grad_norm": r["grad_norm"], "swap": r.get("swap")}
            for r in history if r.get("event") == "iteration"]


def main(out_dir: str, layouts_json: str) -> None:
    import torch

    from chameleon_megatron.megatron.platform import CpuPlatform
    from chameleon_megatron.megatron import groups
    from chameleon_megatron.megatron.te_absent import TeAbsentPatch
    from chameleon_megatron.training.env import env_from_torchrun

    torch.set_num_threads(1)
    layouts = json.loads(layouts_json)
    env = env_from_torchrun()
    platform, te_absent = CpuPlatform(), TeAbsentPatch()  # as pretrain_gpt.run sets them up
    platform.apply()
    te_absent.apply()
    results = {}
    try:
        for name, spec in layouts.items():
            argv = BASE + spec["flags"]
            results[name] = {"off": train(argv, env), "on": train(argv + spec["swap"], env)}
    finally:
        groups.destroy()
        te_absent.remove()
        platform.remove()
    Path(out_dir, f"rank{env.rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
