"""Expected stall of a swap plan: its copies replayed on one stream per direction (pure).

Walks the profiled events in order with a clock that is the profiled compute time plus
the stall so far. A swap-out starts at its pack on the device-to-host stream (copies
queue); at its planned out event compute waits until it has finished, which is what
keeps the budget. A prefetch starts at its anchor on the host-to-device stream, not
before its swap-out finished; at the first backward use compute waits for it.
"""

from __future__ import annotations

from collections import defaultdict

from chameleon_megatron.swap.profile import StepProfile
from chameleon_megatron.swap.windows import Windows

_WAIT_IN, _START_OUT, _WAIT_OUT, _START_IN = range(4)
"""Order of the actions that fall on one event."""


def expected_stall(profile: StepProfile, picked: Windows, bandwidth_bps: float) -> float:
    """Seconds of compute the plan's copies are expected to stall in one step."""
    actions: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for j, uid in enumerate(picked.uids):
        rec = profile.records[int(uid)]
        actions[rec.pack_event].append((_START_OUT, j))
        actions[int(picked.out_event[j])].append((_WAIT_OUT, j))
        actions[int(picked.prefetch_event[j])].append((_START_IN, j))
        actions[rec.use_event].append((_WAIT_IN, j))
    copy_s = picked.nbytes / bandwidth_bps
    out_end: dict[int, float] = {}
    in_end: dict[int, float] = {}
    d2h_free = h2d_free = stall = 0.0
    for event in sorted(actions):
        now = profile.event_times[event] + stall
        for kind, j in sorted(actions[event]):
            if kind == _START_OUT:
                d2h_free = out_end[j] = max(now, d2h_free) + copy_s[j]
            elif kind == _START_IN:
                h2d_free = in_end[j] = max(now, h2d_free, out_end[j]) + copy_s[j]
            else:
                ready = out_end[j] if kind == _WAIT_OUT else in_end[j]
                if ready > now:
                    stall += ready - now
                    now = ready
    return stall
