"""The timeline arithmetic the policy generator works on (pure, numpy).

Convention: a quantity "at event e" is its value just after event e has happened. A
storage is resident from its pack event until its free event. Swapped out, it leaves the
device at its *out event* (the first event by which its device-to-host copy, started at
the pack, has had time to finish) and comes back at its *prefetch event* (the last pack
or use event whose distance in compute time to the first backward use covers the
host-to-device copy). So it is absent at events in ``[out, prefetch)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from chameleon_megatron.swap.profile import FREE, StepProfile, TensorRecord


@dataclass(frozen=True)
class Windows:
    """Absence windows of the candidate storages (parallel arrays)."""

    uids: np.ndarray
    nbytes: np.ndarray
    out_event: np.ndarray
    prefetch_event: np.ndarray

    def subset(self, keep: np.ndarray) -> Windows:
        return Windows(self.uids[keep], self.nbytes[keep], self.out_event[keep],
                       self.prefetch_event[keep])


def resident_curve(profile: StepProfile) -> np.ndarray:
    """Resident saved bytes at each event without swapping."""
    delta = np.zeros(profile.num_events + 1, dtype=np.int64)
    for r in profile.records:
        delta[r.pack_event] += r.nbytes
        if r.free_event >= 0:
            delta[r.free_event] -= r.nbytes
    return np.cumsum(delta[:-1])


def is_candidate(r: TensorRecord, min_bytes: int) -> bool:
    """Swappable: a forward activation at least ``min_bytes`` big that backward uses later."""
    return r.swappable and r.nbytes >= min_bytes and r.use_event > r.pack_event


def anchor_events(profile: StepProfile) -> np.ndarray:
    """Events the executor can act on (packs and first uses), ascending."""
    return np.array([e for e, (_, kind) in enumerate(profile.events) if kind != FREE],
                    dtype=np.int64)


def candidate_windows(profile: StepProfile, min_bytes: int, bandwidth_bps: float) -> Windows:
    """Windows of every candidate when each copy takes size / bandwidth of compute time.

    ``bandwidth_bps = inf`` gives the widest windows: out at the pack, back at the last
    anchor before the use. Candidates whose window is empty are dropped.
    """
    cands = [r for r in profile.records if is_candidate(r, min_bytes)]
    times = np.asarray(profile.event_times, dtype=np.float64)
    anchors = anchor_events(profile)
    nbytes = np.array([r.nbytes for r in cands], dtype=np.int64)
    pack = np.array([r.pack_event for r in cands], dtype=np.int64)
    use = np.array([r.use_event for r in cands], dtype=np.int64)
    copy_s = nbytes / bandwidth_bps
    if len(cands):
        out = np.maximum(pack, np.searchsorted(times, times[pack] + copy_s, side="left"))
        last_anchor_before_use = np.searchsorted(anchors, use, side="left") - 1
        in_time = np.searchsorted(times[anchors], times[use] - copy_s, side="right") - 1
        k = np.minimum(last_anchor_before_use, in_time)
        prefetch = np.where(k >= 0, anchors[np.maximum(k, 0)], -1)
    else:
        out = prefetch = np.zeros(0, dtype=np.int64)
    w = Windows(np.array([r.uid for r in cands], dtype=np.int64), nbytes, out, prefetch)
    return w.subset(w.out_event < w.prefetch_event)


def coverage(windows: Windows, num_events: int) -> np.ndarray:
    """Bytes absent at each event if every storage in ``windows`` is swapped."""
    delta = np.zeros(num_events + 1, dtype=np.int64)
    np.add.at(delta, windows.out_event, windows.nbytes)
    np.add.at(delta, windows.prefetch_event, -windows.nbytes)
    return np.cumsum(delta[:-1])
