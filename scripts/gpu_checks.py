"""GPU checks that settle what only a GPU can, one per call, each about a minute on an H200.

    python scripts/gpu_checks.py CHECK --out FILE.json [--dry-run] [--break]

Prints one line, ``PASS CHECK {figures}`` or ``FAIL CHECK {figures and the reason}``, and
writes the figures to FILE.json; exit status 0 on PASS. CHECK is one of:

* the resilience checks of ``gpu_resilience.py``: ``nccl_abort``, ``optimizer_shards``,
  ``grad_sync``, ``plan_failover``, ``recovery_memory`` (see there); ``--break`` injects
  each one's deliberate defect, which must make it FAIL;
* ``overlap``: bf16 matmuls alone, the executor's copies alone, then both interleaved as the
  executor issues them. Overlap = (compute + copies - both) / min(compute, copies), goal
  >= 0.8; the host must never block (issuing the interleaved work takes well under its
  device time). Run it with and without ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (its value must be
  set before CUDA starts: ``gpu_validate.py`` runs both).
* ``in_flight``: bf16, hidden 1024, sequence 1024, 8 layers; no synchronisation per
  microbatch; a forward hook that keeps the GPU busy (so copies are in flight when blocks are
  reused); a budget of 30 % of the no-swap peak and a small host cache. Loss and gradients
  bitwise equal to a run without hooks, and device memory back at its baseline.
* ``oom``: out-of-memory errors forced in a forward and in a copy back; the step is redone
  (every rank of a world of one) with the same loss as without the error, and memory is
  back at its baseline (with and without expandable segments: ``gpu_validate.py`` runs both).

``--dry-run`` runs the same code on the CPU at tiny sizes (gloo, the synchronous copier), so
CI keeps every check from rotting; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _device(dry_run: bool) -> torch.device:
    if dry_run:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA (use --dry-run on a machine without a GPU)")
    return torch.device("cuda", 0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _busy(device: torch.device, cycles: int) -> None:
    """Keep the GPU busy without the host waiting (nothing on CPU)."""
    if device.type == "cuda":
        torch.cuda._sleep(cycles)


# ----------------------------------------------------------------------------- (A) overlap
def overlap(dry_run: bool) -> dict[str, Any]:
    from chameleon_megatron.swap.copier import copier_for
    from chameleon_megatron.swap.hostpool import HostPool

    device = _device(dry_run)
    n, rounds, mib = (128, 2, 1) if dry_run else (8192, 24, 256)
    dtype = torch.float32 if dry_run else torch.bfloat16
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    srcs = [torch.empty(mib << 20, dtype=torch.uint8, device=device) for _ in range(rounds)]
    pool = HostPool(pin=device.type == "cuda", cache_bytes=rounds * (mib << 20))
    hosts = [pool.acquire(mib << 20) for _ in range(rounds)]
    copier = copier_for(device)

    def compute() -> None:
        for _ in range(rounds):
            torch.mm(a, b)

    def copies() -> None:
        for src, host in zip(srcs, hosts):
            copier.start_out(src, host)

    def both() -> None:  # as the executor issues them: a copy out after each producer
        for src, host in zip(srcs, hosts):
            torch.mm(a, b)
            copier.start_out(src, host)

    def timed(fn: Callable[[], None]) -> tuple[float, float]:
        fn()  # warm-up
        _sync(device)
        start = time.perf_counter()
        fn()
        issued = time.perf_counter() - start
        _sync(device)
        return time.perf_counter() - start, issued

    t_compute, _ = timed(compute)
    t_copy, _ = timed(copies)
    t_both, issue = timed(both)
    ratio = (t_compute + t_copy - t_both) / min(t_compute, t_copy)
    for host in hosts:
        pool.release(host)
    pool.clear()
    return {"compute_s": t_compute, "copies_s": t_copy, "both_s": t_both, "overlap": ratio,
            "host_issue_s": issue, "max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
            "passed": dry_run or (ratio >= 0.8 and issue < 0.5 * t_both)}


# ----------------------------------------------------------------------- (B) bitwise, in flight
def _gpt(device: torch.device, dry_run: bool):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from chameleon_megatron.megatron.groups import free_port

    if not dist.is_initialized():
        dist.init_process_group("gloo" if dry_run else "nccl", rank=0, world_size=1,
                                init_method=f"tcp://127.0.0.1:{free_port()}",
                                timeout=datetime.timedelta(minutes=5))
        parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    hidden, layers, seq = (64, 2, 32) if dry_run else (1024, 8, 1024)
    dtype = torch.float32 if dry_run else torch.bfloat16
    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=8 if not dry_run else 4,
        ffn_hidden_size=4 * hidden, hidden_dropout=0.0, attention_dropout=0.0,
        bf16=not dry_run, params_dtype=dtype, pipeline_dtype=dtype,
        use_cpu_initialization=dry_run, gradient_accumulation_fusion=False,
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=4096 if not dry_run else 256, max_sequence_length=seq)
    return model.to(device=device, dtype=dtype), seq  # every parameter, norms too (as Float16Module)


def _step(model: torch.nn.Module, seq: int, step: int, device: torch.device,
          microbatches: int = 4) -> tuple[float, list[torch.Tensor]]:
    """Forward-backward of ``microbatches`` with no synchronisation in between; (loss, grads)."""
    g = torch.Generator(device=device).manual_seed(step)
    model.zero_grad(set_to_none=True)
    vocab = model.vocab_size
    total = torch.zeros((), device=device)
    for _ in range(microbatches):
        tokens = torch.randint(0, vocab, (2, seq + 1), device=device, generator=g)
        pos = torch.arange(seq, device=device).expand(2, seq)
        loss = model(tokens[:, :-1], pos, None, labels=tokens[:, 1:]).float().mean()
        loss.backward()
        total += loss.detach()
    return float(total), [p.grad.detach().clone() for p in model.parameters()]


def _swap_plugin(model: torch.nn.Module, device: torch.device, **cfg: Any):
    from chameleon_megatron.swap.config import SwapConfig
    from chameleon_megatron.swap.plugin import SwapPlugin
    from chameleon_megatron.training.plugin import TrainContext

    plugin = SwapPlugin(SwapConfig(enabled=True, **cfg))
    plugin.on_model_built(TrainContext(model=[model], config=model.config, args=None,
                                       device=device, rank=0, tp_rank=0, pp_rank=0, pp_size=1,
                                       dp_rank=0, vpp_size=1))
    return plugin


def _scheduled(model: torch.nn.Module, seq: int, step: int, device: torch.device,
               plugin: Any) -> tuple[float, list[torch.Tensor]]:
    """One step inside the swap plugin, microbatches attributed by the tracker."""
    tracker = plugin.manager.executor.tracker
    with plugin.step_context(step, training=True):
        g = torch.Generator(device=device).manual_seed(step)
        model.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for mb in range(4):
            tokens = torch.randint(0, model.vocab_size, (2, seq + 1), device=device, generator=g)
            pos = torch.arange(seq, device=device).expand(2, seq)
            with tracker.forward(mb):
                loss = model(tokens[:, :-1], pos, None, labels=tokens[:, 1:]).float().mean()
            with tracker.backward(mb):
                loss.backward()
            total += loss.detach()
    return float(total), [p.grad.detach().clone() for p in model.parameters()]


def in_flight(dry_run: bool) -> dict[str, Any]:
    device = _device(dry_run)
    model, seq = _gpt(device, dry_run)
    steps = 4
    ref = [_step(model, seq, s, device) for s in range(steps)]
    _sync(device)
    baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    hooks = [layer.register_forward_hook(lambda *_: _busy(device, 2_000_000))
             for layer in model.decoder.layers]
    plugin = _swap_plugin(model, device, budget_fraction=0.3, min_tensor_bytes=1 << 10,
                          host_cache_bytes=256 << 20)
    equal, metrics = [], []
    try:
        for s in range(steps):
            got = _scheduled(model, seq, s, device, plugin)
            equal.append(got[0] == ref[s][0] and all(torch.equal(x, y)
                                                     for x, y in zip(got[1], ref[s][1])))
            metrics.append(plugin.metrics().get("swap", {}))
    finally:
        for h in hooks:
            h.remove()
        plugin.on_train_end()
    model.zero_grad(set_to_none=True)
    _sync(device)
    after = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    planned = metrics[1:]
    return {"bitwise_equal": equal, "swapped_out_bytes": [m.get("swapped_out_bytes") for m in metrics],
            "within_budget": [m.get("peak_resident_saved_bytes", 0) <= (m.get("budget_bytes") or 0)
                              for m in planned],
            "memory_baseline_bytes": baseline, "memory_after_bytes": after,
            "passed": all(equal) and all(m.get("swapped_out_bytes", 0) > 0 for m in planned)
            and after <= baseline}


# ----------------------------------------------------------------------------------- (C) OOM
def oom(dry_run: bool) -> dict[str, Any]:
    device = _device(dry_run)
    model, seq = _gpt(device, dry_run)
    ref = [_step(model, seq, s, device) for s in range(4)]
    _sync(device)
    baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    plugin = _swap_plugin(model, device, budget_fraction=0.5, min_tensor_bytes=1 << 10)
    results: dict[str, Any] = {"expandable_segments": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    try:
        for s in range(2):
            _scheduled(model, seq, s, device, plugin)
        results["forward"] = _redo_after(model, seq, 2, device, plugin, ref[2], _oom_in_forward)
        results["copy_back"] = _redo_after(model, seq, 3, device, plugin, ref[3], _oom_in_copy)
    finally:
        plugin.on_train_end()
    model.zero_grad(set_to_none=True)
    _sync(device)
    after = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    results.update(memory_baseline_bytes=baseline, memory_after_bytes=after,
                   passed=all(results[k]["fired"] and results[k]["equal"]
                              for k in ("forward", "copy_back")) and after <= baseline)
    return results


@contextlib.contextmanager
def _oom_in_forward(model: torch.nn.Module, plugin: Any):
    fired = []

    def hook(*_: Any) -> None:
        if not fired:
            fired.append(1)
            raise torch.OutOfMemoryError("injected in forward")

    handle = model.decoder.layers[-1].register_forward_hook(hook)
    try:
        yield fired
    finally:
        handle.remove()


@contextlib.contextmanager
def _oom_in_copy(model: torch.nn.Module, plugin: Any):
    copier = plugin.manager.executor.copier
    real, fired = copier.alloc, []

    def alloc(nbytes: int, device: torch.device) -> torch.Tensor:
        if not fired:
            fired.append(1)
            raise torch.OutOfMemoryError("injected in a copy back")
        return real(nbytes, device)

    copier.alloc = alloc
    try:
        yield fired
    finally:
        copier.alloc = real


def _redo_after(model, seq, step, device, plugin, want, inject) -> dict[str, Any]:
    """Run ``step`` with an injected OOM; redo it when the plugin says so (a world of one:
    every rank). The result must equal ``want``."""
    attempts = 0
    with inject(model, plugin) as fired:
        while True:
            attempts += 1
            try:
                got = _scheduled(model, seq, step, device, plugin)
                break
            except torch.OutOfMemoryError as exc:
                if plugin.on_step_failed(exc, None) != "abandon" or attempts > 2:
                    raise
    equal = got[0] == want[0] and all(torch.equal(x, y) for x, y in zip(got[1], want[1]))
    return {"fired": bool(fired), "attempts": attempts, "equal": equal,
            "evictions": plugin.metrics()["swap"]["evictions"]}


SWAP_CHECKS: dict[str, Callable[[bool], dict[str, Any]]] = {
    "overlap": overlap, "in_flight": in_flight, "oom": oom,
}


def run_check(name: str, dry_run: bool, broken: bool) -> dict[str, Any]:
    """The check's figures; ``broken``: with its deliberate defect (resilience checks)."""
    from gpu_resilience import CHECKS as RESILIENCE

    if name in RESILIENCE:
        return RESILIENCE[name](dry_run, broken)
    return SWAP_CHECKS[name](dry_run)


def main() -> int:
    from gpu_resilience import CHECKS as RESILIENCE

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("check", choices=sorted([*SWAP_CHECKS, *RESILIENCE]))
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--break", dest="broken", action="store_true",
                    help="inject the check's deliberate defect: it must FAIL")
    a = ap.parse_args()
    if a.broken and a.check not in RESILIENCE:
        print(f"error: --break: {a.check!r} has no defect to inject; checks that have: "
              f"{', '.join(RESILIENCE)}", file=sys.stderr)
        return 2
    if a.dry_run:
        from chameleon_megatron.megatron.platform import CpuPlatform

        CpuPlatform().apply()
    try:
        result = run_check(a.check, a.dry_run, a.broken)
    except Exception as exc:  # noqa: BLE001 - any error is this check's FAIL, with its reason
        result = {"passed": False, "reason": f"{type(exc).__name__}: {exc}"}
    Path(a.out).write_text(json.dumps(result, indent=1, default=str))
    verdict = "PASS" if result.get("passed") else "FAIL"
    print(f"{verdict} {a.check} {json.dumps(result, default=str)}", flush=True)
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
