"""xlaserve's gRPC service (`xlaserve.v1.Generation`, defined in `xlaserve/v1/xlaserve.proto`).

`serving.grpc.stubs` loads the generated stubs (building them first if needed, see
`build_stubs`); `serving.grpc.server.start_grpc_server` serves an AsyncEngine.
"""
