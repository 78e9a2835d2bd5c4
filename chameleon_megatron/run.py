"""chameleon-run: torchrun, with an agent that keeps the survivors of a failure running.

Takes torchrun's arguments unchanged (``--nproc-per-node``, ``--nnodes``, ``--node-rank``,
``--rdzv-backend``, ``--rdzv-endpoint``, ``--rdzv-id``, ``--master-addr``, ``--master-port``,
``-m module`` or a script, then the training arguments). When the training arguments enable
fault tolerance (``--chameleon-ft``, or ``ft.enabled`` in a ``--chameleon-config`` preset), each
node runs ``ChameleonAgent`` instead of torchrun's; otherwise this is plain torchrun. With
``--chameleon-ft-join`` too, this node joins a running job (``join_node.py``). When the job
store is lost with node 0, the surviving nodes relaunch the job among themselves from its
last checkpoint (``store_loss.py``) when they hold a majority of the launch's nodes; a node on
the losing side of a partition stops with status 75 (``quorum.py``).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import time

import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

from chameleon_megatron.config import add_chameleon_args, config_from_args
from chameleon_megatron.errors import USAGE_EXIT, fail, user_errors
from chameleon_megatron.logs import log_ours
from chameleon_megatron.megatron import torch_seams
from chameleon_megatron.resilience.config import ResilienceConfig
from chameleon_megatron.resilience.launch import deadline, quorum
from chameleon_megatron.resilience.launch.agent import ChameleonAgent
from chameleon_megatron.resilience.launch.join_node import run_joining_node
from chameleon_megatron.resilience.launch.store_loss import (
    StoreLost,
    relaunch_args,
    resume_directory,
)
from chameleon_megatron.resilience.store.env import AGENT_ENV, AGENT_PID_ENV, RELAUNCH_ENV

logger = logging.getLogger("chameleon_megatron.run")  # also when run as __main__
PROG = "chameleon-run"
TRAINER = "chameleon_megatron.pretrain_gpt"


def ft_config(training_args: list[str]) -> ResilienceConfig:
    """The ``ft`` section the training command will run with (flags over preset)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_chameleon_args(parser)
    namespace, _ = parser.parse_known_args(training_args)
    return config_from_args(namespace).ft


def check_ft_launch(args: argparse.Namespace) -> None:
    """Refuse torchrun options that would undo in-process recovery, before anything starts."""
    if args.max_restarts != 0:
        raise ValueError(f"--max-restarts={args.max_restarts}: must be 0 with --chameleon-ft "
                         "(a restart relaunches every worker; recovery happens in-process)")
    if args.run_path:
        raise ValueError("--run-path: not supported with --chameleon-ft (workers must be "
                         "processes of their own so one can fail alone)")
    if os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1":
        raise ValueError("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: the job store must be the "
                         "agent's (with it off, worker 0 hosts the store and dies with it)")


def check_world(args: argparse.Namespace) -> None:
    """A process count that cannot be a world: one line here, not a worker's traceback."""
    nproc = str(args.nproc_per_node)
    if nproc.lstrip("-").isdigit() and int(nproc) < 1:
        raise ValueError(f"--nproc-per-node={nproc}: must be >= 1")
    for bound in str(args.nnodes).split(":"):
        if bound.lstrip("-").isdigit() and int(bound) < 1:
            raise ValueError(f"--nnodes={args.nnodes}: every bound must be >= 1")


def check_training_args(args: argparse.Namespace) -> None:
    """When the workers run this project's trainer on a known world size, check their
    arguments here: a mistake is one line before any worker starts, not one per worker."""
    if not (args.module and args.training_script == TRAINER):
        return
    nproc, nnodes = str(args.nproc_per_node), str(args.nnodes)
    low, _, high = nnodes.partition(":")
    nnodes = low if high in ("", low) else ""  # "1" and "1:1" fix it; elastic "1:4" does not
    if not (nproc.isdigit() and nnodes.isdigit()):  # nor do "gpu" and "auto"
        return
    from chameleon_megatron.pretrain_gpt import checked_args

    checked_args(args.training_script_args, int(nproc) * int(nnodes), prog=PROG)


