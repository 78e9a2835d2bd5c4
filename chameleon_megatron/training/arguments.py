"""Command-line arguments of the GPT trainer, with Megatron-LM's flag names.

Every flag here means what it means in Megatron-LM's ``pretrain_gpt.py``. A Megatron-LM
flag this trainer does not implement is refused by name (never silently ignored). A YAML
preset's ``megatron`` section gives the same arguments by dest name; CLI flags override it.
"""

from __future__ import annotations

import argparse
from typing import Any, Mapping, NoReturn, Sequence

from chameleon_megatron.config import add_chameleon_args, read_yaml
from chameleon_megatron.configurable import ConfigError
from chameleon_megatron.errors import UserError

TOKENIZER_TYPES = ("NullTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer")
"""The values of --tokenizer-type this trainer builds (Megatron-LM has more)."""

# Megatron-LM flags that users commonly pass and that this trainer does not implement.
UNSUPPORTED_MEGATRON_FLAGS = frozenset({
    "--fp16", "--fp8-format", "--fp8", "--context-parallel-size", "--expert-model-parallel-size",
    "--expert-tensor-parallel-size", "--use-flash-attn", "--use-mcore-models",
    "--use-legacy-models", "--legacy-tokenizer", "--tokenizer-metadata",
    "--tokenizer-special-tokens", "--tokenizer-hf-use-fast", "--trust-remote-code",
    "--ckpt-format", "--finetune", "--exit-interval", "--exit-duration-in-mins",
    "--tensorboard-dir", "--wandb-project", "--num-workers", "--dataloader-type",
    "--loss-scale", "--initial-loss-scale", "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers", "--pipeline-model-parallel-layout",
    "--overlap-param-gather", "--use-torch-fsdp2", "--use-megatron-fsdp", "--train-samples",
    "--lr-decay-samples", "--lr-warmup-samples", "--moe-grouped-gemm", "--transformer-impl",
    "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
    "--num-virtual-stages-per-pipeline-rank", "--mock-data-path", "--optimizer-cpu-offload",
    "--use-precision-aware-optimizer",
    # Megatron's own activation offloading: this trainer has none (its swap is Chameleon's)
    "--cpu-offloading-num-layers", "--fine-grained-activation-offloading",
})


def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=False, help="transformer layers")
    g.add_argument("--hidden-size", type=int, help="hidden size")
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="MLP size (4 x hidden)")
    g.add_argument("--num-attention-heads", type=int, help="attention heads")
    g.add_argument("--group-query-attention", action="store_true", help="use GQA")
    g.add_argument("--num-query-groups", type=int, default=1, help="query groups with GQA")
    g.add_argument("--kv-channels", type=int, default=None, help="hidden / heads by default")
    g.add_argument("--seq-length", type=int, help="tokens per sample")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="position table size (seq-length by default)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="byte tokenizer: its size (257 with --data-path by default); "
                        "NullTokenizer: ids before its end of document; GPT2BPETokenizer and "
                        "HuggingFaceTokenizer: from their files")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this x TP")
    g.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=["learned_absolute", "rope", "none"])
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false",
                   help="no linear biases")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--num-experts", type=int, default=None, help="MoE experts per layer")
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None)
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    g.add_argument("--moe-router-score-function", default="softmax",
                   choices=["softmax", "sigmoid"])
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="aux-loss-free load balancing: a per-expert routing bias updated "
                        "each step from the tokens each expert got (needs sigmoid scores)")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)


def _training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="micro x data-parallel size by default")
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None,
                   metavar=("START", "INCR", "SAMPLES"), help="batch-size ramp-up")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--lr", type=float, default=1e-4)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root"])
    g.add_argument("--lr-decay-iters", type=int, default=None, help="train-iters by default")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--bf16", action="store_true", help="bf16 parameters and compute")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"])
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--seed", type=int, default=1234)


def _parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo"],
                   help="nccl with CUDA, gloo otherwise")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    g.add_argument("--use-cpu-initialization", action="store_true")


def _data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action=argparse.BooleanOptionalAction, default=False,
                   help="synthetic token data (--no-mock-data overrides a preset's)")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="indexed dataset prefix(es), or a blend: W1 PREFIX1 W2 PREFIX2 ...")
    g.add_argument("--split", default="969,30,1", help="train,valid,test weights")
    g.add_argument("--data-cache-path", default=None,
                   help="where megatron writes the dataset index caches (next to the data "
                        "by default)")
    g.add_argument("--tokenizer-type", default=None, choices=TOKENIZER_TYPES,
                   help="the datasets' tokenizer (a byte tokenizer, vocabulary 257, without "
                        "it); the model's vocabulary follows it")
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: its vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: its merges.txt")
    g.add_argument("--tokenizer-model", default=None,
                   help="HuggingFaceTokenizer: a local tokenizer directory (needs transformers)")


def _io_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpointing and logging")
    g.add_argument("--save", default=None, help="checkpoint directory to write")
    g.add_argument("--load", default=None, help="checkpoint directory to resume from")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--eval-interval", type=int, default=None)
    g.add_argument("--eval-iters", type=int, default=0)


class _Parser(argparse.ArgumentParser):
    """A bad flag is a UserError (one line from the entry), not argparse's usage dump."""

    def error(self, message: str) -> NoReturn:
        raise UserError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="chameleon-pretrain-gpt", allow_abbrev=False,
        description="GPT pretraining on megatron-core with Chameleon swap and fault tolerance.",
    )
    for add in (_model_args, _training_args, _parallel_args, _data_args, _io_args):
        add(parser)
    add_chameleon_args(parser)
    return parser


def yaml_to_argv(parser: argparse.ArgumentParser, section: Mapping[str, Any]) -> list[str]:
    """Turn a preset's ``megatron`` section (dest names) into flags, refusing unknown keys."""
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    argv: list[str] = []
    for key, value in section.items():
        action = actions.get(key)
        if action is None or key.startswith("chameleon"):
            raise ConfigError(f"unknown key megatron.{key}: not a flag of this trainer")
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            if not isinstance(value, bool):
                raise ConfigError(f"megatron.{key}={value!r}: must be true or false")
            argv.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if not isinstance(value, bool):
                raise ConfigError(f"megatron.{key}={value!r}: must be true or false")
            # The flag stores the opposite of its default; give it when the value asks for that.
            argv += [flag] if value != action.default else []
        elif value is None:
            continue
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse flags (YAML preset first, CLI on top), then validate; errors name the flag."""
    import sys

    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    pre, _ = parser.parse_known_args(argv)
    preset: dict[str, Any] = read_yaml(pre.chameleon_config) if pre.chameleon_config else {}
    section = dict(preset.get("megatron") or {})
    if "--data-path" in argv:  # real data on the command line replaces a preset's mock data
        section.pop("mock_data", None)
    argv = yaml_to_argv(parser, section) + argv
    args, extra = parser.parse_known_args(argv)
    if extra:
        flag = next((x for x in extra if x.startswith("-")), extra[0]).split("=")[0]
        if flag in UNSUPPORTED_MEGATRON_FLAGS:
            raise UserError(f"{flag} is a Megatron-LM flag that this trainer does not support")
        raise UserError(f"unrecognized argument {flag}")
    args.chameleon_preset = preset
    return args
