"""A ``Trainer`` set up in a world of one, in this process (as ``pretrain_gpt`` sets it up:
the CPU platform patch, optionally megatron's Transformer-Engine-absent patch).

Tests using it must run before ``tests/swap`` in the session: its session fixture holds a
one-process world of its own until the session ends."""

from __future__ import annotations

import contextlib
from typing import Iterator

from chameleon_megatron.config import build_config
from chameleon_megatron.megatron import groups
from chameleon_megatron.megatron.platform import CpuPlatform
from chameleon_megatron.megatron.te_absent import TeAbsentPatch
from chameleon_megatron.training.arguments import parse_args
from chameleon_megatron.training.env import DistEnv
from chameleon_megatron.training.trainer import Trainer
from chameleon_megatron.training.validate import validate_args

SMALL_GPT = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
             "--mock-data", "--vocab-size", "64", "--lr", "1e-2", "--log-interval", "100"]
"""A GPT small enough to train a few steps in a second (``--train-iters`` is the caller's)."""


@contextlib.contextmanager
def one_process_trainer(argv: list[str], *, te_absent: bool = False) -> Iterator[Trainer]:
    """The trainer of ``argv``, set up; closed, its groups destroyed and the patches removed
    on exit."""
    args = parse_args(argv)
    validate_args(args, 1)
    patches = [CpuPlatform(), *([TeAbsentPatch()] if te_absent else [])]
    for patch in patches:
        patch.apply()
    run = Trainer(args, build_config(), env=DistEnv(0, 1, 0))
    try:
        run.setup()
        yield run
    finally:
        run.close()
        groups.destroy()
        for patch in reversed(patches):
            patch.remove()
