"""Where injected faults fire: hooks on the model chunks and the optimizer of a run."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

from chameleon_megatron.resilience.recovery.faults import FaultInjector


def torch_optimizers(optimizer: Any) -> Iterator[torch.optim.Optimizer]:
    """The torch optimizers inside a megatron optimizer (chained or wrapped) or a torch one."""
    if isinstance(optimizer, torch.optim.Optimizer):
        yield optimizer
    elif hasattr(optimizer, "chained_optimizers"):
        for inner in optimizer.chained_optimizers:
            yield from torch_optimizers(inner)
    elif hasattr(optimizer, "optimizer"):
        yield from torch_optimizers(optimizer.optimizer)


def install_fault_hooks(injector: FaultInjector, model: list[torch.nn.Module], optimizer: Any,
                        iteration: Callable[[], int]) -> Callable[[], None]:
    """Call ``injector.check`` at the forward, backward, grads and optimizer phases of each
    step.

    forward: a forward pre-hook on each model chunk; backward: a gradient hook on one
    parameter per chunk (fires while backward runs, without wrapping the chunk's outputs,
    which megatron's schedules free in place); grads: as megatron's optimizer starts its step
    (``prepare_grads``: the gradients are all-reduced, the norm's all-reduce follows);
    optimizer: a step pre-hook on each torch optimizer inside ``optimizer``. ``iteration()``
    gives the step being computed. Returns a function that removes the hooks.
    """
    handles = []
    for chunk in model:
        handles.append(chunk.register_forward_pre_hook(
            lambda *_: injector.check(iteration(), "forward")))
        param = next((p for p in chunk.parameters() if p.requires_grad), None)
        if param is not None:
            handles.append(param.register_hook(
                lambda grad: injector.check(iteration(), "backward")))
    for opt in torch_optimizers(optimizer):
        handles.append(opt.register_step_pre_hook(
            lambda *_: injector.check(iteration(), "optimizer")))
    prepare = getattr(optimizer, "prepare_grads", None)
    if prepare is not None:  # an instance attribute over megatron's method, removed below
        def prepare_grads(*args: Any, **kwargs: Any) -> Any:
            injector.check(iteration(), "grads")
            return prepare(*args, **kwargs)
        optimizer.prepare_grads = prepare_grads

    def remove() -> None:
        for h in handles:
            h.remove()
        if prepare is not None:
            del optimizer.prepare_grads
    return remove
