"""State units of a real megatron GPT (the trainer's, one process): names, Adam and SGD
state, and that moving every unit's parameters and optimizer state reproduces the next
step exactly, with torch's optimizers and with stand-ins of Transformer Engine's and apex's
fused ones (``fused_standins``: the step count in the param group)."""

from __future__ import annotations

import pytest
import torch

from chameleon_megatron.resilience.model_state import ModelState, optimizer_slots
from chameleon_megatron.resilience.optim_layout import Slot, layout_of
from chameleon_megatron.resilience.recovery.overlap import SourceTensors
from chameleon_megatron.training.optim import build_scheduler

from fused_standins import installed
from one_process import SMALL_GPT, one_process_trainer

pytestmark = pytest.mark.timeout(120)

ARGS = [*SMALL_GPT, "--train-iters", "8", "--hidden-dropout", "0", "--attention-dropout", "0"]


OPTIMIZERS = {"adam": ["--optimizer", "adam"], "sgd": ["--optimizer", "sgd"],
              "sgd-plain": ["--optimizer", "sgd", "--sgd-momentum", "0"],
              "te-adam": ["--optimizer", "adam"], "apex-adam": ["--optimizer", "adam", "--bf16"],
              "te-sgd": ["--optimizer", "sgd"], "apex-sgd": ["--optimizer", "sgd"]}
"""Those named ``te-``/``apex-`` run with that family's stand-ins in megatron-core."""


@pytest.fixture(scope="module", params=list(OPTIMIZERS))
def trainer(request):
    family = {"te": "te", "apex": "apex"}.get(request.param.partition("-")[0])
    with installed(family), one_process_trainer([*ARGS, *OPTIMIZERS[request.param]]) as run:
        inner = type(run.optimizer.optimizer)
        assert (family is None) == inner.__module__.startswith("torch."), inner
        yield run


class Snapshot:
    """Plain copies of a view's tensors (a stand-in for a replica on another rank)."""

    def __init__(self, view: ModelState) -> None:
        self.data = {(u, k): {n: t.clone() for n, t in view.tensors(u, k).items()}
                     for u in view.units() for k in ("params", "optimizer")}

    def tensors(self, item, kind):
        return self.data[(item, kind)]


def test_units_cover_every_parameter_with_layout_free_names(trainer) -> None:
    view = ModelState(trainer.model, trainer.optimizer, role="sink")
    assert sorted(map(str, view.units())) == ["0", "1", "embedding", "output"]
    layer = view.tensors(1, "params")
    assert "self_attention.linear_qkv.weight" in layer and "mlp.linear_fc2.weight" in layer
    assert {n for n in view.tensors("embedding", "params") if "/" not in n} == {
        "word_embeddings.weight", "position_embeddings.weight"}  # (bf16: and their /main)
    # tied output weight: only a source offers it (as the embedding weight)
    assert "output_layer.weight" not in view.tensors("output", "params")
    source = ModelState(trainer.model, trainer.optimizer, role="source")
    assert source.tensors("output", "params")["output_layer.weight"].data_ptr() == \
        view.tensors("embedding", "params")["word_embeddings.weight"].data_ptr()
    n_params = sum(1 for c in trainer.model for _ in c.parameters())
    assert sum(1 for u in view.units() for n in view.tensors(u, "params") if "/" not in n) \
        == n_params
    assert len(optimizer_slots(trainer.optimizer)) == n_params


