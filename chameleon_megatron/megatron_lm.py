"""Chameleon inside a Megatron-LM checkout's ``pretrain_gpt.py`` (patched by patches/apply.py).

The patch rebinds ``pretrain = wrap_pretrain(pretrain)`` at the top of the script's
``__main__`` block. From then on:

* ``parse_args`` of ``megatron.training.arguments`` (and ``.initialize``, before 0.19) chain our
  ``extra_args_provider``: every parse (``--help``, the in-process-restart check, the one in
  ``initialize_megatron``) knows ``--chameleon-config`` and the flags of ``COMPONENTS`` (swap,
  fault tolerance, metrics), and the preset's ``megatron``
  section becomes parser defaults (as do the flags a CPU needs, on a host without CUDA), so
  command-line flags still win. Each parse checks the Chameleon config against Megatron-LM's
  arguments and ends a run it cannot serve with one line, before any work.
* Without CUDA, ``lm_cpu_platform`` patches Megatron-LM's start-up for the CPU while
  ``pretrain()`` runs (``chameleon_megatron/megatron/lm_cpu.py``), and ``validate_args``
  gets the CPU's answers wherever it runs (0.19 calls it before ``pretrain()``).
* While the wrapped ``pretrain()`` runs, ``MegatronLMHook`` (``training/lm_hook.py``) calls the
  plugins from Megatron-LM's loop, which ``LMLoop`` (``training/lm_loop.py``) re-enters after a
  recovery.

This module imports nothing from ``megatron.training`` at import time, so it loads (and does
nothing) where only megatron-core is installed.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import sys
from typing import Any, Callable, Sequence

from chameleon_megatron.config import (
    ChameleonConfig,
    MetricsConfig,
    add_chameleon_args,
    config_from_args,
    read_yaml,
)
from chameleon_megatron.configurable import ConfigError
from chameleon_megatron.errors import fail
from chameleon_megatron.megatron.lm_cpu import (
    lm_cpu_platform,
    set_cpu_defaults,
    validating_on_cpu,
)
from chameleon_megatron.megatron.lm_limits import first_refused, ft_limits, swap_limits
from chameleon_megatron.megatron.lm_seams import UnsupportedMegatron, check_release
from chameleon_megatron.training.lm_hook import USED, MegatronLMHook
from chameleon_megatron.training.lm_loop import Joining, Leave, Providers
from chameleon_megatron.preflight import check_launcher, check_metrics_file
from chameleon_megatron.resilience.config import ResilienceConfig
from chameleon_megatron.resilience.recovery.faults import check_end_of_job_faults
from chameleon_megatron.resilience.store.env import JOIN_ENV
from chameleon_megatron.resilience.store.joiners import join_id_from_env
from chameleon_megatron.resilience.launch.with_agent import end_with_agent
from chameleon_megatron.swap.config import SwapConfig
from chameleon_megatron.training.plugin import TrainerPlugin

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]
COMPONENTS = (MetricsConfig, SwapConfig, ResilienceConfig)
"""What this path supports: its --help offers their flags."""
PROG = "pretrain_gpt.py"
PRETRAIN_PARAMS = ("train_valid_test_dataset_provider", "model_provider", "model_type",
                   "forward_step_func")
"""What a recovery takes from pretrain()'s arguments (``Providers``, in order)."""


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


def check_supported(config: ChameleonConfig, margs: argparse.Namespace) -> None:
    """Refuse what this path cannot run (before Megatron-LM builds anything): one
    ConfigError naming the flag and why (tables in ``megatron/lm_limits.py``), or naming a
    metrics file that holds a run without ``--chameleon-metrics-append`` (as on chameleon's
    trainer)."""
    check_metrics_file(config)
    if config.swap.enabled:
        refused = first_refused(swap_limits(margs))
        if refused is not None:
            raise ConfigError(f"--chameleon-swap with {refused}")
    ft = config.ft
    if not ft.enabled:
        if join_id_from_env() is not None:
            raise ConfigError(f"{JOIN_ENV} is set (a joiner) but --chameleon-ft is not: only "
                              "a fault-tolerant job admits new members")
        return
    refused = first_refused(ft_limits(margs))
    if refused is not None:
        raise ConfigError(f"--chameleon-ft: {refused}")
    check_end_of_job_faults(ft.inject_fault, margs.train_iters, megatron_lm=True)
    check_launcher(config)


