"""Checks of what a run is given that need files or the environment, before any work starts.

``validate_args`` checks the flags against each other; this checks them against the world:
the data files exist, the fault-tolerant launcher is there, and the metrics file is not
another run's. Each failure is a ConfigError naming the flag and the value.
"""

from __future__ import annotations

import argparse
import os

from chameleon_megatron.config import ChameleonConfig
from chameleon_megatron.configurable import ConfigError
from chameleon_megatron.metrics_file import run_ids
from chameleon_megatron.resilience.store.env import AGENT_ENV, JOIN_ENV, RELAUNCH_ENV
from chameleon_megatron.training.data_files import check_data_files


def preflight(args: argparse.Namespace, cfg: ChameleonConfig) -> None:
    check_data_files(args)
    check_launcher(cfg)
    check_metrics_file(cfg)


def check_launcher(cfg: ChameleonConfig) -> None:
    """Fault tolerance needs the workers started by chameleon-run's agent."""
    if cfg.ft.enabled and os.environ.get(AGENT_ENV) != "1":
        raise ConfigError("--chameleon-ft: needs the chameleon-run launcher (chameleon-run "
                          "... or python -m chameleon_megatron.run ..., torchrun's arguments), "
                          "whose agent keeps the survivors of a failure running")


def check_metrics_file(cfg: ChameleonConfig) -> None:
    """A metrics file that holds a run is refused unless ``--chameleon-metrics-append``."""
    path = cfg.metrics.file
    # A relaunched, restarted or joining worker continues the run already in the file.
    continuing = cfg.ft.join or RELAUNCH_ENV in os.environ or JOIN_ENV in os.environ
    if path and not cfg.metrics.append and not continuing and run_ids(path):
        raise ConfigError(f"--chameleon-metrics-file {path}: already holds a run; give "
                          "--chameleon-metrics-append to add this one to it, or another file")
