"""Generates the Python stubs of xlaserve's .proto files with `grpc_tools.protoc`.

Where the stubs come from, and why: they are build output, never committed and never edited by
hand. `make serve` and `make test` run this module right after `pip install -e .`, and
`serving.grpc.stubs` runs it again on import whenever the stubs are missing or older than a
.proto, so a plain `pip install -e .` (or an edited .proto) also just works. A setuptools build
hook was the alternative; it runs only when pip builds, not when the .proto changes afterwards.

Layout: `xlaserve/v1/xlaserve.proto` (relative to this folder) generates
`_generated/xlaserve/v1/xlaserve_pb2.py`, `.pyi` and `xlaserve_pb2_grpc.py`. `_generated/` is
gitignored. protoc writes the `_pb2_grpc` module's import of its `_pb2` module as a top-level
import (`from xlaserve.v1 import ...`); this build makes it package-relative, so the stubs import
as `serving.grpc._generated.xlaserve.v1` without touching `sys.path`, while the descriptors keep
their canonical file name `xlaserve/v1/xlaserve.proto` (what reflection clients see).

Run: `python -m serving.grpc.build_stubs [--force]`.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
OUT_DIR = PROTO_ROOT / "_generated"
PROTOS = ("xlaserve/v1/xlaserve.proto",)


class StubBuildError(RuntimeError):
    """protoc rejected a .proto, or its output could not be written."""


def generated_files(proto: str) -> list[Path]:
    stem = OUT_DIR / proto.removesuffix(".proto")
    return [Path(f"{stem}{suffix}") for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]


def stubs_are_current() -> bool:
    """True if every stub exists and is newer than its .proto."""
    for proto in PROTOS:
        source_time = (PROTO_ROOT / proto).stat().st_mtime
        for path in generated_files(proto):
            if not path.exists() or path.stat().st_mtime < source_time:
                return False
    return True


def build_stubs(*, force: bool = False) -> bool:
    """Generates the stubs unless they are current; returns whether it generated them.

    protoc writes into a scratch folder first and the files are then moved into place one by
    one, so a process importing the stubs meanwhile never sees a half-written file.
    """
    if not force and stubs_are_current():
        return False
    OUT_DIR.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=OUT_DIR, prefix=".build-") as scratch:
        _run_protoc(Path(scratch))
        for proto in PROTOS:
            _make_imports_relative(Path(scratch), proto)
        _add_package_markers(Path(scratch))
        _move_into_place(Path(scratch))
    return True


def _run_protoc(out: Path) -> None:
    from grpc_tools import protoc  # the build tool; only needed when the stubs are (re)built

    well_known = resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"--proto_path={PROTO_ROOT}",
        f"--proto_path={well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *PROTOS,
    ]
    status = protoc.main(args)
    if status != 0:
        raise StubBuildError(f"protoc failed ({status}) on {', '.join(PROTOS)}; see its message")


def _make_imports_relative(out: Path, proto: str) -> None:
    """`from xlaserve.v1 import xlaserve_pb2` -> `from . import xlaserve_pb2` in the proto's
    `_pb2_grpc` module: its `_pb2` module is its sibling."""
    grpc_module = out / proto.replace(".proto", "_pb2_grpc.py")
    package = ".".join(Path(proto).parent.parts)
    pattern = re.compile(rf"^from {re.escape(package)} import ", re.MULTILINE)
    grpc_module.write_text(pattern.sub("from . import ", grpc_module.read_text()))


def _add_package_markers(out: Path) -> None:
    for folder in [out, *(p for p in out.rglob("*") if p.is_dir())]:
        (folder / "__init__.py").touch()


def _move_into_place(scratch: Path) -> None:
    for source in sorted(scratch.rglob("*")):
        if source.is_file():
            target = OUT_DIR / source.relative_to(scratch)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(source, target)


def clean() -> None:
    shutil.rmtree(OUT_DIR, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild even if current")
    built = build_stubs(force=parser.parse_args(argv).force)
    print(f"gRPC stubs {'generated' if built else 'up to date'} in {OUT_DIR}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
