"""Config of the resilience runtime (flags --chameleon-ft*, YAML section ft)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Literal

from chameleon_megatron.configurable import ConfigError, check
from chameleon_megatron.resilience.recovery.faults import parse_fault


@dataclass(frozen=True, kw_only=True)
class ResilienceConfig:
    """Fault tolerance (paper B): detection, decision center, recovery."""

    SECTION: ClassVar[str] = "ft"

    enabled: bool = False
    """Keep training in-process when a rank fails (needs the chameleon-run launcher)."""
    mtbf_prior_s: float = 6 * 3600.0
    """Prior estimate of the mean time between failures of the job, in seconds."""
    strategy: Literal["adaptive", "reroute", "replan"] = "adaptive"
    """Recovery strategy: pick by score (adaptive) or force one."""
    plans: bool = True
    """Recoveries may run layouts megatron's parallel state cannot express (rerouting around dead ranks, pipelines of different depths) through the plan runtime; false: megatron layouts only. On Megatron-LM's pretrain_gpt.py a plan changes to a megatron layout for each evaluation and checkpoint, and back after it."""
    keep_replicas: bool = True
    """A re-plan keeps two or more pipelines where such a layout fits memory, so that every stage's state has a copy when the next failure comes (one pipeline leaves only the checkpoint); false: the fastest layout, even a single pipeline."""
    inject_fault: tuple[str, ...] = dataclasses.field(
        default=(), metadata={"flag": "--chameleon-inject-fault"}
    )
    """Deterministic fault, repeatable: 'rank=R,iteration=I,phase=forward|backward|grads|optimizer|recovery|eval|save|copy|final-save|final-eval|final-test,kind=exit|hang|exception|oom', or kind=slow,seconds=S (final-*: Megatron-LM pretrain()'s end-of-job work, I = --train-iters)."""
    startup_timeout_s: float = 300.0
    """Process-group and heartbeat timeout until a step time has been measured (start-up, model build, checkpoint I/O)."""
    pg_timeout_factor: float = 5.0
    """Process-group timeout = max(min_pg_timeout_s, this x the measured step time); heartbeat timeout = 2 x that."""
    min_pg_timeout_s: float = 5.0
    """Lower bound of the derived process-group timeout, in seconds."""
    timing_steps: int = 3
    """Steps measured (after the first, which is warm-up) before timeouts are derived from the step time."""
    node_timeout_s: float = 30.0
    """An agent (node) silent this long in the job store is declared lost with all its ranks."""
    recovery_retries: int = 5
    """Attempts of one recovery that may fail with no rank failing (a slow peer) before the
    job gives up; each retry waits twice as long."""
    feedback_steps: int = 5
    """Steps measured after each recovery (after one warm-up step) whose median is compared
    with the decision center's estimate and recalibrates it; a rerouting job then asks it
    again whether to re-plan."""
    profile: str | None = None
    """Decision-center profile JSON (``chameleon profile``); none: derived from the model and calibrated to the measured step time."""
    respawns: int = 0
    """How many failed workers this node's agent restarts, each as a new member that joins the job at its next step boundary (a repaired node); 0: none."""
    respawn_delay_s: float = 5.0
    """Seconds between a worker's failure and its restart."""
    shard_replica_interval: int = 10
    """With --use-distributed-optimizer: every this many steps each rank copies its optimizer shard to host memory and to its data-parallel successor's (a dead rank's shard has no other copy); a failure rolls the job back to the newest copy and redoes the steps since (1: none). The exchange overlaps the next steps (a thread); the steps wait 1.0 percent at 1 and 0.1 percent at 10 (measured on CPU by scripts/bench_shard_replica.py)."""
    join: bool = False
    """chameleon-run on a new (or repaired) node: join the running job found at the rendezvous endpoint under --rdzv-id, its workers admitted at the job's next step boundary, instead of starting a job."""

    def __post_init__(self) -> None:
        check(self.mtbf_prior_s > 0, "ft.mtbf_prior_s", self.mtbf_prior_s, "must be > 0")
        check(self.startup_timeout_s > 0, "ft.startup_timeout_s", self.startup_timeout_s,
              "must be > 0")
        check(self.pg_timeout_factor >= 1, "ft.pg_timeout_factor", self.pg_timeout_factor,
              "must be >= 1 (a timeout shorter than one step kills healthy ranks)")
        check(self.min_pg_timeout_s > 0, "ft.min_pg_timeout_s", self.min_pg_timeout_s,
              "must be > 0")
        check(self.timing_steps >= 1, "ft.timing_steps", self.timing_steps, "must be >= 1")
        check(self.recovery_retries >= 0, "ft.recovery_retries", self.recovery_retries,
              "must be >= 0")
        check(self.feedback_steps >= 1, "ft.feedback_steps", self.feedback_steps, "must be >= 1")
        check(self.node_timeout_s > 0, "ft.node_timeout_s", self.node_timeout_s, "must be > 0")
        check(self.shard_replica_interval >= 1, "ft.shard_replica_interval",
              self.shard_replica_interval, "must be >= 1")
        check(self.respawns >= 0, "ft.respawns", self.respawns, "must be >= 0")
        check(self.respawn_delay_s >= 0, "ft.respawn_delay_s", self.respawn_delay_s,
              "must be >= 0")
        for text in self.inject_fault:
            try:
                parse_fault(text)
            except ValueError as exc:
                raise ConfigError(f"ft.inject_fault={text!r}: {exc}") from None
        check(self.plans or self.strategy != "reroute", "ft.strategy", self.strategy,
              "reroutes through the plan runtime, which ft.plans=false turns off")
        check(self.enabled or not self.join, "ft.join", self.join,
              "joins a fault-tolerant job: give --chameleon-ft too")
        check(self.enabled or not self.inject_fault, "ft.inject_fault", self.inject_fault,
              "faults are injected into fault-tolerant jobs: give --chameleon-ft too")
