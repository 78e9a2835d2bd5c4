"""The ``chameleon`` command-line tool: planning, simulation and reports without a cluster.

Each subcommand lives in ``chameleon_megatron.commands.<name>`` and exposes
``add_parser(subparsers)`` (returning its parser) and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from chameleon_megatron.errors import fail, user_error

SUBCOMMANDS = ("plan", "profile", "simulate", "report")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chameleon", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"chameleon_megatron.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"chameleon_megatron.commands.{name}":
                raise
            continue
        module.add_parser(sub).set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args._run(args) or 0)
    except Exception as exc:  # noqa: BLE001 - a user's mistake is one line; a bug is not
        message = user_error(exc)
        if message is None or args.verbose:
            raise
        raise fail(f"chameleon {args.command}", message) from None


if __name__ == "__main__":
    sys.exit(main())
