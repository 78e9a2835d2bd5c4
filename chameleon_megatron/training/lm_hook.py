"""``MegatronLMHook``: Chameleon's plugins called from Megatron-LM's ``pretrain()``.

While the wrapped ``pretrain()`` runs, these functions of ``megatron.training.training``
(which ``pretrain()`` and ``train()`` look up at call time) are replaced, and restored when it
returns or raises:

- ``setup_model_and_optimizer``: then the plugins are built from the Chameleon config and
  see ``on_model_built`` with the DDP-wrapped chunks, the optimizer and the LR schedule,
  and with ``--chameleon-metrics-file`` rank 0 writes the ``run`` record;
- ``build_train_valid_test_data_iterators``: the loop learns the iterators it replaces
  after a recovery;
- ``train``: ``LMLoop.train`` calls it, and calls it again after each recovery;
- ``train_step``: the plugins' work between steps before it; after it the loop counts the
  step, the plugins' ``metrics()`` are collected and, with ``--chameleon-metrics-file``,
  rank 0 appends the iteration record;
- ``get_forward_backward_func``: each call of the returned schedule (training and
  evaluation) runs inside the plugins' ``step_context``;
- ``evaluate_and_print_results`` and ``save_checkpoint``: marked as the work after a step
  (a failure in them is recovered like one in a step), with the model, optimizer, schedule
  and iterators trained now (``pretrain()`` calls them with the ones it built). The loop
  runs pretrain()'s end-of-job calls of them itself (``LMLoop._end_of_job``, recovered like
  the rest), so pretrain()'s own calls after ``train()`` returned are skipped.

``on_train_end`` is called when ``pretrain()`` returns or raises.

In a joiner (a restarted worker or a new node's, ``CHAMELEON_FT_JOIN_ID`` set),
``initialize_megatron`` is replaced too: Megatron-LM's arguments are set, no world is built,
and ``Joining`` unwinds ``pretrain()``; ``join`` then runs the loop for it (``LMLoop.join``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import os
import time
from types import ModuleType
from typing import Any, Callable, Iterator, Sequence

import torch

from chameleon_megatron.config import ChameleonConfig, config_from_args
from chameleon_megatron.logs import log_ours
from chameleon_megatron.megatron.lm_cpu import load_dataset_helpers
from chameleon_megatron.megatron.lm_seams import setup_for_rebuild
from chameleon_megatron.training.lm_loop import Joining, LMLoop, Providers
from chameleon_megatron.training.lm_work import Entry
from chameleon_megatron.metrics_file import MetricsWriter, continue_run, run_record
from chameleon_megatron.training.plugin import (
    END_OF_JOB,
    TrainContext,
    TrainerPlugin,
    plugins_step,
)

logger = logging.getLogger(__name__)

PluginBuilder = Callable[[ChameleonConfig], Sequence[TrainerPlugin]]

WRAPPED = ("setup_model_and_optimizer", "build_train_valid_test_data_iterators", "train",
           "train_step", "get_forward_backward_func", "evaluate_and_print_results",
           "save_checkpoint")
"""Functions of megatron.training.training replaced while pretrain() runs."""
USED = WRAPPED + ("get_args", "get_timers", "mpu", "get_model_config", "get_num_microbatches",
                  "load_checkpoint", "save_checkpoint_and_time",
                  "num_floating_point_operations", "preprocess_common_state_dict",
                  "print_datetime", "get_optimizer_param_scheduler",
                  "build_train_valid_test_datasets")
"""Every name of megatron.training.training the hook relies on."""


class MegatronLMHook:
    """Calls Chameleon's plugins from Megatron-LM's training loop; owns the replaced seams."""

    def __init__(self, training: ModuleType, build_plugins: PluginBuilder,
                 providers: Providers, *, joining: bool = False) -> None:
        """``joining``: this process joins a running job (a restarted worker or a new
        node): pretrain() stops after Megatron-LM's arguments are set (``join`` goes on)."""
        self._training = training
        self._wrapped = WRAPPED + (("initialize_megatron",) if joining else ())
        self._build_plugins = build_plugins
        self._providers = providers
        self.plugins: list[TrainerPlugin] = []
        self.loop: LMLoop | None = None
        self._originals: dict[str, Callable[..., Any]] = {}
        self._metrics_path: str | None = None
        self._metrics = MetricsWriter(None)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Replace the training seams for the duration of the block, then restore them and
        end the plugins."""
        self._originals = {name: getattr(self._training, name) for name in self._wrapped}
        for name, original in self._originals.items():
            setattr(self._training, name, getattr(self, f"_{name}")(original))
        try:
            yield
        finally:
            for name, fn in self._originals.items():
                setattr(self._training, name, fn)
            try:
                for plugin in self.plugins:
                    plugin.on_train_end()
            finally:
                self._metrics.close()

    # ------------------------------------------------------------------- set-up
    def _setup_model_and_optimizer(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def setup_model_and_optimizer(*args: Any, **kwargs: Any) -> Any:
            model, optimizer, scheduler = original(*args, **kwargs)
            self._start_loop(original, rank=torch.distributed.get_rank())
            self.loop.built(model, optimizer, scheduler)
            ctx = self.loop.context()
            self._announce(ctx)
            logger.info({"event": "chameleon_megatron_lm_hook", "rank": ctx.rank,
                         "plugins": [type(p).__name__ for p in self.plugins],
                         "metrics_file": self._metrics_path})
            return model, optimizer, scheduler

        return setup_model_and_optimizer

    def _start_loop(self, setup: Callable[..., Any], *, rank: int | None) -> None:
        """The plugins, the metrics file and the loop, once Megatron-LM's arguments are
        known; ``rank``: this rank in the job's first world (None: a joiner, which writes
        the metrics file only if the layout that admits it makes it rank 0)."""
        config = config_from_args(self._training.get_args())
        if config.ft.enabled:
            log_ours()  # recoveries are worth reading on the console
        self.plugins = list(self._build_plugins(config))
        self._metrics_path = config.metrics.file
        self._metrics = MetricsWriter(self._metrics_path, enabled=rank == 0)
        if self._metrics_path is not None and rank == 0:  # the file starts as our trainer's
            self._metrics.write(run_record(torch.distributed.get_world_size(),
                                           self._training.get_args(), _megatron_version()))
        self.loop = LMLoop(
            self._training, self.plugins, self._providers, setup=setup_for_rebuild(setup),
            build_iterators=self._originals["build_train_valid_test_data_iterators"],
            announce=self._announce, emit=self._emit, new_world=self._new_world)

    # ------------------------------------------------------------------- a joiner
    def _initialize_megatron(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """A joiner's ``initialize_megatron``: Megatron-LM's arguments and global state
        without its distributed world (the running job's recovery builds the groups this
        rank joins), then ``Joining`` ends pretrain() before it builds anything."""
        def initialize_megatron(*args: Any, **kwargs: Any) -> None:
            original(*args, **{**kwargs, "skip_mpu_initialization": True})
            raise Joining()

        return initialize_megatron

    def join(self, forward_step_func: Callable[..., Any],
             process_non_loss_data_func: Any = None, non_loss_data_func: Any = None
             ) -> tuple[int, float]:
        """After ``Joining``: wait to be invited, take the layout the running job's
        recovery gives this rank, and train in it (``LMLoop.join``)."""
        args = self._training.get_args()
        if torch.cuda.is_available():  # as Megatron-LM's distributed set-up does
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        load_dataset_helpers()
        # what setup_model_and_optimizer states when it loads nothing (the recovery moves
        # the position in)
        args.iteration, args.num_floating_point_operations_so_far = 0, 0
        from chameleon_megatron.training.distributed import seed_unplaced  # megatron-core

        seed_unplaced(args.seed)  # each holder's streams come with its stage
        self._start_loop(self._originals["setup_model_and_optimizer"], rank=None)
        entry = Entry(forward_step_func, process_non_loss_data_func, {}, non_loss_data_func)
        done = self.loop.join(self._originals["train"], entry)
        # pretrain()'s only collective after train() (its end-of-job work ran in the loop):
        # the members' barrier, which this rank must join
        self._training.print_datetime("after training is done")
        return done

    def _announce(self, ctx: TrainContext) -> None:
        for plugin in self.plugins:
            plugin.on_model_built(ctx)

    def _emit(self, record: dict[str, Any]) -> None:
        self._metrics.write(record)

    def _new_world(self, rank: int) -> None:
        self._metrics = continue_run(self._metrics, self._metrics_path, rank)

    def _build_train_valid_test_data_iterators(
            self, original: Callable[..., Any]) -> Callable[..., Any]:
        def build_train_valid_test_data_iterators(*args: Any, **kwargs: Any) -> Any:
            iterators = original(*args, **kwargs)
            if self.loop is not None:
                self.loop.iterators_built(iterators)
            return iterators

        return build_train_valid_test_data_iterators

    # ------------------------------------------------------------------- the loop
    def _train(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def train(*args: Any, **kwargs: Any) -> Any:
            assert self.loop is not None, "train() before setup_model_and_optimizer()"
            return self.loop.train(original, *args, **kwargs)

        return train

    def _get_forward_backward_func(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def get_forward_backward_func(*args: Any, **kwargs: Any) -> Callable[..., Any]:
            schedule = original(*args, **kwargs)

            @functools.wraps(schedule)
            def forward_backward(*f_args: Any, **f_kwargs: Any) -> Any:
                training = not f_kwargs.get("forward_only", False)
                # As in chameleon's trainer: the step being computed (1-based) in training,
                # the steps completed in an evaluation.
                completed = self.loop.iteration if self.loop is not None else 0
                with plugins_step(self.plugins, completed + training, training=training):
                    return schedule(*f_args, **f_kwargs)

            return forward_backward

        return get_forward_backward_func

    def _train_step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def train_step(*args: Any, **kwargs: Any) -> Any:
            assert self.loop is not None, "train_step() before setup_model_and_optimizer()"
            self.loop.before_step()
            start = time.perf_counter()
            out = original(*args, **kwargs)
            step_time = time.perf_counter() - start
            margs = self._training.get_args()
            samples = (margs.data_parallel_size * margs.micro_batch_size
                       * self._training.get_num_microbatches())
            self.loop.step_applied(
                samples, self._training.num_floating_point_operations(margs, samples))
            extra: dict[str, Any] = {}
            for plugin in self.plugins:
                extra.update(plugin.metrics())
            if self._metrics_path is not None:
                loss = _loss_to_rank0(out[0], margs.pipeline_model_parallel_size > 1)
                self._metrics.write(self._record(loss, step_time) | extra)
            return out

        return train_step

    def _record(self, loss: float | None, step_time: float) -> dict[str, Any]:
        margs = self._training.get_args()
        return {
            "event": "iteration",
            "iteration": self.loop.iteration,
            "loss": loss,
            "step_time_s": step_time,
            "consumed_samples": self.loop.consumed_samples,
            "world_size": torch.distributed.get_world_size(),
            "layout": {
                "tp": margs.tensor_model_parallel_size,
                "pp": margs.pipeline_model_parallel_size,
                "vpp": margs.virtual_pipeline_model_parallel_size or 1,
                "dp": margs.data_parallel_size,
            },
        }

    # ------------------------------------------------------------------- after a step
    def _evaluate_and_print_results(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def current(named: dict[str, Any]) -> None:
            named["model"], named["config"] = self.loop.model, self.loop.config
            named["data_iterator"] = self.loop.current(named["data_iterator"])

        return self._after_step(original, "eval", current)

    def _save_checkpoint(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def current(named: dict[str, Any]) -> None:
            named["model"], named["optimizer"], named["opt_param_scheduler"] = \
                self.loop.current_objects(named["model"], named["optimizer"],
                                          named["opt_param_scheduler"])
            if named.get("train_data_iterator") is not None:
                named["train_data_iterator"] = self.loop.current(named["train_data_iterator"])

        return self._after_step(original, "save", current)

    def _after_step(self, original: Callable[..., Any], phase: str,
                    current: Callable[[dict[str, Any]], None]) -> Callable[..., Any]:
        """``original`` as the work ``phase`` after a step, its arguments made ``current``
        (pretrain() passes the objects it built; before the loop exists: unchanged)."""
        signature = inspect.signature(original)

        @functools.wraps(original)
        def seam(*args: Any, **kwargs: Any) -> Any:
            if self.loop is None:
                return original(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            if self.loop.end.skips(phase):
                return None  # pretrain()'s end-of-job call: the loop ran it, recovered
            current(bound.arguments)
            if self.loop.after_step in END_OF_JOB:  # the loop's own call, marked there
                return original(*bound.args, **bound.kwargs)
            with self.loop.after_step_phase(phase):
                return original(*bound.args, **bound.kwargs)

        return seam


def _megatron_version() -> str:
    """The version of the megatron package imported: the checkout's, not an installed wheel's."""
    from megatron.core import package_info

    return str(package_info.__version__)


def _loss_to_rank0(loss_dict: dict[str, Any], pipelined: bool) -> float | None:
    """The step's loss on rank 0 (None when the step reported none).

    Megatron-LM reduces the loss on the last pipeline stage only; with pipelining every rank
    calls this and the last rank (always in the last stage) broadcasts it.
    """
    value = loss_dict.get("lm loss", next(iter(loss_dict.values()), None))
    if not pipelined:
        return None if value is None else float(value)
    nccl = torch.distributed.get_backend() == "nccl"
    t = torch.tensor([math.nan if value is None else float(value)],
                     device=torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu")
    torch.distributed.broadcast(t, src=torch.distributed.get_world_size() - 1)
    loss = t.item()
    return None if math.isnan(loss) else loss
