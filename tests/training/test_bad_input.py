"""Bad input fails before any work starts, with a message naming the value and the limit."""

import sys
import time

import pytest

from chameleon_megatron.configurable import ConfigError
from chameleon_megatron.training.arguments import parse_args
from chameleon_megatron.training.validate import validate_args
from dist_utils import run_command

pytestmark = pytest.mark.timeout(120)

GOOD = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--vocab-size", "128", "--mock-data", "--train-iters", "2"]


def _validate(argv, world_size=4):
    return validate_args(parse_args(GOOD + argv), world_size)


def test_good_layout_fills_derived_values():
    args = _validate(["--tensor-model-parallel-size", "2", "--micro-batch-size", "2"])
    assert args.data_parallel_size == 2 and args.global_batch_size == 4
    assert args.ffn_hidden_size == 256 and args.max_position_embeddings == 32


@pytest.mark.parametrize("argv,pattern", [
    (["--global-batch-size", "10", "--micro-batch-size", "2"],
     r"--global-batch-size=10 is not divisible by --micro-batch-size=2 x data-parallel size 4"),
    (["--tensor-model-parallel-size", "3"], r"world size 4 is not divisible"),
    (["--tensor-model-parallel-size", "4", "--num-attention-heads", "6", "--hidden-size", "60"],
     r"--tensor-model-parallel-size=4 does not divide --num-attention-heads=6"),
    (["--pipeline-model-parallel-size", "4", "--num-layers", "6"],
     r"--pipeline-model-parallel-size=4 does not divide --num-layers=6"),
    (["--seq-length", "64", "--max-position-embeddings", "32"],
     r"--seq-length=64 exceeds --max-position-embeddings=32"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"],
     r"--num-layers-per-virtual-pipeline-stage=3 does not divide the 2 layers"),
    (["--lr-warmup-iters", "5"], r"--lr-warmup-iters=5 must be < --lr-decay-iters=2"),
])
def test_layout_and_batch_errors(argv, pattern):
    with pytest.raises(ConfigError, match=pattern):
        _validate(argv)


def test_unknown_and_unsupported_megatron_flags(capsys):
    with pytest.raises(SystemExit):
        parse_args(GOOD + ["--no-such-flag", "1"])
    assert "unrecognized argument --no-such-flag" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(GOOD + ["--fp16"])
    assert "--fp16 is a Megatron-LM flag that this trainer does not support" in (
        capsys.readouterr().err)
    # No prefix matching: a truncated flag is not silently taken for a longer one.
    with pytest.raises(SystemExit):
        parse_args(GOOD + ["--num-lay", "3"])


def test_yaml_errors(tmp_path):
    bad_key = tmp_path / "bad.yaml"
    bad_key.write_text("megatron:\n  num_layerz: 4\n")
    with pytest.raises(ConfigError, match="unknown key megatron.num_layerz"):
        parse_args(["--chameleon-config", str(bad_key)])
    bad_section = tmp_path / "section.yaml"
    bad_section.write_text("swapp:\n  enabled: true\n")
    from chameleon_megatron.config import config_from_args

    args = parse_args(GOOD + ["--chameleon-config", str(bad_section)])
    with pytest.raises(ConfigError, match="unknown section 'swapp'"):
        config_from_args(args)


def test_yaml_preset_then_cli_override(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("megatron:\n  num_layers: 8\n  hidden_size: 64\n  bf16: true\n"
                      "metrics:\n  file: a.jsonl\n")
    from chameleon_megatron.config import config_from_args

    args = parse_args(GOOD + ["--chameleon-config", str(preset), "--num-layers", "2",
                              "--chameleon-metrics-file", "b.jsonl"])
    assert args.num_layers == 2 and args.bf16 is True and args.hidden_size == 64
    assert config_from_args(args).metrics.file == "b.jsonl"


def test_cli_refuses_bad_layout_before_any_work():
    start = time.perf_counter()
    out = run_command([sys.executable, "-m", "chameleon_megatron.pretrain_gpt", *GOOD,
                       "--pipeline-model-parallel-size", "3"], timeout=60, check=False)
    assert ("world size 1 is not divisible by --tensor-model-parallel-size=1 x "
            "--pipeline-model-parallel-size=3 = 3") in out
    # Refused before torch and megatron are even imported (they take seconds).
    assert time.perf_counter() - start < 20
    assert "Traceback" not in out
