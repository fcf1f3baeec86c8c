"""Regenerates the protobuf and gRPC stubs from mesh.proto: `python -m stratamesh.fleet.wire.gen [OUT_DIR]`."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = HERE / "mesh.proto"
STUBS = ("mesh_pb2.py", "mesh_pb2.pyi", "mesh_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Writes the stubs into out_dir; the generated imports name stratamesh.fleet.wire."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        # Lay the proto out under its import path so protoc writes package-qualified imports.
        package_dir = Path(tmp, "stratamesh", "fleet", "wire")
        package_dir.mkdir(parents=True)
        shutil.copy(PROTO, package_dir / PROTO.name)
        rc = protoc.main([
            "grpc_tools.protoc", f"-I{tmp}", f"--python_out={tmp}", f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}", str(package_dir / PROTO.name),
        ])
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}")
        out_dir.mkdir(parents=True, exist_ok=True)
        return [Path(shutil.copy(package_dir / name, out_dir / name)) for name in STUBS]


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE):
        print(path)
