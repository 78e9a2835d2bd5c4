"""``Trainer.rebuild`` keeps nothing of a layout it failed to build: the arguments, model,
optimizer and schedule stay as they were (as ``LMLoop.rebuild`` leaves Megatron-LM's global
arguments), so the recovery that called it can try again or give up cleanly.

In-process groups, like ``test_model_state.py``: it runs before ``tests/swap``, whose
session fixture holds a one-process world until the session ends."""

from __future__ import annotations

import pytest
import torch

from chameleon_megatron.training import trainer as trainer_module

from one_process import SMALL_GPT, one_process_trainer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def trainer():
    with one_process_trainer([*SMALL_GPT, "--train-iters", "4"]) as run:
        yield run


def test_a_failed_rebuild_keeps_nothing_and_a_later_one_trains(trainer, monkeypatch) -> None:
    trainer.train_one()
    args = trainer.args
    trainer.drop_layout()

    def no_room(*_, **__):
        raise torch.OutOfMemoryError("no room for the new layout's optimizer")

    with monkeypatch.context() as patched:
        patched.setattr(trainer_module, "build_optimizer", no_room)
        with pytest.raises(torch.OutOfMemoryError):
            trainer.rebuild(tp=1, pp=1, rank=0, world_size=1)
    assert trainer.args is args  # the arguments of the layout that still stands
    assert not {"model", "optimizer", "scheduler", "engine"} & set(vars(trainer))

    trainer.rebuild(tp=1, pp=1, rank=0, world_size=1)
    assert trainer.args is not args and trainer.args.tensor_model_parallel_size == 1
    assert torch.isfinite(torch.tensor(trainer.train_one()["loss"]))