def plugins_for(config: ChameleonConfig) -> list[TrainerPlugin]:
    """Plugins of the enabled subsystems: those chameleon's own trainer builds (a plan's
    steps run through ``training.lm_plan``)."""
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
               ((arguments, ("parse_args",)), (training, USED))
               for name in names if not hasattr(m, name)]
    if missing:
        raise RuntimeError(
            f"this Megatron-LM lacks {', '.join(missing)}; the hook supports 0.16.x, 0.17.x "
            "and 0.19.x (see patches/README.md)"
        )
    # 0.16/0.17's initialize imports parse_args by name; 0.19's parses before pretrain()
    for module in (m for m in (arguments, initialize) if hasattr(m, "parse_args")):
        if not getattr(module.parse_args, _CHAINED, False):
            check_parse_args(module.parse_args)
            module.parse_args = with_chameleon_args(module.parse_args)
    # 0.19 validates in pretrain_gpt.py's __main__ (by this module's global name), before
    # pretrain() and its CPU platform: validation needs the CPU's answers there too
    if hasattr(arguments, "validate_args"):
        arguments.validate_args = validating_on_cpu(arguments.validate_args)

    from megatron.core import package_info

    try:  # a checkout updated after patches/apply.py patched it
        check_release(str(package_info.__version__), training, pretrain)
    except UnsupportedMegatron as exc:
        raise fail(PROG, f"{exc}; see patches/README.md") from None
    signature = inspect.signature(pretrain)

    @functools.wraps(pretrain)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        named = signature.bind(*args, **kwargs).arguments
        # 0.19's pretrain_gpt.py passes no model_provider (its config container builds one)
        providers = Providers(*(named.get(name) for name in PRETRAIN_PARAMS))
        end_with_agent()  # under chameleon-run: no worker outlives its agent
        hook = MegatronLMHook(training, plugins_for, providers,
                              joining=join_id_from_env() is not None)
        with lm_cpu_platform(training, initialize), hook.installed():
            try:
                try:
                    return pretrain(*args, **kwargs)
                except Joining:  # a restarted worker or a new node: admitted by the job
                    return hook.join(named["forward_step_func"],
                                     named.get("process_non_loss_data_func"),
                                     named.get("non_loss_data_func"))
            except Leave:  # a spare at the job's end, or a joiner the job ended before
                return None

    return wrapped


_CHAINED = "_chameleon_chained"


def check_parse_args(parse_args: Callable[..., Any]) -> None:
    """Megatron-LM's ``parse_args`` must take the ``extra_args_provider`` first (0.16-0.19)."""
    params = list(inspect.signature(parse_args).parameters)
    if params[:1] != ["extra_args_provider"]:
        raise RuntimeError(f"this Megatron-LM's parse_args({', '.join(params)}) does not take "
                           "extra_args_provider first; the hook cannot add --chameleon-* flags")


def refuse_yaml_cfg(parsed: Any) -> None:
    """Megatron-LM's experimental ``--yaml-cfg`` cannot start a GPT job in 0.16-0.19 (its
    ``validate_yaml`` reads ``account_for_embedding_in_pipeline_split`` at the top level, the
    model config from the file's sections, and its flattening refuses the key in both:
    tests/megatron/test_megatron_lm_yaml.py), and it drops every command-line flag, ours
    too: refused in one line rather than failing in Megatron-LM."""
    path = getattr(parsed, "yaml_cfg", None)
    if path is not None:
        raise ConfigError(
            f"--yaml-cfg {path}: Megatron-LM's YAML arguments cannot start pretrain_gpt.py in "
            "this release and would replace every command-line flag, --chameleon-* included; "
            "give Megatron-LM's arguments as flags, or in the megatron section of a "
            "--chameleon-config preset")


def with_chameleon_args(parse_args: Callable[..., Any]) -> Callable[..., Any]:
    """Megatron-LM's ``parse_args`` with our ``extra_args_provider`` chained after the caller's
    (marked, so that it is chained once however often the script wraps ``pretrain``)."""

    @functools.wraps(parse_args)
    def parse(*args: Any, **kwargs: Any) -> Any:
        theirs = args[0] if args else kwargs.pop("extra_args_provider", None)
        try:
            parsed = parse_args(chain_providers(theirs, extra_args_provider), *args[1:],
                                **kwargs)
            refuse_yaml_cfg(parsed)
            check_supported(config_from_args(parsed), parsed)
        except ValueError as exc:  # ConfigError, a malformed preset: one line, exit 2
            raise fail(PROG, str(exc).splitlines()[0]) from None
        return parsed

    setattr(parse, _CHAINED, True)
    return parse
