"""README.md's two commands are the ones CI and users run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_readme_starts_with_demo_then_tests() -> None:
    demo, tests = readme_commands()[:2]
    assert demo.endswith("llm-extproc demo")
    assert tests.endswith("python -m pytest")


def test_ci_runs_the_readme_test_command() -> None:
    steps = readme_commands()[1].split(" && ")
    ci = (ROOT / ".ci" / "run").read_text()
    system = [s for s in steps if s.startswith("sudo apt-get")]
    python_steps = [s for s in steps if not s.startswith("sudo ")]
    # The same system package in both (CI runs as root, without sudo, and only installs if missing).
    assert any(s.endswith("install -y redis-server") for s in system)
    assert "missing+=(redis-server)" in ci
    assert 'apt-get install -y -qq --no-install-recommends "${missing[@]}"' in ci
    # The Python part verbatim.
    assert " && ".join(python_steps[:-1]) in ci
    assert python_steps[-1] in ci
    assert "-eq 5" in ci  # "no tests collected" must fail CI
