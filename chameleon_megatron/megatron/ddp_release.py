"""Let a dropped layout go: megatron DDP's gradient hooks can hold it from C++.

megatron's DDP hangs a backward hook (a closure over the DDP and one parameter) on each
parameter's AccumulateGrad node and keeps no handle to it. The distributed optimizer keeps
fp32 shards as views of the parameters, and those views carry autograd history back to the
nodes that held the parameters when the optimizer was built. The cycle optimizer -> shard
view -> (C++ graph) AccumulateGrad -> hook -> DDP -> config -> optimizer runs through objects
the garbage collector cannot traverse (torch shows a node's hooks to it only while nothing
else refers to the node's wrapper), so a recovery with the distributed optimizer kept the
whole old model, gradient buffers and optimizer alive next to the new layout. Emptying the
hooks' closures cuts it.
"""

from __future__ import annotations

import gc
from types import CellType, FunctionType
from typing import Any, Sequence

HOOK = "_make_backward_post_hook.<locals>.hook"


def release_grad_hooks(chunks: Sequence[Any]) -> int:
    """Empty the closures of megatron DDP's gradient hooks over ``chunks``, which must never
    run backward again. Returns how many hooks were cut (three scans of the heap in all)."""
    if not chunks:
        return 0
    cells = [r for r in gc.get_referrers(*chunks) if type(r) is CellType]
    closures = [r for r in gc.get_referrers(*cells) if isinstance(r, tuple)] if cells else []
    hooks = [f for f in gc.get_referrers(*closures)
             if isinstance(f, FunctionType) and f.__qualname__.endswith(HOOK)] if closures else []
    for hook in hooks:
        for cell in hook.__closure__ or ():
            cell.cell_contents = None
    return len(hooks)
