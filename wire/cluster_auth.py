"""Who may talk to a worker's gRPC server: the processes that hold the cluster secret.

One cluster secret (32 random bytes, hex, in a file of mode 0600; `$PDSERVE_CLUSTER_SECRET_FILE`
or `--cluster-secret-file` names it) is all a process needs. From it, every process derives the
same certificate authority and makes its own leaf certificate; every worker gRPC server and every
channel to one (router, controller, a decode worker's calls to prefill workers) is mutual TLS
under that CA. `ClusterAuth` is the one place that decides: with a secret it binds secure ports
and opens secure channels, without one (`INSECURE`) plaintext, as before.

Why mutual TLS derived from a shared secret:
- TLS gives confidentiality and integrity, not only origin: prompts and tokens cross the network
  encrypted, and nobody on the path can alter or inject a call. A per-call token (a bearer
  header) would prove origin only, travel in the clear on plaintext gRPC, and could be replayed
  by whoever sniffed one call.
- Nothing to distribute but one file: no CA to run, no certificates to issue, copy or renew. The
  CA key is a function of the secret, so a process on any node that holds the secret signs leaf
  certificates that every other one accepts; a process without it can neither call a worker
  (client certificates are required) nor pass for one (clients check the server's certificate).
  `pdserve serve` generates a secret per run and hands it to its actors inside their (pickled)
  options, so users of `pdserve serve` have nothing to set up.

The derivation (HKDF-SHA256, each value under its own purpose label, `derive_key`):
- CA: an EC P-256 key (`ec.derive_private_key` of a scalar from the secret) and a self-signed
  certificate whose every field (name, serial, validity 2000-9999, extensions) is fixed. Its
  ECDSA self-signature is randomized, so two processes' CA certificates differ in their signature
  bytes; that does not matter: a trust anchor is matched by its name and public key, and a leaf
  is verified with the CA's public key (tests/wire/test_cluster_auth.py checks that a CA rebuilt
  in another process verifies this one's leaves, both ways).
- Leaf: per process, made on first use: a fresh P-256 key, signed by the CA, valid from a day
  before now (clock skew between nodes) for ten years, for server and client auth, with the DNS
  name `CLUSTER_NAME`. Clients check that name (`grpc.ssl_target_name_override`) instead of the
  address they dial, so a worker is reached at any address.

`derive_key` also gives the keys that authenticate the KV transports (their challenge-response
and keyed MAC; not yet used). Torch-free, like the rest of `wire`.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import logging
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, NamedTuple

import grpc

logger = logging.getLogger(__name__)

SECRET_FILE_ENV = "PDSERVE_CLUSTER_SECRET_FILE"  # names the secret file (the flags' default)
SECRET_FILE_FLAG = "--cluster-secret-file"
SECRET_BYTES = 32  # what `generate_secret_file` writes and the least `load_secret` accepts
CLUSTER_NAME = "pdserve-cluster"  # every leaf certificate's DNS name, what clients check
LOOPBACK_HOST = "127.0.0.1"
# Hosts that only this machine reaches: a server bound there needs no authentication (the
# router's HTTP without --api-key, a worker's gRPC without a secret); a worker on one advertises it.
LOOPBACK_HOSTS: tuple[str, ...] = (LOOPBACK_HOST, "localhost", "::1")

_HKDF_LABEL = b"pdserve cluster-auth v1: "  # + the purpose: one key per purpose
KV_HANDSHAKE_PURPOSE = "kv-handshake"  # the KV transports' challenge-response
KV_MAC_PURPOSE = "kv-mac"  # the keyed checksum of each KV transfer
_CA_NAME = "pdserve cluster CA"
_CA_NOT_BEFORE = datetime.datetime(2000, 1, 1, tzinfo=datetime.timezone.utc)
_CA_NOT_AFTER = datetime.datetime(9999, 12, 31, 23, 59, 59, tzinfo=datetime.timezone.utc)  # RFC 5280: no end
_LEAF_CLOCK_SKEW = datetime.timedelta(days=1)
_LEAF_LIFETIME = datetime.timedelta(days=3650)


# ---- the secret file ----------------------------------------------------------------------------

def generate_secret_file(path: str | os.PathLike) -> Path:
    """A new secret file at `path`: `SECRET_BYTES` random bytes, hex, mode 0600. ValueError when
    `path` exists (it may be a cluster's secret: remove it yourself to replace it)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ValueError(f"cluster secret file {path} already exists; use it, or remove it first") from None
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)  # (whatever the umask)
        f.write(secrets.token_hex(SECRET_BYTES) + "\n")
    return path


