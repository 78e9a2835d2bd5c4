"""Build the GPT model chunks of this rank: TransformerConfig, layer spec, DDP wrapping."""

from __future__ import annotations

import argparse
import importlib.util
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_block import get_num_layers_to_build

from chameleon_megatron.megatron.sp_norm import block_spec, torch_norms
from chameleon_megatron.megatron.te_absent import te_usable
from chameleon_megatron.training.init_weights import init_layout_independent

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Kernels:
    """Which fused GPU code this process can run (all False without CUDA)."""

    transformer_engine: bool
    """TransformerEngine imports and works: its layer spec (and persistent layer norm)."""
    softmax: bool
    """megatron's fused masked-softmax CUDA extensions are installed (apex or Megatron-LM's
    fused kernels); megatron imports them at the first fused call, not before."""
    jit: bool
    """torch's fusers for bias-dropout-add and bias-GeLU (CUDA only)."""


def available_kernels() -> Kernels:
    if not torch.cuda.is_available():
        return Kernels(transformer_engine=False, softmax=False, jit=False)
    return Kernels(transformer_engine=te_usable(),
                   softmax=all(importlib.util.find_spec(m) is not None for m in _SOFTMAX_EXT),
                   jit=True)


_SOFTMAX_EXT = ("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda",
                "scaled_softmax_cuda")


def transformer_config(args: argparse.Namespace, kernels: Kernels) -> TransformerConfig:
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    on_gpu = torch.cuda.is_available()
    k = kernels
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        normalization=args.normalization,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=args.add_bias_linear,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=args.bf16,
        num_moe_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk,
        moe_ffn_hidden_size=(args.moe_ffn_hidden_size or args.ffn_hidden_size)
        if args.num_experts else None,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_router_score_function=args.moe_router_score_function,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=args.moe_router_bias_update_rate,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        # One normaliser for the whole global batch, whatever the layout or microbatch split.
        calculate_per_token_loss=True,
        # gloo pairs p2p ops by order; batched p2p is wrong when prev and next are one peer.
        batch_p2p_comm=False,
        deallocate_pipeline_outputs=True,
        use_cpu_initialization=not on_gpu or args.use_cpu_initialization,
        # Fused kernels need CUDA (and apex/TE); the unfused paths compute the same thing.
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=k.softmax,
        bias_activation_fusion=k.jit and not args.swiglu,
        bias_dropout_fusion=k.jit,
        apply_rope_fusion=False,
        # Only TE's layer norm persists; megatron's torch norm (the local spec) refuses it.
        persist_layer_norm=k.transformer_engine,
    )


def layer_spec(args: argparse.Namespace, kernels: Kernels):
    """TransformerEngine spec when TE and CUDA are usable, megatron's local spec otherwise."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if kernels.transformer_engine:
        return specs.get_gpt_layer_with_transformer_engine_spec(num_experts=args.num_experts)
    return specs.get_gpt_layer_local_spec(num_experts=args.num_experts,
                                          normalization=args.normalization)


def model_spec(args: argparse.Namespace, kernels: Kernels, num_layers: int):
    """What ``GPTModel`` gets for a chunk of ``num_layers`` layers: the layer spec, or with
    --sequence-parallel on torch's norms a block of such layers whose norms support it
    (``megatron.sp_norm``)."""
    spec = layer_spec(args, kernels)
    if args.sequence_parallel and torch_norms(kernels.transformer_engine):
        return block_spec(spec, num_layers)
    return spec


def build_model_chunks(args: argparse.Namespace, config: TransformerConfig,
                       kernels: Kernels) -> list[GPTModel]:
    """One GPTModel per virtual pipeline stage of this rank (one without interleaving);
    ``kernels``: those ``config`` was made for (the spec must agree with it)."""
    vpp = args.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        chunks.append(GPTModel(
            config=config,
            transformer_layer_spec=model_spec(args, kernels,
                                              get_num_layers_to_build(config, vp_stage=stage)),
            vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False,
                                                              vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False,
                                                              vp_stage=stage),
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            rotary_base=args.rotary_base,
            vp_stage=stage,
        ))
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    for chunk in chunks:
        chunk.to(device)
    init_layout_independent(chunks, seed=args.seed, std=args.init_method_std,
                            num_layers=args.num_layers)
    return chunks


def half_precision(config: TransformerConfig,
                   chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """With --bf16 each chunk is cast whole to bf16 (norms included) and runs in
    ``Float16Module`` (bf16 inputs, fp32 outputs on the last stage), as Megatron-LM's
    ``get_model`` stacks it."""
    return [Float16Module(config, chunk) for chunk in chunks] if config.bf16 else chunks


def ddp_config(args: argparse.Namespace, *, plan: bool = False) -> DistributedDataParallelConfig:
    """megatron's DDP settings (fp32 main grads for bf16 parameters). ``plan``: a plan's
    stage, whose gradients the plan reduces itself (``resilience.execution.grad_sync``, with
    its own overlap): DDP keeps the main-gradient buffers (laid out for the distributed
    optimizer's shards with --use-distributed-optimizer) and reduces nothing."""
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.bf16,
        overlap_grad_reduce=args.overlap_grad_reduce and not plan,
        use_distributed_optimizer=args.use_distributed_optimizer,
        check_for_nan_in_grad=False,
    )


def wrap_ddp(args: argparse.Namespace, config: TransformerConfig,
             chunks: list[GPTModel]) -> list[DistributedDataParallel]:
    """Megatron's wrappers over megatron's parallel state (``half_precision``, then DDP)."""
    return [
        DistributedDataParallel(config=config, ddp_config=ddp_config(args), module=chunk,
                                # Only the first chunk buckets, as in Megatron-LM.
                                disable_bucketing=i > 0)
        for i, chunk in enumerate(half_precision(config, chunks))
    ]
