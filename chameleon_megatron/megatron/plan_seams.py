"""megatron-core for layouts its parallel state cannot express (``resilience.execution``).

Heterogeneous pipelines and rerouted layouts run megatron-core's own model, schedules and
communicators over groups built per plan, never through ``parallel_state``'s own groups:

* a stage's ``GPTModel`` with an explicit ``ProcessGroupCollection`` (``stage_gpt``), its
  layers from a ``pipeline_model_parallel_layout`` that knows the stage (``stage_layout``);
* the 1F1B schedule of one pipeline with its own ``P2PCommunicator``
  (``pipeline_schedule``);
* the single-microbatch ``forward_step``/``backward_step`` of megatron's schedules
  (``forward_one``/``backward_one``), looked up at call time so that the swap seams wrap them
  here too;
* megatron's DDP (main-gradient buffers: fp32 for bf16 parameters) and optimizer, one DDP
  per part of a stage whose layers share their holders (``stage_ddp_groups``), stepped by
  the plan with its global gradient norm (``step_with_norm``);
* seeding of the tensor-parallel RNG tracker, and the scratch buffer attention needs;
* for the job's own code that reads ``parallel_state`` (its model builder, forward step and
  loss), a view of one stage set in those globals while it runs (``stage_view``).

``check_plan_seams`` checks each signature these calls rely on (parameter names), so a
megatron-core release that changes one is refused before a recovery tries to use it.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist


class PipelinePosition:
    """Stands in for the pipeline group while a stage is built.

    megatron-core reads only ``rank()`` and ``size()`` of the model's pipeline group (layer
    offsets, first/last stage); the plan knows both. A stage whose pipeline lost a rank
    (rerouting) can thus be built without a group that could never form. The schedules get
    the real groups separately.
    """

    def __init__(self, stage: int, depth: int) -> None:
        if not 0 <= stage < depth:
            raise ValueError(f"stage={stage}: must be in [0, {depth})")
        self._stage, self._depth = stage, depth

    def rank(self) -> int:
        return self._stage

    def size(self) -> int:
        return self._depth


NEEDS: dict[str, tuple[str, ...]] = {
    "pipeline_parallel.get_forward_backward_func": ("pp_size", "vp_size"),
    "pipeline_parallel.schedules.forward_backward_pipelining_without_interleaving":
        ("p2p_communicator", "pg_collection"),
    "pipeline_parallel.schedules.forward_backward_no_pipelining": ("pg_collection",),
    "pipeline_parallel.schedules.forward_step":
        ("input_tensor", "forward_data_store", "config", "cp_group_size", "current_microbatch",
         "is_last_stage"),
    "pipeline_parallel.schedules.backward_step": ("input_tensor", "output_tensor",
                                                  "output_tensor_grad", "config"),
    "models.gpt.GPTModel": ("pg_collection",),
    "tensor_parallel.model_parallel_cuda_manual_seed": ("tp_rank", "ep_rank", "etp_rank"),
    "optimizer.clip_grads.clip_grad_by_total_norm_fp32": ("parameters", "max_norm",
                                                          "total_norm"),
    "distributed.DistributedDataParallel": ("pg_collection",),
    "optimizer.get_megatron_optimizer": ("pg_collection", "use_gloo_process_groups"),
}
"""megatron-core callables (below ``megatron.core``) and the parameters the plan runtime
passes them by name."""


def plan_seams_refusal() -> str | None:
    """Why this megatron-core cannot run the plan runtime (the first callable whose
    parameters do not fit, or a global of ``stage_view`` it lacks), or None when it can."""
    import importlib

    from megatron.core import __version__ as mcore_version
    from megatron.core import parallel_state

    lacking = [name for name in STAGE_VIEW if not hasattr(parallel_state, name)]
    if lacking:
        return (f"megatron-core {mcore_version}: megatron.core.parallel_state lacks "
                f"{', '.join(lacking)}; a plan's stages need them (see docs/heterogeneous.md)")

    for path, params in NEEDS.items():
        module_name, _, attr = f"megatron.core.{path}".rpartition(".")
        target = getattr(importlib.import_module(module_name), attr, None)
        have = set(inspect.signature(target).parameters) if target is not None else set()
        missing = [p for p in params if p not in have]
        if target is None or missing:
            return (f"megatron-core {mcore_version}: megatron.core.{path} lacks "
                    f"{', '.join(missing) or 'itself'}; heterogeneous pipelines and rerouting "
                    "need it (see docs/heterogeneous.md)")
    return None


def check_plan_seams() -> None:
    """RuntimeError naming the first callable whose parameters do not fit."""
    refusal = plan_seams_refusal()
    if refusal is not None:
        raise RuntimeError(refusal)


def stage_groups(solo: dist.ProcessGroup, tp: dist.ProcessGroup, pipeline: Any) -> Any:
    """The model's process groups for a stage: ``tp`` is its TP group (this rank alone at
    tp = 1), also its TP x CP group (no context parallelism) and, experts being split as the
    dense layers are (expert parallelism 1), its expert TP and TP x EP groups; this rank
    alone is its CP and expert-parallel group; ``pipeline`` is the pipeline group
    or a ``PipelinePosition``. The copy of the tied embedding is loaded with the state, not
    all-reduced in (no embedding groups)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection(tp=tp, cp=solo, pp=pipeline, embd=None, pos_embd=None,
                                  dp_cp=None, ep=solo, expt_tp=tp, tp_ep=tp,
                                  tp_cp=tp, tp_dp_cp=tp, expt_dp=None)


