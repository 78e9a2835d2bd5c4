"""The resilience checks of ``gpu_checks.py``: code that recovers a job, run on one GPU.

Each check takes ``(dry_run, broken)`` and returns its figures with ``passed``; ``broken``
injects the check's deliberate defect (``--break``), which must make it fail. Each check's
use of the library sits in one small function, named in its docstring.

* ``nccl_abort`` (world of one, 20 cycles; ``groups.init_from_launcher``,
  ``groups.new_groups``, ``Teardown.interrupt`` from a thread, ``Teardown.leave``):
  three NCCL groups each run a collective (communicators exist), then each gets a collective
  queued behind a busy kernel (pending) and is aborted from a watcher thread; an exception
  there fails the check. Torch's allocated and reserved memory and the device's used memory
  after the last cycle must not exceed the first's. Defect: the abort is skipped.
* ``optimizer_shards`` (world of one, bf16, megatron's distributed optimizer, with TE's
  FusedAdam when TE imports, else torch's AdamW; ``shard_replica.collect``,
  ``shard_assembly.AssembledUnits``, ``dist_opt.sink_view``, ``transfer.migrate``,
  ``ShardSink.commit``): after two steps the shard is copied to the host, the state on the
  device overwritten, rebuilt from the copy and committed; every main piece, optimizer state
  and parameter must be bitwise what it was. Defect: one element of the copy nudged.
* ``grad_sync``, ``plan_failover``, ``recovery_memory``: launched jobs
  (``gpu_plan_job.py``), judged here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def _device(dry_run: bool) -> torch.device:
    if dry_run:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA (use --dry-run on a machine without a GPU)")
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def in_thread(fn: Callable[[], Any], timeout_s: float) -> tuple[Any, float]:
    """``fn()`` in a thread of its own (as the abort watcher runs it): (its result, seconds).
    An exception raised there is raised here; a thread still running is an error."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - carried to the caller
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    start = time.monotonic()
    thread.start()
    thread.join(timeout_s)
    seconds = time.monotonic() - start
    if thread.is_alive():
        raise TimeoutError(f"the watcher thread still runs after {timeout_s} s")
    if "error" in box:
        raise RuntimeError(f"the watcher thread raised: {box['error']!r}") from box["error"]
    return box["result"], seconds


