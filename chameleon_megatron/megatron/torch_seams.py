"""The private parts of torch.distributed that the project relies on, each behind a check.

torch offers no public way to list process groups, read a group's current timeout, reach the
worker processes of an elastic agent, or choose the agent class ``torchrun`` builds. Each such
use lives here, and each checks that what it needs exists before using it, so that a torch
release that moves it fails with one message naming the torch version and the missing piece
instead of an ``AttributeError`` in the middle of a recovery.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import logging
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class TorchSeamError(RuntimeError):
    """A private torch API the project needs is missing or changed in this torch release."""


def _missing(what: str) -> TorchSeamError:
    return TorchSeamError(f"torch {torch.__version__}: {what} is missing or changed; this "
                          "chameleon-megatron release needs it (supported: torch 2.4 to 2.14)")


def registered_groups() -> list[dist.ProcessGroup]:
    """Every process group torch.distributed knows of (the default one included)."""
    if not dist.is_initialized():
        return []
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is None or not hasattr(world, "pg_map"):
        raise _missing("torch.distributed.distributed_c10d._world.pg_map")
    return list(world.pg_map)


def group_timeout(group: dist.ProcessGroup) -> datetime.timedelta:
    """The collective timeout ``group`` has now (``set_timeout`` updates it). gloo's
    point-to-point waits keep the timeout the group was created with unless given this one."""
    device = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
    try:
        timeout = group._get_backend(device).options._timeout
    except AttributeError as exc:
        raise _missing("ProcessGroup._get_backend(device).options._timeout") from exc
    if not isinstance(timeout, datetime.timedelta):
        raise _missing("ProcessGroup._get_backend(device).options._timeout (a timedelta)")
    return timeout


def storage_users(t: torch.Tensor) -> int:
    """How many tensors share ``t``'s storage (``t`` itself included)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        raise _missing("torch._C._storage_Use_Count")
    storage = t.untyped_storage()
    return use_count(storage._cdata) - 1  # less the storage object just taken


def check_abort(group_class: type = dist.ProcessGroup) -> None:
    """Refuse a torch whose process groups cannot be aborted (``ProcessGroup.abort`` came
    with torch 2.7): an NCCL collective blocked on a dead peer could not be interrupted."""
    if not callable(getattr(group_class, "abort", None)):
        raise TorchSeamError(f"torch {torch.__version__}: ProcessGroup.abort is missing (torch "
                             "2.7 added it); fault tolerance over NCCL needs it to interrupt a "
                             "collective blocked on a dead peer: use torch >= 2.7, or gloo")


def abort_together(nccl_groups: list[Any]) -> int:
    """Abort NCCL groups inside one ``ncclGroupStart``/``ncclGroupEnd`` (as torch's own
    ``_abort_process_group`` does for the world): aborted one at a time, one communicator's
    abort can wait behind another's hung kernel. Newest first; returns how many aborted.
    A group that fails to abort (already aborted by the watchdog) is logged and skipped."""
    if not nccl_groups:
        return 0
    try:
        backend = nccl_groups[0]._get_backend(torch.device("cuda"))
        start, end = backend._group_start, backend._group_end
    except (AttributeError, RuntimeError) as exc:
        raise _missing("ProcessGroupNCCL._group_start/_group_end") from exc
    aborted = 0
    start()
    try:
        for group in reversed(nccl_groups):
            try:
                group.abort()
                aborted += 1
            except RuntimeError as exc:
                logger.warning("abort of %s failed: %s", group, exc)
    finally:
        end()
    return aborted


# ---------------------------------------------------------------------------- elastic agent
LAUNCH_API_LOGGER = "torch.distributed.elastic.multiprocessing.api"
"""The logger torchrun reports a worker's exit with (a name, not an API: a rename only
lets that report through again)."""

AGENT_HOOKS = {
    "_start_workers": ("worker_group",),
    "_monitor_workers": ("worker_group",),
    "_restart_workers": ("worker_group",),
    "_exit_barrier": (),
    "_shutdown": ("death_sig", "timeout"),
}
"""The methods of torch's ``LocalElasticAgent`` that ``ChameleonAgent`` overrides, with the
parameters it expects them to take."""


def check_agent_hooks(agent_class: type) -> None:
    """Refuse a torch whose elastic agent lacks a method ``ChameleonAgent`` overrides."""
    for name, params in AGENT_HOOKS.items():
        method = getattr(agent_class, name, None)
        if method is None:
            raise _missing(f"{agent_class.__name__}.{name}")
        have = list(inspect.signature(method).parameters)[1:]
        if list(params) != have[:len(params)]:
            raise _missing(f"{agent_class.__name__}.{name}({', '.join(params)}) "
                           f"(found ({', '.join(have)}))")


def started_workers(agent: Any) -> dict[int, tuple[Any, dict[str, str], str, str]]:
    """local rank -> (its ``Popen``, its environment, stdout and stderr paths) of the workers
    an elastic agent has just started. ValueError when they are not processes of their own
    (``--run-path`` runs them as functions)."""
    pcontext = getattr(agent, "_pcontext", None)
    if pcontext is None:
        raise _missing("LocalElasticAgent._pcontext")
    if not hasattr(pcontext, "subprocess_handlers"):
        raise ValueError("--chameleon-ft needs workers started as commands, not --run-path")
    try:
        return {local: (handler.proc, dict(pcontext.envs[local]), pcontext.stdouts[local],
                        pcontext.stderrs[local])
                for local, handler in pcontext.subprocess_handlers.items()}
    except AttributeError as exc:
        raise _missing("the process context's envs, stdouts and stderrs") from exc


def error_file(agent: Any, local_rank: int) -> str:
    """Where a worker of an elastic agent writes its error (torch's ``@record``)."""
    try:
        return agent._pcontext.error_files[local_rank]
    except AttributeError as exc:
        raise _missing("LocalElasticAgent._pcontext.error_files") from exc


@contextlib.contextmanager
def torchrun_agent(factory: Callable[..., Any]) -> Iterator[None]:
    """Make ``torchrun``'s ``launch_agent`` build its agent with ``factory`` (it looks the
    class up by its module-level name); restored on exit."""
    import torch.distributed.launcher.api as launcher_api

    if not hasattr(launcher_api, "LocalElasticAgent"):
        raise _missing("torch.distributed.launcher.api.LocalElasticAgent")
    original = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = factory  # type: ignore[misc, assignment]
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = original  # type: ignore[misc]
