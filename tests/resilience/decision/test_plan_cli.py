"""The ``chameleon plan`` and ``chameleon profile`` commands."""

import json

import pytest
from dc_helpers import make_profile

from chameleon_megatron.cli import main
from chameleon_megatron.resilience.decision.layout import Plan, UniformLayout
from chameleon_megatron.resilience.decision.model_shape import ModelShape
from chameleon_megatron.resilience.decision.perf_model import plan_step
from chameleon_megatron.resilience.decision.profile import load_profile, save_profile
from chameleon_megatron.resilience.decision.shape_profile import Hardware, profile_from_shape

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def profile_file(tmp_path):
    path = tmp_path / "profile.json"
    save_profile(make_profile(4, gbs=16, transfer_bw=1.0, regroup=2.0), path)
    return path


def test_plan_json_has_both_candidates_and_the_choice(profile_file, capsys):
    assert main(["plan", "--profile", str(profile_file), "--layout", "tp=1,pp=2,dp=4",
                 "--failed", "1", "--d-s", "1e6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    names = [c["name"] for c in out["decision"]["candidates"]]
    assert names == ["reroute", "replan"] and out["decision"]["choice"] == "replan"
    assert out["reroute"]["failed_ranks"] == [1]
    assert Plan.from_dict(out["replan"]["plan"]).microbatches == 16
    assert out["replan"]["restore"]["unrecoverable"] is False


def test_plan_table_short_d_and_chained_plan(profile_file, tmp_path, capsys):
    written = tmp_path / "next.json"
    assert main(["plan", "--profile", str(profile_file), "--layout", "tp=1,pp=2,dp=4",
                 "--failed", "1", "--d-s", "1", "--write-plan", str(written)]) == 0
    table = capsys.readouterr().out
    assert "choice: reroute" in table and "D = 1 s" in table
    # the rerouting keeps the layout; plan the next failure from the written plan
    assert main(["plan", "--profile", str(profile_file), "--plan", str(written),
                 "--failed", "1,3", "--d-s", "1e6"]) == 0
    assert "choice: replan" in capsys.readouterr().out


def test_plan_without_feasible_candidate_exits_2(profile_file, capsys):
    assert main(["plan", "--profile", str(profile_file), "--layout", "tp=1,pp=2,dp=4",
                 "--failed", "4,5,6,7"]) == 2
    assert "none (no feasible candidate)" in capsys.readouterr().out


def test_plan_rejects_unknown_ranks(profile_file, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--profile", str(profile_file), "--layout", "tp=1,pp=2,dp=4",
              "--failed", "9"])
    assert exc.value.code == 2
    assert "--failed: ranks [9] are not in the layout" in capsys.readouterr().err


ARGS = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
            micro_batch_size=1, global_batch_size=8, padded_vocab_size=128,
            tensor_model_parallel_size=1, bf16=True)
HW = dict(device_memory_bytes=2**34, p2p_bandwidth_Bps=25e9, allreduce_bandwidth_Bps=40e9,
          transfer_bandwidth_Bps=25e9, link_latency_s=20e-6)


def test_profile_from_metrics_inverts_the_step_model(tmp_path, capsys):
    """Steps measured on a machine doing 2 GFLOP/s give back 0.5 ns per FLOP."""
    truth = profile_from_shape(ModelShape.from_args(ARGS), Hardware(**HW),
                               seconds_per_flop=0.5e-9, name="truth", source="")
    lines = [json.dumps({"event": "run", "args": ARGS, "world_size": 4})]
    for pp, dp in ((2, 2), (1, 4)):
        step = plan_step(UniformLayout(tp=1, pp=pp, dp=dp).to_plan(4, 8), truth).t_step_s
        for it in range(5):
            lines.append(json.dumps({"event": "iteration", "iteration": it, "loss": 1.0,
                                     "step_time_s": step * (3 if it == 0 else 1),
                                     "layout": {"tp": 1, "pp": pp, "vpp": 1, "dp": dp}}))
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(lines) + "\n")
    out = tmp_path / "p.json"
    assert main(["profile", "--metrics", str(metrics), "-o", str(out), "--json",
                 "--skip", "1", "--device-memory-gib", "16", "--p2p-gbs", "25",
                 "--allreduce-gbs", "40", "--latency-us", "20"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["calibration"]["mean_abs_error"] < 1e-6
    assert len(report["calibration"]["rows"]) == 2
    got = load_profile(out)
    assert got.layers[0].forward_s == pytest.approx(truth.layers[0].forward_s, rel=1e-6)
    assert got.output.backward_s == pytest.approx(truth.output.backward_s, rel=1e-6)


def test_profile_from_args_and_tflops(tmp_path):
    args = tmp_path / "args.json"
    args.write_text(json.dumps(ARGS))
    out = tmp_path / "p.json"
    assert main(["profile", "--args", str(args), "--effective-tflops", "2", "-o", str(out)]) == 0
    shape = ModelShape.from_args(ARGS)
    assert load_profile(out).layers[0].forward_s == pytest.approx(shape.layer_flops() / 2e12)
    assert json.loads(out.read_text())["model"]["hidden_size"] == 64


def test_profile_refuses_metrics_without_run_record(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    metrics.write_text(json.dumps({"event": "iteration", "step_time_s": 1.0}) + "\n")
    with pytest.raises(SystemExit):
        main(["profile", "--metrics", str(metrics), "-o", str(tmp_path / "p.json")])
    assert "no {'event': 'run'}" in capsys.readouterr().err


def test_plan_with_swap_fits_a_stage_over_memory(tmp_path, capsys):
    """Device memory the failure-free DP2 x PP2 layout just fits: re-planning three ranks,
    the fastest split (2-1-1) is over memory on its first stage; with a swap bandwidth it
    is taken with that stage's budget and stall, without one another split is."""
    args = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
            "micro_batch_size": 2, "global_batch_size": 8, "padded_vocab_size": 128,
            "tensor_model_parallel_size": 1}
    hw = Hardware(device_memory_bytes=2508800, p2p_bandwidth_Bps=1e15,
                  allreduce_bandwidth_Bps=1e3, transfer_bandwidth_Bps=1e9)
    path = tmp_path / "p.json"
    save_profile(profile_from_shape(ModelShape.from_args(args), hw, seconds_per_flop=1e-12,
                                    name="tiny", source="test"), path)
    base = ["plan", "--profile", str(path), "--layout", "tp=1,pp=2,dp=2", "--failed", "3",
            "--d-s", "1e9", "--strategy", "replan"]
    assert main([*base, "--json", "--swap-bandwidth-gbps", "10"]) == 0
    out = json.loads(capsys.readouterr().out)
    plan = Plan.from_dict(out["replan"]["plan"])
    assert [len(s.layers) for s in plan.pipelines[0].stages] == [2, 1, 1]
    (swap,) = out["decision"]["swap"]
    assert (swap["pipeline"], swap["stage"]) == (0, 0) and 0 < swap["fraction"] < 1
    assert main([*base, "--json"]) == 0  # the profile's own: no swapping
    out = json.loads(capsys.readouterr().out)
    assert out["decision"]["swap"] == []
    assert [len(s.layers) for s in Plan.from_dict(out["replan"]["plan"]).pipelines[0].stages] \
        == [1, 2, 1]
    assert main([*base, "--swap-bandwidth-gbps", "10"]) == 0
    assert "stage 0 (ranks [0]) swaps to fit: keeps 67% of its activations" in \
        capsys.readouterr().out
