"""The wire: the gRPC schema (`wire/proto/pdserve.proto`, loaded at run time), the options of every
gRPC server and channel, and the conversions between schema messages and engine objects.
Router, both worker kinds and deploy import it; it imports `engine` only for the types it
converts, and `kvtransfer.status` (torch-free) for the KV dtype's description. Who may call a
worker (the cluster secret, mutual TLS) is `wire.cluster_auth`."""
from wire.schema import (GRPC_OPTIONS, cache_salt_from_wire, cache_salt_to_wire, load, messages, sampling_from_wire,
                         sampling_to_wire, services)

__all__ = ["GRPC_OPTIONS", "cache_salt_from_wire", "cache_salt_to_wire", "load", "messages", "sampling_from_wire",
           "sampling_to_wire", "services"]
