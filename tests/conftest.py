from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from extproc_lab.engines import EngineGroup

sys.path.insert(0, str(Path(__file__).parent))

from gateway_stack import Stack

MODEL = "sim-llama"


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """A test that runs a CLI in-process (setup_logging) under capsys leaves a handler on a stream that
    pytest closes: later tests' log lines would fail to print. Put the root logger back after each."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


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


# -- test tiers ---------------------------------------------------------------------------------------
# The fast tier (`pytest -m "not integration"`, ~2-3 minutes: the edit-test loop) runs unit and
# in-process tests only; `integration` marks every test that starts Envoy, redis-server or a service
# process (the full suite, CI, runs both). A test is integration when it carries the envoy, slow or
# wheel marker, uses one of the fixtures below, or is marked by hand. Starting one of those processes
# from any other test (or from a fixture it sets up) raises, in every run, so the marks stay true.
INTEGRATION_FIXTURES = frozenset(
    {"make_stack", "redis_server", "harness", "stack", "setup", "gateway", "sentinel", "cluster"}
)
INTEGRATION_MARKERS = ("envoy", "slow", "wheel")
SERVER_PROGRAMS = frozenset({"envoy", "redis-server"})
_current: list[pytest.Item] = []  # the test being set up, run or torn down


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & INTEGRATION_FIXTURES or any(item.get_closest_marker(m) for m in INTEGRATION_MARKERS):
            item.add_marker(pytest.mark.integration)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    _current[:] = [item]


def _starts_a_server(args: Any) -> str | None:
    argv = [args] if isinstance(args, str | bytes | os.PathLike) else list(args)
    if not argv:
        return None
    program = os.path.basename(os.fsdecode(argv[0]))
    if program in SERVER_PROGRAMS:
        return program
    words = [os.fsdecode(a) for a in argv[1:4] if isinstance(a, str | bytes | os.PathLike)]
    if "extproc.cli" in words or program == "llm-extproc":
        return "an llm-extproc process"
    return None


_real_popen_init = subprocess.Popen.__init__


def _guarded_popen_init(self: subprocess.Popen[Any], args: Any, *rest: Any, **kw: Any) -> None:
    what = _starts_a_server(args)
    item = _current[0] if _current else None
    if what is not None and item is not None and not item.get_closest_marker("integration"):
        raise RuntimeError(f"{item.nodeid} starts {what}: mark it @pytest.mark.integration (conftest.py)")
    _real_popen_init(self, args, *rest, **kw)


subprocess.Popen.__init__ = _guarded_popen_init  # type: ignore[method-assign]
