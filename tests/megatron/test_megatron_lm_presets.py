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
import argparse, dataclasses, json, sys
preset = sys.argv[1]
sys.argv = ["pretrain_gpt.py", "--chameleon-config", preset]
from megatron.training.arguments import add_megatron_arguments
from chameleon_megatron.config import config_from_args
from chameleon_megatron.configurable import to_dict
from chameleon_megatron.megatron_lm import extra_args_provider
parser = extra_args_provider(add_megatron_arguments(argparse.ArgumentParser(
    allow_abbrev=False)))
args = parser.parse_args(sys.argv[1:])
print(json.dumps({"megatron": vars(args), "chameleon": to_dict(config_from_args(args))},
                 default=str))
'''


def probe_preset(checkout: str, preset: Path) -> None:
    """The preset on the parser of the Megatron-LM at ``checkout``: every megatron key is a
    default with the preset's value, every Chameleon section reaches the config."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONPATH": os.pathsep.join([checkout, str(REPO)])}
    run = subprocess.run([sys.executable, "-c", PROBE, str(preset)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    parsed = json.loads(run.stdout.splitlines()[-1])
    data = yaml.safe_load(preset.read_text())
    for key, value in data["megatron"].items():
        assert parsed["megatron"][key] == value, (preset.name, key)
    for section, fields in data.items():
        if section != "megatron":
            for name, value in fields.items():
                got = parsed["chameleon"][section][name]
                assert got == value or (isinstance(value, list) and got == list(value)), (
                    preset.name, section, name)


@pytest.mark.parametrize("preset", PRESETS, ids=[p.stem for p in PRESETS])
def test_every_preset_is_read_by_megatron_lms_parser(preset):
    probe_preset(str(REAL), preset)
