"""The authenticated handshake (`TransferConfig.auth_key`), over every transport as the conformance
suite runs them: the same key on both sides transfers as before; a sender without the key, or with
another one, is refused by a keyed receiver (nothing written, the refusal counted); a keyed sender
refuses a receiver that does not prove the key. Then raw tcp clients that forge the handshake, and
an impostor receiver."""
from __future__ import annotations

import json
import os
import random
import socket
import threading

import pytest

from kvtransfer import AuthenticationError, TransferConfig, TransferState, create_receiver, create_sender
from kvtransfer import _auth, _protocol as proto
from kvtransfer.transports._stream import encode_frame

from ..helpers import eventually
from .peer import SENTINEL, CacheSpec, PeerProcess, is_sentinel, same_bytes, sentinel_caches, source_caches
from .variants import options, transport, variant  # noqa: F401 (fixtures: every transport variant)

SPEC = CacheSpec()
SEED = 4321
TIMEOUT_S = 3.0
GUARD_S = 60.0
KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # starts processes


def _config(options, key):
    return TransferConfig(timeout_s=TIMEOUT_S, auth_key=key, **options)


def _receiver(transport, options, key):
    caches = sentinel_caches(SPEC)
    receiver = create_receiver(transport, caches, _config(options, key))
    receiver.caches = caches
    return receiver


@pytest.fixture(scope="module")
def shared_keyed_receiver(transport, options):
    receiver = _receiver(transport, options, KEY)
    yield receiver
    receiver.close()


@pytest.fixture
def keyed_receiver(shared_keyed_receiver):
    """The module's keyed receiver (set-up is slow), its caches reset."""
    for cache in shared_keyed_receiver.caches:
        cache.fill_(SENTINEL)
    return shared_keyed_receiver


@pytest.fixture(scope="module")
def keyed_sender_peer(variant, transport, options):
    extra = {"shared_source": True} if variant == "shm-mapped" else {}
    peer = PeerProcess("sender", transport, SPEC, SEED, timeout_s=TIMEOUT_S, auth_key=KEY, **options, **extra)
    yield peer
    peer.close()


def assert_untouched(receiver, dst_ids):
    for layer in range(SPEC.num_layers):
        for dst in dst_ids:
            assert is_sentinel(receiver.caches[layer][dst]), (layer, dst)


def test_the_same_key_on_both_sides_transfers_byte_exact(keyed_receiver, keyed_sender_peer, variant, transport):
    receiver = keyed_receiver
    rng = random.Random(1)
    src_ids, dst_ids = rng.sample(range(SPEC.num_blocks), 12), rng.sample(range(SPEC.num_blocks), 12)
    refused = receiver.refused_connections
    receiver.expect("keyed", dst_ids)
    keyed_sender_peer.call("send", "keyed", receiver.address, src_ids, dst_ids)
    received = receiver.wait("keyed", GUARD_S)
    sent = keyed_sender_peer.call("wait", "keyed", GUARD_S)
    assert received.state is TransferState.SUCCESS, received.error
    assert sent.state is TransferState.SUCCESS and not sent.auth_refused, sent.error
    source = source_caches(SPEC, SEED)
    for layer in range(SPEC.num_layers):
        for src, dst in zip(src_ids, dst_ids):
            assert same_bytes(receiver.caches[layer][dst], source[layer][src]), (layer, src, dst)
    assert_untouched(receiver, [block for block in range(SPEC.num_blocks) if block not in dst_ids])
    assert receiver.refused_connections == refused
    if transport == "shm":  # shm hands the shared caches over only after the auth: still mapped
        from kvtransfer.transports import _cma
        expected = {"shm": "ring", "shm-cma": "cma" if _cma.available() else "ring", "shm-mapped": "mapped"}[variant]
        assert expected in {connection.channel.mode for connection in receiver._connections}
    keyed_sender_peer.call("cancel", "keyed")
    receiver.cancel("keyed")


@pytest.mark.parametrize("sender_key, why", [(None, "it has no auth_key"),
                                             (OTHER_KEY, "did not prove the KV auth key")], ids=["no key", "another key"])