# ------------------------------------------------------------------------- (a) NCCL abort
def abort_cycle(backend: str, device: torch.device, skip_abort: bool) -> dict[str, Any]:
    """One create/use/abort/destroy cycle in a world of one (the library calls)."""
    from chameleon_megatron.megatron import groups
    from chameleon_megatron.megatron.teardown import Teardown

    groups.init_from_launcher(rank=0, world_size=1, backend=backend, timeout_s=60)
    teardown = Teardown(backend, None)  # no job store: no connection is shut down
    handles = [dist.group.WORLD, *groups.new_groups([(0,), (0,)], timeout_s=60)]
    x = torch.ones(MiB, device=device)
    for g in handles:  # communicators are created by a group's first collective
        dist.all_reduce(x, group=g)
    _sync(device)
    used = bool(torch.all(x == 1.0))
    if device.type == "cuda":
        torch.cuda._sleep(400_000_000)  # about 0.2 s: the collectives below wait behind it
    works = [dist.all_reduce(torch.ones(MiB, device=device), group=g, async_op=True)
             for g in handles]
    pending = sum(not w.is_completed() for w in works)
    aborted, abort_s = in_thread(lambda: 0 if skip_abort else teardown.interrupt(),
                                 timeout_s=30)
    start = time.monotonic()
    del works
    teardown.leave()
    _sync(device)
    return {"groups": len(handles), "used": used, "pending": pending, "aborted": aborted,
            "abort_s": round(abort_s, 4), "destroy_s": round(time.monotonic() - start, 4)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_memory(device: torch.device) -> dict[str, int]:
    if device.type != "cuda":
        return {"allocated": 0, "reserved": 0, "device_used": 0}
    free, total = torch.cuda.mem_get_info(device)
    return {"allocated": torch.cuda.memory_allocated(device),
            "reserved": torch.cuda.memory_reserved(device), "device_used": total - free}


def nccl_abort(dry_run: bool, broken: bool) -> dict[str, Any]:
    device = _device(dry_run)
    backend = "gloo" if dry_run else "nccl"
    cycles = 3 if dry_run else 20
    # as chameleon-run sets it for its workers: an aborted communicator raises, and its
    # watchdog does not tear the process down
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    runs, memory = [], []
    for _ in range(cycles):
        runs.append(abort_cycle(backend, device, skip_abort=broken))
        memory.append(_device_memory(device))
    reason = abort_failure(runs, memory, nccl=backend == "nccl")
    growth = {k: memory[-1][k] - memory[0][k] for k in memory[0]}
    return {"backend": backend, "cycles": cycles, "broken": broken,
            "async_error_handling": os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"],
            "first": runs[0],
            "last": runs[-1], "memory_first": memory[0], "memory_last": memory[-1],
            "memory_growth": growth, "max_abort_s": max(r["abort_s"] for r in runs),
            "max_destroy_s": max(r["destroy_s"] for r in runs),
            "passed": reason is None, "reason": reason}


def abort_failure(runs: list[dict], memory: list[dict], *, nccl: bool) -> str | None:
    """Why the abort cycles fail (None: they pass). On NCCL every group must have had work
    pending and been aborted; on gloo nothing is aborted (its connections are another path)."""
    wrong = [k for k, r in enumerate(runs)
             if not r["used"] or r["aborted"] != (r["groups"] if nccl else 0)
             or (nccl and r["pending"] < r["groups"]) or r["abort_s"] > 10]
    growth = {k: memory[-1][k] - memory[0][k] for k in memory[0]}
    if wrong:
        return f"cycles {wrong}: not every group used, pending and aborted"
    if growth["allocated"] > 0 or growth["reserved"] > 0 or growth["device_used"] > 64 * MiB:
        return f"device memory grew over {len(runs)} cycles: {growth}"
    return None


# ---------------------------------------------------------------- (b) optimizer and shards
def _trainer(device: torch.device) -> Any:
    """Megatron's distributed optimizer in a world of one, bf16, after two steps."""
    from chameleon_megatron.config import config_from_args
    from chameleon_megatron.training.arguments import parse_args
    from chameleon_megatron.training.env import DistEnv
    from chameleon_megatron.training.trainer import Trainer
    from chameleon_megatron.training.validate import validate_args

    args = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads",
                       "4", "--seq-length", "64", "--vocab-size", "128",
                       "--make-vocab-size-divisible-by", "32", "--mock-data",
                       "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-3",
                       "--train-iters", "2", "--bf16", "--use-distributed-optimizer"])
    validate_args(args, 1)
    trainer = Trainer(args, config_from_args(args), [], DistEnv(0, 1, 0))
    trainer.setup()
    for _ in range(2):
        trainer.train_one()
    return trainer


def restore_from_shard_copy(model: list, optimizer: Any, iteration: int,
                            nudge: bool) -> dict[str, Any]:
    """The shard copied to the host, the device's state overwritten, then rebuilt from the
    copy as a recovery rebuilds it (the library calls)."""
    from chameleon_megatron.megatron.groups import unregistered_gloo_group
    from chameleon_megatron.resilience.decision.restorer import Transfer
    from chameleon_megatron.resilience.dist_opt import sink_view
    from chameleon_megatron.resilience.model_state import unit_parameters
    from chameleon_megatron.resilience.recovery.shard_assembly import AssembledUnits
    from chameleon_megatron.resilience.recovery.host_copies import HostMover
    from chameleon_megatron.resilience.recovery.shard_replica import collect
    from chameleon_megatron.resilience.recovery.transfer import migrate

    mover = HostMover()
    copy = collect(model, optimizer, mover, rank=0, group=(0,), iteration=iteration)
    copy.data.wait()
    if nudge:  # the defect
        main = copy.tensor(0, "main")
        main[0] = torch.nextafter(main[0], torch.tensor(float("inf")))
    _overwrite(model, optimizer)
    sink = sink_view(model, optimizer)
    transfers = [Transfer(0, 0, unit, kind, 0.0) for unit in unit_parameters(model)
                 for kind in ("params", "optimizer")]
    report = migrate(unregistered_gloo_group(dist.HashStore(), 0, 1, timeout_s=60), [0], 0,
                     transfers, old=AssembledUnits([copy], keep=copy.units), new=sink,
                     store=dist.HashStore(), timeout_s=60)
    sink.commit()
    return {"copy_bytes": copy.nbytes, "copy_pinned": copy.data.buffers.pinned,
            "copy_asynchronous": copy.data.asynchronous, "copied_bytes": report.copied_bytes,
            "optimizer_keys": list(copy.keys), "sink": type(sink).__name__}