def test_moving_all_state_reproduces_the_next_step_and_params_alone_do_not(trainer) -> None:
    for _ in range(2):
        trainer.train_one()
    view = ModelState(trainer.model, trainer.optimizer, role="sink")
    state = ModelState(trainer.model, trainer.optimizer, role="source").tensors(0, "optimizer")
    if trainer.args.optimizer == "adam":
        assert state["mlp.linear_fc1.weight/exp_avg"].abs().sum() > 0
        assert state["mlp.linear_fc1.weight/step"] == 2
    elif trainer.args.sgd_momentum:
        assert set(state) == {f"{n}/momentum_buffer" for n in view.tensors(0, "params")}
        assert state["mlp.linear_fc1.weight/momentum_buffer"].abs().sum() > 0
    else:  # plain SGD keeps no state: the parameters are all there is to move
        assert state == {}
    saved = Snapshot(ModelState(trainer.model, trainer.optimizer, role="source"))
    saved_iteration, saved_consumed = trainer.iteration, trainer.consumed_samples
    saved_sched = trainer.scheduler.state_dict()

    def restore(kinds: tuple[str, ...]) -> list[float]:
        with torch.no_grad():
            for u in view.units():  # scramble, then fill from the snapshot
                for k in ("params", "optimizer"):
                    for name, t in view.tensors(u, k).items():
                        fill = (saved.tensors(u, k)[name] if k in kinds
                                else torch.full_like(t, 5) if name.endswith("/step")
                                else torch.rand_like(t))
                        t.copy_(fill)
            view.commit()
        trainer.iteration, trainer.consumed_samples = saved_iteration, saved_consumed
        trainer.scheduler = build_scheduler(trainer.args, trainer.optimizer)  # as a rebuild does
        trainer.scheduler.load_state_dict(saved_sched)
        return [trainer.train_one()["loss"] for _ in range(2)]

    reference = restore(("params", "optimizer"))
    assert restore(("params", "optimizer")) == reference  # bitwise: same computation
    without_moments = restore(("params",))
    assert without_moments[0] == reference[0]  # same params: same loss at the redone step
    if state:
        assert without_moments[1] != pytest.approx(reference[1], rel=1e-6)
    else:
        assert without_moments == reference


def test_a_new_layout_adopts_the_old_optimizer_state_once_without_a_copy(trainer) -> None:
    """A unit that stays on its rank: the new optimizer takes the old state tensors
    themselves (recovery.overlap.adopt_local); a tensor already taken is not taken twice
    (a tied weight's state is offered under two units), nor one that does not fit."""
    trainer.train_one()
    old = SourceTensors(ModelState(trainer.model, trainer.optimizer, role="source"))
    trainer.drop_layout()
    trainer.rebuild(tp=1, pp=1, rank=0, world_size=1)
    new = ModelState(trainer.model, trainer.optimizer, role="sink")
    new.adopt(0, "optimizer", old.tensors(0, "optimizer"))
    new.adopt(1, "optimizer", old.tensors(0, "optimizer"))  # layer 0's again: refused
    wrong = {n: t[..., :1] if t.dim() else t for n, t in old.tensors("embedding",
                                                                      "optimizer").items()}
    new.adopt("embedding", "optimizer", wrong)  # shapes do not fit: refused
    given = {id(t) for u in ("embedding", 0, 1) for t in old.tensors(u, "optimizer").values()}
    if trainer.args.optimizer == "sgd" and not trainer.args.sgd_momentum:
        assert new.tensors(0, "optimizer") == {}  # no state to adopt
        return
    if any(any(s.staged().values()) for s in optimizer_slots(trainer.optimizer).values()):
        # a fused Adam keeps its step in the param group: its state is written, not adopted
        assert not any(t is old.tensors(0, "optimizer").get(n)
                       for n, t in new.tensors(0, "optimizer").items())
        return
    for name, t in new.tensors(0, "optimizer").items():
        assert t is old.tensors(0, "optimizer")[name], name
    for unit in (1, "embedding"):
        fresh = new.tensors(unit, "optimizer")
        assert fresh and not {id(t) for t in fresh.values()} & given, unit
        assert all(not t.any() for k, t in fresh.items() if not k.endswith("/step"))


def test_a_zero_momentum_buffer_gives_sgds_first_step_exactly() -> None:
    """A sink that receives SGD state before its first step holds a zero buffer; torch
    would start the buffer from the first gradient instead: the same step, bit for bit."""
    torch.manual_seed(0)
    fresh = torch.nn.Parameter(torch.randn(8, 8))
    filled = torch.nn.Parameter(fresh.detach().clone())
    steps = [torch.optim.SGD([p], lr=0.1, momentum=0.9, weight_decay=0.01)
             for p in (fresh, filled)]
    group = steps[1].param_groups[0]
    buffer = Slot(steps[1], filled, group, layout_of(steps[1])).read()["momentum_buffer"]
    assert not buffer.any()
    for _ in range(3):
        grad = torch.randn(8, 8)
        for p, opt in zip((fresh, filled), steps):
            p.grad = grad.clone()
            opt.step()
    assert torch.equal(fresh, filled)
    assert torch.equal(steps[0].state[fresh]["momentum_buffer"], buffer)