def test_a_sender_without_the_key_or_with_another_is_refused(keyed_receiver, transport, options, sender_key, why):
    receiver = keyed_receiver
    dst_ids = [3, 9, 27]
    refused = receiver.refused_connections
    sender = create_sender(transport, source_caches(SPEC, 0), _config(options, sender_key))
    try:
        with pytest.raises(AuthenticationError, match=_auth.REFUSED) as raised:
            sender.connect(receiver.address)
        assert why in str(raised.value)
        receiver.expect("intruder", dst_ids)
        sender.send("intruder", receiver.address, [1, 2, 3], dst_ids)
        status = sender.wait("intruder", GUARD_S)
        assert status.state is TransferState.FAILED and status.auth_refused
        assert _auth.REFUSED in status.error and why in status.error
        assert eventually(lambda: receiver.refused_connections == refused + 2), receiver.refused_connections
        assert receiver.poll("intruder").state is TransferState.PENDING
        assert_untouched(receiver, dst_ids)
        assert not receiver._connections or all(c.transfers == {} for c in receiver._connections)
    finally:
        sender.close()
        receiver.cancel("intruder")


def test_a_keyed_sender_refuses_a_receiver_without_the_key(transport, options):
    receiver = _receiver(transport, options, None)
    sender = create_sender(transport, source_caches(SPEC, 0), _config(options, KEY))
    try:
        with pytest.raises(AuthenticationError, match="this receiver has none"):
            sender.connect(receiver.address)
        receiver.expect("unkeyed", [4, 5])
        sender.send("unkeyed", receiver.address, [1, 2], [4, 5])
        status = sender.wait("unkeyed", GUARD_S)
        assert status.state is TransferState.FAILED and status.auth_refused and _auth.REFUSED in status.error
        assert receiver.refused_connections == 2
        assert receiver.poll("unkeyed").state is TransferState.PENDING
        assert_untouched(receiver, [4, 5])
    finally:
        sender.close()
        receiver.close()


# ---- forged handshakes over raw tcp ---------------------------------------------------------------

def _tcp_endpoint(receiver) -> tuple[str, int]:
    [endpoint] = [part for part in receiver.address.split(",") if part.startswith("tcp://")]
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


def _read_frame(sock: socket.socket) -> dict:
    def exact(count: int) -> bytes:
        data = b""
        while len(data) < count:
            chunk = sock.recv(count - len(data))
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
        return data
    header = exact(8)
    assert header[:4] == b"PDKV"
    return json.loads(exact(int.from_bytes(header[4:], "big")))


def _disconnected(sock: socket.socket) -> bool:
    """Whether the receiver closed the connection (EOF or reset) within the guard time."""
    sock.settimeout(GUARD_S)
    try:
        while sock.recv(65536):
            pass
    except ConnectionError:
        pass  # a reset: the receiver closed with our forged bytes unread
    return True


def _forged_writes(request_id: str, dst_ids: list[int]) -> bytes:
    """A begin for an expected transfer and one data message of layer 0's first block, 0x55 bytes."""
    begin = {"type": proto.BEGIN, "uid": "forged", "request_id": request_id, "dst_block_ids": dst_ids,
             "layers": list(range(SPEC.num_layers)), "skip_blocks": [0] * SPEC.num_layers, "epoch": 7}
    data = {"type": proto.DATA, "uid": "forged", "request_id": request_id, "layers": [0],
            "block_start": 0, "block_end": 1, "nbytes": SPEC.chunk_nbytes}
    return encode_frame(begin) + encode_frame(data) + b"\x55" * SPEC.chunk_nbytes + b"\x01"


def _hello(nonce: str | None) -> dict:
    from kvtransfer import KVLayout
    hello = {"type": proto.HELLO, "version": proto.PROTOCOL_VERSION,
             "layout": KVLayout.from_caches(source_caches(SPEC, 0)).to_wire()}
    return hello if nonce is None else dict(hello, auth=nonce)


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass  # the receiver closed already


@pytest.fixture
def tcp_keyed_receiver():
    receiver = _receiver("tcp", {}, KEY)
    yield receiver
    receiver.close()