def worker_failure(exc: ChildFailedError) -> tuple[str, int]:
    """One line for the workers that failed (their own messages are above it) and the exit
    code to end with: the first failed worker's, one that exited by itself before those
    ended by a signal (torchrun stops the others once one fails: on a loaded machine a
    lower rank may still be running then, and is not the cause)."""
    failures = sorted(exc.failures.items(), key=lambda f: ((f[1].exitcode or 0) <= 0, f[0]))
    rank, first = failures[0]
    others = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
    return (f"worker rank {rank} (local rank {first.local_rank}, pid {first.pid}) exited with "
            f"code {first.exitcode}{others}; its output is above", first.exitcode or 1)


def checked_launch(argv: list[str]) -> tuple[argparse.Namespace, ResilienceConfig]:
    """torchrun's arguments and the job's ``ft`` section, checked before anything starts; a
    mistake ends the process with one ``chameleon-run: error:`` line. With fault tolerance,
    marks the environment as the agent's (the workers inherit it; the training arguments
    are checked as theirs)."""
    args = torchrun.parse_args(argv)
    with user_errors(PROG):
        check_world(args)
        ft = ft_config(args.training_script_args)
        if ft.enabled:
            check_ft_launch(args)
            os.environ[AGENT_ENV] = "1"
    check_training_args(args)
    return args, ft


@record
def main(argv: list[str] | None = None) -> int:
    args, ft = checked_launch(sys.argv[1:] if argv is None else argv)
    if ft.enabled:
        os.environ[AGENT_PID_ENV] = str(os.getpid())  # its workers end with it
    # torchrun logs a failed worker at ERROR; the line printed below says the same.
    logging.getLogger(torch_seams.LAUNCH_API_LOGGER).addFilter(
        lambda record: "failed (exitcode" not in record.getMessage())
    try:
        return leave(launch(args, ft))
    except ChildFailedError as exc:
        message, code = worker_failure(exc)
        fail(PROG, message)
        return leave(code if code > 0 else USAGE_EXIT)


def leave(code: int) -> int:
    """``code``, or this process ends with it at once when a store call it gave up on is
    still blocked (``deadline.abandoned``)."""
    if deadline.abandoned():
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def launch(args: argparse.Namespace, ft: ResilienceConfig) -> int:
    if not ft.enabled:
        torchrun.run(args)
        return 0
    log_ours()  # the agent's records: failures, restarts, joins
    # NCCL: on a communication error abort the communicators and raise (2), rather than
    # tear the process down (torchrun's default 1), so that the survivors can recover.
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    if ft.join:
        return run_joining_node(args, ft)
    relaunches = 0
    while True:
        try:
            with torch_seams.torchrun_agent(functools.partial(ChameleonAgent, ft=ft)):
                torchrun.run(args)
            return 0
        except quorum.CutOff as cut:
            fail(PROG, str(cut))
            return quorum.CUT_OFF_EXIT
        except StoreLost as lost:
            verdict = quorum.storeless_side(lost.launch_agents, len(lost.survivors))
            if not verdict.go_on:
                fail(PROG, str(quorum.CutOff(f"job store lost ({lost.cause})", verdict)))
                return quorum.CUT_OFF_EXIT
            args = relaunch_args(args, lost)  # ValueError: cannot resume, said why
            # the store's side stops its workers within this window (quorum.py)
            time.sleep(quorum.relaunch_wait_s(ft.node_timeout_s))
            relaunches += 1
            os.environ[RELAUNCH_ENV] = str(relaunches)
            logger.error({"event": "relaunch", "why": str(lost), "count": relaunches,
                          "nodes": int(args.nnodes), "node_rank": args.node_rank,
                          "store": f"{args.master_addr}:{args.master_port}",
                          "resume_from": resume_directory(args.training_script_args)})


if __name__ == "__main__":
    sys.exit(main())
