"""Chameleon's configuration: the component dataclasses of a run, YAML presets, CLI flags.

Each component (one keyword-only dataclass, a docstring under each field, defined next to
its subsystem) is listed in COMPONENTS; ``configurable`` turns it into YAML keys
(``<section>.<field>``) and ``--chameleon-*`` flags, so a field is written once.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Mapping

import yaml

from chameleon_megatron.configurable import ConfigError, add_flags, cli_overrides, from_mapping
from chameleon_megatron.errors import reading
from chameleon_megatron.resilience.config import ResilienceConfig
from chameleon_megatron.swap.config import SwapConfig


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    """Per-iteration JSON-lines metrics."""

    SECTION: ClassVar[str] = "metrics"

    file: str | None = None
    """Path of the JSON-lines metrics file written by the first rank (none: no file)."""
    append: bool = False
    """Add this run to a metrics file that already holds one (each record then carries the
    run's ``run_id``); without it such a file is refused, so that runs are never mixed."""


COMPONENTS: tuple[type, ...] = (MetricsConfig, SwapConfig, ResilienceConfig)


@dataclass(frozen=True, kw_only=True)
class ChameleonConfig:
    """All component configs of one run."""

    metrics: MetricsConfig = dataclasses.field(default_factory=MetricsConfig)
    swap: SwapConfig = dataclasses.field(default_factory=SwapConfig)
    ft: ResilienceConfig = dataclasses.field(default_factory=ResilienceConfig)


SECTIONS: frozenset[str] = frozenset(c.SECTION for c in COMPONENTS)


def add_chameleon_args(parser: argparse.ArgumentParser,
                       components: tuple[type, ...] = COMPONENTS) -> argparse.ArgumentParser:
    """Add ``--chameleon-config`` and the flags of ``components`` (every component by
    default; an entry that supports fewer offers only theirs)."""
    group = parser.add_argument_group("chameleon")
    group.add_argument(
        "--chameleon-config", dest="chameleon_config", default=None, metavar="FILE.yaml",
        help="YAML preset; its sections are component names (and 'megatron' for trainer flags).",
    )
    for cls in components:
        add_flags(group, cls.SECTION, cls)
    return parser


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a preset file, which must hold a mapping at the top."""
    if not Path(path).is_file():
        raise ConfigError(f"--chameleon-config {path}: no such file")
    with reading(path):
        data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def build_config(
    yaml_data: Mapping[str, Any] | None = None,
    namespace: argparse.Namespace | None = None,
) -> ChameleonConfig:
    """Defaults, then YAML sections, then explicit CLI flags; unknown sections are refused."""
    yaml_data = dict(yaml_data or {})
    unknown = sorted(set(yaml_data) - SECTIONS - {"megatron"})
    if unknown:
        raise ConfigError(
            f"unknown section {unknown[0]!r}; known sections: megatron, {', '.join(sorted(SECTIONS))}"
        )
    parts = {}
    for cls in COMPONENTS:
        section = yaml_data.get(cls.SECTION) or {}
        if not isinstance(section, Mapping):
            raise ConfigError(f"section {cls.SECTION!r} must be a mapping")
        merged = dict(section)
        if namespace is not None:
            merged.update(cli_overrides(namespace, cls.SECTION, cls))
        parts[cls.SECTION] = from_mapping(cls, merged, where=cls.SECTION)
    return ChameleonConfig(**parts)


def config_from_args(namespace: argparse.Namespace) -> ChameleonConfig:
    """Chameleon config for parsed arguments (reads ``--chameleon-config`` if given)."""
    path = getattr(namespace, "chameleon_config", None)
    return build_config(read_yaml(path) if path else None, namespace)
