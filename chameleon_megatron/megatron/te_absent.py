"""Let megatron-core's MoE router run without TransformerEngine (CPU, or a GPU without TE).

megatron-core 0.16.x imports ``te_general_gemm`` into ``transformer.moe.moe_utils`` only
when TransformerEngine imports, yet its router reads the name unconditionally (it checks
``te_general_gemm is not None``), so without TE the first MoE forward raises NameError.
``TeAbsentPatch.apply()`` defines the name as None in that module when it is missing, which
selects megatron's own torch path; ``remove()`` deletes it again. Idempotent; the version
check is shared with the CPU platform patches.
"""

from __future__ import annotations

from chameleon_megatron.megatron.platform import check_megatron_version


class TeAbsentPatch:
    def __init__(self) -> None:
        self._module = None

    def apply(self) -> bool:
        """Define the missing name; returns whether a patch is in effect."""
        if self._module is not None:
            return True
        check_megatron_version()
        from megatron.core.transformer.moe import moe_utils

        if hasattr(moe_utils, "te_general_gemm"):
            return False
        moe_utils.te_general_gemm = None
        self._module = moe_utils
        return True

    def remove(self) -> None:
        if self._module is not None:
            del self._module.te_general_gemm
            self._module = None
