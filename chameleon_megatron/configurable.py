"""Machinery shared by every component config: field docs, typed loading, CLI flags.

A component config is a frozen, keyword-only dataclass with a docstring string literal
under each field. From that one definition this module derives:

* YAML loading (``from_mapping``) with a clear error for an unknown key or a wrong type,
* ``--chameleon-<section>-<field>`` argparse flags whose help text is the field docstring,
* merging so that CLI values override YAML values, which override the defaults.

Value checks (ranges, combinations) live in each dataclass's ``__post_init__`` and raise
``ValueError`` naming the key, the value and the limit.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from typing import Any, Literal, Mapping


class ConfigError(ValueError):
    """An invalid configuration value; the message names the key, the value and the limit."""


def check(condition: bool, key: str, value: Any, limit: str) -> None:
    """Raise ConfigError('<key>=<value>: <limit>') unless condition holds."""
    if not condition:
        raise ConfigError(f"{key}={value!r}: {limit}")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each dataclass field, read from the class source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _resolved_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def coerce(key: str, value: Any, tp: Any) -> Any:
    """Convert a YAML/CLI value to the field type, or raise ConfigError naming the key."""
    base, optional = _unwrap_optional(tp)
    if value is None:
        check(optional, key, value, "may not be empty")
        return None
    origin = typing.get_origin(base)
    if origin is Literal:
        choices = typing.get_args(base)
        check(value in choices, key, value, f"must be one of {list(choices)}")
        return value
    if origin is tuple:
        item_tp = typing.get_args(base)[0]
        items = value if isinstance(value, (list, tuple)) else [value]
        return tuple(coerce(key, v, item_tp) for v in items)
    if base is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        check(isinstance(value, bool), key, value, "must be true or false")
        return value
    if base is int:
        if isinstance(value, str):
            try:
                value = int(float(value)) if "e" in value.lower() else int(value)
            except ValueError:
                raise ConfigError(f"{key}={value!r}: must be an integer") from None
        check(isinstance(value, int) and not isinstance(value, bool), key, value,
              "must be an integer")
        return value
    if base is float:
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{key}={value!r}: must be a number") from None
        check(isinstance(value, (int, float)) and not isinstance(value, bool), key, value,
              "must be a number")
        return float(value)
    if base is str:
        check(isinstance(value, str), key, value, "must be a string")
        return value
    raise TypeError(f"unsupported config field type {tp!r} for {key}")


def from_mapping(cls: type, data: Mapping[str, Any] | None, *, where: str) -> Any:
    """Build ``cls`` from a mapping, refusing unknown keys (``where`` prefixes key names)."""
    data = dict(data or {})
    hints = _resolved_types(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ConfigError(
            f"unknown key {where}.{unknown[0]!s}; known keys of {where}: {', '.join(names)}"
        )
    kwargs = {k: coerce(f"{where}.{k}", v, hints[k]) for k, v in data.items()}
    return cls(**kwargs)


def flag_name(section: str, field: dataclasses.Field) -> str:
    """``--chameleon-<section>-<field>``; a field named ``enabled`` is ``--chameleon-<section>``."""
    if "flag" in field.metadata:
        return field.metadata["flag"]
    if field.name == "enabled":
        return f"--chameleon-{section.replace('_', '-')}"
    return f"--chameleon-{section.replace('_', '-')}-{field.name.replace('_', '-')}"


def dest_name(section: str, field: dataclasses.Field) -> str:
    return f"chameleon__{section}__{field.name}"


def add_flags(parser: argparse.ArgumentParser | Any, section: str, cls: type) -> None:
    """Add one flag per field; values default to SUPPRESS so only given flags are seen."""
    hints = _resolved_types(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        base, _ = _unwrap_optional(hints[f.name])
        kw: dict[str, Any] = {
            "dest": dest_name(section, f),
            "default": argparse.SUPPRESS,
            "help": f"{docs.get(f.name, '')} (default: {_default_repr(f)})",
        }
        origin = typing.get_origin(base)
        if base is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif origin is tuple:
            kw["action"] = "append"
            kw["metavar"] = "VALUE"
        elif origin is Literal:
            kw["choices"] = list(typing.get_args(base))
        else:
            kw["metavar"] = base.__name__.upper()
        parser.add_argument(flag_name(section, f), **kw)


def _default_repr(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return repr(f.default_factory())  # type: ignore[misc]
    return "required"


def cli_overrides(namespace: argparse.Namespace, section: str, cls: type) -> dict[str, Any]:
    """The fields of ``cls`` given explicitly on the command line (raw, uncoerced)."""
    out = {}
    for f in dataclasses.fields(cls):
        dest = dest_name(section, f)
        if hasattr(namespace, dest):
            out[f.name] = getattr(namespace, dest)
    return out


def to_dict(obj: Any) -> dict[str, Any]:
    """Plain-data view of a config (tuples become lists) for YAML/JSON output."""
    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        return v
    return plain(obj)
