"""Subcommands of the ``chameleon`` tool; each module has ``add_parser`` and ``run``."""
