"""Bad input fails before any work starts, with a message naming the value and the limit."""

import sys
import time

import pytest

from chameleon_megatron.configurable import ConfigError
from chameleon_megatron.errors import UserError
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
    (["--optimizer", "sgd", "--use-distributed-optimizer"],
     r"--optimizer sgd with --use-distributed-optimizer: .* shards Adam only"),
    (["--num-experts", "4"],
     r"--num-experts=4 with linear biases: .* fail in backward; give --disable-bias-linear"),
])
def test_layout_and_batch_errors(argv, pattern):
    with pytest.raises(ConfigError, match=pattern):
        _validate(argv)


@pytest.mark.parametrize("argv,message", [
    (["--adam-beta1", "-1"], "--adam-beta1=-1.0: must be in [0, 1)"),
    (["--attention-dropout", "3"], "--attention-dropout=3.0: must be in [0, 1]"),
    (["--sgd-momentum", "nan"], "--sgd-momentum=nan: must be in [0, 1)"),
    (["--adam-eps", "0"], "--adam-eps=0.0: must be > 0"),
    (["--group-query-attention", "--num-query-groups", "0"], "--num-query-groups=0: must be >= 1"),
    (["--make-vocab-size-divisible-by", "-1"], "--make-vocab-size-divisible-by=-1: must be >= 1"),
])
def test_values_out_of_range_are_refused(argv, message):
    """Each of these passed the checks before (found by tests/test_fuzz_inputs.py) and
    failed later, deep in megatron, or trained with a meaningless value."""
    with pytest.raises(ConfigError) as exc:
        _validate(argv)
    assert str(exc.value) == message


def test_unknown_and_unsupported_megatron_flags():
    with pytest.raises(UserError, match="unrecognized argument --no-such-flag"):
        parse_args(GOOD + ["--no-such-flag", "1"])
    with pytest.raises(UserError,
                       match="--fp16 is a Megatron-LM flag that this trainer does not support"):
        parse_args(GOOD + ["--fp16"])
    # Megatron's activation offloading would own swap's saved-tensor hooks: not offered
    for flag in ("--cpu-offloading-num-layers", "--fine-grained-activation-offloading"):
        with pytest.raises(UserError, match=f"{flag} is a Megatron-LM flag that this trainer "
                                            "does not support"):
            parse_args(GOOD + ["--chameleon-swap", flag, "1"])
    # No prefix matching: a truncated flag is not silently taken for a longer one.
    with pytest.raises(UserError, match="--num-lay"):
        parse_args(GOOD + ["--num-lay", "3"])


def test_a_command_line_data_path_replaces_a_presets_mock_data(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("megatron:\n  mock_data: true\n")
    args = parse_args(GOOD[:-3] + ["--chameleon-config", str(preset), "--data-path", "x"])
    assert not args.mock_data and args.data_path == ["x"]
    assert not parse_args(["--chameleon-config", str(preset), "--no-mock-data"]).mock_data


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


# ------------------------------------------------------------ data and tokenizer flags

MODEL = GOOD[:8]  # layers, hidden, heads, sequence: no data, vocabulary or iterations


def _checked(argv):
    """Flags against flags (validate), then against the files (preflight), as a run does."""
    from chameleon_megatron.config import config_from_args
    from chameleon_megatron.preflight import preflight

    args = validate_args(parse_args(MODEL + ["--train-iters", "2"] + argv), 1)
    preflight(args, config_from_args(args))
    return args


def test_an_unknown_tokenizer_type_names_the_choices():
    with pytest.raises(UserError, match=r"argument --tokenizer-type: invalid choice: 'Sp'.*"
                                        r"NullTokenizer.*GPT2BPETokenizer.*HuggingFaceTokenizer"):
        parse_args(GOOD + ["--tokenizer-type", "Sp"])


MOCK = ["--mock-data"]


@pytest.mark.parametrize("argv,pattern", [
    (MOCK + ["--tokenizer-type", "GPT2BPETokenizer"],
     r"^--tokenizer-type GPT2BPETokenizer needs --vocab-file$"),
    (MOCK + ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json"],
     r"^--tokenizer-type GPT2BPETokenizer needs --merge-file$"),
    (MOCK + ["--tokenizer-type", "HuggingFaceTokenizer"],
     r"^--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model$"),
    (MOCK + ["--tokenizer-type", "NullTokenizer"],
     r"^--tokenizer-type NullTokenizer needs --vocab-size"),
    (MOCK + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "0"],
     r"^--vocab-size=0: must be > 0$"),
    (MOCK + ["--vocab-size", "128", "--vocab-file", "v.json"],
     r"^--vocab-file v.json: read only by --tokenizer-type GPT2BPETokenizer, not by the byte "
     r"tokenizer"),
    (MOCK + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "8", "--tokenizer-model", "m"],
     r"^--tokenizer-model m: read only by --tokenizer-type HuggingFaceTokenizer, not by "
     r"NullTokenizer$"),
    (["--data-path", "0.3", "a", "0", "b"],
     r"^--data-path weight 0.0 \(of b\): must be a number > 0$"),
    (["--data-path", "-1", "a", "2", "b"], r"^--data-path weight -1.0 \(of a\): must be a number"),
    (["--data-path", "nan", "a", "1", "b"], r"^--data-path weight nan \(of a\): must be a number"),
    (MOCK + ["--vocab-size", "128", "--split", "a,b"],
     r"^--split 'a,b': must be up to three numbers >= 0"),
    (MOCK + ["--vocab-size", "128", "--split", "0,0,0"], r"^--split '0,0,0': must be up to three"),
    (MOCK + ["--vocab-size", "128", "--split", "1,0,0", "--eval-interval", "1", "--eval-iters",
             "1"], r"^--split 1,0,0: no validation part, but --eval-interval 1 --eval-iters 1"),
])
def test_data_and_tokenizer_flag_errors(argv, pattern):
    with pytest.raises(ConfigError, match=pattern):
        validate_args(parse_args(MODEL + ["--train-iters", "2"] + argv), 1)


