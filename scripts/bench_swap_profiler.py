"""Profiler cost per step: none vs lightweight vs full mode, against no profiler, one run.

Two measurements of the same GPT-like model (plain torch, CPU):

1. End to end: training steps (microbatched forward + backward) in four set-ups,
   interleaved round by round: no hooks, the executor's hooks with the profiler off,
   lightweight mode, full mode (plus building its profile). Median step time of each.
2. Profiler replay: the profiler calls of one real step (from its full profile: one
   signature update per saved tensor and the end-of-step comparison in lightweight mode;
   plus the record, first-use and release calls and building the profile in full mode),
   replayed many times. This is the profiler's own cost per step, free of the
   step-to-step noise that hides it in (1).
3. Hook replay: the tensors one microbatch saves, packed, unpacked and released through
   the executor in each mode: the whole hook path per saved tensor.

Targets: lightweight <= 2 % of the step time and >= 84.25 % below full mode (the paper's
figure). Times are the CPU time
of this process (``time.process_time``), so other jobs on a shared host do not inflate
them; run with one intra-op thread for the same reason.

    python scripts/bench_swap_profiler.py [--layers 8 --hidden 256 --seq 256 ...]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from chameleon_megatron.swap.copier import SyncCopier
from chameleon_megatron.swap.executor import SwapExecutor
from chameleon_megatron.swap.hostpool import HostPool
from chameleon_megatron.swap.profile import PACK, USE
from chameleon_megatron.swap.recorder import FullRecorder
from chameleon_megatron.swap.signature import StageStats, StepSignature, changed_stages
from chameleon_megatron.megatron.swap_seams import LayerHooks
from chameleon_megatron.swap.stage import StageTracker

MODES = ("none", "off", "light", "full")


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.out = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (t.reshape(b, s, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(self.norm1(x)).split(h, dim=-1))
        att = F.dropout(((q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5).softmax(-1), 0.1)
        x = x + self.out((att @ v).transpose(1, 2).reshape(b, s, h))
        return x + self.down(F.dropout(F.gelu(self.up(self.norm2(x))), 0.1))


class Model(nn.Module):
    def __init__(self, vocab: int, hidden: int, heads: int, layers: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Layer(hidden, heads) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def step(model: Model, batch: list[torch.Tensor], tracker: StageTracker | None) -> None:
    for i, tokens in enumerate(batch):
        with tracker.forward(i) if tracker else contextlib.nullcontext():
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        with tracker.backward(i) if tracker else contextlib.nullcontext():
            loss.backward()


def end_of_step(ex: SwapExecutor, mode: str, reference) -> object:
    """What the manager does for the profiler at a step's end in this mode."""
    tracker = ex.tracker
    signature = tracker.signature()
    if mode == "full":
        ex.recorder.finish(tracker.segments, ex.op_names, signature)
    if reference is not None:
        changed_stages(reference, signature, 0.05)
    return signature


def end_to_end(model: Model, batch: list[torch.Tensor], ex: SwapExecutor,
               rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {m: [] for m in MODES}
    reference = None
    for _ in range(rounds):
        for mode in MODES:
            gc.collect()
            start = time.process_time()
            if mode == "none":
                step(model, batch, None)
            else:
                ex.begin_step(profile=mode)
                with ex.hooks():
                    step(model, batch, ex.tracker)
                reference = end_of_step(ex, mode, reference)
            times[mode].append(time.process_time() - start)
            model.zero_grad(set_to_none=True)
    return {m: statistics.median(t) for m, t in times.items()}


def replay(model: Model, tokens: torch.Tensor, ex: SwapExecutor, reps: int) -> dict[str, float]:
    """Seconds per saved tensor of the hook path in each mode (best of ``reps``)."""
    saved: list[tuple[torch.Tensor, int]] = []
    layer = [-1]
    hooks = [lyr.register_forward_pre_hook(lambda _m, _a, n=n: layer.__setitem__(0, n + 1))
             for n, lyr in enumerate(model.layers)]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t, layer[0])) or t,
                                                  lambda t: t):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    for h in hooks:
        h.remove()
    del loss
    best = {m: float("inf") for m in ("off", "light", "full")}
    reference = None
    for _ in range(reps):  # modes interleaved, so drifts of the host hit all alike
        for mode in best:
            ex.begin_step(profile=mode)
            gc.collect()
            gc.disable()  # a collection triggered by one mode's garbage must not bill another
            start = time.process_time()
            with ex.tracker.forward(0):
                handles = []
                for t, n in saved:
                    if n != ex.tracker.current.key[3]:
                        ex.tracker.enter_layer(n)
                    handles.append(ex._pack(t))
            with ex.tracker.backward(0):
                for h in reversed(handles):
                    ex._unpack(h)
                del handles, h
            reference = end_of_step(ex, mode, reference)
            best[mode] = min(best[mode], time.process_time() - start)
            gc.enable()
    return {m: v / len(saved) for m, v in best.items()}


