"""``chameleon profile``: a profile JSON from a trainer metrics file (measured) or from
Megatron args and an effective FLOP rate (derived)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from chameleon_megatron.errors import UserError, reading
from chameleon_megatron.resilience.decision.metrics_profile import profile_from_metrics
from chameleon_megatron.resilience.decision.model_shape import SHAPE_KEYS, ModelShape
from chameleon_megatron.resilience.decision.profile import save_profile
from chameleon_megatron.resilience.decision.shape_profile import H100, Hardware, profile_from_shape


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("profile", help="build a decision-center profile JSON",
                              description=__doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--metrics", metavar="FILE.jsonl",
                     help="trainer metrics file (measured times)")
    src.add_argument("--args", metavar="FILE.json",
                     help="Megatron args as a JSON object (derived times)")
    p.add_argument("--effective-tflops", type=float,
                   help="with --args: achieved TFLOP/s per device")
    p.add_argument("-o", "--output", required=True, help="profile JSON to write")
    p.add_argument("--name", default=None, help="profile name (default: output file stem)")
    p.add_argument("--run", type=int, default=None,
                   help="with --metrics: which run of the file (run ids count from 1; "
                        "default: the last)")
    p.add_argument("--skip", type=int, default=2,
                   help="warm-up steps ignored per layout (default 2)")
    p.add_argument("--device-memory-gib", type=float, default=H100.device_memory_bytes / 2**30)
    p.add_argument("--p2p-gbs", type=float, default=H100.p2p_bandwidth_Bps / 1e9,
                   help="stage-to-stage bandwidth, GB/s")
    p.add_argument("--allreduce-gbs", type=float, default=H100.allreduce_bandwidth_Bps / 1e9,
                   help="per-rank all-reduce bandwidth, GB/s")
    p.add_argument("--transfer-gbs", type=float, default=H100.transfer_bandwidth_Bps / 1e9,
                   help="per-rank state migration bandwidth, GB/s")
    p.add_argument("--latency-us", type=float, default=H100.link_latency_s * 1e6)
    p.add_argument("--regroup-s", type=float, default=H100.regroup_s,
                   help="measured cost of switching to a new plan, s")
    p.add_argument("--json", action="store_true", help="print the calibration report as JSON")
    return p


def run(args: argparse.Namespace) -> int:
    hw = Hardware(device_memory_bytes=args.device_memory_gib * 2**30,
                  p2p_bandwidth_Bps=args.p2p_gbs * 1e9,
                  allreduce_bandwidth_Bps=args.allreduce_gbs * 1e9,
                  transfer_bandwidth_Bps=args.transfer_gbs * 1e9,
                  link_latency_s=args.latency_us / 1e6, regroup_s=args.regroup_s)
    name = args.name or Path(args.output).stem
    report: dict[str, Any] = {"output": args.output}
    if args.metrics:
        profile, cal, model = profile_from_metrics(args.metrics, hw, name=name, skip=args.skip,
                                                   run=args.run)
        report["calibration"] = {
            "factor": cal.factor, "mean_abs_error": cal.mean_abs_error,
            "rows": [dict(zip(("layout", "measured_s", "estimated_s", "rel_error"), r))
                     for r in cal.rows],
        }
    else:
        if not args.effective_tflops or args.effective_tflops <= 0:
            raise UserError(f"--effective-tflops={args.effective_tflops}: --args needs it > 0")
        with reading(args.args):
            megatron = json.loads(Path(args.args).read_text())
        profile = profile_from_shape(
            ModelShape.from_args(megatron), hw, seconds_per_flop=1e-12 / args.effective_tflops,
            name=name, source=f"chameleon profile --args {Path(args.args).name} --effective-tflops "
                              f"{args.effective_tflops:g}: times from FLOPs, bytes from the shape")
        model = {k: megatron[k] for k in SHAPE_KEYS if k in megatron}
    save_profile(profile, args.output, model)
    layer = profile.layers[0]
    report["layer"] = {"forward_s": layer.forward_s, "backward_s": layer.backward_s,
                       "state_bytes": layer.state_bytes, "activation_bytes": layer.activation_bytes}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"wrote {args.output}: {profile.num_layers} layers, tp={profile.tp}, "
              f"layer fwd {layer.forward_s * 1e3:.3f} ms, bwd {layer.backward_s * 1e3:.3f} ms, "
              f"state {layer.state_bytes / 2**20:.1f} MiB, "
              f"act {layer.activation_bytes / 2**20:.1f} MiB")
        for row in report.get("calibration", {}).get("rows", []):
            print(f"  {row['layout']}: measured {row['measured_s']:.4f}s, "
                  f"model {row['estimated_s']:.4f}s ({row['rel_error']:+.2%})")
    return 0
