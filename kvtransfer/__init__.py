"""kvtransfer: move paged KV cache blocks between processes and hosts.

    receiver = create_receiver("auto", layer_caches, TransferConfig())   # decode worker
    receiver.expect("req-1", dst_block_ids)            # then hand receiver.address to prefill
    sender = create_sender("auto", layer_caches)                         # prefill worker
    handle = sender.send("req-1", address, src_block_ids, dst_block_ids)  # non-blocking
    receiver.poll("req-1").state   # PENDING -> TRANSFERRING -> SUCCESS | FAILED

See kvtransfer/README.md for transports, streaming per layer, failure handling and numbers.
"""
from .config import TransferConfig
from .factory import (TRANSPORT_NAMES, available_transports, create_receiver, create_sender,
                      transport_unavailable_reason)
from .layout import KVLayout
from .receiver import KVReceiver
from .sender import KVSender, TransferHandle
from .shared_memory import SharedMemory, allocate_shared
from .status import (LayoutMismatchError, TransferError, TransferState, TransferStatus,
                     TransportUnavailableError)

__all__ = [
    "KVLayout", "KVReceiver", "KVSender", "LayoutMismatchError", "SharedMemory", "TRANSPORT_NAMES",
    "TransferConfig", "TransferError", "TransferHandle", "TransferState", "TransferStatus",
    "TransportUnavailableError", "allocate_shared", "available_transports", "create_receiver", "create_sender",
    "transport_unavailable_reason",
]
