from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc.lab.engines import EngineGroup

sys.path.insert(0, str(Path(__file__).parent))

MODEL = "sim-llama"


@pytest.fixture(scope="module")
def engines() -> Iterator[EngineGroup]:
    """Two simulated engines shared by a test module (tests reset their counters and speed)."""
    group = EngineGroup([0.005, 0.005], MODEL)
    yield group
    group.close()
