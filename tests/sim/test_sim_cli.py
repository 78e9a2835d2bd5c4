"""``chameleon simulate`` and the shipped presets."""

import json
from pathlib import Path

import pytest
from sim_helpers import small_profile

from chameleon_megatron.cli import main
from chameleon_megatron.resilience.decision.profile import save_profile
from chameleon_megatron.sim.config import SimConfig, load_preset

pytestmark = pytest.mark.timeout(120)

PRESETS = Path(__file__).resolve().parents[2] / "configs" / "sim"


def test_simulate_prints_json_and_draws_a_png(tmp_path, capsys):
    save_profile(small_profile(), tmp_path / "small.json")
    (tmp_path / "preset.yaml").write_text(
        "profile: small.json\ntp: 1\npp: 2\ndp: 8\nhorizon_s: 3600\nmtbf_s: 600\nrepair_s: 1200\n")
    trace = tmp_path / "trace.json"
    png = tmp_path / "tp.png"
    assert main(["simulate", "--preset", str(tmp_path / "preset.yaml"), "--seed", "2",
                 "--save-trace", str(trace), "--plot", str(png)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["strategies"]) == {"chameleon", "reroute", "replan", "checkpoint_restart",
                                         "redundant"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # replaying the saved trace gives the same figures
    assert main(["simulate", "--preset", str(tmp_path / "preset.yaml"), "--trace", str(trace),
                 "--strategies", "chameleon,replan"]) == 0
    again = json.loads(capsys.readouterr().out)
    for name in ("chameleon", "replan"):
        assert again["strategies"][name] == report["strategies"][name]


@pytest.mark.parametrize("name,devices", [("32", 32), ("1024", 1024), ("8192", 8192)])
def test_presets_load_and_match_their_profiles(name, devices):
    cfg = load_preset(PRESETS / f"{name}.yaml")
    assert cfg.world_size == devices and Path(cfg.profile).exists()


def test_the_32_device_preset_runs(capsys):
    assert main(["simulate", "--preset", "32", "--horizon-s", "10800", "--seed", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["devices"] == 32 and report["profile"] == "gpt-7b-h100"


def test_unknown_keys_and_strategies_are_refused(tmp_path):
    (tmp_path / "bad.yaml").write_text("profile: x.json\ncolour: red\n")
    with pytest.raises(ValueError, match="colour"):
        load_preset(tmp_path / "bad.yaml")
    with pytest.raises(ValueError, match="known strategies"):
        SimConfig(profile="x", strategies=("magic",))
