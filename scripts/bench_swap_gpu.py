"""Swap on one GPU (written for an H200): throughput, peak memory, capacity, copy bandwidth.

Single process, megatron-core GPTModel with the local layer spec (TransformerEngine
cannot travel to the lent machine), bf16, AdamW, forward_backward_no_pipelining.

* ``throughput``: tokens/s and peak device memory of (a) no swap, (b) full recompute,
  (c) megatron-core's fine-grained activation offloading when it can run (it needs
  TransformerEngine; otherwise reported as unavailable), (d)
  ``torch.autograd.graph.save_on_cpu(pin_memory=True)``, (e) Chameleon swap with a budget
  of half the no-swap peak of saved activations. Goals: (e) >= 95 % of (a)'s throughput,
  and faster than (b).
* ``capacity``: device memory capped with ``torch.cuda.set_per_process_memory_fraction``;
  models of growing depth, the largest that trains without swap, with recompute and with
  swap, each as a multiple of the cap (its no-swap peak memory, measured uncapped, over
  the cap).
* ``bandwidth``: bytes/s of the executor's copy engine (device->host and back, tensors of
  the swap's typical size) against a plain pinned copy of the same bytes. Goal >= 80 %.

The swap rows: "chameleon swap" lets the policy recompute leading layers where that costs
less than the swap's stall (offload or recompute); "chameleon swap only" never recomputes.

    python scripts/bench_swap_gpu.py [--only bandwidth,throughput,capacity] [--layers 24 ...]
    python scripts/bench_swap_gpu.py --smoke   # tiny sizes, runs on CPU too (no numbers)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.util
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from chameleon_megatron.swap.config import SwapConfig


# ------------------------------------------------------------------------------ set-up
def init_megatron() -> torch.device:
    from megatron.core import parallel_state, tensor_parallel

    from chameleon_megatron.megatron.groups import free_port

    cuda = torch.cuda.is_available()
    if not cuda:
        from chameleon_megatron.megatron.platform import CpuPlatform

        CpuPlatform().apply()
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{free_port()}",
                            timeout=datetime.timedelta(minutes=5))
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def build(a: argparse.Namespace, layers: int, device: torch.device, **extra: Any):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    config = TransformerConfig(
        num_layers=layers, hidden_size=a.hidden, num_attention_heads=a.heads,
        ffn_hidden_size=4 * a.hidden, hidden_dropout=0.0, attention_dropout=0.0,
        bf16=cuda, params_dtype=dtype, pipeline_dtype=dtype, use_cpu_initialization=not cuda,
        gradient_accumulation_fusion=False, masked_softmax_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, **extra)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=a.vocab, max_sequence_length=a.seq).to(device=device, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    return model, opt


def swap_plugin(model: torch.nn.Module, device: torch.device, cfg: SwapConfig):
    from chameleon_megatron.swap.plugin import SwapPlugin
    from chameleon_megatron.training.plugin import TrainContext

    plugin = SwapPlugin(cfg)
    plugin.on_model_built(TrainContext(model=[model], config=model.config, args=None,
                                       device=device, rank=0, tp_rank=0, pp_rank=0, pp_size=1,
                                       dp_rank=0, vpp_size=1))
    return plugin


WARMUP = 2
"""Steps before the figures: swap profiles the first and plans from the second on."""


def train(model, opt, a: argparse.Namespace, device: torch.device, steps: int, *,
          plugin=None, context: Callable[[], Any] = contextlib.nullcontext) -> dict[str, float]:
    """``steps`` iterations (an OOM step is redone when the swap plugin asks for it); the
    median step time and the peak memory of the steps after ``WARMUP`` (once a swap plan
    exists: the profiling step holds every activation)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data, m):
        tokens = next(data)
        out = m(tokens[:, :-1], position_ids, None, labels=tokens[:, 1:])
        return out, lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})

    position_ids = torch.arange(a.seq, device=device).expand(a.micro_batch, a.seq)
    gen = torch.Generator(device=device).manual_seed(0)
    fb = get_forward_backward_func()
    times = []
    for it in range(steps):
        if it == min(WARMUP, steps - 1) and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        data = [torch.randint(0, a.vocab, (a.micro_batch, a.seq + 1), device=device,
                              generator=gen) for _ in range(a.microbatches)]
        _sync(device)
        start = time.perf_counter()
        while True:
            try:
                step_context = plugin.step_context(it, training=True) if plugin else context()
                with step_context:
                    fb(forward_step_func=forward_step, data_iterator=iter(data), model=model,
                       num_microbatches=a.microbatches, seq_length=a.seq,
                       micro_batch_size=a.micro_batch, forward_only=False)
                break
            except torch.OutOfMemoryError as exc:
                # One process: the step is redone here (abandoned by every rank, which is it).
                if plugin is None or plugin.on_step_failed(exc, None) != "abandon":
                    raise
                opt.zero_grad(set_to_none=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times[WARMUP:] if len(times) > WARMUP else times)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {"step_s": step_s, "tokens_per_s": a.microbatches * a.micro_batch * a.seq / step_s,
            "peak_gib": peak / 2**30}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ sections