def profiler_replay(profile, reps: int) -> dict[str, float]:
    """CPU seconds per step of the profiler's own calls in each mode (best of ``reps``),
    less the cost of the replay loop itself (mode "loop": the same walk, no calls)."""
    stages = sorted({r.stage for r in profile.records})
    names = ["op"] * (1 + max((r.code for r in profile.records), default=0))
    best = {"loop": float("inf"), "light": float("inf"), "full": float("inf")}
    reference = None
    for _ in range(reps):
        for mode in best:
            gc.collect()
            gc.disable()
            start = time.process_time()
            reference = _replay_once(profile, stages, names, mode, reference)
            best[mode] = min(best[mode], time.process_time() - start)
            gc.enable()
    return {m: best[m] - best["loop"] for m in ("light", "full")}


def _replay_once(profile, stages, names, mode: str, reference):
    stats = {k: StageStats(k) for k in stages}
    recorder = FullRecorder() if mode == "full" else None
    light = mode != "loop"
    uids = {}
    for uid, kind in profile.events:
        r = profile.records[uid]
        if kind == PACK:
            if light:
                stats[r.stage].add(r.code, r.nbytes)
            if recorder is not None:
                uids[uid] = recorder.on_pack(r.stage, r.ordinal, r.code, r.history,
                                             r.occurrence, r.nbytes, r.shape, r.swappable, 0, 0)
        elif recorder is not None:
            (recorder.on_use if kind == USE else recorder.on_free)(uids[uid], 0)
    if not light:
        return reference
    signature = StepSignature.of(stats)
    if recorder is not None:
        recorder.finish([(0.0, 1.0)], names, signature)
    if reference is not None:
        changed_stages(reference, signature, 0.05)
    return signature


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = Model(512, a.hidden, a.heads, a.layers)
    batch = [torch.randint(0, 512, (a.micro_batch, a.seq + 1)) for _ in range(a.microbatches)]
    tracker = StageTracker()
    LayerHooks(tracker, ((lyr, n + 1) for n, lyr in enumerate(model.layers)))
    ex = SwapExecutor(tracker, copier=SyncCopier(), pool=HostPool(pin=False, cache_bytes=0),
                      min_bytes=1 << 62, exclude=list(model.parameters()))
    step(model, batch, None)  # warm-up
    model.zero_grad(set_to_none=True)
    ex.begin_step(profile="full")
    with ex.hooks():
        step(model, batch, tracker)
    packs = ex.counters.packs
    profile = ex.recorder.finish(tracker.segments, ex.op_names, tracker.signature())
    model.zero_grad(set_to_none=True)
    e2e = end_to_end(model, batch, ex, a.rounds)
    own = profiler_replay(profile, a.replays)
    per_tensor = replay(model, batch[0], ex, a.replays)

    base = e2e["none"]
    print(f"model: {a.layers} layers, hidden {a.hidden}, seq {a.seq}, micro batch "
          f"{a.micro_batch}, {a.microbatches} microbatches; {packs} saved tensors per step; "
          f"{a.threads} threads")
    print(f"end to end, median of {a.rounds} interleaved rounds (CPU s/step):")
    for m in MODES:
        print(f"  {m:5s} {e2e[m]:.4f}  ({100 * (e2e[m] / base - 1):+.2f} % vs no hooks)")
    light, full = own["light"], own["full"]
    print(f"profiler replay of one step ({len(profile.records)} storages, {packs} saved "
          f"tensors; CPU, best of {a.replays}): lightweight {1e3 * light:.3f} ms = "
          f"{100 * light / base:.3f} % of the step; full {1e3 * full:.3f} ms = "
          f"{100 * full / base:.3f} %")
    print(f"lightweight is {100 * (1 - light / full):.2f} % below full "
          "(targets: <= 2 % of the step, >= 84.25 % below full)")
    print("hook path replay (CPU us per saved tensor, best of "
          f"{a.replays}): " + ", ".join(f"{m} {1e6 * v:.2f}" for m, v in per_tensor.items()))
    e2e_light, e2e_full = e2e["light"] - e2e["off"], e2e["full"] - e2e["off"]
    print(f"end-to-end differences vs profiler off: lightweight {1e3 * e2e_light:+.2f} ms "
          f"({100 * e2e_light / base:+.2f} %), full {1e3 * e2e_full:+.2f} ms "
          f"({100 * e2e_full / base:+.2f} %)")


if __name__ == "__main__":
    main()
