from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from gateway_stack import Engines


@pytest.fixture(scope="module")
def engines() -> Iterator[Engines]:
    e = Engines(2)
    yield e
    e.close()
