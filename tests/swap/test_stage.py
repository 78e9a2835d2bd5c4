"""Stage attribution: phases, microbatches, chunks, layers, segments."""

from __future__ import annotations

import pytest
import torch

from chameleon_megatron.swap.stage import LayerHooks, StageTracker

pytestmark = pytest.mark.timeout(30)


def test_tracker_follows_segments_and_layers():
    tr = StageTracker()
    seen = []
    layers = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    hooks = LayerHooks(tr, [(layers[0], 3), (layers[1], 4)])
    seen.append(tr.current.key)
    with tr.forward(microbatch=1, chunk=2):
        seen.append(tr.current.key)
        x = layers[0](torch.ones(2))
        seen.append(tr.current.key)
        layers[1].register_forward_pre_hook(lambda *a: seen.append(tr.current.key))
        layers[1](x)
        seen.append(tr.current.key)
    with tr.backward(microbatch=1, chunk=2):
        layers[0](x)  # recompute in backward: attributed to the backward phase
        seen.append(tr.current.key)
    hooks.remove()
    layers[0](x)
    seen.append(tr.current.key)
    assert seen == [("F", 0, 0, -1), ("F", 1, 2, -1), ("F", 1, 2, -1), ("F", 1, 2, 4),
                    ("F", 1, 2, -1), ("B", 1, 2, -1), ("F", 0, 0, -1)]
    assert ("B", 1, 2, 3) in tr.stats and ("F", 1, 2, 3) in tr.stats
    assert len(tr.segments) == 2 and all(end >= start for start, end in tr.segments)


def test_microbatch_granularity_ignores_layers():
    tr = StageTracker(layers=False)
    with tr.forward(0):
        tr.enter_layer(5)
        assert tr.current.key == ("F", 0, 0, -1)
        tr.exit_layer()


def test_backward_is_attributed_through_the_forward_output():
    tr = StageTracker()
    out = object()
    tr.remember_output(out, microbatch=3, chunk=1)
    assert tr.output_stage(out) == (3, 1)
    assert tr.output_stage(out) == (-1, 0)  # consumed
    tr.remember_output(out, 2, 0)
    tr.reset()
    assert tr.output_stage(out) == (-1, 0)
