"""Component dataclasses become YAML keys and --chameleon-* flags, written once."""

import argparse
import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Literal

import pytest

from chameleon_megatron import config as cfg_mod
from chameleon_megatron.configurable import (
    ConfigError, add_flags, cli_overrides, field_docs, from_mapping,
)

pytestmark = pytest.mark.timeout(60)


@dataclass(frozen=True, kw_only=True)
class Demo:
    SECTION: ClassVar[str] = "demo"

    enabled: bool = False
    """Turn the demo on."""
    size: int = 3
    """How many."""
    ratio: float | None = None
    """A fraction."""
    mode: Literal["a", "b"] = "a"
    """Which mode."""
    tags: tuple[str, ...] = ()
    """Repeatable."""


def test_field_docstrings_are_read():
    assert field_docs(Demo) == {"enabled": "Turn the demo on.", "size": "How many.",
                                "ratio": "A fraction.", "mode": "Which mode.",
                                "tags": "Repeatable."}


def test_flags_generated_with_help_and_types():
    p = argparse.ArgumentParser()
    add_flags(p, "demo", Demo)
    help_text = p.format_help()
    for flag in ("--chameleon-demo ", "--chameleon-demo-size", "--chameleon-demo-ratio",
                 "--chameleon-demo-mode", "--chameleon-demo-tags", "--no-chameleon-demo"):
        assert flag in help_text
    assert "How many." in help_text
    ns = p.parse_args(["--chameleon-demo", "--chameleon-demo-size", "7",
                       "--chameleon-demo-tags", "x", "--chameleon-demo-tags", "y"])
    got = from_mapping(Demo, cli_overrides(ns, "demo", Demo), where="demo")
    assert got == Demo(enabled=True, size=7, tags=("x", "y"))
    # Flags not given stay out, so YAML values are not overwritten by defaults.
    assert cli_overrides(p.parse_args([]), "demo", Demo) == {}


@pytest.mark.parametrize("data,pattern", [
    ({"sise": 1}, r"unknown key demo.sise; known keys of demo: enabled, size"),
    ({"size": "many"}, r"demo.size='many': must be an integer"),
    ({"size": True}, r"demo.size=True: must be an integer"),
    ({"mode": "c"}, r"demo.mode='c': must be one of \['a', 'b'\]"),
    ({"enabled": "perhaps"}, r"demo.enabled='perhaps': must be true or false"),
    ({"size": None}, r"demo.size=None: may not be empty"),
])
def test_bad_values_name_key_value_limit(data, pattern):
    with pytest.raises(ConfigError, match=pattern):
        from_mapping(Demo, data, where="demo")


def test_every_component_has_docs_and_flags():
    parser = argparse.ArgumentParser()
    cfg_mod.add_chameleon_args(parser)
    help_text = parser.format_help()
    for cls in cfg_mod.COMPONENTS:
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"
        assert dataclasses.fields(cls)[0].kw_only
    assert "--chameleon-swap " in help_text and "--chameleon-metrics-file" in help_text
    assert "--chameleon-ft " in help_text and "--chameleon-inject-fault" in help_text


def test_yaml_then_cli_precedence():
    parser = argparse.ArgumentParser()
    cfg_mod.add_chameleon_args(parser)
    ns = parser.parse_args(["--chameleon-metrics-file", "cli.jsonl"])
    got = cfg_mod.build_config({"metrics": {"file": "yaml.jsonl"}, "swap": {"enabled": True}},
                               ns)
    assert got.metrics.file == "cli.jsonl" and got.swap.enabled is True
    assert cfg_mod.build_config({}).swap.enabled is False
    with pytest.raises(ConfigError, match="unknown section 'bogus'"):
        cfg_mod.build_config({"bogus": {}})
    with pytest.raises(ConfigError, match="section 'swap' must be a mapping"):
        cfg_mod.build_config({"swap": 3})


def test_range_checks_come_from_the_component():
    with pytest.raises(ConfigError, match=r"ft.mtbf_prior_s=-1.0: must be > 0"):
        cfg_mod.build_config({"ft": {"mtbf_prior_s": -1}})