def load_secret(path: str | os.PathLike) -> bytes:
    """The secret in the file at `path`. ValueError, saying what to do, when the file is missing,
    readable or writable by group or others, not hex, or shorter than `SECRET_BYTES` bytes."""
    path = Path(path)
    fix = f"make one with `(umask 077; openssl rand -hex {SECRET_BYTES} > {path})`"
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip() if stat.S_ISREG(mode) else None
    except FileNotFoundError:
        raise ValueError(f"cluster secret file {path} does not exist; {fix}") from None
    except OSError as exc:
        raise ValueError(f"cluster secret file {path} cannot be read: {exc.strerror}") from None
    if text is None:
        raise ValueError(f"cluster secret file {path} is not a regular file")
    if mode & 0o077:
        raise ValueError(f"cluster secret file {path} is open to group or others (mode {stat.S_IMODE(mode):04o}); "
                         f"`chmod 600 {path}`")
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"cluster secret file {path} does not hold hex digits; {fix}") from None
    if len(secret) < SECRET_BYTES:
        raise ValueError(f"cluster secret file {path} holds {len(secret)} bytes, fewer than {SECRET_BYTES}; {fix}")
    return secret


def secret_file_from_environment() -> str | None:
    """The secret file `$PDSERVE_CLUSTER_SECRET_FILE` names (None when unset or empty)."""
    return os.environ.get(SECRET_FILE_ENV) or None


def add_secret_file_argument(parser: argparse.ArgumentParser | Any, without: str) -> None:
    """`--cluster-secret-file PATH` (dest `cluster_secret_file`), default `$PDSERVE_CLUSTER_SECRET_FILE`;
    the file is checked as the command line is parsed (argparse's error names the problem).
    `without`: what the command does when neither is given. Never the secret itself: a command
    line is visible to every user of the machine."""
    parser.add_argument(SECRET_FILE_FLAG, dest="cluster_secret_file", metavar="PATH", type=_checked_secret_file,
                        default=secret_file_from_environment(),
                        help=f"the cluster secret: a file of {SECRET_BYTES}+ random bytes in hex, mode 0600; worker "
                             f"gRPC is mutual TLS under certificates derived from it (default: ${SECRET_FILE_ENV}; "
                             f"without one: {without})")


def _checked_secret_file(text: str) -> str:
    try:
        load_secret(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


# ---- what the secret derives --------------------------------------------------------------------

def derive_key(secret: bytes, purpose: str, length: int = 32) -> bytes:
    """`length` bytes for `purpose` (HKDF-SHA256 of the secret, the purpose in its info): the same
    in every process that holds the secret, unrelated across purposes."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    if not purpose:
        raise ValueError("a derived key needs a purpose label")
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None,
                info=_HKDF_LABEL + purpose.encode()).derive(secret)


def ca_private_key(secret: bytes) -> Any:
    """The cluster CA's EC P-256 key (the same in every process that holds the secret)."""
    from cryptography.hazmat.primitives.asymmetric import ec
    order = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551  # P-256's group order n
    # 48 bytes reduced into [1, n-1]: no bias worth the name (2^-128)
    scalar = int.from_bytes(derive_key(secret, "grpc ca key", 48), "big") % (order - 1) + 1
    return ec.derive_private_key(scalar, ec.SECP256R1())


def ca_certificate(secret: bytes) -> Any:
    """The cluster CA's self-signed certificate: every field fixed by the secret; the ECDSA
    signature bytes vary (module docstring)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID
    key = ca_private_key(secret)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, _CA_NAME)])
    public_key = key.public_key()
    return (x509.CertificateBuilder()
            .subject_name(name).issuer_name(name).public_key(public_key)
            .serial_number(int.from_bytes(derive_key(secret, "grpc ca serial", 16), "big") | 1)
            .not_valid_before(_CA_NOT_BEFORE).not_valid_after(_CA_NOT_AFTER)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
            .sign(key, hashes.SHA256()))


def leaf_certificate(secret: bytes) -> tuple[Any, Any]:
    """A new (key, certificate) for this process, signed by the cluster CA (module docstring)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    ca_key = ca_private_key(secret)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CLUSTER_NAME)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, _CA_NAME)]))
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - _LEAF_CLOCK_SKEW).not_valid_after(now + _LEAF_LIFETIME)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(CLUSTER_NAME)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256()))
    return key, certificate


