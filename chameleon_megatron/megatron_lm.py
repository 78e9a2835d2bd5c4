"""Chameleon inside a Megatron-LM checkout's ``pretrain_gpt.py`` (patched by patches/apply.py).

The patch rebinds ``pretrain = wrap_pretrain(pretrain)`` at the top of the script's
``__main__`` block. From then on:

* ``parse_args`` of ``megatron.training.arguments`` and ``.initialize`` chain our
  ``extra_args_provider``: every parse (``--help``, the in-process-restart check, the one in
  ``initialize_megatron``) knows ``--chameleon-config`` and the flags of ``COMPONENTS`` (swap,
  metrics), and the preset's ``megatron`` section becomes parser defaults (as do the flags a
  CPU needs, on a host without CUDA), so command-line flags still win. Each parse checks
  the Chameleon config and ends a run it cannot serve with one line, before any work.
* Without CUDA, ``lm_cpu_platform`` patches Megatron-LM's start-up for the CPU while
  ``pretrain()`` runs (``chameleon_megatron/megatron/lm_cpu.py``).
* While the wrapped ``pretrain()`` runs, three functions of ``megatron.training.training``
  that ``pretrain()`` and ``train()`` look up at call time are replaced (``MegatronLMHook``),
  and restored when it returns or raises:

  - ``setup_model_and_optimizer``: then the plugins are built from the Chameleon config and
    see ``on_model_built`` with the DDP-wrapped chunks and the optimizer;
  - ``get_forward_backward_func``: each call of the returned schedule (training and
    evaluation) runs inside the plugins' ``step_context``;
  - ``train_step``: after each step the plugins' ``metrics()`` are collected and, with
    ``--chameleon-metrics-file``, rank 0 appends the iteration record.

  ``on_train_end`` is called when ``pretrain()`` returns or raises.

This module imports nothing from ``megatron.training`` at import time, so it loads (and does
nothing) where only megatron-core is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import logging
import math
import sys
import time
from types import ModuleType
from typing import Any, Callable, Iterator, Sequence

import torch

from chameleon_megatron.config import (
    ChameleonConfig,
    MetricsConfig,
    add_chameleon_args,
    config_from_args,
    read_yaml,
)
from chameleon_megatron.configurable import ConfigError
from chameleon_megatron.errors import fail
from chameleon_megatron.megatron.lm_cpu import lm_cpu_platform, set_cpu_defaults
from chameleon_megatron.metrics_file import MetricsWriter
from chameleon_megatron.swap.config import SwapConfig
from chameleon_megatron.training.plugin import TrainContext, TrainerPlugin, plugins_step

logger = logging.getLogger(__name__)

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]
PluginBuilder = Callable[[ChameleonConfig], Sequence[TrainerPlugin]]

WRAPPED = ("setup_model_and_optimizer", "get_forward_backward_func", "train_step")
"""Functions of megatron.training.training replaced while pretrain() runs."""
USED = WRAPPED + ("get_args", "mpu", "get_model_config", "get_num_microbatches")
"""Every name of megatron.training.training the hook relies on."""
COMPONENTS = (MetricsConfig, SwapConfig)
"""What this path supports: its --help offers only their flags, and a preset that enables
another component (fault tolerance) is refused when the arguments are parsed."""
PROG = "pretrain_gpt.py"


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM ``extra_args_provider``: Chameleon's flags plus the preset's megatron
    defaults. A parser that already has them is returned unchanged."""
    if "--chameleon-config" not in parser._option_string_actions:
        add_chameleon_args(parser, COMPONENTS)
        set_cpu_defaults(parser)
        apply_preset_defaults(parser, sys.argv[1:])
    return parser


