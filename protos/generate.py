"""Regenerate the Python code for the snapshot schema.

    python protos/generate.py            # writes extproc/fleet/snapshot_pb2.py(i)
    python protos/generate.py --check    # exit 1 if the checked-in code differs (drift)

Uses grpcio-tools (pinned in the `dev` extra, so the output is byte-for-byte repeatable).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]
PROTO = "llm_extproc/fleet/v1/snapshot.proto"
TARGET = ROOT / "extproc" / "fleet"
OUTPUTS = ("snapshot_pb2.py", "snapshot_pb2.pyi")


def generate(out_dir: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main(
            ["grpc_tools.protoc", f"-I{ROOT / 'protos'}", f"--python_out={tmp}", f"--pyi_out={tmp}", PROTO]
        )
        if rc != 0:
            raise SystemExit(f"protoc failed with {rc}")
        for name in OUTPUTS:
            shutil.copyfile(Path(tmp) / Path(PROTO).parent / name, out_dir / name)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    if not args.check:
        generate(TARGET)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = [n for n in OUTPUTS if (Path(tmp) / n).read_bytes() != (TARGET / n).read_bytes()]
    if stale:
        print(f"generated code is stale: {stale}; run python protos/generate.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
