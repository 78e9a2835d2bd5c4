"""Every preset in configs/ on Megatron-LM's own parser: its ``megatron`` section becomes the
defaults of that release's arguments (each key a dest of its parser, each value as written)
and its Chameleon sections build the config, as ``--chameleon-config`` does on
pretrain_gpt.py. 0.19 runs the same probe (test_megatron_lm_019.py), and trains the CPU
preset end to end there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lm_support import REAL, REPO, needs_real  # noqa: E402

pytestmark = [needs_real, pytest.mark.timeout(300)]

PRESETS = sorted((REPO / "configs").glob("*.yaml"))
PROBE = '''
import argparse, json, sys
from megatron.training.arguments import add_megatron_arguments
from chameleon_megatron.config import config_from_args
from chameleon_megatron.configurable import to_dict
from chameleon_megatron.megatron_lm import extra_args_provider
for preset in sys.argv[1:]:
    sys.argv = ["pretrain_gpt.py", "--chameleon-config", preset]
    parser = extra_args_provider(add_megatron_arguments(argparse.ArgumentParser(
        allow_abbrev=False)))
    args = parser.parse_args(sys.argv[1:])
    print(json.dumps({"preset": preset, "megatron": vars(args),
                      "chameleon": to_dict(config_from_args(args))}, default=str))
'''


def probe_presets(checkout: str) -> dict[str, dict]:
    """Every preset on the parser of the Megatron-LM at ``checkout``, in one process (the
    import is most of the time): what each parsed to, by preset path."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONPATH": os.pathsep.join([checkout, str(REPO)])}
    run = subprocess.run([sys.executable, "-c", PROBE, *map(str, PRESETS)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    parsed = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    return {p["preset"]: p for p in parsed}


def check_preset(parsed: dict[str, dict], preset: Path) -> None:
    """Every megatron key of ``preset`` is a default with its value, every Chameleon section
    reaches the config."""
    assert str(preset) in parsed, f"{preset.name} was not parsed"
    got_megatron, got_chameleon = parsed[str(preset)]["megatron"], parsed[str(preset)]["chameleon"]
    data = yaml.safe_load(preset.read_text())
    for key, value in data["megatron"].items():
        assert got_megatron[key] == value, (preset.name, key)
    for section, fields in data.items():
        if section != "megatron":
            for name, value in fields.items():
                got = got_chameleon[section][name]
                assert got == value or (isinstance(value, list) and got == list(value)), (
                    preset.name, section, name)


@pytest.fixture(scope="module")
def parsed_presets() -> dict[str, dict]:
    return probe_presets(str(REAL))


@pytest.mark.parametrize("preset", PRESETS, ids=[p.stem for p in PRESETS])
def test_every_preset_is_read_by_megatron_lms_parser(parsed_presets, preset):
    check_preset(parsed_presets, preset)