def apply_preset_defaults(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """Make the ``megatron`` section of ``--chameleon-config`` (if given in argv) parser defaults."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--chameleon-config", default=None)
    path = pre.parse_known_args(list(argv))[0].chameleon_config
    if path is None:
        return
    section = read_yaml(path).get("megatron") or {}
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: section 'megatron' must be a mapping")
    known = {action.dest for action in parser._actions}
    unknown = sorted(set(section) - known)
    if unknown:
        raise ConfigError(
            f"{path}: unknown key megatron.{unknown[0]}: not an argument of this parser "
            "(keys are Megatron-LM argument dest names, e.g. num_layers)"
        )
    parser.set_defaults(**section)


def chain_providers(*providers: ArgsProvider | None) -> ArgsProvider:
    """One ``extra_args_provider`` calling each given provider in order (None skipped)."""
    chosen = [p for p in providers if p is not None]

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for p in chosen:
            parser = p(parser)
        return parser

    return provider


def check_supported(config: ChameleonConfig) -> None:
    """Refuse what this path cannot run (before Megatron-LM builds anything)."""
    if config.ft.enabled:
        raise ConfigError(
            "ft.enabled=True: in-process recovery needs chameleon-pretrain-gpt under "
            "chameleon-run; Megatron-LM's pretrain_gpt.py runs swap and metrics only"
        )


def plugins_for(config: ChameleonConfig) -> list[TrainerPlugin]:
    """Plugins of the enabled subsystems: the same as chameleon's own trainer builds."""
    from chameleon_megatron.pretrain_gpt import build_plugins

    return build_plugins(config)


def wrap_pretrain(pretrain: Callable[..., Any]) -> Callable[..., Any]:
    """``pretrain`` with Chameleon's flags and hooks (plugins from ``plugins_for``).

    Called at the top of pretrain_gpt.py's ``__main__`` block, it adds Chameleon's flags to
    every later argument parse, for the rest of the process: Megatron-LM parses before
    ``pretrain()`` (in-process restart, ``--help``) and inside it. Each call of the returned
    function installs the training seams for that call only.
    """
    from megatron.training import (  # a Megatron-LM checkout
        arguments,
        initialize,
        training,
    )

    missing = [f"{m.__name__}.{name}" for m, names in
               ((arguments, ("parse_args",)), (initialize, ("parse_args",)), (training, USED))
               for name in names if not hasattr(m, name)]
    if missing:
        raise RuntimeError(
            f"this Megatron-LM lacks {', '.join(missing)}; the hook supports 0.16.x and 0.17.x "
            "(see patches/README.md)"
        )
    for module in (arguments, initialize):
        if not getattr(module.parse_args, _CHAINED, False):
            check_parse_args(module.parse_args)
            module.parse_args = with_chameleon_args(module.parse_args)

    @functools.wraps(pretrain)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with lm_cpu_platform(training, initialize), \
                MegatronLMHook(training, plugins_for).installed():
            return pretrain(*args, **kwargs)

    return wrapped


_CHAINED = "_chameleon_chained"


def check_parse_args(parse_args: Callable[..., Any]) -> None:
    """Megatron-LM's ``parse_args`` must take the ``extra_args_provider`` first (0.16-0.19)."""
    params = list(inspect.signature(parse_args).parameters)
    if params[:1] != ["extra_args_provider"]:
        raise RuntimeError(f"this Megatron-LM's parse_args({', '.join(params)}) does not take "
                           "extra_args_provider first; the hook cannot add --chameleon-* flags")


def with_chameleon_args(parse_args: Callable[..., Any]) -> Callable[..., Any]:
    """Megatron-LM's ``parse_args`` with our ``extra_args_provider`` chained after the caller's
    (marked, so that it is chained once however often the script wraps ``pretrain``)."""

    @functools.wraps(parse_args)
    def parse(*args: Any, **kwargs: Any) -> Any:
        theirs = args[0] if args else kwargs.pop("extra_args_provider", None)
        try:
            parsed = parse_args(chain_providers(theirs, extra_args_provider), *args[1:],
                                **kwargs)
            check_supported(config_from_args(parsed))
        except ValueError as exc:  # ConfigError, a malformed preset: one line, exit 2
            raise fail(PROG, str(exc).splitlines()[0]) from None
        return parsed

    setattr(parse, _CHAINED, True)
    return parse


class MegatronLMHook:
    """Calls Chameleon's plugins from Megatron-LM's training loop; owns the replaced seams."""

    def __init__(self, training: ModuleType, build_plugins: PluginBuilder) -> None:
        self._training = training
        self._build_plugins = build_plugins
        self.plugins: list[TrainerPlugin] = []
        self._metrics = MetricsWriter(None)
        self._send_metrics = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Replace the training seams for the duration of the block, then restore them and
        end the plugins."""
        originals = {name: getattr(self._training, name) for name in WRAPPED}
        self._training.setup_model_and_optimizer = self._setup(originals["setup_model_and_optimizer"])
        self._training.get_forward_backward_func = self._schedule(originals["get_forward_backward_func"])
        self._training.train_step = self._step(originals["train_step"])
        try:
            yield
        finally:
            for name, fn in originals.items():
                setattr(self._training, name, fn)
            try:
                for plugin in self.plugins:
                    plugin.on_train_end()
            finally:
                self._metrics.close()

    def _setup(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def setup_model_and_optimizer(*args: Any, **kwargs: Any) -> Any:
            model, optimizer, scheduler = original(*args, **kwargs)
            margs = self._training.get_args()
            config = config_from_args(margs)
            self.plugins = list(self._build_plugins(config))
            self._send_metrics = config.metrics.file is not None
            self._metrics = MetricsWriter(config.metrics.file,
                                          enabled=torch.distributed.get_rank() == 0)
            ctx = self._context(model, optimizer, scheduler, margs)
            for plugin in self.plugins:
                plugin.on_model_built(ctx)
            logger.info({"event": "chameleon_megatron_lm_hook", "rank": ctx.rank,
                         "plugins": [type(p).__name__ for p in self.plugins],
                         "metrics_file": config.metrics.file})
            return model, optimizer, scheduler

        return setup_model_and_optimizer

    def _context(self, model: list[Any], optimizer: Any, scheduler: Any, margs: Any) -> TrainContext:
        mpu = self._training.mpu
        return TrainContext(
            model=list(model),
            config=self._training.get_model_config(model[0]),
            args=margs,
            device=next(model[0].parameters()).device,
            rank=torch.distributed.get_rank(),
            tp_rank=mpu.get_tensor_model_parallel_rank(),
            pp_rank=mpu.get_pipeline_model_parallel_rank(),
            pp_size=mpu.get_pipeline_model_parallel_world_size(),
            dp_rank=mpu.get_data_parallel_rank(),
            vpp_size=margs.virtual_pipeline_model_parallel_size or 1,
            pipeline_group=mpu.get_pipeline_model_parallel_group(),
            extra={"optimizer": optimizer, "opt_param_scheduler": scheduler},
        )

    def _schedule(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def get_forward_backward_func(*args: Any, **kwargs: Any) -> Callable[..., Any]:
            schedule = original(*args, **kwargs)

            @functools.wraps(schedule)
            def forward_backward(*f_args: Any, **f_kwargs: Any) -> Any:
                margs = self._training.get_args()
                iteration = getattr(margs, "curr_iteration", margs.iteration)
                training = not f_kwargs.get("forward_only", False)
                with plugins_step(self.plugins, iteration, training=training):
                    return schedule(*f_args, **f_kwargs)

            return forward_backward

        return get_forward_backward_func

    def _step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def train_step(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = original(*args, **kwargs)
            step_time = time.perf_counter() - start
            extra: dict[str, Any] = {}
            for plugin in self.plugins:
                extra.update(plugin.metrics())
            if self._send_metrics:
                pipelined = self._training.get_args().pipeline_model_parallel_size > 1
                loss = _loss_to_rank0(out[0], pipelined)
                self._metrics.write(self._record(loss, step_time) | extra)
            return out

        return train_step

    def _record(self, loss: float | None, step_time: float) -> dict[str, Any]:
        """The iteration record; train() bumps iteration and consumed samples after train_step."""
        margs = self._training.get_args()
        batch = margs.data_parallel_size * margs.micro_batch_size * self._training.get_num_microbatches()
        return {
            "event": "iteration",
            "iteration": margs.curr_iteration + 1,
            "loss": loss,
            "step_time_s": step_time,
            "consumed_samples": margs.consumed_train_samples + batch,
            "world_size": torch.distributed.get_world_size(),
            "layout": {
                "tp": margs.tensor_model_parallel_size,
                "pp": margs.pipeline_model_parallel_size,
                "vpp": margs.virtual_pipeline_model_parallel_size or 1,
                "dp": margs.data_parallel_size,
            },
        }


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
