"""The cluster secret (wire/cluster_auth.py): secret files (private, long enough, hex), what it
derives (the same in every process, one key per purpose), mutual TLS between credentials built
independently (in two processes: their CA certificates differ in their signature bytes), and
everyone else refused: a plaintext client, a client of another secret, a client that trusts the
CA but shows no certificate, a plaintext impostor server.

End to end (slow): a real prefill and decode worker started with `--cluster-secret-file`. A
client with the secret gets Health, Stats and a generation; a plaintext client and a client of
another secret get UNAVAILABLE and the engine sees nothing; a disaggregated request is prefilled
on the prefill worker, over the decode worker's (authenticated) channel to it."""
import logging
import pickle
import random
import subprocess
import sys
from concurrent import futures

import grpc
import pytest

import serving
import wire
from decode_worker.__main__ import parse_args as decode_args
from deploy.cli import build_parser as serve_parser
from deploy.cli import serve_options
from router.__main__ import build_parser as router_parser
from router.__main__ import config_from_args
from tests.helpers import REPO, child_env, wait_until
from tests.workers.harness import kv_outcome, sampling, start_workers, stop_workers
from wire.cluster_auth import (INSECURE, SECRET_BYTES, SECRET_FILE_ENV, ClusterAuth, ca_certificate, ca_private_key,
                               channel_options, derive_key, generate_secret_file, load_secret)

ECHO = "/test.Echo/Echo"


def echo_server(auth: ClusterAuth) -> tuple[grpc.Server, int]:
    """A gRPC server (bytes in, the same bytes out) bound through `auth` on 127.0.0.1."""
    server = grpc.server(futures.ThreadPoolExecutor(2))
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", {"Echo": handler}),))
    port = auth.add_port(server, "127.0.0.1:0")
    server.start()
    return server, port


def echo(channel: grpc.Channel) -> bytes:
    with channel:
        return channel.unary_unary(ECHO)(b"ping", timeout=10)


def refused(channel: grpc.Channel) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as failure:
        echo(channel)
    return failure.value.code()


# ---- the secret file ----------------------------------------------------------------------------

def test_a_generated_secret_file_is_private_random_and_never_overwritten(tmp_path):
    path = generate_secret_file(tmp_path / "secret")
    assert path.stat().st_mode & 0o777 == 0o600
    text = path.read_text()
    assert len(text.strip()) == 2 * SECRET_BYTES and load_secret(path) == bytes.fromhex(text)
    assert load_secret(generate_secret_file(tmp_path / "other")) != load_secret(path)
    with pytest.raises(ValueError, match="already exists"):
        generate_secret_file(path)
    assert path.read_text() == text


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o660], ids=oct)
def test_a_secret_file_open_to_group_or_others_is_refused(tmp_path, mode):
    path = generate_secret_file(tmp_path / "secret")
    path.chmod(mode)
    with pytest.raises(ValueError, match=rf"open to group or others \(mode 0{mode:o}\); `chmod 600 {path}`"):
        load_secret(path)


@pytest.mark.parametrize("text, message", [("", "holds 0 bytes, fewer than 32"),
                                           ("ab" * 31, "holds 31 bytes, fewer than 32"),
                                           ("not a secret", "does not hold hex digits")])
def test_an_empty_short_or_garbled_secret_file_is_refused(tmp_path, text, message):
    path = tmp_path / "secret"
    path.write_text(text)
    path.chmod(0o600)
    with pytest.raises(ValueError, match=message) as failure:
        load_secret(path)
    assert "openssl rand -hex 32" in str(failure.value)  # says how to make a good one


