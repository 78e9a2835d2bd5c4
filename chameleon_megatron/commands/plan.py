"""``chameleon plan``: both recovery candidates for a layout, a profile and failed ranks,
and the choice by Eq. 8 (JSON with ``--json``, else a table)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chameleon_megatron.errors import UserError, reading

if TYPE_CHECKING:  # the decision center loads numpy; --help should not wait for it
    from chameleon_megatron.resilience.decision.candidates import Candidates
    from chameleon_megatron.resilience.decision.layout import UniformLayout


def parse_layout(text: str) -> UniformLayout:
    """'tp=2,pp=4,dp=8[,vpp=2]' -> UniformLayout."""
    from chameleon_megatron.resilience.decision.layout import UniformLayout

    try:
        parts = dict(item.split("=", 1) for item in text.split(","))
        return UniformLayout(**{k.strip(): int(v) for k, v in parts.items()})
    except (ValueError, TypeError) as exc:
        raise ValueError(f"--layout {text!r}: expected tp=T,pp=P,dp=D[,vpp=V] ({exc})") from None


NUMBER = {int: "an integer", float: "a number"}


def parse_list(text: str, flag: str, kind: type = int) -> list:
    """'1,5,9' -> [1, 5, 9]; UserError naming ``flag`` and the item that is not a number."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        try:
            out.append(kind(item))
        except ValueError:
            raise UserError(f"{flag} {text!r}: {item!r} is not {NUMBER[kind]}") from None
    return out


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
    from chameleon_megatron.resilience.decision.candidates import make_candidates
    from chameleon_megatron.resilience.decision.center import swap_budgets
    from chameleon_megatron.resilience.decision.layout import Plan
    from chameleon_megatron.resilience.decision.mtbf import MtbfEstimator
    from chameleon_megatron.resilience.decision.perf_model import plan_step
    from chameleon_megatron.resilience.decision.planner import Planner, SearchOptions
    from chameleon_megatron.resilience.decision.profile import load_profile
    from chameleon_megatron.resilience.decision.selector import NoFeasibleCandidate, select

    profile = load_profile(args.profile)
    if args.swap_bandwidth_gbps is not None:
        if args.swap_bandwidth_gbps < 0:
            raise UserError(f"--swap-bandwidth-gbps={args.swap_bandwidth_gbps}: must be >= 0")
        profile = dataclasses.replace(profile, swap_bandwidth_Bps=args.swap_bandwidth_gbps * 1e9)
    if args.layout:
        try:
            current = parse_layout(args.layout).to_plan(profile.num_layers,
                                                        profile.global_microbatches)
        except ValueError as exc:
            raise UserError(f"--layout {args.layout} with the {profile.num_layers} layers of "
                            f"--profile {args.profile}: {exc}") from None
    else:
        with reading(args.plan):
            current = Plan.from_dict(json.loads(Path(args.plan).read_text()))
    if not args.failed.strip():
        raise UserError("--failed '': name at least one failed rank (a healthy cluster "
                        "needs no recovery)")
    dead = parse_list(args.failed, "--failed")
    unknown = sorted(set(dead) - set(current.ranks()))
    if unknown:
        raise UserError(f"--failed: ranks {unknown} are not in the layout "
                        f"(ranks 0..{len(current.ranks()) - 1})")
    d_s = args.d_s if args.d_s is not None else MtbfEstimator(prior_s=args.mtbf_prior_s).expected_s(
        parse_list(args.failure_times, "--failure-times", float) if args.failure_times.strip()
        else [], args.now_s)
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
    lines.append("plans: Nx(dD,mM) = N pipelines of D stages running M microbatches each; "
                 "tpT = ranks per stage")
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
