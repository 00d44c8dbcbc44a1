"""kvtransfer: move paged KV cache blocks between processes and hosts.

    receiver = create_receiver("auto", layer_caches, TransferConfig())   # decode worker
    receiver.expect("req-1", dst_block_ids)            # then hand receiver.address to prefill
    sender = create_sender("auto", layer_caches)                         # prefill worker
    handle = sender.send("req-1", address, src_block_ids, dst_block_ids)  # non-blocking
    receiver.poll("req-1").state   # PENDING -> TRANSFERRING -> SUCCESS | FAILED

See kvtransfer/README.md for transports, streaming per layer, failure handling and numbers.
"""
from .addresses import TRANSPORT_CHOICES, TRANSPORT_NAMES, check_transport_choice
from .config import TransferConfig
from .status import (AuthenticationError, LayoutMismatchError, TransferError, TransferState, TransferStatus,
                     TransportUnavailableError)

__all__ = [
    "AuthenticationError", "KVLayout", "KVReceiver", "KVSender", "LayoutMismatchError", "SharedMemory",
    "TRANSPORT_CHOICES", "TRANSPORT_NAMES", "TransferConfig", "TransferError", "TransferHandle", "TransferState",
    "TransferStatus", "TransportUnavailableError", "allocate_shared", "available_transports",
    "check_transport_choice", "create_receiver", "create_sender", "transport_unavailable_reason",
]

# What needs torch or the transports loads on first use, so that a torch-free submodule
# (addresses, config, status) can be imported without them.
_LAZY = {
    "available_transports": "factory", "create_receiver": "factory", "create_sender": "factory",
    "transport_unavailable_reason": "factory", "KVLayout": "layout", "KVReceiver": "receiver",
    "KVSender": "sender", "TransferHandle": "sender", "SharedMemory": "shared_memory",
    "allocate_shared": "shared_memory",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtransfer' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
