"""The generated stubs of `xlaserve/v1/xlaserve.proto`, built on first import if missing.

Importing this module runs `build_stubs.build_stubs()`, which returns at once when the stubs
are current and otherwise regenerates them (see `build_stubs` for why the build works this way).
Everything else imports the messages and service classes from here, never from `_generated`.
"""

from __future__ import annotations

from serving.grpc.build_stubs import build_stubs

build_stubs()

from serving.grpc._generated.xlaserve.v1 import (  # noqa: E402  (generated just above)
    xlaserve_pb2 as pb2,
)
from serving.grpc._generated.xlaserve.v1 import (  # noqa: E402
    xlaserve_pb2_grpc as pb2_grpc,
)

SERVICE_NAME = pb2.DESCRIPTOR.services_by_name["Generation"].full_name  # "xlaserve.v1.Generation"

__all__ = ["SERVICE_NAME", "pb2", "pb2_grpc"]
