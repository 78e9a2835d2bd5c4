"""CPU stand-ins for Transformer Engine's and apex's fused optimizers (test-only).

Each keeps the real class's state layout and computes its update with plain torch ops, so
that migration code meets on CPU what it meets on a GPU install. Written from the sources of
Transformer Engine 2.x (``transformer_engine/pytorch/optimizers/fused_adam.py`` and
``fused_sgd.py`` at commit 04912bf, release 2.9 line) and apex
(``apex/optimizers/fused_adam.py``, ``fused_sgd.py``, 24.04):

- Adam: the step count is one int in each param group (``group["step"]``), set to 1 at the
  group's first step and incremented at each; per parameter ``exp_avg`` and ``exp_avg_sq``.
  Transformer Engine's adds ``master_weights`` (an fp32 ``master_param`` in the state,
  or, with ``store_param_remainders`` and bf16 parameters, its low 16 bits as int16), moment
  dtypes (bf16 stored as is; fp16 stored divided by a per-tensor scale kept in
  ``self._scales[param][name]``, recomputed from the absolute maximum after each step), and
  ``get_unscaled_state``/``set_scaled_state``, which megatron's distributed optimizer uses.
- SGD: a ``momentum_buffer`` per parameter, created as zeros the first time the parameter is
  stepped; a step that creates it uses the gradient as momentum (the kernel's first run).

``install(family)`` puts a family where megatron-core looks for Transformer Engine or apex.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import torch

_FP16_RANGE = torch.finfo(torch.float16).max / 2.0


def split_fp32(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 rounded to nearest on the upper 16 bits, int16 lower 16 bits) of fp32 values:
    the remainder's sign says whether the bf16 was rounded up."""
    bits = master.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    low = bits & 0xFFFF
    high = (bits >> 16) + (low >= 0x8000).to(torch.int64)
    return _as(high & 0xFFFF, torch.bfloat16), _as(low, torch.int16)


