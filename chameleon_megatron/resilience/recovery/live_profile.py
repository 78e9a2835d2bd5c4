"""The profile the decision center plans with inside a running job.

Either the user's (``ft.profile``: a JSON written by ``chameleon profile``), checked against
the run, or derived from the model's arguments (bytes from the shape, times from FLOP shares)
and calibrated to the step time measured in the current layout, so that the estimator
reproduces what this job really does. Link figures come from the hardware (H100-class
defaults on GPU, gloo on this host's CPU otherwise); the regroup cost is the one measured at
the previous recovery when there was one.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Sequence

import torch

from chameleon_megatron.resilience.decision.calibration import Observation, calibrate
from chameleon_megatron.resilience.decision.layout import Plan
from chameleon_megatron.resilience.decision.model_shape import ModelShape
from chameleon_megatron.resilience.decision.profile import Profile, load_profile
from chameleon_megatron.resilience.decision.reroute import ReroutePlan
from chameleon_megatron.resilience.decision.shape_profile import H100, Hardware, profile_from_shape

logger = logging.getLogger(__name__)

CPU_GLOO = Hardware(
    device_memory_bytes=8 * 2**30,  # replaced by the host's memory per rank
    p2p_bandwidth_Bps=1e9,
    allreduce_bandwidth_Bps=0.5e9,
    transfer_bandwidth_Bps=0.2e9,
    link_latency_s=100e-6,
    regroup_s=1.0,
)
"""gloo between processes of one CPU host: p2p and all-reduce of host tensors at ~1 and
~0.5 GB/s, state migration at ~0.2 GB/s and regrouping (new groups, model, optimizer)
~1 s, the order measured in docs/benchmarks.md, Recovery."""


def hardware_for(device: torch.device) -> Hardware:
    """H100-class figures on a GPU (memory: the device's, less 10%), gloo on CPU (memory:
    the host's, shared by its local ranks)."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return dataclasses.replace(H100, device_memory_bytes=0.9 * total)
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return dataclasses.replace(CPU_GLOO, device_memory_bytes=host / ranks)


def check_profile(profile: Profile, args: Any) -> None:
    """A user-given profile must describe this run (ValueError naming the mismatch)."""
    expected = {"num_layers": args.num_layers, "tp": args.tensor_model_parallel_size,
                "micro_batch_size": args.micro_batch_size,
                "global_batch_size": args.global_batch_size}
    for name, want in expected.items():
        have = getattr(profile, name)
        if have != want:
            raise ValueError(f"ft.profile {profile.name!r}: {name}={have}, but this run has "
                             f"{want}")


def runtime_profile(args: Any, *, path: str | None, hardware: Hardware, plan: Plan,
                    step_time_s: float | None, regroup_s: float | None,
                    reroute: ReroutePlan | None = None,
                    history: Sequence[Observation] = (), swap_bandwidth_Bps: float = 0.0
                    ) -> Profile:
    """The profile for a decision while training ``plan`` (rerouting as ``reroute`` says) at
    ``step_time_s`` (None: not measured yet), calibrated on that and on the layouts measured
    earlier in this job (``history``, from estimator feedback). ``swap_bandwidth_Bps``: the
    job swaps activations at this bandwidth (0: it does not, so no plan may rely on it; a
    profile file's own figure, when it has one, is kept)."""
    profile = _profile(args, path=path, hardware=hardware, plan=plan, step_time_s=step_time_s,
                       regroup_s=regroup_s, reroute=reroute, history=history)
    if swap_bandwidth_Bps <= 0:
        return dataclasses.replace(profile, swap_bandwidth_Bps=0.0)
    if profile.swap_bandwidth_Bps <= 0:
        return dataclasses.replace(profile, swap_bandwidth_Bps=swap_bandwidth_Bps)
    return profile


def _profile(args: Any, *, path: str | None, hardware: Hardware, plan: Plan,
             step_time_s: float | None, regroup_s: float | None, reroute: ReroutePlan | None,
             history: Sequence[Observation]) -> Profile:
    if path:
        profile = load_profile(path)
        check_profile(profile, args)
        return profile
    if regroup_s is not None:
        hardware = dataclasses.replace(hardware, regroup_s=regroup_s)
    shape = ModelShape.from_args(vars(args))
    profile = profile_from_shape(
        shape, hardware, seconds_per_flop=1e-12, name="runtime",
        source="derived from the model args, times calibrated to the measured step times")
    observations = list(history)
    if step_time_s is not None:
        extra = reroute.extra_microbatches() if reroute is not None else {}
        observations.append(Observation(plan, step_time_s, "current layout", extra))
    if not observations:
        return profile
    try:
        return calibrate(profile, observations).profile
    except ValueError as exc:  # communication alone exceeds a step: keep FLOP shares
        logger.warning("profile not calibrated: %s", exc)
        return profile