def test_a_missing_secret_file_or_a_folder_is_refused(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_secret(tmp_path / "missing")
    with pytest.raises(ValueError, match="not a regular file"):
        load_secret(tmp_path)


def test_the_environment_names_the_file_and_every_command_checks_it(tmp_path, monkeypatch, capsys):
    path = generate_secret_file(tmp_path / "secret")
    secret = load_secret(path)
    monkeypatch.setenv(SECRET_FILE_ENV, str(path))
    assert serving.worker_options(decode_args([])).cluster_auth == ClusterAuth(secret)
    router = config_from_args(router_parser().parse_args(["--decode", "127.0.0.1:1", "--prefill", "127.0.0.1:2"]))
    assert router.cluster_secret_file == str(path) and router.cluster_auth() == ClusterAuth(secret)
    served = serve_options(serve_parser().parse_args(["serve"]))
    assert served.worker_spec({"CPU": 2.0}, started_ray=True).cluster_auth == ClusterAuth(secret)
    assert served.router_config(port=8000).cluster_secret_file == str(path)
    # the flag wins over the environment; none at all: a worker is plaintext, as before
    other = generate_secret_file(tmp_path / "other")
    assert serving.worker_options(decode_args(["--cluster-secret-file", str(other)])).cluster_auth.secret \
        == load_secret(other)
    monkeypatch.delenv(SECRET_FILE_ENV)
    assert serving.worker_options(decode_args([])).cluster_auth == INSECURE
    assert serve_options(serve_parser().parse_args(["serve"])).cluster_secret_file is None  # serve generates one
    # a bad file fails as the command line is parsed, naming the problem
    path.chmod(0o644)
    with pytest.raises(SystemExit):
        decode_args(["--cluster-secret-file", str(path)])
    assert "open to group or others" in capsys.readouterr().err
    monkeypatch.setenv(SECRET_FILE_ENV, str(path))
    with pytest.raises(SystemExit):
        router_parser().parse_args(["--colocated", "127.0.0.1:1"])
    assert "argument --cluster-secret-file" in capsys.readouterr().err


# ---- what the secret derives --------------------------------------------------------------------

def test_derivation_is_deterministic_and_one_key_per_purpose():
    secret, other = bytes(range(32)), bytes(range(1, 33))
    assert derive_key(secret, "kv mac") == derive_key(secret, "kv mac")
    assert len(derive_key(secret, "kv mac")) == 32 and len(derive_key(secret, "kv mac", 64)) == 64
    assert derive_key(secret, "kv mac") != derive_key(secret, "kv challenge")
    assert derive_key(secret, "kv mac") != derive_key(other, "kv mac")
    with pytest.raises(ValueError, match="purpose"):
        derive_key(secret, "")
    assert ca_private_key(secret).private_numbers() == ca_private_key(secret).private_numbers()
    assert ca_private_key(secret).private_numbers() != ca_private_key(other).private_numbers()
    # the CA certificate: every field the same, the (randomized ECDSA) signature not
    first, again = ca_certificate(secret), ca_certificate(secret)
    assert first.tbs_certificate_bytes == again.tbs_certificate_bytes
    assert first.signature != again.signature


def test_cluster_auth_pickles_and_never_shows_the_secret():
    auth = ClusterAuth(bytes(range(32)))
    assert pickle.loads(pickle.dumps(auth)) == auth and auth.secure
    assert bytes(range(32)).hex() not in repr(auth) and "mutual TLS" in repr(auth)
    assert not INSECURE.secure and pickle.loads(pickle.dumps(INSECURE)) == INSECURE
    with pytest.raises(ValueError, match="at least 32 bytes"):
        ClusterAuth(b"short")


def test_a_plaintext_server_beyond_loopback_is_loudly_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="wire.cluster_auth"):
        for host in ("127.0.0.1", "0.0.0.0"):
            server = grpc.server(futures.ThreadPoolExecutor(1))
            INSECURE.add_port(server, f"{host}:0")
            server.stop(None)
    assert [record.getMessage().split(" WITHOUT")[0] for record in caplog.records] == ["gRPC server on 0.0.0.0:0"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="wire.cluster_auth"):
        server = grpc.server(futures.ThreadPoolExecutor(1))
        ClusterAuth(bytes(32)).add_port(server, "0.0.0.0:0")
        server.stop(None)
    assert not caplog.records


# ---- mutual TLS ---------------------------------------------------------------------------------

