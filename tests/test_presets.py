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
    "demo-cpu.yaml": 4,
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


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_swap_alone_runs_on_every_cpu_preset(tmp_path):
    """``--chameleon-swap`` with nothing else, on the presets that run on CPU under plain
    torchrun, as shipped (the tiny preset: TP2 x PP2 over 4 ranks): it swaps, within its
    budget. (The demo preset, with fault tolerance, runs in tests/test_readme.py.)"""
    from dist_utils import run_trainer

    cpu = [n for n in sorted(WORLD) if read_yaml(CONFIGS / n)["megatron"].get(
        "distributed_backend") == "gloo" and not read_yaml(CONFIGS / n).get("ft")]
    assert cpu == ["tiny-cpu.yaml"]
    for name in cpu:
        records = run_trainer(WORLD[name], [
            "--chameleon-config", str(CONFIGS / name), "--train-iters", "3",
            "--lr-warmup-iters", "1", "--eval-iters", "0", "--chameleon-swap"],
            tmp_path, name=name)
        swap = [r["swap"] for r in records if r["event"] == "iteration"]
        assert len(swap) == 3
        for s in swap[1:]:  # planned from the second step on, on every pipeline stage
            assert [st["stage"] for st in s["stages"]] == [0, 1]
            for st in s["stages"]:
                assert st["plan_version"] >= 1 and st["swapped_out_bytes"] > 0, st
                assert st["peak_resident_saved_bytes"] <= st["budget_bytes"], st
        # 1F1B: the first stage holds more microbatches in flight than the last
        assert swap[-1]["stages"][0]["peak_saved_bytes"] > swap[-1]["stages"][1]["peak_saved_bytes"]
