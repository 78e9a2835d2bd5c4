"""Shared by the Megatron-LM patch tests: patches/apply.py loaded as a module."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("chameleon_patch_apply",
                                               REPO / "patches" / "apply.py")
patch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(patch)


def script_bytes(checkout: Path) -> bytes:
    return (checkout / "pretrain_gpt.py").read_bytes()
