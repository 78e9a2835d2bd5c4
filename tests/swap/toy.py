"""A small transformer-ish model and a driver that runs it like a microbatched schedule."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from chameleon_megatron.megatron.swap_seams import LayerHooks
from chameleon_megatron.swap.stage import StageTracker


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)  # views of one storage
        q, k, v = (t.reshape(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / (q.shape[-1] ** 0.5)
        att = F.dropout(att.softmax(-1), p=0.1, training=self.training)
        y = (att @ v).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ToyGPT(nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = 32, layers: int = 2, heads: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


class MlpBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class SplitGPT(nn.Module):
    """Layers that share a microbatch's tokens: block i runs on its slice of the sequence,
    ``shares`` of it each. Changing the shares moves saved bytes between layers and keeps
    the microbatch's total and operator sequence, as expert capacity does in MoE layers
    (exaggerated here, so every step's change passes the size tolerance)."""

    def __init__(self, vocab: int = 64, hidden: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(MlpBlock(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)
        self.shares = (1 / layers,) * layers

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x, out, start = self.emb(tokens), [], 0
        for i, (blk, share) in enumerate(zip(self.blocks, self.shares)):
            end = x.shape[1] if i == len(self.blocks) - 1 else start + round(share * x.shape[1])
            out.append(blk(x[:, start:end]))
            start = end
        return self.head(torch.cat(out, dim=1))


def layer_hooks(model: nn.Module, tracker: StageTracker) -> LayerHooks:
    return LayerHooks(tracker, ((b, i + 1) for i, b in enumerate(model.blocks)))


def batches(seed: int, n: int, batch: int, seq: int, vocab: int = 64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq + 1), generator=g) for _ in range(n)]


def run_step(model: ToyGPT, micro: list[torch.Tensor], tracker: StageTracker | None,
             seed: int) -> tuple[float, list[torch.Tensor]]:
    """Forward+backward over microbatches (no pipelining); returns summed loss and grads."""
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    total = 0.0
    for i, tokens in enumerate(micro):
        ctx = tracker.forward(i) if tracker else contextlib.nullcontext()
        with ctx:
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        ctx = tracker.backward(i) if tracker else contextlib.nullcontext()
        with ctx:
            loss.backward()
        total += loss.item()
    return total, [p.grad.clone() for p in model.parameters()]


def make_manager(model: nn.Module, cfg, *, bandwidth_bps: float = 10e9, layers: bool = True,
                 copier=None, spec=None):
    """A CPU swap manager for ``model`` (tracker with layer hooks, sync copier)."""
    from chameleon_megatron.swap.budget import BudgetSpec
    from chameleon_megatron.swap.copier import SyncCopier
    from chameleon_megatron.swap.cost import ProfilerCost
    from chameleon_megatron.swap.executor import SwapExecutor
    from chameleon_megatron.swap.hostpool import HostPool
    from chameleon_megatron.swap.manager import SwapManager
    from chameleon_megatron.swap.plugin import first_threshold

    tracker = StageTracker(granularity="layer" if layers else "microbatch")
    if layers and hasattr(model, "blocks"):
        layer_hooks(model, tracker)
    ex = SwapExecutor(tracker, copier=copier or SyncCopier(),
                      pool=HostPool(pin=False, cache_bytes=1 << 30),
                      min_bytes=first_threshold(cfg, bandwidth_bps),
                      exclude=list(model.parameters()))
    spec = spec or BudgetSpec(absolute_bytes=cfg.budget_bytes, fraction=cfg.budget_fraction)
    return SwapManager(cfg, ex, budget=spec, bandwidth_bps=bandwidth_bps,
                       cost=ProfilerCost(light_s=0.0, full_s=0.0))
