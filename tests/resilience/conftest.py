"""The resilience tests' shared helpers (``dc_helpers``, ``rt_support``, ``e2e_support``,
``hetero_support``) are importable from every sub-folder; every test has a heartbeat
folder."""

import sys
from pathlib import Path

import pytest

from chameleon_megatron.resilience.store.env import BEAT_DIR_ENV

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def beat_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where a failure detector made in the test's process beats (in a job: the folder its
    agent gives it; an agent the test starts sets its own)."""
    beats = tmp_path / "beats"
    beats.mkdir()
    monkeypatch.setenv(BEAT_DIR_ENV, str(beats))
    return beats
