"""Shared test helpers (``dist_utils``) are importable from every test folder; the
``busy_cores`` fixture runs a test with every core taken."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def busy_cores():
    """One busy-looping process per core for the test's duration: distributed code must
    survive a machine with every core taken (slowness is not failure)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
             for _ in range(os.cpu_count() or 1)]
    try:
        yield len(procs)
    finally:
        for p in procs:
            p.kill()
            p.wait()