def _state(model: list, optimizer: Any) -> list[torch.Tensor]:
    """Every main piece, its optimizer state, and every model parameter, in one order."""
    from chameleon_megatron.resilience.dist_opt import owned

    out = []
    for own in owned(model, optimizer):
        out += [own.main, *(own.state[k] for k in sorted(own.state))]
    out += [p for chunk in model for p in chunk.parameters()]
    return out


@torch.no_grad()
def _overwrite(model: list, optimizer: Any) -> None:
    for t in _state(model, optimizer):
        t.fill_(0.5)


def optimizer_shards(dry_run: bool, broken: bool) -> dict[str, Any]:
    from chameleon_megatron.resilience.model_state import megatron_leaves

    device = _device(dry_run)
    trainer = _trainer(device)
    model, optimizer = trainer.model, trainer.optimizer
    want = [t.detach().clone() for t in _state(model, optimizer)]
    figures = restore_from_shard_copy(model, optimizer, trainer.iteration, nudge=broken)
    got = _state(model, optimizer)
    differ = sum(not torch.equal(a, b) for a, b in zip(want, got))
    inner = next(megatron_leaves(optimizer)).optimizer
    # each where it was: torch's Adam keeps its step count on the host (unless fused or
    # capturable), everything else is on the device
    moved = sum(a.device != b.device for a, b in zip(want, got))
    on_host = sum(b.device.type == "cpu" for b in got) if device.type != "cpu" else 0
    reason = (f"{differ} of {len(want)} tensors differ after the round trip" if differ else
              f"{moved} of {len(want)} tensors changed device" if moved else None)
    return {**figures, "optimizer": f"{type(inner).__module__}.{type(inner).__name__}",
            "tensors": len(want), "tensors_differing": differ, "tensors_moved": moved,
            "tensors_on_host": on_host, "passed": reason is None, "reason": reason}


# ---------------------------------------------------------------------- launched jobs
def job_limit(seconds: float, dry_run: bool) -> float:
    """A launched job's limit, under its check's in ``gpu_validate.py`` (so that the check
    still prints its FAIL line); a dry run's CPU is slower (``DRY_RUN_SLOWDOWN`` there)."""
    return seconds * (4 if dry_run else 1)


def launch_job(mode: str, nproc: int, dry_run: bool, broken: bool, timeout_s: float,
               extra: tuple[str, ...] = ()) -> dict[int, dict]:
    """``gpu_plan_job.py`` on ``nproc`` ranks under torchrun; rank -> its record."""
    out = Path(tempfile.mkdtemp(prefix=f"gpu_{mode}_"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "scripts/gpu_plan_job.py", str(out), "--mode", mode,
           *(["--dry-run"] * dry_run), *(["--break"] * broken), *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]), "OMP_NUM_THREADS": "1"}
    with open(out / "log", "w+") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:  # torchrun's workers too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        log.seek(0)
        tail = log.read()[-3000:]
    if code != 0:  # its directory is kept, for the whole log
        why = f"timed out after {timeout_s} s" if code is None else f"exit status {code}"
        raise RuntimeError(f"{mode} job ({out}): {why}: {tail}")
    records = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)}
    shutil.rmtree(out, ignore_errors=True)
    return records


