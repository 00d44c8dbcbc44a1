"""Control messages exchanged on every connection, whatever the transport.

sender -> receiver   hello {version, layout, auth?}     first message on a connection
receiver -> sender   hello_auth {nonce, proof}          only with an auth_key (kvtransfer/_auth.py)
sender -> receiver   hello_proof {proof}                only with an auth_key
receiver -> sender   hello_ok {} | hello_reject {error, layout_mismatch, auth_refused}
sender -> receiver   begin {uid, request_id, dst_block_ids, layers, skip_blocks, epoch}
sender -> receiver   data {uid, request_id, layers, block_start, block_end, nbytes} + payload
receiver -> sender   ack {uid, layers, block_start, block_end}
receiver -> sender   error {uid, error}             the receiver dropped or refused a transfer
sender -> receiver   abort {uid, error}             the sender gave up on a transfer
both                 ping {}                        heartbeat while the connection is idle
"""
from __future__ import annotations

HELLO = "hello"
HELLO_AUTH = "hello_auth"
HELLO_PROOF = "hello_proof"
HELLO_OK = "hello_ok"
HELLO_REJECT = "hello_reject"
BEGIN = "begin"
DATA = "data"
ACK = "ack"
ERROR = "error"
ABORT = "abort"
PING = "ping"

# 2: layouts carry layer_windows, begin carries skip_blocks; 3: the authenticated handshake
PROTOCOL_VERSION = 3
