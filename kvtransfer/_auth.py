"""The authenticated handshake of a KV connection (`TransferConfig.auth_key` on both sides).

A challenge-response, so the key never crosses the wire and each side proves it to the other:

    sender -> receiver   hello {..., auth: Ns}                Ns: the sender's fresh nonce
    receiver -> sender   hello_auth {nonce: Nr, proof: P("receiver")}
    sender -> receiver   hello_proof {proof: P("sender")}      only once P("receiver") verified
    receiver -> sender   hello_ok | hello_reject               only once P("sender") verified

    P(role) = HMAC-SHA256(key, DOMAIN | role | Ns | Nr | SHA-256(canonical JSON of the hello))

The hello (protocol version, layout, transport fields) is bound into both proofs, the role
label keeps one side's proof from serving as the other's, and fresh nonces on both sides keep
an old exchange from being replayed. A receiver reads nothing but the hello and the proof
before the proof verified; until then a transport hands out nothing that only an authenticated
peer may have (`Channel.after_auth`: shm passes the sender's shared caches only then). This
authenticates the peers, it does not encrypt: someone on the path sees the bytes (the engine's
keyed checksum, engine/kv_connector.py, then catches bytes changed in flight).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import secrets

NONCE_BYTES = 32
_DOMAIN = b"pdserve-kvtransfer-handshake-v1\0"
RECEIVER, SENDER = b"receiver\0", b"sender\0"
# Every refusal's message starts with this (the sender's transfer errors and connect() carry it).
REFUSED = "KV handshake refused"


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def _nonce_bytes(nonce: object) -> bytes | None:
    """The nonce a peer sent, or None when it is not one (absent, malformed)."""
    if not isinstance(nonce, str) or len(nonce) != 2 * NONCE_BYTES:
        return None
    try:
        return bytes.fromhex(nonce)
    except ValueError:
        return None


def is_nonce(nonce: object) -> bool:
    return _nonce_bytes(nonce) is not None


def proof(key: bytes, role: bytes, sender_nonce: str, receiver_nonce: str, hello: dict) -> str:
    """P(role) above (hex). Both nonces must have passed `is_nonce`."""
    transcript = hashlib.sha256(json.dumps(hello, sort_keys=True, separators=(",", ":")).encode()).digest()
    message = b"".join((_DOMAIN, role, _nonce_bytes(sender_nonce), _nonce_bytes(receiver_nonce), transcript))
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def verify(expected: str, given: object) -> bool:
    """Whether a peer's proof equals the expected one (constant time)."""
    return isinstance(given, str) and given.isascii() and hmac.compare_digest(expected, given)
