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


def own_servers_block() -> list[str]:
    """The "use it in front of your own model servers" commands, comments stripped, continuations joined."""
    block = next(
        b
        for b in re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text(), re.S)
        if "llm-extproc init" in b
    )
    joined = block.replace("\\\n", " ")
    return [line.split("  #")[0].strip() for line in joined.splitlines() if line.strip()]


def test_own_servers_block_backgrounds_the_servers_and_waits_before_curl() -> None:
    import shlex

    from extproc.cli import build_parser
    from extproc.settings import shipped_configs

    lines = own_servers_block()
    long_running = [
        line
        for line in lines
        if line.startswith(("llm-extproc sim", "llm-extproc serve", "llm-extproc publish", "envoy "))
    ]
    assert len(long_running) == 4  # engines, service, Envoy, publisher: all started
    assert all(line.endswith("&") for line in long_running), long_running
    doctor = next(i for i, line in enumerate(lines) if line.startswith("llm-extproc doctor"))
    curl = next(i for i, line in enumerate(lines) if line.startswith("curl "))
    assert max(lines.index(line) for line in long_running) < doctor < curl
    parsed = {}
    for line in lines:
        if line.startswith("llm-extproc "):
            argv = shlex.split(line.removesuffix("&"))[1:]
            parsed[argv[0]] = build_parser().parse_args(argv)
    assert parsed["doctor"].wait > 0 and parsed["doctor"].envoy_admin == parsed["publish"].envoy_admin
    init_dir = parsed["init"].dir
    assert parsed["serve"].config == parsed["doctor"].config == f"{init_dir}/llm-extproc.yaml"
    # The simulated engines listen where the written envoy.yaml's GPU clusters point.
    import yaml

    envoy = yaml.safe_load((shipped_configs() / "envoy.yaml").read_text())
    gpu_ports = sorted(
        e["endpoint"]["address"]["socket_address"]["port_value"]
        for c in envoy["static_resources"]["clusters"]
        if c["name"].startswith("gpu-")
        for group in c["load_assignment"]["endpoints"]
        for e in group["lb_endpoints"]
    )
    sim = parsed["sim"]
    assert gpu_ports == [sim.port + i for i in range(sim.count)]
    assert f'"model":"{sim.model}"' in lines[curl]