def _gpt2_vocab(tmp_path, tokens=("a", "b", "ab", "<|endoftext|>"), merges="a b\n"):
    (tmp_path / "vocab.json").write_text("{" + ", ".join(
        f'"{t}": {i}' for i, t in enumerate(tokens)) + "}")
    (tmp_path / "merges.txt").write_text(merges)
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tmp_path / "vocab.json"),
            "--merge-file", str(tmp_path / "merges.txt")]


def test_tokenizer_files_are_checked_before_any_model(tmp_path):
    flags = _gpt2_vocab(tmp_path)
    assert _checked(MOCK + flags).padded_vocab_size == 128  # 4 tokens, padded to 128
    missing = str(tmp_path / "nope.json")
    with pytest.raises(ConfigError, match=f"^--vocab-file {missing}: does not exist"):
        _checked(MOCK + flags[:3] + [missing] + flags[4:])
    with pytest.raises(ConfigError, match=f"^--merge-file {missing}: does not exist"):
        _checked(MOCK + flags[:5] + [missing])
    with pytest.raises(ConfigError, match=f"^--tokenizer-model {missing}: does not exist"):
        _checked(MOCK + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", missing])
    with pytest.raises(ConfigError, match=r"^--vocab-size=100 contradicts --tokenizer-type "
                                          r"GPT2BPETokenizer, whose vocabulary has 4 tokens"):
        _checked(MOCK + flags + ["--vocab-size", "100"])
    assert _checked(MOCK + flags + ["--vocab-size", "4"]).vocab_size == 4  # agrees: fine
    _gpt2_vocab(tmp_path, tokens=("a", "b"))
    with pytest.raises(ConfigError, match=r"vocab.json: no <\|endoftext\|> token"):
        _checked(MOCK + flags)
    _gpt2_vocab(tmp_path, merges="#version: 0.2\nab\n")
    with pytest.raises(ConfigError, match=r"^--merge-file .*merges.txt:2: 'ab' is not a merge"):
        _checked(MOCK + flags)
    _gpt2_vocab(tmp_path)
    (tmp_path / "vocab.json").write_text('{"a": 0,\n "b": }')
    with pytest.raises(ConfigError, match=r"^--vocab-file .*vocab.json:2: not valid JSON"):
        _checked(MOCK + flags)


def test_hf_tokenizer_without_transformers_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    (tmp_path / "hf").mkdir()
    with pytest.raises(ConfigError, match=r"^--tokenizer-type HuggingFaceTokenizer needs the "
                                          r"transformers package: pip install transformers$"):
        _checked(MOCK + ["--tokenizer-type", "HuggingFaceTokenizer",
                         "--tokenizer-model", str(tmp_path / "hf")])


def _write_index(prefix, documents):
    from chameleon_megatron.training.indexed_data import build_indexed_dataset

    prefix.with_suffix(".txt").write_text("\n\n".join(["some text"] * documents))
    build_indexed_dataset(prefix.with_suffix(".txt"), prefix)


def test_data_files_and_splits_are_checked_before_any_model(tmp_path):
    prefix = tmp_path / "small"
    _write_index(prefix, 10)
    # 969,30,1 of 10 documents leaves valid and test none: megatron would loop forever.
    with pytest.raises(ConfigError, match=r"^--split 969,30,1: its valid part of --data-path "
                                          r".*small \(10 sequences\) holds none"):
        _checked(["--data-path", str(prefix)])
    assert _checked(["--data-path", str(prefix), "--split", "8,2,0"]).vocab_size == 257
    (tmp_path / "bad.bin").write_bytes(b"")
    (tmp_path / "bad.idx").write_bytes(b"not an index")
    with pytest.raises(ConfigError, match=r"bad.idx is not a megatron index file"):
        _checked(["--data-path", "1", str(prefix), "1", str(tmp_path / "bad"), "--split", "8,2,0"])


def test_cli_refuses_a_missing_vocab_file_in_one_line(tmp_path):
    out = run_command([sys.executable, "-m", "chameleon_megatron.pretrain_gpt", *GOOD[:8],
                       "--mock-data", "--train-iters", "1", "--tokenizer-type",
                       "GPT2BPETokenizer", "--vocab-file", str(tmp_path / "v.json"),
                       "--merge-file", str(tmp_path / "m.txt")], timeout=60, check=False)
    assert out.strip() == (f"chameleon-pretrain-gpt: error: --vocab-file {tmp_path}/v.json: "
                           "does not exist (--tokenizer-type GPT2BPETokenizer reads it; nothing "
                           "is downloaded)")