def stage_layout(counts: Sequence[int], stage: int) -> Any:
    """megatron-core's ``pipeline_model_parallel_layout`` for a pipeline with ``counts``
    layers per stage (any contiguous split), answering for ``stage``: megatron asks the
    layout for this stage's layer count and offset with the rank read from parallel state,
    which holds no such pipeline."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    class StageLayout(PipelineParallelLayerLayout):
        def get_num_layers_to_build(self, layer_type: Any = LayerType.decoder,
                                    vp_stage: int | None = None,
                                    pp_rank: int | None = None) -> int:
            return self.layout[stage if pp_rank is None else pp_rank][0].count(layer_type)

        def get_layer_offset(self, layer_type: Any = LayerType.decoder,
                             vp_stage: int | None = None, pp_rank: int | None = None) -> int:
            upto = stage if pp_rank is None else pp_rank
            return sum(self.layout[s][0].count(layer_type) for s in range(upto))

    rows = [["decoder"] * c for c in counts]
    rows[0].insert(0, "embedding")
    rows[-1].append("loss")
    return StageLayout(rows, len(counts))


def stage_gpt(config: Any, layer_spec: Any, *, args: Any, pre_process: bool,
              post_process: bool, groups: Any) -> torch.nn.Module:
    """megatron-core's ``GPTModel`` for one stage, on this process's device."""
    from megatron.core.models.gpt import GPTModel

    model = GPTModel(
        config=config, transformer_layer_spec=layer_spec,
        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process, post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
        pg_collection=groups,
    )
    return model.to(torch.cuda.current_device() if torch.cuda.is_available() else "cpu")


STAGE_VIEW = ("_TENSOR_MODEL_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS",
              "_MPU_TENSOR_MODEL_PARALLEL_RANK", "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE",
              "_MPU_PIPELINE_MODEL_PARALLEL_RANK", "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE",
              "_CONTEXT_PARALLEL_GROUP", "_CONTEXT_PARALLEL_GLOBAL_RANKS")
"""The globals of megatron's ``parallel_state`` a stage's view sets (``stage_view``)."""


@contextlib.contextmanager
def stage_view(*, stage: int, depth: int, tp: dist.ProcessGroup,
               cp: dist.ProcessGroup) -> Iterator[None]:
    """Megatron's parallel state as one stage of a plan sees it, while the body runs: its
    pipeline position (``stage`` of ``depth``), its tensor-parallel group ``tp`` and ``cp``
    (this rank alone) as context-parallel group; as it was afterwards. A job's own model
    builder, forward step and loss read these globals (which pipeline stage loads data,
    where a batch is broadcast from, the vocabulary-parallel cross entropy's group), and
    megatron's state holds no plan."""
    from megatron.core import parallel_state as ps

    view = (tp, dist.get_process_group_ranks(tp), tp.rank(), tp.size(), stage, depth,
            cp, dist.get_process_group_ranks(cp))
    kept = {name: getattr(ps, name) for name in STAGE_VIEW}
    vars(ps).update(zip(STAGE_VIEW, view))
    try:
        yield
    finally:
        vars(ps).update(kept)


def ensure_memory_buffer() -> None:
    """megatron's attention takes scratch space from parallel_state's global buffer, which
    only ``initialize_model_parallel`` creates (and ``destroy_model_parallel`` drops)."""
    from megatron.core import parallel_state

    if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
        parallel_state._set_global_memory_buffer()


def seed_tp_tracker(seed: int, *, tp_rank: int) -> None:
    """megatron's tensor-parallel RNG tracker with the rank given, not read from parallel
    state."""
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=0,
                                                   etp_rank=0)


