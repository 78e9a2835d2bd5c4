"""Losing the job store: the survivors resume the job from its last checkpoint by themselves.

The store lives in the agent of the static rendezvous' node 0; when that node is lost, no
survivor can announce, meet or agree any more, so in-memory recovery is over. Each surviving
launch agent then knows, from the beats it had read, which other agents were still training
(``NodeWatch.launch_survivors``): every one of them derives the same new launch from that
list (``relaunch_args``): a static rendezvous of the survivors, the first one hosting the
new store at the old port, node ranks in the old order, and the training command resuming
from the checkpoint directory (``--load``, or ``--save`` when no ``--load`` was given). The
workers of the relaunched job see ``job_store.RELAUNCH_ENV`` and record the resume.
"""

from __future__ import annotations

import argparse
import copy

import torch.distributed.run as torchrun


class StoreLost(Exception):
    """Raised by an agent whose job store is gone while its workers trained."""

    def __init__(self, survivors: list[tuple[int, str]], me: int, cause: str, *,
                 launch_agents: int) -> None:
        super().__init__(f"job store lost ({cause}); surviving agents {survivors}")
        self.cause = cause
        self.launch_agents = launch_agents
        """How many agents the launch had (``quorum``'s majority is of these)."""
        self.survivors = tuple(survivors)
        """(old group rank, address) of the launch's agents still training, this one
        included."""
        self.me = me
        """This agent's old group rank."""


def _training_flags(training_args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--save", default=None)
    parser.add_argument("--load", default=None)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    namespace, _ = parser.parse_known_args(training_args)
    return namespace


def resume_directory(training_args: list[str]) -> str | None:
    """Where a resumed job loads from: ``--load``, else ``--save``."""
    flags = _training_flags(training_args)
    return flags.load or flags.save


def relaunch_args(args: argparse.Namespace, lost: StoreLost) -> argparse.Namespace:
    """torchrun's arguments for this node in the job the survivors resume (ValueError when
    they cannot: not a static rendezvous, no checkpoint directory, a world size the model's
    parallelism does not divide)."""
    if args.rdzv_backend != "static" or args.rdzv_endpoint:
        raise ValueError(f"--rdzv-backend={args.rdzv_backend}: the survivors relaunch by "
                         "themselves only from a static rendezvous (--master-addr/--master-port)")
    flags = _training_flags(args.training_script_args)
    directory = resume_directory(args.training_script_args)
    if directory is None:
        raise ValueError("the job store is lost and the job has no checkpoint directory "
                         "(--save/--load): nothing to resume from")
    order = [g for g, _ in lost.survivors]
    if lost.me not in order:
        raise ValueError(f"this agent (group rank {lost.me}) is not among the survivors {order}")
    world = len(order) * torchrun.determine_local_world_size(args.nproc_per_node)
    model_parallel = flags.tensor_model_parallel_size * flags.pipeline_model_parallel_size
    if world % model_parallel:
        raise ValueError(f"{len(order)} surviving nodes x {args.nproc_per_node} workers = {world}"
                         f" ranks: not a multiple of TP x PP = {model_parallel}; the job cannot "
                         f"resume on them (relaunch it with --load {directory})")
    new = copy.copy(args)
    new.nnodes = str(len(order))
    new.node_rank = order.index(lost.me)
    new.master_addr = lost.survivors[0][1]
    new.training_script_args = [*args.training_script_args] if flags.load else \
        [*args.training_script_args, "--load", directory]
    return new
