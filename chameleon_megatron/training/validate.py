"""Check trainer arguments against the world size and fill in derived values.

Runs before any process group or model exists, so a bad layout fails in milliseconds with a
message that names the value and the limit it breaks.
"""

from __future__ import annotations

import argparse
import importlib.util

from chameleon_megatron.configurable import ConfigError
from chameleon_megatron.training.data_flags import check_data


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


# dest -> (low, high, low included, high included); None: unbounded. NaN is in no range.
RANGES: dict[str, tuple[float | None, float | None, bool, bool]] = {
    "hidden_dropout": (0, 1, True, True),
    "attention_dropout": (0, 1, True, True),
    "init_method_std": (0, None, False, False),
    "moe_aux_loss_coeff": (0, None, True, False),
    "moe_router_bias_update_rate": (0, None, True, False),
    "lr": (0, None, True, False),
    "min_lr": (0, None, True, False),
    "lr_warmup_init": (0, None, True, False),
    "weight_decay": (0, None, True, False),
    "clip_grad": (0, None, True, False),
    "adam_beta1": (0, 1, True, False),
    "adam_beta2": (0, 1, True, False),
    "adam_eps": (0, None, False, False),
    "sgd_momentum": (0, 1, True, False),
    "distributed_timeout_minutes": (0, None, False, False),
    "make_vocab_size_divisible_by": (1, None, True, False),
    "num_query_groups": (1, None, True, False),
    "kv_channels": (1, None, True, False),
    "ffn_hidden_size": (1, None, True, False),
    "moe_ffn_hidden_size": (1, None, True, False),
    "eval_iters": (0, None, True, False),
}


def _in_range(value: float, low: float | None, high: float | None, low_in: bool,
              high_in: bool) -> bool:
    above = low is None or (value >= low if low_in else value > low)
    below = high is None or (value <= high if high_in else value < high)
    return above and below


def _interval(low: float | None, high: float | None, low_in: bool, high_in: bool) -> str:
    if high is None:
        return f"must be {'>=' if low_in else '>'} {low}"
    return f"must be in {'[' if low_in else '('}{low}, {high}{']' if high_in else ')'}"


def _check_ranges(args: argparse.Namespace) -> None:
    for dest, bounds in RANGES.items():
        value = getattr(args, dest, None)
        if value is not None:
            _need(_in_range(value, *bounds),
                  f"--{dest.replace('_', '-')}={value}: {_interval(*bounds)}")


def _check_model(args: argparse.Namespace) -> None:
    _check_ranges(args)
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        value = getattr(args, flag)
        _need(value is not None and value > 0,
              f"--{flag.replace('_', '-')}={value}: required, must be > 0")
    _need(args.hidden_size % args.num_attention_heads == 0 or args.kv_channels is not None,
          f"--hidden-size={args.hidden_size} is not divisible by "
          f"--num-attention-heads={args.num_attention_heads}")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    _need(args.seq_length <= args.max_position_embeddings,
          f"--seq-length={args.seq_length} exceeds "
          f"--max-position-embeddings={args.max_position_embeddings}")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    _need(args.num_attention_heads % args.num_query_groups == 0,
          f"--num-attention-heads={args.num_attention_heads} is not divisible by "
          f"--num-query-groups={args.num_query_groups}")


def _local_layers() -> bool:
    """Whether the model is built from megatron-core's local layer spec (no TE on CUDA)."""
    import torch

    return not (torch.cuda.is_available()
                and importlib.util.find_spec("transformer_engine") is not None)


