"""``chameleon plan``: both recovery candidates for a layout, a profile and failed ranks,
and the choice by Eq. 8 (JSON with ``--json``, else a table)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from chameleon_megatron.resilience.decision.candidates import Candidates, make_candidates
from chameleon_megatron.resilience.decision.center import swap_budgets
from chameleon_megatron.resilience.decision.layout import Plan, UniformLayout
from chameleon_megatron.resilience.decision.mtbf import MtbfEstimator
from chameleon_megatron.resilience.decision.perf_model import plan_step
from chameleon_megatron.resilience.decision.planner import Planner, SearchOptions
from chameleon_megatron.resilience.decision.profile import load_profile
from chameleon_megatron.resilience.decision.selector import NoFeasibleCandidate, select


def parse_layout(text: str) -> UniformLayout:
    """'tp=2,pp=4,dp=8[,vpp=2]' -> UniformLayout."""
    try:
        parts = dict(item.split("=", 1) for item in text.split(","))
        return UniformLayout(**{k.strip(): int(v) for k, v in parts.items()})
    except (ValueError, TypeError) as exc:
        raise ValueError(f"--layout {text!r}: expected tp=T,pp=P,dp=D[,vpp=V] ({exc})") from None


def parse_list(text: str, kind: type = int) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="recovery candidates and the choice for failed ranks",
                              description=__doc__)
    p.add_argument("--profile", required=True, help="profile JSON (see docs/decision_center.md)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--layout", help="uniform layout trained now: tp=T,pp=P,dp=D[,vpp=V]")
    where.add_argument("--plan", help="plan JSON trained now (as written by --write-plan)")
    p.add_argument("--failed", required=True, help="dead ranks, comma separated")
    p.add_argument("--d-s", type=float, help="D: expected seconds to the next failure")
    p.add_argument("--mtbf-prior-s", type=float, default=6 * 3600.0,
                   help="without --d-s: prior MTBF of the job, s (default 21600)")
    p.add_argument("--failure-times", default="", help="without --d-s: past failure times, s")
    p.add_argument("--now-s", type=float, default=0.0, help="without --d-s: job age, s")
    p.add_argument("--strategy", choices=("adaptive", "reroute", "replan"), default="adaptive")
    p.add_argument("--uniform", action="store_true", help="re-plan only to uniform layouts")
    p.add_argument("--min-depth", type=int, default=1)
    p.add_argument("--max-depth", type=int, default=None)
    p.add_argument("--min-pipelines", type=int, default=1)
    p.add_argument("--max-pipelines", type=int, default=None)
    p.add_argument("--max-idle", type=int, default=None, help="most TP groups left idle")
    p.add_argument("--time-limit-s", type=float, default=5.0, help="plan search limit (default 5)")
    p.add_argument("--swap-bandwidth-gbps", type=float, default=None,
                   help="the job swaps activations at this host<->device bandwidth: stages over "
                        "device memory may swap to fit (0: no swapping; default: the profile's)")
    p.add_argument("--write-plan", help="write the chosen layout as plan JSON")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def run(args: argparse.Namespace) -> int:
    profile = load_profile(args.profile)
    if args.swap_bandwidth_gbps is not None:
        if args.swap_bandwidth_gbps < 0:
            raise SystemExit(f"--swap-bandwidth-gbps={args.swap_bandwidth_gbps}: must be >= 0")
        profile = dataclasses.replace(profile, swap_bandwidth_Bps=args.swap_bandwidth_gbps * 1e9)
    if args.layout:
        current = parse_layout(args.layout).to_plan(profile.num_layers, profile.global_microbatches)
    else:
        current = Plan.from_dict(json.loads(Path(args.plan).read_text()))
    dead = parse_list(args.failed)
    unknown = sorted(set(dead) - set(current.ranks()))
    if unknown:
        raise SystemExit(f"--failed: ranks {unknown} are not in the layout")
    d_s = args.d_s if args.d_s is not None else MtbfEstimator(prior_s=args.mtbf_prior_s).expected_s(
        parse_list(args.failure_times, float), args.now_s)
    options = SearchOptions(min_depth=args.min_depth, max_depth=args.max_depth,
                            min_pipelines=args.min_pipelines, max_pipelines=args.max_pipelines,
                            max_idle_units=args.max_idle, uniform=args.uniform,
                            time_limit_s=args.time_limit_s)
    cands = make_candidates(current, dead, Planner(profile, options))
    try:
        decision = select(cands, d_s=d_s, batch=profile.global_batch_size, strategy=args.strategy)
        record, chosen = dict(decision.record), decision.chosen
        est = chosen.reroute.estimate(profile) if chosen.reroute else plan_step(chosen.plan,
                                                                               profile)
        record["swap"] = swap_budgets(chosen.plan, est)[1]
    except NoFeasibleCandidate as exc:
        record, chosen = exc.record, None
    if args.write_plan and chosen is not None:
        Path(args.write_plan).write_text(json.dumps(chosen.plan.to_dict()) + "\n")
    if args.json:
        print(json.dumps(_report(cands, record), indent=2))
    else:
        print(_table(cands, record))
    return 0 if chosen is not None else 2


def _report(cands: Candidates, record: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"failed_ranks": list(cands.failed_ranks), "decision": record}
    rr, rp = cands.reroute, cands.replan
    out["reroute"] = rr.reroute.to_dict() if rr.reroute else None
    out["replan"] = {
        "plan": rp.plan.to_dict() if rp.plan else None,
        "restore": rp.restore.to_dict() if rp.restore else None,
    }
    return out


def _table(cands: Candidates, record: dict[str, Any]) -> str:
    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    lines = [f"failed ranks {list(cands.failed_ranks)}   D = {record['D_s']:.0f} s   "
             f"B = {record['B']}   strategy {record['strategy']}",
             f"{'candidate':<10}{'feasible':<10}{'t_step s':>10}{'t_trans s':>11}"
             f"{'score':>10}  plan / reason"]
    for row in record["candidates"]:
        detail = row["plan"] if row["feasible"] else row["reason"]
        lines.append(f"{row['name']:<10}{'yes' if row['feasible'] else 'no':<10}"
                     f"{num(row['t_step_s'], '.3f'):>10}{num(row['t_transition_s'], '.2f'):>11}"
                     f"{num(row['score'], '.2f'):>10}  {detail}")
    lines.append(f"choice: {record['choice'] or 'none (no feasible candidate)'}")
    for sw in record.get("swap", ()):
        lines.append(f"  pipeline {sw['pipeline']} stage {sw['stage']} (ranks {sw['ranks']}) "
                     f"swaps to fit: keeps {sw['fraction']:.0%} of its activations "
                     f"({sw['budget_bytes'] / 2**30:.2f} GiB), stall {sw['stall_s']:.3f} s "
                     "per step")
    restore = cands.replan.restore
    if restore is not None:
        lines.append(f"re-plan restore: {len(restore.transfers)} transfers, "
                     f"{restore.bytes_moved() / 2**30:.1f} GiB, busiest rank "
                     f"{restore.busiest_rank_bytes() / 2**30:.2f} GiB, {len(restore.groups)} "
                     f"all-reduce groups in {len(restore.rounds)} rounds")
    return "\n".join(lines)
