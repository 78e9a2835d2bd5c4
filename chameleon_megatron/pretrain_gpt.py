"""GPT pretraining on megatron-core, the ``pretrain_gpt.py`` of Megatron-LM with Chameleon.

Run it under ``torchrun`` (or ``chameleon-run`` for fault tolerance); without a launcher it
trains in one process. Flags are Megatron-LM's, plus ``--chameleon-*``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

from chameleon_megatron.config import ChameleonConfig, config_from_args
from chameleon_megatron.configurable import ConfigError
from chameleon_megatron.errors import user_errors
from chameleon_megatron.logs import setup_logging
from chameleon_megatron.preflight import preflight
from chameleon_megatron.resilience.recovery.faults import check_end_of_job_faults
from chameleon_megatron.resilience.launch.with_agent import end_with_agent
from chameleon_megatron.training.arguments import parse_args
from chameleon_megatron.training.env import env_from_torchrun
from chameleon_megatron.training.validate import validate_args

if TYPE_CHECKING:
    from chameleon_megatron.training.plugin import TrainerPlugin

logger = logging.getLogger("chameleon_megatron.pretrain_gpt")
PROG = "chameleon-pretrain-gpt"


def build_plugins(cfg: ChameleonConfig) -> list["TrainerPlugin"]:
    """The Chameleon subsystems this run enables, in the order their hooks nest."""
    plugins: list["TrainerPlugin"] = []
    if cfg.ft.enabled:  # outermost: its step time includes the others' work
        from chameleon_megatron.resilience.recovery.plugin import ResiliencePlugin
        from chameleon_megatron.swap.config import planned_bandwidth

        plugins.append(ResiliencePlugin(cfg.ft,
                                        swap_bandwidth_Bps=planned_bandwidth(cfg.swap)))
    if cfg.swap.enabled:
        from chameleon_megatron.swap.plugin import SwapPlugin

        plugins.append(SwapPlugin(cfg.swap))
    return plugins


def run(argv: list[str] | None = None) -> list[dict]:
    """Parse, validate, train; returns this rank's metrics records."""
    # Heavy imports stay inside: checkpoint writers spawn helper processes that re-import
    # the main module, and bad flags should fail before torch and megatron are loaded.
    env = env_from_torchrun()
    end_with_agent()  # under chameleon-run: no worker outlives its agent
    args, cfg = checked_args(argv, env.world_size, speak=env.rank == 0)
    from chameleon_megatron.megatron.platform import CpuPlatform

    platform = CpuPlatform()
    platform.apply()  # before megatron-core is imported (see its torch.compile note)
    from chameleon_megatron.megatron import groups
    from chameleon_megatron.megatron.te_absent import TeAbsentPatch
    from chameleon_megatron.training.trainer import Trainer

    te_absent = TeAbsentPatch()
    te_absent.apply()

    trainer = Trainer(args, cfg, build_plugins(cfg), env)
    try:
        # A checkpoint that does not fit the model is the user's to fix (every rank sees it).
        with user_errors(PROG, speak=env.rank == 0, only=(ConfigError,)):
            trainer.setup(join=joining(cfg))
        return trainer.train()
    finally:
        trainer.close()
        groups.destroy()
        te_absent.remove()
        platform.remove()


def checked_args(argv: list[str] | None, world_size: int, *, prog: str = PROG,
                 speak: bool = True) -> tuple[argparse.Namespace, ChameleonConfig]:
    """The run's arguments and Chameleon config, checked against each other and the world;
    a mistake ends the process with ``<prog>: error: <line>`` (said where ``speak``: by rank 0
    only, as every rank has the same)."""
    with user_errors(prog, speak=speak):
        args = validate_args(parse_args(argv), world_size)
        cfg = config_from_args(args)
        preflight(args, cfg)
        check_end_of_job_faults(cfg.ft.inject_fault, args.train_iters, megatron_lm=False)
    return args, cfg


def joining(cfg: ChameleonConfig) -> bool:
    """Whether this process was started to join a running job (a restarted worker)."""
    if not cfg.ft.enabled:
        return False
    from chameleon_megatron.resilience.store.joiners import join_id_from_env

    return join_id_from_env() is not None


def main(argv: list[str] | None = None) -> int:
    setup_logging(env_from_torchrun().rank)
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