def p2p_communicator(group: dist.ProcessGroup, config: Any) -> Any:
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    return P2PCommunicator(group, config)


def pipeline_schedule(depth: int) -> Callable[..., list[dict]]:
    """megatron's schedule for one pipeline of ``depth`` stages (no interleaving); call it
    with ``p2p_communicator=`` and ``pg_collection=``."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func(pp_size=depth, vp_size=None)


def forward_one(forward_step_func: Callable, batches: Iterator[dict], model: Any, *,
                input_tensor: torch.Tensor | None, reports: list, config: Any,
                microbatch: int, is_last_stage: bool) -> tuple[torch.Tensor, Any]:
    """One microbatch's forward as megatron's schedules run it: (output, token count)."""
    from megatron.core.pipeline_parallel import schedules

    return schedules.forward_step(
        forward_step_func, batches, model, num_microbatches=1, input_tensor=input_tensor,
        forward_data_store=reports, config=config, cp_group_size=1,
        current_microbatch=microbatch, is_last_stage=is_last_stage)


def release_output(output: torch.Tensor, config: Any) -> None:
    """Free an output's storage once it is sent (megatron keeps only its grad_fn)."""
    from megatron.core.pipeline_parallel import schedules

    schedules.deallocate_output_tensor(output, config.deallocate_pipeline_outputs)


def backward_one(input_tensor: torch.Tensor | None, output: torch.Tensor,
                 output_grad: torch.Tensor | None, model: Any, config: Any) -> Any:
    """One microbatch's backward as megatron's schedules run it: the input's gradient."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.utils import get_model_type

    if "model_type" in inspect.signature(schedules.backward_step).parameters:  # before 0.19
        return schedules.backward_step(input_tensor, output, output_grad,
                                       get_model_type(model), config)
    return schedules.backward_step(input_tensor, output, output_grad, config)


def stage_ddp_groups(dp: dist.ProcessGroup, solo: dist.ProcessGroup, tp: dist.ProcessGroup,
                     pipeline: Any) -> Any:
    """The groups megatron's DDP and optimizer read for a part of a plan's stage: ``dp``
    (the part's holders, over which the distributed optimizer shards it; ``solo`` without
    it), its TP group, and this rank alone as every model-parallel group. A plan reduces each
    layer's gradients among exactly its holders (``grad_sync``) and computes the global norm
    itself, so DDP only keeps the main-gradient buffers and the optimizer only updates."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection(tp=tp, pp=pipeline, ep=solo, dp=dp, dp_cp=dp, expt_dp=dp,
                                  intra_dist_opt=dp, mp=solo, tp_ep_pp=solo)


def step_with_norm(optimizer: Any, max_norm: float,
                   norm: Callable[[], float]) -> tuple[bool, float | None]:
    """megatron's optimizer step (main gradients taken from the DDP buffers, clipping, update)
    with the plan's global gradient norm instead of one over its model-parallel group:
    (applied, norm; None without clipping)."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    if optimizer.prepare_grads():  # found inf/nan (fp16 loss scaling only)
        return False, None
    total = None
    if max_norm > 0:
        total = norm()
        for leaf in getattr(optimizer, "chained_optimizers", [optimizer]):
            # --use-precision-aware-optimizer: the optimizer reads ``decoupled_grad``
            decoupled = leaf.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
            clip_grad_by_total_norm_fp32(leaf.get_parameters(), max_norm, total,
                                         use_decoupled_grad=decoupled)
    return optimizer.step_with_ready_grads(), total


