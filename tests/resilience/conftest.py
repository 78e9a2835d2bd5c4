"""The resilience tests' shared helpers (``dc_helpers``, ``rt_support``, ``e2e_support``,
``hetero_support``) are importable from every sub-folder."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
