"""The swap executor: saved-tensor hooks that apply a plan to live tensors.

Every saved activation goes through ``_pack``; tensors saved on one storage share one
``Entry`` (the unit that is swapped, so views keep their exact layout and a storage is
copied once). Parameters, pipeline inputs and views of them are held elsewhere anyway and
are returned untouched. A pack is matched to a profile record (``matching.py``); a
planned record is copied to a host buffer at once and its device storage dropped when the
copy has finished. First uses in backward (and packs) are the anchors at which planned
prefetches start; an unpack that finds its storage still on the host copies it back
itself and counts a blocking swap-in. When resident bytes pass the budget anyway, the
executor waits for copies out in flight, then swaps the storage being packed too (a forced
swap), or, when that one is not swappable (below the size threshold, or saved in backward),
evicts older resident storages; a prefetch that would pass it is left to the unpack, which evicts to make room.

Entries are released when autograd drops their last handle (``entry.py``), so
tensors packed but never unpacked (recompute) do not leak.

Copies go through a copier (``copier.py``): synchronous on CPU, streams and events on
CUDA; the executor only keeps tokens and polls them.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any, Iterable

import torch

from chameleon_megatron.megatron import torch_seams
from chameleon_megatron.swap.copier import SyncCopier
from chameleon_megatron.swap.entry import (
    BACK,
    IN,
    OUT,
    RESIDENT,
    SWAPPED,
    Entry,
    Handle,
    bytes_of,
    rebuild,
    view_of,
)
from chameleon_megatron.swap.hostpool import HostPool
from chameleon_megatron.swap.matching import MatchIndex
from chameleon_megatron.swap.policy import SwapPolicy
from chameleon_megatron.swap.profile import PACK, USE
from chameleon_megatron.swap.recorder import FullRecorder
from chameleon_megatron.swap.signature import StageStats
from chameleon_megatron.swap.stage import StageTracker

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class StepCounters:
    """What the executor did in one step."""

    packs: int = 0
    entries: int = 0
    swapped_out_bytes: int = 0
    swapped_in_bytes: int = 0
    swap_outs: int = 0
    forced_swaps: int = 0
    budget_waits: int = 0
    prefetches: int = 0
    blocking_swapins: int = 0
    matched: int = 0
    unmatched: int = 0
    evictions: int = 0
    peak_resident_saved_bytes: int = 0
    peak_saved_bytes: int = 0


class SwapExecutor:
    """Pack/unpack hooks, the entry state machine and the per-step counters."""

    def __init__(self, tracker: StageTracker, *, copier: SyncCopier, pool: HostPool,
                 min_bytes: int, exclude: Iterable[torch.Tensor] = ()) -> None:
        self.tracker = tracker
        self.copier = copier
        self.pool = pool
        self.min_bytes = min_bytes
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._codes: dict[tuple, int] = {}
        self.op_names: list[str] = []
        self._entries: dict[int, Entry] = {}
        self._pending_out: collections.deque[Entry] = collections.deque()
        self._pending_host: collections.deque[tuple[Any, torch.Tensor]] = collections.deque()
        self.live_entries = 0
        self.resident = 0
        self.saved = 0
        self.budget: int | None = None
        self.set_policy(None, None)
        self.begin_step(profile="light")

    # ---------------------------------------------------------------- control (per step)
    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def set_policy(self, plan: SwapPolicy | None, index: MatchIndex | None) -> None:
        """Use ``plan`` from the next pack on (None: swap only to keep the budget)."""
        self.plan, self._index = plan, index
        self._swap = frozenset(d.uid for d in plan.decisions) if plan else frozenset()
        triggers: dict[tuple[int, int], list[int]] = {}
        for d in plan.decisions if plan else ():
            triggers.setdefault(d.prefetch_anchor, []).append(d.uid)
        self._triggers = triggers

    def begin_step(self, *, profile: str) -> None:
        """Reset the counters; ``profile`` is 'off', 'light' or 'full'."""
        self.tracker.reset()
        self.counters = StepCounters(peak_resident_saved_bytes=self.resident,
                                     peak_saved_bytes=self.saved)
        self._profiling = profile != "off"
        self.recorder = FullRecorder() if profile == "full" else None
        self._by_uid: dict[int, Entry] = {}
        for entry in self._entries.values():  # survivors of earlier steps: not this step's
            entry.rec = entry.uid = -1

    def end_step(self) -> StepCounters:
        """Finish copies still in flight and return the step's counters."""
        for entry in list(self._pending_out):
            self.copier.sync(entry.token)
        for token, _ in self._pending_host:
            self.copier.sync(token)
        self._poll()
        return self.counters

    # ---------------------------------------------------------------- hot path
    def _pack(self, t: torch.Tensor) -> Any:
        if t.requires_grad and t.grad_fn is None:
            return t  # a parameter or a pipeline input: held elsewhere
        base = t._base
        if base is not None and base.requires_grad and base.grad_fn is None:
            return t  # a view of one (e.g. weight.t())
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._exclude:
            return t
        self.counters.packs += 1
        stats = self.tracker.current
        nbytes = storage.nbytes()
        op = (type(t.grad_fn), t.dtype)
        code = self._codes.get(op)
        if code is None:
            code = self._new_code(op)
        entry = self._entries.get(key)
        if entry is not None and entry.ref() is storage:
            if self._profiling:
                stats.add(code, nbytes)
            return self._attach(entry, t.detach())
        ordinal, history = len(stats.codes), stats.history()
        if self._profiling:
            stats.add(code, nbytes)
        # Held detached: an output its own op saves (softmax, sigmoid) would otherwise keep
        # its graph alive through the handle (graph -> handle -> tensor -> grad_fn), and an
        # abandoned step would never free it. Autograd re-attaches grad_fn at unpack.
        return self._new_entry(t.detach(), storage, key, nbytes, stats, code, ordinal,
                               history)

    def _new_entry(self, t: torch.Tensor, storage: Any, key: int, nbytes: int,
                   stats: StageStats, code: int, ordinal: int, history: int) -> Handle:
        """First pack of a storage: account it, record it, apply the plan and the budget."""
        forward = stats.key[0] == "F"
        entry = Entry(self, key, storage, t, nbytes,
                      eligible=forward and nbytes > 0 and nbytes >= self.min_bytes)
        handle = Handle(entry, 0)
        self._entries[key] = entry
        self.live_entries += 1
        self.counters.entries += 1
        self.saved += nbytes
        self.resident += nbytes
        if self.saved > self.counters.peak_saved_bytes:
            self.counters.peak_saved_bytes = self.saved
        occurrence = stats.occurrences.get((code, history), 0)
        stats.occurrences[(code, history)] = occurrence + 1
        if self.recorder is not None:
            in_use = self.copier.memory_in_use()
            entry.rec = self.recorder.on_pack(
                stats.key, ordinal, code, history, occurrence, nbytes, tuple(t.shape), forward,
                self.tracker.segment, self.resident if in_use is None else in_use)
        if self._index is not None:
            self._apply_plan(entry, stats.key, ordinal, code, nbytes, history, occurrence)
        if self.budget is not None and self.resident > self.budget:
            self._enforce_budget(entry)
        self._note_peak()
        if self._pending_out or self._pending_host:
            self._poll()
        return handle

    def _note_peak(self) -> None:
        if self.resident > self.counters.peak_resident_saved_bytes:
            self.counters.peak_resident_saved_bytes = self.resident

    def _unpack(self, packed: Any) -> torch.Tensor:
        if type(packed) is not Handle:
            return packed
        entry = packed.entry
        if not entry.used:
            entry.used = True
            if self.recorder is not None and entry.rec >= 0:
                in_use = self.copier.memory_in_use()
                self.recorder.on_use(entry.rec, self.tracker.segment,
                                     self.resident if in_use is None else in_use)
            if entry.uid >= 0:
                self._fire(entry.uid, USE)
        if entry.tensors is None:
            self._bring_back(entry)
        return entry.tensors[packed.index]

    def _enforce_budget(self, entry: Entry) -> None:
        """Over budget: wait for copies out in flight (the stall the plan foresaw), then
        swap the storage just packed, or, when it cannot go (too small, or saved in
        backward), evict older ones."""
        while self.resident > self.budget and self._pending_out:
            self.copier.sync(self._pending_out[0].token)
            self._poll()
            self.counters.budget_waits += 1
        if self.resident > self.budget and entry.state == RESIDENT:
            if entry.eligible:
                self._swap_out(entry)
                self.counters.forced_swaps += 1
            else:
                self.evict(self.resident - self.budget, memory=False)

    # ---------------------------------------------------------------- plan application
    def _apply_plan(self, entry: Entry, stage: tuple, ordinal: int, code: int, nbytes: int,
                    history: int, occurrence: int) -> None:
        uid = self._index.match(stage, ordinal, code, nbytes, history, occurrence)
        if uid < 0 or uid in self._by_uid:
            self.counters.unmatched += 1
            return
        entry.uid = uid
        self._by_uid[uid] = entry
        if uid in self._swap:
            self.counters.matched += 1
            if entry.eligible:
                self._swap_out(entry)
        self._fire(uid, PACK)

    def _fire(self, uid: int, kind: int) -> None:
        """Start the prefetches anchored at this event."""
        for target in self._triggers.get((uid, kind), ()):
            entry = self._by_uid.get(target)
            if entry is None or entry.tensors is not None or entry.state == IN:
                continue
            if entry.state == SWAPPED and self._over_budget(entry.nbytes):
                continue  # sizes grew since the profile: the unpack makes room
            self._prefetch(entry)

    def _over_budget(self, nbytes: int) -> bool:
        return self.budget is not None and self.resident + nbytes > self.budget

    # ---------------------------------------------------------------- entry transitions
    def _attach(self, entry: Entry, t: torch.Tensor) -> Handle:
        """Another saved tensor on an entry's storage."""
        if entry.tensors is not None:
            entry.tensors.append(t)
            return Handle(entry, len(entry.tensors) - 1)
        entry.views.append(view_of(t))
        return Handle(entry, len(entry.views) - 1)

    def _swap_out(self, entry: Entry) -> None:
        src = bytes_of(entry.tensors[0])
        entry.views = [view_of(t) for t in entry.tensors]
        entry.tensors = None
        entry.host = self.pool.acquire(entry.nbytes)
        entry.token = self.copier.start_out(src, entry.host)
        c = self.counters
        c.swap_outs += 1
        c.swapped_out_bytes += entry.nbytes
        if entry.token is None:
            entry.state = SWAPPED
            self.resident -= entry.nbytes
        else:
            entry.state, entry.data = OUT, src  # device copy held until the copy ends
            self._pending_out.append(entry)

    def _prefetch(self, entry: Entry) -> None:
        self.counters.prefetches += 1
        self._start_in(entry)

    def _start_in(self, entry: Entry) -> None:
        if entry.state == OUT:  # still on device: cancel the swap
            self._finish_host(entry)
        else:
            entry.data, token = self._alloc_and_copy(entry)
            self._defer_host(token, entry.host)
            entry.host, entry.token = None, token
            self.resident += entry.nbytes
            self.counters.swapped_in_bytes += entry.nbytes
        entry.state = IN
        self._note_peak()

    def _alloc_and_copy(self, entry: Entry) -> tuple[torch.Tensor, Any]:
        try:
            return self.copier.start_in(entry.host, entry.device, entry.token)
        except torch.OutOfMemoryError:
            freed = self.evict(entry.nbytes, memory=True)
            logger.warning("swap: out of memory bringing back %d bytes; evicted %d bytes",
                           entry.nbytes, freed)
            if freed < entry.nbytes:
                raise  # retrying would fail again (in the autograd thread): the step's OOM
        return self.copier.start_in(entry.host, entry.device, entry.token)

    def _bring_back(self, entry: Entry) -> None:
        """Unpack of an entry not on the device as packed: finish its copy back."""
        if entry.state in (OUT, SWAPPED):
            if entry.state == SWAPPED:
                self.counters.blocking_swapins += 1
                if self._over_budget(entry.nbytes):
                    self.evict(self.resident + entry.nbytes - self.budget, memory=False)
            self._start_in(entry)
        self.copier.wait_in(entry.token)
        entry.token = None
        entry.tensors = [rebuild(entry.data, v) for v in entry.views]
        entry.data = None
        entry.state = BACK

    def _finish_host(self, entry: Entry) -> None:
        """An out copy that is no longer needed: keep the device copy, recycle the host one."""
        self._pending_out.remove(entry)
        self._defer_host(entry.token, entry.host)
        entry.host = entry.token = None

    def _defer_host(self, token: Any, host: torch.Tensor) -> None:
        if token is None:
            self.pool.release(host)
        else:
            self._pending_host.append((token, host))

    def _poll(self) -> None:
        """Retire finished copies: drop device copies swapped out, recycle host buffers."""
        done = self.copier.done
        while self._pending_out and done(self._pending_out[0].token):
            entry = self._pending_out.popleft()
            entry.token, entry.data = None, None
            if entry.released:
                self.pool.release(entry.host)
                entry.host = None
            else:
                entry.state = SWAPPED
                self.resident -= entry.nbytes
        while self._pending_host and done(self._pending_host[0][0]):
            self.pool.release(self._pending_host.popleft()[1])

    def release(self, entry: Entry) -> None:
        """The last handle of ``entry`` died."""
        entry.released = True
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
        if self._by_uid.get(entry.uid) is entry:
            del self._by_uid[entry.uid]
        self.live_entries -= 1
        self.saved -= entry.nbytes
        if entry.state != SWAPPED:
            self.resident -= entry.nbytes
        if self.recorder is not None and entry.rec >= 0:
            self.recorder.on_free(entry.rec, self.tracker.segment)
        if entry.state == OUT:
            return  # _poll recycles the host buffer when the copy ends
        if entry.state == IN and entry.token is not None:
            # Brought back but never unpacked: the compute stream must pass the copy before
            # the destination's block returns to the allocator for its reuse.
            self.copier.wait_in(entry.token)
        if entry.host is not None:  # swapped out and never brought back
            self.pool.release(entry.host)
        entry.tensors = entry.data = entry.host = entry.token = None

    def evict(self, need_bytes: int, *, memory: bool) -> int:
        """Synchronously swap out resident, not yet used storages, oldest first (the last
        that backward needs), until ``need_bytes`` are off; returns the bytes.

        ``memory``: device memory must be freed now (an out-of-memory error), so a storage
        that other tensors still share (the forward's live activations) is left alone,
        copying it out would free nothing. Otherwise the budget of saved bytes is what
        counts, and a shared storage leaves it once it is swapped."""
        freed = 0
        for entry in list(self._entries.values()):
            if freed >= need_bytes:
                break
            if entry.state == RESIDENT and entry.eligible and not entry.used and not (
                    memory and torch_seams.storage_users(entry.tensors[0]) > len(entry.tensors)):
                self._swap_out(entry)
                if entry.state == OUT:
                    self.copier.sync(entry.token)
                    self._poll()
                freed += entry.nbytes
                self.counters.evictions += 1
        return freed

    def _new_code(self, op: tuple) -> int:
        fn, dtype = op
        name = "leaf" if fn is type(None) else fn.__name__
        self._codes[op] = code = len(self.op_names)
        self.op_names.append(f"{name}:{dtype}")
        return code