def join_fp32(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 values ``split_fp32`` split into ``param`` and ``remainder``."""
    high = param.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    low = remainder.to(torch.int64) & 0xFFFF
    high = (high - (low >= 0x8000).to(torch.int64)) & 0xFFFF
    bits = (high << 16) | low
    return (bits - (bits >= 2 ** 31).to(torch.int64) * 2 ** 32).to(torch.int32).view(torch.float32)


def _as(unsigned16: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    signed = unsigned16 - (unsigned16 >= 0x8000).to(torch.int64) * 0x10000
    return signed.to(torch.int16).view(dtype)


def _adam_update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *,
                 group: dict, decoupled: bool) -> None:
    """One Adam step on fp32 tensors, in place (the kernels' arithmetic)."""
    beta1, beta2 = group["betas"]
    step, lr, eps, wd = group["step"], group["lr"], group["eps"], group["weight_decay"]
    c1, c2 = ((1 - beta1 ** step, 1 - beta2 ** step) if group["bias_correction"]
              else (1.0, 1.0))
    if not decoupled and wd:
        g = g + wd * p
    m.mul_(beta1).add_(g, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    update = (m / c1) / ((v / c2).sqrt() + eps)
    if decoupled and wd:
        update = update + wd * p
    p.sub_(lr * update)


class _GroupStepAdam(torch.optim.Optimizer):
    """What both fused Adams share: the group's step count, fp32 arithmetic."""

    def _grad(self, p: torch.Tensor) -> torch.Tensor | None:
        return p.grad

    def _stepped_group(self, group: dict) -> None:
        group["step"] = group["step"] + 1 if "step" in group else 1

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            if not group["params"]:
                continue
            self._stepped_group(group)
            for p in group["params"]:
                if not self.state[p]:
                    self._start(p)
                grad = self._grad(p)
                if grad is not None:
                    self._update(p, grad.float(), group)
        return loss


class TEFusedAdam(_GroupStepAdam):
    """Transformer Engine's ``FusedAdam`` (2.x), capturable and fp8 aside."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *,
                 bias_correction: bool = True, adam_w_mode: bool = True,
                 capturable: bool = False, master_weights: bool = False,
                 master_weight_dtype: torch.dtype = torch.float32,
                 exp_avg_dtype: torch.dtype = torch.float32,
                 exp_avg_sq_dtype: torch.dtype = torch.float32,
                 use_decoupled_grad: bool = False, store_param_remainders: bool = False,
                 set_grad_none: bool | None = None) -> None:
        if amsgrad or capturable:
            raise RuntimeError("the stand-in has no amsgrad or capturable mode")
        for dtype in (exp_avg_dtype, exp_avg_sq_dtype):
            if dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise RuntimeError(f"the stand-in keeps moments in fp32/fp16/bf16, not {dtype}")
        if master_weights and master_weight_dtype not in (torch.float32, torch.float16):
            raise RuntimeError("FusedAdam only supports fp32/fp16 master weights.")
        super().__init__(params, {"lr": lr, "bias_correction": bias_correction, "betas": betas,
                                  "eps": eps, "weight_decay": weight_decay})
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.capturable = False
        self.master_weights = master_weights
        self.master_weight_dtype = master_weight_dtype
        self.exp_avg_dtype, self.exp_avg_sq_dtype = exp_avg_dtype, exp_avg_sq_dtype
        self.name_to_dtype_map = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype,
                                  "master_param": master_weight_dtype}
        self._scales: dict = {}
        self.use_decoupled_grad = use_decoupled_grad
        self.store_param_remainders = (store_param_remainders and master_weights
                                       and master_weight_dtype == torch.float32)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        if not self.use_decoupled_grad:
            super().zero_grad(set_to_none=set_to_none is not False)
            return
        for group in self.param_groups:
            for p in group["params"]:
                if set_to_none is False and getattr(p, "decoupled_grad", None) is not None:
                    p.decoupled_grad.zero_()
                else:
                    p.decoupled_grad = None

    def _grad(self, p: torch.Tensor) -> torch.Tensor | None:
        return getattr(p, "decoupled_grad", None) if self.use_decoupled_grad else p.grad

    def _start(self, param: torch.Tensor) -> None:
        self.initialize_state(param, self.store_param_remainders and param.dtype == torch.bfloat16)

    def _remainders(self, param: torch.Tensor, name: str) -> bool:
        return (self.store_param_remainders and name == "master_param"
                and param.dtype == torch.bfloat16)

    def _initialize_state(self, param: torch.Tensor, name: str, zero: bool,
                          remainders: bool = False) -> None:
        dtype = self.name_to_dtype_map[name]
        data = (torch.zeros_like(param, dtype=torch.int16) if remainders
                else torch.empty_like(param, dtype=dtype))
        if zero:
            data.zero_()
        self.state[param][name] = data
        if dtype != torch.float32:
            self._scales.setdefault(param, {})[name] = torch.ones(1, dtype=torch.float32)

    def initialize_state(self, param: torch.Tensor, store_param_remainders: bool) -> None:
        self._initialize_state(param, "exp_avg", True)
        self._initialize_state(param, "exp_avg_sq", True)
        if self.master_weights:
            self._initialize_state(param, "master_param", False, store_param_remainders)
            if not store_param_remainders:
                self.set_scaled_state(param, "master_param", param.detach().clone().float())

    def get_unscaled_state(self, param: torch.Tensor, name: str) -> torch.Tensor:
        stored = self.state[param][name]
        dtype = self.name_to_dtype_map[name]
        if dtype == torch.float16:
            return stored.float() * self._scales[param][name]
        if dtype == torch.bfloat16:
            return stored.float()
        return stored  # fp32, or int16 remainders

    def set_scaled_state(self, param: torch.Tensor, name: str, unscaled: torch.Tensor) -> None:
        if name not in self.state[param]:
            self._initialize_state(param, name, False, self._remainders(param, name))
        stored = self.state[param][name]
        if self.name_to_dtype_map[name] == torch.float16:
            scale = self._scales[param][name]
            scale.copy_(unscaled.abs().max().reshape(1) / _FP16_RANGE)
            rscale = torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))
            stored.copy_(unscaled * rscale)
        else:
            stored.copy_(unscaled)

    def _update(self, p: torch.Tensor, grad: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        m = self.get_unscaled_state(p, "exp_avg").clone()
        v = self.get_unscaled_state(p, "exp_avg_sq").clone()
        if self._remainders(p, "master_param"):
            main = join_fp32(p.data, state["master_param"])
        elif self.master_weights:
            main = self.get_unscaled_state(p, "master_param").clone()
        else:
            main = p.data.float()
        _adam_update(main, grad, m, v, group=group, decoupled=bool(self.adam_w_mode))
        if self._remainders(p, "master_param"):
            high, low = split_fp32(main)
            p.data.copy_(high)
            state["master_param"].copy_(low)
        else:
            p.data.copy_(main)
            if self.master_weights:
                self.set_scaled_state(p, "master_param", main)
        self.set_scaled_state(p, "exp_avg", m)
        self.set_scaled_state(p, "exp_avg_sq", v)

    def state_dict(self) -> dict:
        """As Transformer Engine's: every state unscaled (fp32, remainders as int16)."""
        out = super().state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        for index, entry in out["state"].items():
            out["state"][index] = {k: self.get_unscaled_state(params[index], k) for k in entry}
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for index, entry in state_dict["state"].items():
            param = params[index]
            self.state[param] = {}
            for name, value in entry.items():
                if value is not None:
                    self.set_scaled_state(param, name, value if self._remainders(param, name)
                                          else value.float())


class ApexFusedAdam(_GroupStepAdam):
    """apex's ``FusedAdam``: moments in the parameter's dtype, no master weights."""

    def __init__(self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True,
                 capturable: bool = False, master_weights: bool = False) -> None:
        if amsgrad or capturable or master_weights:
            raise RuntimeError("the stand-in has no amsgrad, capturable or master weights")
        super().__init__(params, {"lr": lr, "bias_correction": bias_correction, "betas": betas,
                                  "eps": eps, "weight_decay": weight_decay})
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none

    def _start(self, param: torch.Tensor) -> None:
        self.state[param]["exp_avg"] = torch.zeros_like(param)
        self.state[param]["exp_avg_sq"] = torch.zeros_like(param)

    def _update(self, p: torch.Tensor, grad: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        m, v, main = state["exp_avg"].float(), state["exp_avg_sq"].float(), p.data.float()
        _adam_update(main, grad, m, v, group=group, decoupled=bool(self.adam_w_mode))
        p.data.copy_(main)
        state["exp_avg"].copy_(m)
        state["exp_avg_sq"].copy_(v)


class FusedSGD(torch.optim.Optimizer):
    """Transformer Engine's and apex's ``FusedSGD`` (the same code): plain SGD with momentum,
    whose buffers the first step creates from the gradient."""

    def __init__(self, params: Iterable, lr: float = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
                 wd_after_momentum: bool = False, materialize_master_grads: bool = True,
                 set_grad_none: bool | None = None) -> None:
        if nesterov and (momentum <= 0.0 or dampening != 0.0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, {"lr": lr, "momentum": momentum, "dampening": dampening,
                                  "weight_decay": weight_decay, "nesterov": nesterov})
        self.wd_after_momentum = wd_after_momentum
        self.most_recent_scale = 1.0

    def _momentums(self, params: list[torch.Tensor]) -> tuple[list[torch.Tensor], bool]:
        """The buffers, created as zeros where missing; whether this is a first run (as the
        real class: decided by the last parameter of the launch)."""
        first = True
        bufs = []
        for p in params:
            state = self.state[p]
            first = "momentum_buffer" not in state
            bufs.append(state.setdefault("momentum_buffer", torch.zeros_like(p)))
        return bufs, first

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for dtype in (torch.float16, torch.float32):  # as the real class: no bf16 set
                params = [p for p in group["params"] if p.dtype == dtype and p.grad is not None]
                bufs, first = self._momentums(params)
                for p, buf in zip(params, bufs):
                    self._update(p, p.grad.float() / self.most_recent_scale, buf, group, first)
        self.most_recent_scale = 1.0
        return loss

    def _update(self, p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor, group: dict,
                first: bool) -> None:
        wd, mom, damp = group["weight_decay"], group["momentum"], group["dampening"]
        w = p.data.float()
        if wd and not self.wd_after_momentum:
            g = g + wd * w
        if mom:
            b = g.clone() if first else buf.float() * mom + (1 - damp) * g
            buf.copy_(b)
            g = g + mom * b if group["nesterov"] else b
        if wd and self.wd_after_momentum:
            g = g + wd * w
        p.data.copy_(w - group["lr"] * g)


class ApexFusedSGD(FusedSGD):
    """apex's class (the same update and state as Transformer Engine's)."""


FAMILIES = {"te": (TEFusedAdam, FusedSGD, "USING_TE_OPTIMIZER"),
            "apex": (ApexFusedAdam, ApexFusedSGD, "USING_APEX_OPTIMIZER")}


def install(family: str) -> None:
    """Make megatron-core take ``family``'s stand-ins as it takes Transformer Engine's or
    apex's optimizers when they import (``megatron.core.optimizer`` and the distributed
    optimizer's checkpoint code, which reads the step count from the param groups)."""
    import megatron.core.optimizer as optim
    import megatron.core.optimizer.distrib_optimizer as dist_optim

    adam, sgd, flag = FAMILIES[family]
    optim.Adam, optim.SGD, optim.USING_PYTORCH_OPTIMIZER = adam, sgd, False
    dist_optim.Adam, dist_optim.HAVE_APEX_OR_TE = adam, True
    setattr(dist_optim, flag, True)


_PATCHED = {"megatron.core.optimizer": ("Adam", "SGD", "USING_PYTORCH_OPTIMIZER"),
            "megatron.core.optimizer.distrib_optimizer": (
                "Adam", "HAVE_APEX_OR_TE", "USING_TE_OPTIMIZER", "USING_APEX_OPTIMIZER")}


@contextlib.contextmanager
def installed(family: str | None) -> Iterator[None]:
    """``install(family)`` for the duration (None: nothing), then megatron-core as it was."""
    import importlib

    saved = {(mod, name): getattr(importlib.import_module(mod), name)
             for mod, names in _PATCHED.items() for name in names}
    try:
        if family is not None:
            install(family)
        yield
    finally:
        for (mod, name), value in saved.items():
            setattr(importlib.import_module(mod), name, value)


def install_precision_aware(moments: torch.dtype, remainders: bool) -> None:
    """Make the trainer's optimizer config megatron's ``--use-precision-aware-optimizer``
    (``exp_avg_dtype``/``exp_avg_sq_dtype`` = ``moments``, ``--store-param-remainders``) over
    the Transformer Engine stand-in (``install("te")`` too). megatron-core checks, when it
    builds the config, that Transformer Engine's FusedAdam takes these arguments: the
    stand-in answers that import for the duration of the check only, so that nothing else
    takes Transformer Engine for installed."""
    import sys
    import types

    import megatron.core.optimizer as optim_module
    import megatron.core.optimizer.optimizer_config as config_module

    from chameleon_megatron.training import optim

    install("te")
    config_module.is_te_min_version = optim_module.is_te_min_version = \
        lambda *args, **kwargs: True  # a 2.x release: store_param_remainders is passed
    base = optim.OptimizerConfig

    def precision_aware(**kwargs: Any) -> Any:
        fakes = {name: types.ModuleType(name) for name in (
            "transformer_engine", "transformer_engine.pytorch",
            "transformer_engine.pytorch.optimizers")}
        fakes["transformer_engine.pytorch.optimizers"].FusedAdam = TEFusedAdam
        saved = {name: sys.modules.get(name) for name in fakes}
        sys.modules.update(fakes)
        try:
            return base(**kwargs, use_precision_aware_optimizer=True, exp_avg_dtype=moments,
                        exp_avg_sq_dtype=moments, store_param_remainders=remainders)
        finally:
            for name, module in saved.items():
                if module is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = module

    optim.OptimizerConfig = precision_aware