def throughput(a: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    cuda = device.type == "cuda"
    recompute = dict(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1)
    offload = dict(fine_grained_activation_offloading=True,
                   offload_modules=["attn_norm", "core_attn", "attn_proj", "mlp_norm"])
    runs: dict[str, dict[str, Any]] = {}
    for name, extra in (("no swap", {}), ("full recompute", recompute),
                        ("megatron offloading", offload), ("save_on_cpu", {}),
                        ("chameleon swap only", {}), ("chameleon swap", {})):
        if name == "megatron offloading" and importlib.util.find_spec("transformer_engine") is None:
            runs[name] = {"skipped": "needs TransformerEngine (not on this machine)"}
            continue
        model, opt = build(a, a.layers, device, **extra)
        plugin, context = None, contextlib.nullcontext
        if name == "save_on_cpu":
            def context():
                return torch.autograd.graph.save_on_cpu(pin_memory=cuda)
        elif name.startswith("chameleon swap"):  # with, and without, offload-or-recompute
            plugin = swap_plugin(model, device, SwapConfig(
                enabled=True, budget_fraction=0.5, min_tensor_bytes=a.min_tensor_bytes,
                recompute=name == "chameleon swap"))
        try:
            runs[name] = train(model, opt, a, device, a.steps, plugin=plugin, context=context)
        except (RuntimeError, AssertionError, ValueError) as exc:  # report, go on with the rest
            runs[name] = {"skipped": f"{type(exc).__name__}: {str(exc)[:120]}"}
        if plugin is not None:
            runs[name]["swap"] = plugin.metrics().get("swap", {})
            plugin.on_train_end()
        print(f"  ({name}: {json.dumps(runs[name], default=str)})", flush=True)
        del model, opt
        _free()
    base = runs["no swap"].get("tokens_per_s")
    print(f"\n== throughput: {a.layers} layers, hidden {a.hidden}, seq {a.seq}, micro batch "
          f"{a.micro_batch} x {a.microbatches}, {device}")
    for name, r in runs.items():
        if "skipped" in r:
            print(f"  {name:20s} skipped: {r['skipped']}")
            continue
        rel = f"{100 * r['tokens_per_s'] / base:6.1f} % of no swap" if base else ""
        print(f"  {name:20s} {r['tokens_per_s']:10.0f} tokens/s  "
              f"peak {r['peak_gib']:7.2f} GiB  {rel}")
    swap = runs.get("chameleon swap", {}).get("swap")
    if swap:
        print("  swap: " + ", ".join(f"{k}={swap[k]}" for k in (
            "budget_bytes", "peak_resident_saved_bytes", "peak_saved_bytes", "swapped_out_bytes",
            "blocking_swapins", "expected_stall_s", "matched", "planned_tensors")))
    return runs


def capacity(a: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        print("\n== capacity: needs CUDA (skipped)")
        return {"skipped": "needs CUDA"}
    total = torch.cuda.get_device_properties(device).total_memory
    cap = a.cap_gib * 2**30
    print(f"\n== capacity: device memory capped at {a.cap_gib} GiB of {total / 2**30:.0f} GiB")
    best = {"no swap": 0.0, "full recompute": 0.0, "chameleon swap": 0.0}
    for layers in a.capacity_layers:
        try:
            model, opt = build(a, layers, device)
            need = train(model, opt, a, device, 3)["peak_gib"]
        except torch.OutOfMemoryError:
            print(f"  {layers:3d} layers: too big to measure uncapped; stopping")
            break
        finally:
            model = opt = None
            _free()
        ratio = need * 2**30 / cap
        row = [f"  {layers:3d} layers: needs {need:7.2f} GiB uncapped = {ratio:5.2f} x cap;"]
        torch.cuda.set_per_process_memory_fraction(cap / total, device)
        for name in best:
            extra = dict(recompute_granularity="full", recompute_method="uniform",
                         recompute_num_layers=1) if name == "full recompute" else {}
            plugin = None
            try:
                model, opt = build(a, layers, device, **extra)
                if name == "chameleon swap":
                    plugin = swap_plugin(model, device, SwapConfig(
                        enabled=True, budget_device_fraction=0.9 * cap / total,
                        min_tensor_bytes=a.min_tensor_bytes))
                train(model, opt, a, device, 4, plugin=plugin)
                best[name] = max(best[name], ratio)
                row.append(f" {name}: ok")
            except (torch.OutOfMemoryError, ValueError) as exc:
                row.append(f" {name}: {type(exc).__name__}")
            finally:
                if plugin is not None:
                    plugin.on_train_end()
                model = opt = None
                _free()
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        print("".join(row))
    print("  largest trained, as a multiple of the cap: " +
          ", ".join(f"{k} {v:.2f} x" for k, v in best.items()))
    return {"cap_gib": a.cap_gib, "largest_x_cap": best}


def bandwidth(a: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        print("\n== bandwidth: needs CUDA (skipped)")
        return {"skipped": "needs CUDA"}
    from chameleon_megatron.swap.copier import CudaCopier

    n, size = a.copies, a.copy_mib << 20
    src = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(n)]
    hosts = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(n)]
    total = n * size

    def timed(fn: Callable[[], None]) -> float:
        fn()  # warm-up
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        return total / (time.perf_counter() - start)

    def plain_out():
        for s, h in zip(src, hosts):
            h.copy_(s, non_blocking=True)

    def plain_in():
        for s, h in zip(src, hosts):
            s.copy_(h, non_blocking=True)

    copier = CudaCopier(device)

    def engine_out():
        for s, h in zip(src, hosts):
            copier.start_out(s, h)

    def engine_in():
        for h in hosts:
            copier.wait_in(copier.start_in(h, device, None)[1])

    print(f"\n== bandwidth: {n} copies of {a.copy_mib} MiB")
    out = {}
    for name, plain, engine in (("device->host", plain_out, engine_out),
                                ("host->device", plain_in, engine_in)):
        p, e = timed(plain), timed(engine)
        print(f"  {name}: plain pinned copy {p / 1e9:6.1f} GB/s, swap executor "
              f"{e / 1e9:6.1f} GB/s = {100 * e / p:5.1f} %")
        out[name] = {"plain_gbps": p / 1e9, "executor_gbps": e / 1e9}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="bandwidth,throughput,capacity",
                    help="sections, run in this order (the shortest first)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--min-tensor-bytes", type=int, default=4 << 20)
    ap.add_argument("--cap-gib", type=float, default=24.0)
    ap.add_argument("--capacity-layers", type=int, nargs="+", default=[8, 16, 24, 32, 48, 64])
    ap.add_argument("--copies", type=int, default=32)
    ap.add_argument("--copy-mib", type=int, default=64)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (checks the script)")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    a = ap.parse_args()
    if a.smoke:
        a.layers, a.hidden, a.heads, a.seq, a.vocab = 2, 64, 4, 32, 256
        a.micro_batch, a.microbatches, a.steps, a.min_tensor_bytes = 2, 2, 4, 1024
        a.capacity_layers, a.cap_gib, a.copies, a.copy_mib = [1, 2], 0.05, 4, 1
    device = init_megatron()
    print(f"torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    sections = {"throughput": throughput, "capacity": capacity, "bandwidth": bandwidth}
    results: dict[str, Any] = {}
    for name in a.only.split(","):
        results[name] = sections[name](a, device)
        if a.json:  # after each section: a run cut short keeps what it measured
            Path(a.json).write_text(json.dumps(results, indent=1, default=str))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
