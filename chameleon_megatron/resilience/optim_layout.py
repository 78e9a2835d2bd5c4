"""How a torch optimizer keeps one parameter's state, read and written by that layout.

megatron-core builds torch's Adam/AdamW/SGD, or Transformer Engine's or apex's fused ones
when they import, and these keep their state differently:

- the step count: torch's Adam keeps a 0-dim tensor per parameter (``state["step"]``); the
  fused Adams keep one int per param group (``group["step"]``, absent before the first step);
- the moments and master weights: torch and apex store fp32 tensors (the parameter's dtype);
  Transformer Engine's may store them as bf16, fp16 divided by a per-tensor scale, and the fp32
  master weights (``master_param``, megatron's ``--use-precision-aware-optimizer``) whole or,
  with bf16 parameters and ``store_param_remainders``, as the int16 low half of each fp32
  value whose high half is the bf16 parameter. Such an optimizer offers
  ``get_unscaled_state``/``set_scaled_state`` (megatron's distributed optimizer uses them).

The layout is read from what the optimizer holds and offers, not from its class name. A
``Slot`` shows one parameter's state as the restorer moves it: every per-element entry fp32
(unscaled, master weights whole) unless stored so, and ``step`` as a 0-dim fp32 tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Literal

import torch

_TORCH_ADAMS = (torch.optim.Adam, torch.optim.AdamW)


@dataclass(frozen=True)
class StateLayout:
    family: Literal["adam", "sgd"]
    step_in_group: bool
    """The step count is one per param group (fused Adams), not per parameter."""
    keys: tuple[str, ...]
    """Per-element entries (``master_param``: the fp32 main weights the optimizer keeps)."""
    scaled: tuple[str, ...]
    """Entries read and written through ``get_unscaled_state``/``set_scaled_state`` (stored
    in another dtype than fp32, or scaled)."""
    remainders: bool
    """``master_param`` holds the int16 low halves of the fp32 main weights (bf16 params)."""

    def state_keys(self) -> tuple[str, ...]:
        """Every entry a parameter's state shows, ``step`` included for Adam."""
        return tuple(sorted((*self.keys, "step") if self.family == "adam" else self.keys))


def refuse_offloaded(optimizer: Any) -> None:
    """ValueError for megatron's ``HybridDeviceOptimizer`` (``--optimizer-cpu-offload``): it
    splits the parameters over sub-optimizers on two devices, whose state it copies between
    them at each step; the restorer does not follow those copies."""
    if hasattr(optimizer, "sub_optimizers"):
        raise ValueError(f"in-memory recovery does not support megatron's "
                         f"{type(optimizer).__name__} (--optimizer-cpu-offload): drop "
                         "--optimizer-cpu-offload or --chameleon-ft")


def layout_of(inner: torch.optim.Optimizer) -> StateLayout:
    """The layout of ``inner``'s state (ValueError for one the restorer cannot move)."""
    refuse_offloaded(inner)
    defaults = inner.defaults
    name = type(inner).__name__
    if "momentum" in defaults and "betas" not in defaults:
        return StateLayout("sgd", False, ("momentum_buffer",), (), False)
    if "betas" not in defaults:
        raise ValueError(f"in-memory optimizer migration supports Adam- and SGD-like "
                         f"optimizers (betas or momentum in their defaults), not {name}")
    if defaults.get("amsgrad"):
        raise ValueError(f"{name} with amsgrad: in-memory optimizer migration does not move "
                         "max_exp_avg_sq")
    per_param = isinstance(inner, _TORCH_ADAMS)
    if not per_param and "bias_correction" not in defaults:
        raise ValueError(f"{name}: an Adam whose step count is neither torch's (per parameter) "
                         "nor a fused one's (per param group, with bias_correction)")
    masters = bool(getattr(inner, "master_weights", False))
    keys = ("exp_avg", "exp_avg_sq", *(("master_param",) if masters else ()))
    dtypes = getattr(inner, "name_to_dtype_map", {})
    remainders = masters and bool(getattr(inner, "store_param_remainders", False))
    scaled = tuple(k for k in keys if dtypes.get(k, torch.float32) != torch.float32)
    if scaled and not hasattr(inner, "set_scaled_state"):
        raise ValueError(f"{name} keeps {', '.join(scaled)} in low precision but offers no "
                         "get_unscaled_state/set_scaled_state")
    return StateLayout("adam", not per_param, keys, scaled, remainders)


