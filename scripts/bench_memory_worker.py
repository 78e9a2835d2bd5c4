"""One rank of ``bench_recovery_memory.py``'s jobs: ``pretrain_gpt``, then this rank's
resident high-water mark since the last recovery ended (the new layout's steady state: the
recovery resets the mark as it ends, ``resilience/recovery/memory_peak``), written to
``DIR/<rank>.hwm``.

    chameleon-run ... scripts/bench_memory_worker.py DIR <pretrain_gpt arguments>
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from chameleon_megatron import pretrain_gpt
from chameleon_megatron.resilience.recovery.memory_peak import host_peak_bytes


def main(argv: list[str]) -> int:
    out, rest = Path(argv[0]), argv[1:]
    code = pretrain_gpt.main(rest)
    (out / f"{os.environ['RANK']}.hwm").write_text(str(host_peak_bytes()))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
