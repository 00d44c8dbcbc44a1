"""Control messages exchanged on every connection, whatever the transport.

sender -> receiver   hello {layout}                 first message on a connection
receiver -> sender   hello_ok {} | hello_reject {error}
sender -> receiver   begin {uid, request_id, dst_block_ids, layers, skip_blocks, epoch}
sender -> receiver   data {uid, request_id, layers, block_start, block_end, nbytes} + payload
receiver -> sender   ack {uid, layers, block_start, block_end}
receiver -> sender   error {uid, error}             the receiver dropped or refused a transfer
sender -> receiver   abort {uid, error}             the sender gave up on a transfer
both                 ping {}                        heartbeat while the connection is idle
"""
from __future__ import annotations

HELLO = "hello"
HELLO_OK = "hello_ok"
HELLO_REJECT = "hello_reject"
BEGIN = "begin"
DATA = "data"
ACK = "ack"
ERROR = "error"
ABORT = "abort"
PING = "ping"

PROTOCOL_VERSION = 2  # 2: layouts carry layer_windows, begin carries skip_blocks
