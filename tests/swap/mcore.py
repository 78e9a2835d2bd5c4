"""A tiny megatron-core GPT run in one process on CPU (gloo, world size 1).

``McoreRun`` builds a GPTModel from megatron's local layer spec and runs steps through
``forward_backward_no_pipelining``, returning the summed loss and the gradients, so a
test can compare a run with swap against one without, bit for bit.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import torch
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig

VOCAB = 128


def transformer_config(**overrides: Any) -> TransformerConfig:
    base = dict(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
        hidden_dropout=0.1, attention_dropout=0.1, init_method_std=0.02,
        pipeline_dtype=torch.float32, params_dtype=torch.float32,
        calculate_per_token_loss=False, use_cpu_initialization=True,
        gradient_accumulation_fusion=False, masked_softmax_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, deallocate_pipeline_outputs=True,
    )
    base.update(overrides)
    return TransformerConfig(**base)


def reseed(seed: int) -> None:
    torch.manual_seed(seed)
    tensor_parallel.get_cuda_rng_tracker().reset()
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build_gpt(config: TransformerConfig, *, experts: int | None = None, seed: int = 1234,
              max_seq: int = 64) -> GPTModel:
    reseed(seed)
    return GPTModel(config=config,
                    transformer_layer_spec=get_gpt_layer_local_spec(num_experts=experts),
                    vocab_size=VOCAB, max_sequence_length=max_seq)


def _loss(mask: torch.Tensor, output: torch.Tensor):
    loss = (output.float().view(-1) * mask.view(-1)).sum() / mask.sum()
    return loss, {"loss": loss.detach()}


def _forward_step(data: Iterator[dict], model: GPTModel):
    batch = next(data)
    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return out, lambda o: _loss(batch["mask"], o)


@dataclasses.dataclass
class McoreRun:
    model: GPTModel

    def batches(self, step: int, num_microbatches: int, seq: int, micro: int = 2) -> list[dict]:
        g = torch.Generator().manual_seed(1000 + step)
        out = []
        for _ in range(num_microbatches):
            tokens = torch.randint(0, VOCAB, (micro, seq + 1), generator=g)
            out.append({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                        "position_ids": torch.arange(seq).expand(micro, seq).contiguous(),
                        "mask": torch.ones(micro, seq)})
        return out

    def step(self, step: int, *, num_microbatches: int = 2, seq: int = 16,
             forward_only: bool = False) -> tuple[list[float], list[torch.Tensor]]:
        """One forward-backward; (per-microbatch losses, gradients), grads zeroed first."""
        reseed(100 + step)
        self.model.zero_grad(set_to_none=True)
        data = iter(self.batches(step, num_microbatches, seq))
        fb = get_forward_backward_func()
        reports = fb(forward_step_func=_forward_step, data_iterator=data, model=self.model,
                     num_microbatches=num_microbatches, seq_length=seq, micro_batch_size=2,
                     forward_only=forward_only)
        grads = [] if forward_only else [p.grad.clone() for p in self.model.parameters()
                                         if p.grad is not None]
        return [r["loss"].item() for r in reports], grads