class _Pems(NamedTuple):
    ca_certificate: bytes
    private_key: bytes
    certificate: bytes


@functools.lru_cache(maxsize=4)
def _pems(secret: bytes) -> _Pems:
    """This process's CA certificate and leaf, PEM-encoded; made once per secret and process."""
    from cryptography.hazmat.primitives import serialization
    key, certificate = leaf_certificate(secret)
    return _Pems(ca_certificate(secret).public_bytes(serialization.Encoding.PEM),
                 key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                   serialization.NoEncryption()),
                 certificate.public_bytes(serialization.Encoding.PEM))


def server_credentials(secret: bytes) -> grpc.ServerCredentials:
    """A worker server's: this process's leaf; clients must present one of the cluster's."""
    pems = _pems(secret)
    return grpc.ssl_server_credentials([(pems.private_key, pems.certificate)], root_certificates=pems.ca_certificate,
                                       require_client_auth=True)


def channel_credentials(secret: bytes) -> grpc.ChannelCredentials:
    """A client's: this process's leaf; the server must present one of the cluster's (checked for
    `CLUSTER_NAME`: `channel_options`)."""
    pems = _pems(secret)
    return grpc.ssl_channel_credentials(root_certificates=pems.ca_certificate, private_key=pems.private_key,
                                        certificate_chain=pems.certificate)


def channel_options(options: Iterable[tuple[str, Any]] = ()) -> list[tuple[str, Any]]:
    """`options` plus what a secure channel needs: the name to check in the server's certificate
    (`CLUSTER_NAME`, whatever address is dialled)."""
    return [*options, ("grpc.ssl_target_name_override", CLUSTER_NAME)]


# ---- the one place that decides -----------------------------------------------------------------

@dataclass(frozen=True)
class ClusterAuth:
    """A process's gRPC security: mutual TLS under the cluster secret, or none (`INSECURE`:
    `ClusterAuth()`, plaintext as before). Plain bytes, so it pickles: it travels to Ray actors
    in their options. Every worker gRPC server and every channel to one goes through it."""
    secret: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.secret is not None and len(self.secret) < SECRET_BYTES:
            raise ValueError(f"a cluster secret has at least {SECRET_BYTES} bytes, got {len(self.secret)}")

    @classmethod
    def from_file(cls, path: str | os.PathLike | None) -> ClusterAuth:
        """The secret in the file at `path` (`load_secret`'s ValueError); None: `INSECURE`."""
        return cls(None if path is None else load_secret(path))

    @property
    def secure(self) -> bool:
        return self.secret is not None

    @property
    def kv_handshake_key(self) -> bytes | None:
        """The KV transports' handshake key (kvtransfer `TransferConfig.auth_key`); None: insecure."""
        return None if self.secret is None else derive_key(self.secret, KV_HANDSHAKE_PURPOSE)

    @property
    def kv_mac_key(self) -> bytes | None:
        """The key of the KV transfer checksum (engine `KVConnectorConfig.mac_key`); None: insecure."""
        return None if self.secret is None else derive_key(self.secret, KV_MAC_PURPOSE)

    def __repr__(self) -> str:
        return f"ClusterAuth({'mutual TLS' if self.secure else 'insecure'})"

    def add_port(self, server: grpc.Server | grpc.aio.Server, address: str) -> int:
        """Bind `server` (sync or aio) at `address` (host:port): secure with a secret, else
        insecure, with a warning where others than this machine can reach it. Returns the port
        (0, or grpc's RuntimeError, when it cannot bind)."""
        if self.secure:
            return server.add_secure_port(address, server_credentials(self.secret))
        host = address.rpartition(":")[0].strip("[]")
        if host not in LOOPBACK_HOSTS:
            logger.warning("gRPC server on %s WITHOUT AUTHENTICATION: anyone who can reach it can drive this "
                           "worker; give every process of the cluster the same %s (or $%s)",
                           address, SECRET_FILE_FLAG, SECRET_FILE_ENV)
        return server.add_insecure_port(address)

    def channel(self, address: str, options: Iterable[tuple[str, Any]] = (), aio: bool = True) -> Any:
        """A channel to the worker at `address` (`grpc.aio` unless `aio` is False): secure with a
        secret, else insecure."""
        module = grpc.aio if aio else grpc
        if self.secure:
            return module.secure_channel(address, channel_credentials(self.secret), options=channel_options(options))
        return module.insecure_channel(address, options=list(options))


INSECURE = ClusterAuth()