@dataclass(frozen=True)
class Slot:
    """One parameter's state in its optimizer."""

    optimizer: torch.optim.Optimizer
    main: torch.Tensor
    """The tensor the optimizer updates (fp32 main weights, or with ``master_param`` the
    low-precision parameter)."""
    group: dict
    layout: StateLayout

    def _remainders(self) -> bool:
        return self.layout.remainders and self.main.dtype == torch.bfloat16

    def _direct(self, key: str) -> bool:
        """Stored as shown: read and written in place."""
        if key == "step":
            return not self.layout.step_in_group
        return key not in self.layout.scaled and not (key == "master_param"
                                                      and self._remainders())

    def _state(self) -> dict:
        """The optimizer's state of ``main``, created as its first step would."""
        state = self.optimizer.state[self.main]
        if self.layout.family == "sgd":
            if self.group["momentum"] and state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(self.main)
            return state
        if not state:
            init = getattr(self.optimizer, "initialize_state", None)
            if init is not None and self.layout.step_in_group:
                init(self.main, self._remainders())
            else:
                state["exp_avg"] = torch.zeros_like(self.main)
                state["exp_avg_sq"] = torch.zeros_like(self.main)
        if not self.layout.step_in_group and state.get("step") is None:
            on_device = self.group.get("capturable") or self.group.get("fused")
            state["step"] = torch.zeros((), dtype=torch.float32,
                                        device=self.main.device if on_device else "cpu")
        return state

    def keys(self) -> tuple[str, ...]:
        """The entries this parameter shows (SGD without momentum has none)."""
        if self.layout.family == "sgd" and not self.group["momentum"]:
            return ()
        return self.layout.state_keys()

    def read(self) -> dict[str, torch.Tensor]:
        """key -> tensor: the stored tensor where stored as shown, else an fp32 copy."""
        state = self._state()
        out: dict[str, torch.Tensor] = {}
        for key in self.keys():
            if self._direct(key):
                out[key] = state[key]
            elif key == "step":
                out[key] = torch.tensor(float(self.group.get("step", 0)), dtype=torch.float32)
            elif key == "master_param" and self._remainders():
                out[key] = join_fp32(self.main.detach(), state[key])
            else:
                out[key] = self.optimizer.get_unscaled_state(self.main, key).float().clone()
        return out

    def staged(self) -> dict[str, bool]:
        """key -> whether a sink stages it (``write`` stores it) rather than receiving it in
        place."""
        return {key: not self._direct(key) for key in self.keys()}

    @torch.no_grad()
    def write(self, values: dict[str, torch.Tensor]) -> None:
        """Store ``values`` (as ``read`` shows them); a group's ``step`` is ``set_steps``'s."""
        state = self._state()
        for key, value in values.items():
            if key == "step" and self.layout.step_in_group:
                continue
            if self._direct(key):
                state[key].copy_(value)
            elif key == "master_param" and self._remainders():
                high, low = split_fp32(value.to(torch.float32).view(self.main.shape))
                self.main.copy_(high)
                state[key].copy_(low)
            else:
                self.optimizer.set_scaled_state(self.main, key,
                                                value.to(torch.float32).view(self.main.shape))


def set_steps(steps: Iterable[tuple[Slot, torch.Tensor]]) -> None:
    """Set each param group's step count from the values its parameters received (a
    ValueError if they disagree); per-parameter steps are written with the state."""
    by_group: dict[int, tuple[dict, set[int]]] = {}
    for slot, value in steps:
        if slot.layout.step_in_group:
            group, seen = by_group.setdefault(id(slot.group), (slot.group, set()))
            seen.add(int(round(float(value))))
    for group, seen in by_group.values():
        if len(seen) > 1:
            raise ValueError(f"the parameters of one {type(group).__name__} param group arrived "
                             f"with different step counts {sorted(seen)}: their sources were at "
                             "different steps")
        (step,) = seen
        if step == 0:
            group.pop("step", None)  # not stepped yet: the first step sets it
        elif isinstance(group.get("step"), torch.Tensor):
            group["step"].fill_(step)
        else:
            group["step"] = step


def split_fp32(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 -> (bf16 high halves rounded to nearest, int16 low halves): the remainder's sign
    bit says the high half was rounded up."""
    bits = values.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    low = bits & 0xFFFF
    high = (bits >> 16) + (low >= 0x8000).to(torch.int64)
    return _from_unsigned16(high & 0xFFFF, torch.bfloat16), _from_unsigned16(low, torch.int16)


def join_fp32(high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The fp32 values ``split_fp32`` split (exact)."""
    up = high.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    rest = low.to(torch.int64) & 0xFFFF
    up = (up - (rest >= 0x8000).to(torch.int64)) & 0xFFFF
    bits = (up << 16) | rest
    signed = bits - (bits >= 2 ** 31).to(torch.int64) * 2 ** 32
    return signed.to(torch.int32).view(torch.float32)


def _from_unsigned16(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    signed = values - (values >= 0x8000).to(torch.int64) * 0x10000
    return signed.to(torch.int16).view(dtype)
