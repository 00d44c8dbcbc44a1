"""The gRPC wire schema, loaded at run time from `proto/pdserve.proto`.

There is no generated code in the tree (and no Python package named `proto`, see DESIGN.md):
`grpc.protos_and_services` compiles the one `.proto` on first use. Router and both workers import
this module, so they always agree with the schema file.
"""
from __future__ import annotations

import functools
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent.parent / "proto"
PROTO_FILE = "pdserve.proto"


@functools.lru_cache(maxsize=1)
def load():
    """Returns (messages module, services module) for pdserve.proto."""
    import sys

    import grpc

    if not (PROTO_DIR / PROTO_FILE).exists():
        raise RuntimeError(f"wire schema {PROTO_DIR / PROTO_FILE} is missing from this installation")
    if str(PROTO_DIR) not in sys.path:
        sys.path.append(str(PROTO_DIR))  # grpc_tools resolves the .proto through sys.path
    return grpc.protos_and_services(PROTO_FILE)


def messages():
    return load()[0]


def services():
    return load()[1]
