"""Let megatron-core run without a working TransformerEngine (CPU, or a GPU without TE).

Two gaps in megatron-core's own guards, both closed by ``TeAbsentPatch.apply()`` and undone
by ``remove()`` (idempotent; both check what they patch, not a version):

* TE that is installed but cannot load (its meta package alone, or shared libraries that do
  not match the CUDA found) raises RuntimeError or OSError at import, and megatron catches
  only ImportError. When TE does not import cleanly it is hidden (``sys.modules`` entries of
  None make every later import raise ImportError), so megatron takes its own paths.
* megatron-core (0.16.x at least) imports ``te_general_gemm`` into
  ``transformer.moe.moe_utils`` only when TransformerEngine imports, yet its router reads
  the name unconditionally (it checks ``te_general_gemm is not None``), so without TE the
  first MoE forward raises NameError.
  The name is defined as None when it is missing, which selects megatron's torch path.
"""

from __future__ import annotations

import importlib.util
import logging
import sys

logger = logging.getLogger(__name__)

_TE_MODULES = ("transformer_engine", "transformer_engine.pytorch")


def te_usable() -> bool:
    """Whether TransformerEngine imports, its PyTorch part and libraries included."""
    try:
        import transformer_engine  # noqa: F401
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return False
    except (RuntimeError, OSError) as exc:  # installed, but its libraries cannot load
        logger.info("TransformerEngine is installed but unusable (%s)", exc)
        return False
    return True


class TeAbsentPatch:
    def __init__(self) -> None:
        self._module = None
        self._hidden: dict[str, object] | None = None

    def apply(self) -> bool:
        """Hide a broken TE and define the missing name; returns whether a patch is in
        effect. Call it before megatron-core is imported."""
        if self._module is not None or self._hidden is not None:
            return True
        installed = sys.modules.get(_TE_MODULES[0]) is not None or \
            importlib.util.find_spec(_TE_MODULES[0]) is not None
        if installed and not te_usable():
            self._hidden = {m: sys.modules.get(m) for m in _TE_MODULES}
            for m in _TE_MODULES:
                sys.modules[m] = None  # type: ignore[assignment]
        from megatron.core.transformer.moe import moe_utils

        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
            self._module = moe_utils
        return self._module is not None or self._hidden is not None

    def remove(self) -> None:
        if self._module is not None:
            del self._module.te_general_gemm
            self._module = None
        if self._hidden is not None:
            for name, module in self._hidden.items():
                if module is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = module
            self._hidden = None
