"""Every preset in configs/ loads into the trainer's parser and validates at its world size."""

from pathlib import Path

import pytest

from chameleon_megatron.config import config_from_args, read_yaml
from chameleon_megatron.training.arguments import parse_args
from chameleon_megatron.training.validate import validate_args

pytestmark = pytest.mark.timeout(60)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# The world size each preset is written for; a new preset must be added here.
WORLD = {
    "tiny-cpu.yaml": 4,
    "gpt-1.3b-8xh100.yaml": 8,
    "gpt-7b-8xh100.yaml": 8,
    "llama-13b-8xh100.yaml": 8,
}


def test_every_preset_is_listed():
    assert {p.name for p in CONFIGS.glob("*.yaml")} == set(WORLD)


@pytest.mark.parametrize("name", sorted(WORLD))
def test_preset_validates(name):
    preset = read_yaml(CONFIGS / name)["megatron"]
    # GPU presets leave the data to the user (--mock-data or --data-path).
    data = [] if preset.get("mock_data") or preset.get("data_path") else ["--mock-data"]
    args = parse_args(["--chameleon-config", str(CONFIGS / name), *data])
    validate_args(args, WORLD[name])
    cfg = config_from_args(args)
    assert args.train_iters > 0 and args.data_parallel_size >= 1
    assert (args.global_batch_size
            % (args.micro_batch_size * args.data_parallel_size)) == 0
    assert cfg.metrics is not None