@pytest.mark.parametrize("attack", ["no hello", "hello without proof", "forged proof"])
def test_a_raw_client_that_forges_the_handshake_writes_nothing_and_is_disconnected(tcp_keyed_receiver, attack):
    receiver = tcp_keyed_receiver
    dst_ids = [6, 7]
    receiver.expect("victim", dst_ids)
    with socket.create_connection(_tcp_endpoint(receiver), timeout=GUARD_S) as sock:
        if attack == "no hello":  # begin and data straight away
            _send_quietly(sock, _forged_writes("victim", dst_ids))
        elif attack == "hello without proof":  # pipelined: the receiver must not read past the hello
            _send_quietly(sock, encode_frame(_hello(None)) + _forged_writes("victim", dst_ids))
            reply = _read_frame(sock)
            assert reply["type"] == proto.HELLO_REJECT and reply["auth_refused"]
            assert "did not prove the KV auth key" in reply["error"]
        else:
            _send_quietly(sock, encode_frame(_hello(_auth.new_nonce())))
            challenge = _read_frame(sock)
            assert challenge["type"] == proto.HELLO_AUTH and _auth.is_nonce(challenge["nonce"])
            forged = {"type": proto.HELLO_PROOF, "proof": "00" * 32}
            _send_quietly(sock, encode_frame(forged) + _forged_writes("victim", dst_ids))
            reply = _read_frame(sock)
            assert reply["type"] == proto.HELLO_REJECT and reply["auth_refused"]
        assert _disconnected(sock)
    assert eventually(lambda: not receiver._connections)
    assert receiver.refused_connections == (0 if attack == "no hello" else 1)
    assert receiver.poll("victim").state is TransferState.PENDING and receiver.total_bytes_received == 0
    assert_untouched(receiver, dst_ids)
    # the expectation is intact: a sender with the key still delivers it
    with create_sender("tcp", source_caches(SPEC, 5), _config({}, KEY)) as sender:
        sender.send("victim", receiver.address, [10, 11], dst_ids)
        assert receiver.wait("victim", GUARD_S).ok
        assert sender.wait("victim", GUARD_S).ok
    receiver.cancel("victim")


def test_a_keyed_sender_sends_nothing_but_its_hello_to_an_impostor():
    """A tcp listener that answers the hello with hello_ok, as a receiver without the key would if it
    skipped the auth: the sender refuses it, and nothing of its caches went out."""
    listener = socket.create_server(("127.0.0.1", 0))
    received: list[dict] = []

    def impostor():
        conn, _ = listener.accept()
        with conn:
            received.append(_read_frame(conn))
            conn.sendall(encode_frame({"type": proto.HELLO_OK}))
            conn.settimeout(GUARD_S)
            try:
                while data := conn.recv(65536):
                    received.append({"extra_bytes": len(data)})
            except OSError:
                pass

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    with create_sender("tcp", source_caches(SPEC, 0), _config({}, KEY)) as sender:
        sender.send("leak", address, [1, 2], [1, 2])
        status = sender.wait("leak", GUARD_S)
        assert status.state is TransferState.FAILED and status.auth_refused
        assert "did not prove the KV auth key" in status.error
    thread.join(GUARD_S)
    listener.close()
    assert [message["type"] for message in received] == [proto.HELLO] and _auth.is_nonce(received[0]["auth"])


# ---- the pieces -----------------------------------------------------------------------------------

def test_auth_key_is_validated_and_never_shown():
    config = TransferConfig(auth_key=KEY)
    assert "auth_key" not in repr(config) and repr(KEY) not in repr(config)
    for bad, message in ((KEY[:31], "got 31 bytes"), (KEY.hex(), "got str"), (bytearray(KEY), "got bytearray")):
        with pytest.raises(ValueError, match=f"auth_key must be None or 32 bytes, {message}") as raised:
            TransferConfig(auth_key=bad)
        assert KEY.hex() not in str(raised.value)


def test_proofs_bind_the_role_both_nonces_the_hello_and_the_key():
    hello, ns, nr = _hello(_auth.new_nonce()), _auth.new_nonce(), _auth.new_nonce()
    base = _auth.proof(KEY, _auth.RECEIVER, ns, nr, hello)
    assert _auth.verify(base, _auth.proof(KEY, _auth.RECEIVER, ns, nr, json.loads(json.dumps(hello))))
    assert len({base, _auth.proof(KEY, _auth.SENDER, ns, nr, hello), _auth.proof(KEY, _auth.RECEIVER, nr, ns, hello),
                _auth.proof(KEY, _auth.RECEIVER, ns, nr, dict(hello, version=2)),
                _auth.proof(OTHER_KEY, _auth.RECEIVER, ns, nr, hello)}) == 5
    for given in (None, 7, base.upper(), base[:-1], "é" * len(base)):
        assert not _auth.verify(base, given)
    assert not _auth.is_nonce("zz" * _auth.NONCE_BYTES) and not _auth.is_nonce(os.urandom(4).hex())
