"""Module buffers in the restorer's state units: the MoE router's ``expert_bias`` (trained
outside the optimizer, by megatron's ``finalize_model_grads``) travels with its layer's
parameters, is written in place, and moving it is what makes the next steps the same."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from chameleon_megatron.configurable import ConfigError
from chameleon_megatron.resilience.model_state import ModelState, unit_buffers, unwrap
from chameleon_megatron.resilience.recovery.plugin import check_recoverable
from chameleon_megatron.training.arguments import parse_args
from chameleon_megatron.training.optim import build_scheduler
from chameleon_megatron.training.validate import validate_args

from one_process import SMALL_GPT, one_process_trainer

pytestmark = pytest.mark.timeout(120)

ARGS = [*SMALL_GPT, "--train-iters", "8", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear",
        "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate", "0.05"]
BIAS = "mlp.router.expert_bias"


@pytest.fixture(scope="module")
def trainer():
    with one_process_trainer(ARGS, te_absent=True) as run:
        yield run


def test_the_flag_needs_sigmoid_scores() -> None:
    args = parse_args([a for a in ARGS if a not in ("--moe-router-score-function", "sigmoid")])
    with pytest.raises(ValueError, match="needs --moe-router-score-function sigmoid"):
        validate_args(args, 1)


def test_expert_bias_moves_with_its_layer_in_place(trainer) -> None:
    for _ in range(2):
        trainer.train_one()
    routers = [m for c in trainer.model for m in unwrap(c).modules()
               if getattr(m, "expert_bias", None) is not None]
    assert len(routers) == 2 and any(r.expert_bias.abs().sum() > 0 for r in routers)
    # only the persistent buffer: the per-step token counts are rebuilt
    assert {n for b in unit_buffers(trainer.model).values() for n in b} == {BIAS}
    view = ModelState(trainer.model, trainer.optimizer, role="sink")
    for layer, router in enumerate(routers):
        assert view.tensors(layer, "params")[BIAS].data_ptr() == router.expert_bias.data_ptr()
        assert BIAS not in view.tensors(layer, "optimizer")

    source = ModelState(trainer.model, trainer.optimizer, role="source")
    saved = {(u, k): {n: t.clone() for n, t in source.tensors(u, k).items()}
             for u in source.units() for k in ("params", "optimizer")}
    at, consumed, sched = trainer.iteration, trainer.consumed_samples, \
        trainer.scheduler.state_dict()

    def restore(buffers: bool) -> list[float]:
        """Fill a model as a fresh one (zero buffers) from ``saved``, then train 3 steps."""
        with torch.no_grad():
            for router in routers:
                router.expert_bias.zero_()
            for (u, k), tensors in saved.items():
                for name, t in view.tensors(u, k).items():
                    if buffers or name != BIAS:
                        t.copy_(tensors[name])
            view.commit()
        trainer.iteration, trainer.consumed_samples = at, consumed
        trainer.scheduler = build_scheduler(trainer.args, trainer.optimizer)
        trainer.scheduler.load_state_dict(sched)
        return [trainer.train_one()["loss"] for _ in range(3)]

    reference = restore(buffers=True)
    assert restore(buffers=True) == reference  # bitwise: the same computation
    assert restore(buffers=False) != reference  # a zeroed bias routes otherwise


def test_a_distributed_optimizer_with_buffers_is_refused_before_training(trainer) -> None:
    """Its shard copies hold the optimizer's pieces only: the bias would come back zero."""
    class DistributedOptimizer:  # megatron's, as ``dist_opt.is_distributed`` tells it
        def __init__(self, inner: torch.optim.Optimizer) -> None:
            self.optimizer = inner

    ctx = SimpleNamespace(vpp_size=1, args=trainer.args, model=trainer.model,
                          extra={"optimizer": DistributedOptimizer(trainer.optimizer.optimizer)})
    with pytest.raises(ConfigError, match=r"do not hold module buffers \(mlp.router.expert_bias\)"):
        check_recoverable(ctx, SimpleNamespace(profile=None))