def grad_sync(dry_run: bool, broken: bool) -> dict[str, Any]:
    _device(dry_run)
    ranks = launch_job("grad_sync", 2, dry_run, broken, timeout_s=job_limit(120, dry_run))
    equal = {r: rec["bitwise_equal"] for r, rec in ranks.items()}
    early = {r: rec["early_groups"] for r, rec in ranks.items()}
    overlapped = all(n >= 1 for e in early.values() for n in e)
    reason = ("overlapped sync differs from the synchronous one" if not all(equal.values())
              else "no group started during the backward pass" if not overlapped else None)
    return {"ranks": len(ranks), "bitwise_equal": equal, "early_groups": early,
            "tensors_differing": {r: rec["tensors_differing"] for r, rec in ranks.items()},
            "losses": ranks[0]["losses"], "overlapped_losses": ranks[0]["overlapped_losses"],
            "passed": reason is None, "reason": reason}


LOSS_RTOL = 1e-5
"""The failover's losses against the failure-free run's: the survivors sum gradients over
three ranks instead of four (another order of fp32 additions)."""


def plan_failover(dry_run: bool, broken: bool) -> dict[str, Any]:
    _device(dry_run)
    nproc = 3 if dry_run else 4
    ranks = launch_job("failover", nproc, dry_run, broken, timeout_s=job_limit(150, dry_run),
                       extra=("--defect", "drop"))
    dead = ranks[0]["dead"]
    errors = {r: [abs(g - w) / abs(w) for g, w in zip(rec["losses"], rec["reference_losses"])]
              for r, rec in ranks.items() if r not in dead}
    worst = max(max(e) for e in errors.values())
    complete = all(len(e) == len(ranks[0]["reference_losses"]) for e in errors.values())
    reason = (f"a survivor ran {min(map(len, errors.values()))} steps" if not complete else
              f"losses {worst:.3g} off the failure-free run's (limit {LOSS_RTOL})"
              if worst > LOSS_RTOL else None)
    return {"ranks": nproc, "dead": dead, "reference_losses": ranks[0]["reference_losses"],
            "losses": ranks[0]["losses"], "max_relative_error": worst,
            "dropped_microbatches": ranks[0]["dropped_microbatches"],
            "passed": reason is None, "reason": reason}


RESIDENT_SLACK = 1.02
"""The resident memory after a recovery against the steady state's (allocator rounding)."""


def recovery_memory(dry_run: bool, broken: bool) -> dict[str, Any]:
    """The recovery's high-water mark may hold two layouts at once (the old state is kept
    until the copy is confirmed), so it must stay within the steady state's high-water
    mark plus one resident copy; afterwards the old layout must be gone."""
    _device(dry_run)
    ranks = launch_job("failover", 2, dry_run, broken, timeout_s=job_limit(120, dry_run),
                       extra=("--defect", "hold"))
    rows = {r: rec for r, rec in ranks.items() if r not in rec["dead"]}
    reason = memory_failure(rows)
    return {"measured": not dry_run, "survivors": {r: {
        "steady_peak_MiB": rec["steady_peak_bytes"] / MiB,
        "steady_resident_MiB": rec["steady_resident_bytes"] / MiB,
        "recovery_peak_MiB": rec["recovery_peak_bytes"] / MiB,
        "after_recovery_resident_MiB": rec["recovery_resident_bytes"] / MiB,
        "peak_ratio": rec["recovery_peak_bytes"] / max(rec["steady_peak_bytes"], 1),
        "extra_copy_held": rec["extra_copy_held"]} for r, rec in rows.items()},
        "passed": reason is None, "reason": reason}


def memory_failure(survivors: dict[int, dict]) -> str | None:
    """Why the survivors' memory fails (None: it passes); see ``recovery_memory``."""
    reasons = []
    for r, rec in survivors.items():
        steady, resident = rec["steady_peak_bytes"], rec["steady_resident_bytes"]
        peak, after = rec["recovery_peak_bytes"], rec["recovery_resident_bytes"]
        if peak > steady + resident:
            reasons.append(f"rank {r}: recovery peak {peak} B > steady peak {steady} B + "
                           f"resident {resident} B")
        if after > RESIDENT_SLACK * resident:
            reasons.append(f"rank {r}: {after} B resident after the recovery, {resident} B "
                           "in the steady state (the old layout is still held)")
    return "; ".join(reasons) or None


CHECKS = {"nccl_abort": nccl_abort, "optimizer_shards": optimizer_shards,
          "grad_sync": grad_sync, "plan_failover": plan_failover,
          "recovery_memory": recovery_memory}