SERVER_PROCESS = """
import sys
from concurrent import futures
import grpc
from wire.cluster_auth import ClusterAuth
server = grpc.server(futures.ThreadPoolExecutor(2))
handler = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", {"Echo": handler}),))
port = ClusterAuth.from_file(sys.argv[1]).add_port(server, "127.0.0.1:0")
server.start()
print(port, flush=True)
sys.stdin.read()  # until the test closes it
"""


def test_credentials_built_in_two_processes_interoperate(tmp_path):
    """The server's process derives its own CA certificate (other signature bytes) and leaf; each
    side verifies the other's leaf with its own copy of the CA."""
    path = generate_secret_file(tmp_path / "secret")
    process = subprocess.Popen([sys.executable, "-c", SERVER_PROCESS, str(path)], cwd=REPO, env=child_env(),
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(process.stdout.readline())
        auth = ClusterAuth.from_file(path)
        assert echo(auth.channel(f"127.0.0.1:{port}", aio=False)) == b"ping"
        assert refused(ClusterAuth(bytes(32)).channel(f"127.0.0.1:{port}", aio=False)) == grpc.StatusCode.UNAVAILABLE
    finally:
        process.stdin.close()
        assert process.wait(30) == 0


def test_only_clients_with_the_secret_get_in_and_they_reach_only_servers_with_it():
    from cryptography.hazmat.primitives.serialization import Encoding
    secret = bytes(range(32))
    auth = ClusterAuth(secret)
    server, port = echo_server(auth)
    address = f"127.0.0.1:{port}"
    try:
        assert echo(auth.channel(address, aio=False)) == b"ping"
        assert echo(auth.channel(f"localhost:{port}", aio=False)) == b"ping"  # any address: the name is fixed
        assert refused(INSECURE.channel(address, aio=False)) == grpc.StatusCode.UNAVAILABLE
        assert refused(ClusterAuth(bytes(32)).channel(address, aio=False)) == grpc.StatusCode.UNAVAILABLE
        # a client that trusts the cluster's CA but has no certificate of it: client auth is required
        anonymous = grpc.ssl_channel_credentials(root_certificates=ca_certificate(secret).public_bytes(Encoding.PEM))
        assert refused(grpc.secure_channel(address, anonymous, options=channel_options())) == \
            grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(None)
    impostor, port = echo_server(INSECURE)  # a plaintext server where a worker was: not spoken to
    try:
        assert refused(auth.channel(f"127.0.0.1:{port}", aio=False)) == grpc.StatusCode.UNAVAILABLE
    finally:
        impostor.stop(None)


async def test_aio_channels_too():
    auth = ClusterAuth(bytes(range(32)))
    server, port = echo_server(auth)
    try:
        async with auth.channel(f"127.0.0.1:{port}") as channel:
            assert await channel.unary_unary(ECHO)(b"ping", timeout=10) == b"ping"
    finally:
        server.stop(None)


# ---- real workers -------------------------------------------------------------------------------

ENGINE = ["--num-blocks", "128"]


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory):
    return generate_secret_file(tmp_path_factory.mktemp("cluster") / "secret")


@pytest.fixture(scope="module")
def workers(secret_file):
    secured = ["--cluster-secret-file", str(secret_file)]
    prefill, decode = start_workers([("prefill", ENGINE + secured),
                                     ("decode", ENGINE + secured + ["--local-prefill-threshold", "0"])])
    yield prefill, decode
    stop_workers([prefill, decode])


def stub(worker, auth: ClusterAuth):
    channel = auth.channel(worker.grpc_address, options=wire.GRPC_OPTIONS, aio=False)
    services = wire.services()
    return services.PrefillServiceStub(channel) if worker.kind == "prefill" else services.DecodeServiceStub(channel)


def generate(decode_stub, request_id: str, prompt: list[int], prefill_address: str = "") -> list:
    request = wire.messages().GenerateRequest(request_id=request_id, prompt_token_ids=prompt,
                                              sampling=sampling(max_tokens=4), prefill_address=prefill_address)
    return list(decode_stub.Generate(request, timeout=120))


