from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from extproc.lab.engines import EngineGroup

sys.path.insert(0, str(Path(__file__).parent))

from gateway_stack import Stack

MODEL = "sim-llama"


@pytest.fixture(scope="module")
def engines() -> Iterator[EngineGroup]:
    """Two simulated engines shared by a test module (tests reset their counters and speed)."""
    group = EngineGroup([0.005, 0.005], MODEL)
    yield group
    group.close()


@pytest.fixture
def make_stack(engines: EngineGroup, tmp_path: Path) -> Iterator[Callable[..., Stack]]:
    """Start real Envoy + service stacks over the module's engines (reset, fast); stopped after."""
    started: list[Stack] = []
    engines.reset()
    for e in engines.engines:
        e.token_delay_s = 0.005

    def make(**kw: Any) -> Stack:
        s = Stack(engines, tmp_path / f"stack{len(started)}", **kw)
        started.append(s.start())
        return s

    yield make
    for s in started:
        s.stop()
