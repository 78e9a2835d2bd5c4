"""A dropped layout with megatron's distributed optimizer is collectable
(``megatron/ddp_release.py``): the optimizer's shard views reach DDP's gradient hooks through
autograd, a cycle the collector cannot see; ``drop_layout`` cuts the hooks' closures.

In-process groups, like ``test_trainer_rebuild.py`` (before ``tests/swap`` in the session)."""

from __future__ import annotations

import gc
import weakref

import pytest

from chameleon_megatron.training import trainer as trainer_module
from chameleon_megatron.training.trainer import Trainer

from one_process import SMALL_GPT, one_process_trainer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["replicated", "distributed"])
def trainer(request):
    distributed = ["--use-distributed-optimizer"] if request.param == "distributed" else []
    with one_process_trainer([*SMALL_GPT, "--train-iters", "4", *distributed]) as run:
        yield run


def _dropped(trainer: Trainer) -> list[str]:
    """Train a step, drop the layout, collect: the names of what is still alive."""
    trainer.train_one()
    named = {"optimizer": trainer.optimizer, "chunk": trainer.model[0],
             "parameter": next(trainer.model[0].parameters()),
             "grad buffer": trainer.model[0].buffers[0].grad_data}
    refs = {name: weakref.ref(obj) for name, obj in named.items()}
    del named
    trainer.drop_layout()
    gc.collect()
    return sorted(name for name, ref in refs.items() if ref() is not None)


def test_a_dropped_layout_is_collected(trainer) -> None:
    assert _dropped(trainer) == []
    trainer.rebuild(tp=1, pp=1, rank=0, world_size=1)  # and the next one trains
    trainer.train_one()


def test_without_the_release_the_distributed_optimizer_keeps_it(trainer, monkeypatch) -> None:
    monkeypatch.setattr(trainer_module, "release_grad_hooks", lambda chunks: 0)
    alive = _dropped(trainer)
    if trainer.args.use_distributed_optimizer:
        assert alive == ["chunk", "grad buffer", "optimizer", "parameter"]
    else:
        assert alive == []
