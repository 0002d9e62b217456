"""The checked-in snapshot_pb2 code matches protos/ (protos/generate.py --check), and the check can fail."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
GENERATE = ROOT / "protos" / "generate.py"
OUTPUTS = ("snapshot_pb2.py", "snapshot_pb2.pyi")


def _load_generate() -> ModuleType:
    spec = importlib.util.spec_from_file_location("protos_generate_under_test", GENERATE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _copy_outputs(dst: Path) -> None:
    for name in OUTPUTS:
        shutil.copyfile(ROOT / "extproc" / "fleet" / name, dst / name)


def test_generated_code_is_current() -> None:
    proc = subprocess.run(
        [sys.executable, str(GENERATE), "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr


def test_check_passes_on_identical_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = _load_generate()
    _copy_outputs(tmp_path)
    monkeypatch.setattr(gen, "TARGET", tmp_path)
    monkeypatch.setattr(sys, "argv", ["generate.py", "--check"])
    assert gen.main() == 0


@pytest.mark.parametrize("changed", OUTPUTS)
def test_check_fails_on_drift(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], changed: str
) -> None:
    gen = _load_generate()
    _copy_outputs(tmp_path)
    target = tmp_path / changed
    target.write_bytes(target.read_bytes() + b"\n# hand edit\n")
    monkeypatch.setattr(gen, "TARGET", tmp_path)
    monkeypatch.setattr(sys, "argv", ["generate.py", "--check"])
    assert gen.main() == 1
    assert changed in capsys.readouterr().err
    # --check never writes: the drifted copy is left as it was.
    assert target.read_bytes().endswith(b"# hand edit\n")


def test_generate_writes_identical_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = _load_generate()
    monkeypatch.setattr(gen, "TARGET", tmp_path)
    monkeypatch.setattr(sys, "argv", ["generate.py"])
    assert gen.main() == 0
    for name in OUTPUTS:
        assert (tmp_path / name).read_bytes() == (ROOT / "extproc" / "fleet" / name).read_bytes()
