"""The stack's own certificate authority: one CA, and a server certificate for the addresses clients use.

Islands run on networks we do not control, so every connection to the log and to the blob store is
TLS, and clients trust only this CA (not the system's store: a public CA would vouch for anyone's
certificate for an address we happen to reach). The CA's key stays in the stack folder (mode 0600);
join tokens carry only the CA's certificate.

Made with the `cryptography` package: ECDSA P-256 keys (small, fast handshakes, accepted by Go's and
Python's TLS), a CA valid for 10 years, server certificates for 1 year, reissued when the addresses
they must list change (`ensure_server_certificate`).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_DAYS = 3650
SERVER_DAYS = 365


@dataclass(frozen=True)
class ServerCertificate:
    """Files a TLS server is started with, and the CA its clients pin."""

    cert_file: Path
    key_file: Path
    ca_file: Path


def write_private(path: Path, data: bytes) -> Path:
    """Write a secret readable by its owner only, atomically (a reader never sees half a key)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.chmod(staging, 0o600)
    os.replace(staging, path)
    return path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _load_key(path: Path) -> ec.EllipticCurvePrivateKey:
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey), f"{path} is not an EC key"
    return key


def ensure_ca(directory: Path, name: str = "sprawl stack CA") -> tuple[Path, Path]:
    """The CA of this stack folder, made on first use: (certificate, key)."""
    cert_file, key_file = directory / "ca.pem", directory / "ca-key.pem"
    if cert_file.exists() and key_file.exists():
        return cert_file, key_file
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))  # clocks of islands elsewhere drift a little
        .not_valid_after(now + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    write_private(key_file, _key_pem(key))
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_file, key_file


def _names(hosts: list[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):  # keeps order, drops repeats
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


SERVER_ONLY = (ExtendedKeyUsageOID.SERVER_AUTH,)
SERVER_AND_CLIENT = (ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH)
"""For the links between a cluster's servers: each node dials the others and is dialled by them, and
both ends present this certificate (mutual TLS)."""


def _lists_exactly(cert_file: Path, hosts: list[str], usages: tuple) -> bool:
    try:
        cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
        listed = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        granted = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except (OSError, ValueError, x509.ExtensionNotFound):
        return False
    expiring = cert.not_valid_after_utc - dt.datetime.now(dt.UTC) < dt.timedelta(days=30)
    return not expiring and set(map(str, listed)) == set(map(str, _names(hosts))) and set(granted) == set(usages)


def ensure_server_certificate(
    directory: Path, server: str, hosts: list[str], usages: tuple = SERVER_ONLY
) -> ServerCertificate:
    """A certificate for `server` (`nats`, `s3`) signed by this folder's CA, valid for every name and
    address in `hosts` (what clients put in their URLs: 127.0.0.1, and an island's route to the stack).
    Reissued when `hosts` or `usages` changed or it is about to expire; kept otherwise (clients need not care)."""
    ca_file, ca_key_file = ensure_ca(directory)
    cert_file, key_file = directory / f"{server}.pem", directory / f"{server}-key.pem"
    if key_file.exists() and _lists_exactly(cert_file, hosts, usages):
        return ServerCertificate(cert_file, key_file, ca_file)
    ca_cert = x509.load_pem_x509_certificate(ca_file.read_bytes())
    ca_key = _load_key(ca_key_file)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"sprawl {server}")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=SERVER_DAYS))
        .add_extension(x509.SubjectAlternativeName(_names(hosts)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    write_private(key_file, _key_pem(key))
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return ServerCertificate(cert_file, key_file, ca_file)