def prompt(seed: int, length: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(length)]


def stats(worker, auth: ClusterAuth, timeout: float = 30):
    return stub(worker, auth).Stats(wire.messages().StatsRequest(), timeout=timeout)


def engine_counters(worker, auth: ClusterAuth) -> tuple[int, int, int]:
    """What a worker's engine has done: prompt tokens computed, tokens decoded, prefix lookups."""
    answer = stats(worker, auth)
    return answer.prompt_tokens_computed, answer.decode_tokens, answer.prefix_cache_queries


@pytest.mark.slow
def test_a_client_with_the_secret_is_served(workers, secret_file):
    prefill, decode = workers
    auth = ClusterAuth.from_file(secret_file)
    for worker in workers:
        assert stub(worker, auth).Health(wire.messages().HealthRequest(), timeout=30).ok
    decoded = stats(decode, auth).decode_tokens
    chunks = generate(stub(decode, auth), "local", prompt(1))
    assert sum(len(chunk.token_ids) for chunk in chunks) == 4 and chunks[-1].finish_reason == "length"
    assert not kv_outcome(chunks).prefilled_remotely  # (no prefill worker named)
    wait_until(lambda: stats(decode, auth).decode_tokens >= decoded + 3, what="the decode worker's Stats to count it")


@pytest.mark.slow
def test_clients_without_the_secret_are_refused_before_the_engine_sees_anything(workers, secret_file):
    prefill, decode = workers
    good = ClusterAuth.from_file(secret_file)
    before = [engine_counters(worker, good) for worker in workers]
    for auth in (INSECURE, ClusterAuth(bytes(32))):
        for worker in workers:
            with pytest.raises(grpc.RpcError) as failure:
                stats(worker, auth, timeout=10)
            assert failure.value.code() == grpc.StatusCode.UNAVAILABLE, (worker.kind, auth)
        with pytest.raises(grpc.RpcError) as failure:
            generate(stub(decode, auth), "stranger", prompt(2), prefill_address=prefill.grpc_address)
        assert failure.value.code() == grpc.StatusCode.UNAVAILABLE, auth
    assert [engine_counters(worker, good) for worker in workers] == before


@pytest.mark.slow
def test_a_disaggregated_request_is_prefilled_over_the_authenticated_channel(workers, secret_file):
    prefill, decode = workers
    auth = ClusterAuth.from_file(secret_file)
    computed = stats(prefill, auth).prompt_tokens_computed
    chunks = generate(stub(decode, auth), "remote", prompt(3), prefill_address=prefill.grpc_address)
    assert chunks[-1].finish_reason == "length", chunks[-1].error
    assert kv_outcome(chunks, attempted=True).prefilled_remotely
    wait_until(lambda: stats(prefill, auth).prompt_tokens_computed == computed + len(prompt(3)),
               what="the prefill worker's Stats to count the prompt")


@pytest.mark.slow
def test_the_decode_workers_kv_receiver_takes_only_senders_with_the_secrets_key(workers, secret_file):
    """The KV handshake (kvtransfer/_auth.py) under the key the secret derives: a sender with the
    default model's layout but without that key is refused, and one with it is let in."""
    import torch

    import kvtransfer
    prefill, decode = workers
    auth = ClusterAuth.from_file(secret_file)
    caches = [torch.zeros(4, 2, 16, 3, 64) for _ in range(30)]  # SmolLM2-135M: 30 layers, 3 KV heads of 64
    before = engine_counters(decode, auth)
    for key, admitted in ((None, False), (ClusterAuth(bytes(32)).kv_handshake_key, False),
                          (auth.kv_handshake_key, True)):
        sender = kvtransfer.create_sender("tcp", caches, kvtransfer.TransferConfig(auth_key=key))
        try:
            if admitted:
                sender.connect(decode.transport_address)
            else:
                with pytest.raises(kvtransfer.AuthenticationError, match="KV handshake refused"):
                    sender.connect(decode.transport_address)
        finally:
            sender.close()
    assert engine_counters(decode, auth) == before