def _check_layout(args: argparse.Namespace, world_size: int) -> None:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    _need(tp >= 1 and pp >= 1, f"parallel sizes must be >= 1 (TP={tp}, PP={pp})")
    _need(world_size % (tp * pp) == 0,
          f"world size {world_size} is not divisible by --tensor-model-parallel-size={tp} x "
          f"--pipeline-model-parallel-size={pp} = {tp * pp}")
    args.data_parallel_size = world_size // (tp * pp)
    _need(args.num_attention_heads % tp == 0,
          f"--tensor-model-parallel-size={tp} does not divide "
          f"--num-attention-heads={args.num_attention_heads}")
    _need(args.num_query_groups % tp == 0,
          f"--tensor-model-parallel-size={tp} does not divide query groups "
          f"({args.num_query_groups})")
    _need(args.num_layers % pp == 0,
          f"--pipeline-model-parallel-size={pp} does not divide --num-layers={args.num_layers}")
    args.virtual_pipeline_model_parallel_size = None
    per_vp = args.num_layers_per_virtual_pipeline_stage
    if per_vp is not None:
        _need(pp > 1, "--num-layers-per-virtual-pipeline-stage needs "
              f"--pipeline-model-parallel-size > 1 (got {pp})")
        per_stage = args.num_layers // pp
        _need(per_vp > 0 and per_stage % per_vp == 0,
              f"--num-layers-per-virtual-pipeline-stage={per_vp} does not divide the "
              f"{per_stage} layers of each pipeline stage")
        args.virtual_pipeline_model_parallel_size = per_stage // per_vp
    if args.sequence_parallel:
        _need(tp > 1, "--sequence-parallel needs --tensor-model-parallel-size > 1")
    if args.num_experts is not None and tp > 1:
        _need(args.sequence_parallel,
              f"--num-experts with --tensor-model-parallel-size={tp} needs --sequence-parallel "
              "(megatron-core refuses MoE with tensor parallelism without it)")
    if args.num_experts is not None:
        _need(args.num_experts >= args.moe_router_topk >= 1,
              f"--moe-router-topk={args.moe_router_topk} must be in [1, --num-experts="
              f"{args.num_experts}]")
        # megatron-core's local experts add their bias in place to an autograd Function's
        # output, which torch refuses in backward (measured with 0.16.1 on CPU)
        _need(not (args.add_bias_linear and _local_layers()),
              f"--num-experts={args.num_experts} with linear biases: the experts of "
              "megatron-core's local layers (no Transformer Engine on CUDA) fail in backward; "
              "give --disable-bias-linear")
    if args.moe_router_enable_expert_bias:
        _need(args.num_experts is not None, "--moe-router-enable-expert-bias needs --num-experts")
        _need(args.moe_router_score_function == "sigmoid",
              "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid "
              f"(got {args.moe_router_score_function}; megatron-core refuses the others)")


def _check_batch(args: argparse.Namespace) -> None:
    dp, mbs = args.data_parallel_size, args.micro_batch_size
    _need(mbs >= 1, f"--micro-batch-size={mbs}: must be >= 1")
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
    gbs = args.global_batch_size
    _need(gbs % (mbs * dp) == 0,
          f"--global-batch-size={gbs} is not divisible by --micro-batch-size={mbs} x "
          f"data-parallel size {dp} = {mbs * dp}")
    if args.rampup_batch_size is not None:
        start, incr, _ = args.rampup_batch_size
        for name, value in (("start", start), ("increment", incr)):
            _need(value % (mbs * dp) == 0,
                  f"--rampup-batch-size {name}={value} is not divisible by micro x dp = "
                  f"{mbs * dp}")
    vpp = args.virtual_pipeline_model_parallel_size
    if vpp is not None:
        n_micro = gbs // (mbs * dp)
        pp = args.pipeline_model_parallel_size
        _need(n_micro % pp == 0,
              f"interleaved schedule needs the number of microbatches ({n_micro}) to be a "
              f"multiple of --pipeline-model-parallel-size={pp}")


def _check_run(args: argparse.Namespace) -> None:
    _need(args.train_iters is not None and args.train_iters >= 0,
          f"--train-iters={args.train_iters}: required, must be >= 0")
    check_data(args)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = max(args.train_iters, 1)
    _need(args.lr_warmup_iters < max(args.lr_decay_iters, 1),
          f"--lr-warmup-iters={args.lr_warmup_iters} must be < --lr-decay-iters="
          f"{args.lr_decay_iters}")
    _need(args.min_lr <= args.lr, f"--min-lr={args.min_lr} exceeds --lr={args.lr}")
    _need(not (args.use_distributed_optimizer and args.optimizer != "adam"),
          f"--optimizer {args.optimizer} with --use-distributed-optimizer: megatron's "
          "distributed optimizer shards Adam only; drop one of them")
    if args.save_interval is not None:
        _need(args.save is not None, "--save-interval needs --save")
        _need(args.save_interval > 0, f"--save-interval={args.save_interval}: must be > 0")
    if args.eval_interval is not None:
        _need(args.eval_interval > 0, f"--eval-interval={args.eval_interval}: must be > 0")
    _need(args.log_interval > 0, f"--log-interval={args.log_interval}: must be > 0")
    if args.recompute_granularity == "full":
        _need(args.recompute_method is not None,
              "--recompute-granularity full needs --recompute-method uniform|block")
        if args.recompute_num_layers is None:
            args.recompute_num_layers = 1


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Validate in place and fill derived fields (data_parallel_size, ...); returns args."""
    _check_model(args)
    _check_layout(args, world_size)
    _check_batch(args)
    _check_run(args)
    args.world_size = world_size
    return args
