"""Development certificates: a private CA, a server certificate and client certificates.

``agentmesh certs DIR --client PaymentAgent --client gateway`` writes::

    ca.pem ca-key.pem                 the CA (keep ca-key.pem private)
    server.pem server-key.pem         for every server (SANs: localhost, 127.0.0.1, --host ...)
    <name>.pem <name>-key.pem         one client certificate per name (CN = name)

With mutual TLS a client certificate names its holder: an agent whose certificate says
``PaymentAgent`` may act as PaymentAgent. For production, use your own PKI.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _write_cert(cert: x509.Certificate, path: Path) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "agentmesh"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _san(hosts: Iterable[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _issue(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    *,
    hosts: Iterable[str],
    usage: x509.ObjectIdentifier,
    days: int,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
    )
    hosts = list(hosts)
    if hosts:
        builder = builder.add_extension(_san(hosts), critical=False)
    return builder.sign(ca_key, hashes.SHA256())


def write_dev_certificates(
    folder: str | Path,
    *,
    hosts: Iterable[str] = (),
    clients: Iterable[str] = (),
    days: int = 365,
) -> dict[str, Path]:
    """Writes a CA, a server certificate for ``hosts`` (plus localhost and 127.0.0.1) and one
    client certificate per name; returns the files written by role."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = _key()
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("agentmesh development CA"))
        .issuer_name(_name("agentmesh development CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        # Key identifiers: a verifier trusting a bundle of CAs of one name (the old and the
        # new of a rotation) finds which one signed a certificate.
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    files = {"ca": out / "ca.pem", "ca_key": out / "ca-key.pem"}
    _write_cert(ca_cert, files["ca"])
    _write_key(ca_key, files["ca_key"])

    server_hosts = list(dict.fromkeys(["localhost", "127.0.0.1", *hosts]))
    server_key = _key()
    server_cert = _issue(
        server_hosts[0],
        server_key,
        ca_cert,
        ca_key,
        hosts=server_hosts,
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
        days=days,
    )
    files["server"] = out / "server.pem"
    files["server_key"] = out / "server-key.pem"
    _write_cert(server_cert, files["server"])
    _write_key(server_key, files["server_key"])

    for name in clients:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"not a usable client name: {name!r}")
        key = _key()
        cert = _issue(
            name, key, ca_cert, ca_key, hosts=[], usage=ExtendedKeyUsageOID.CLIENT_AUTH, days=days
        )
        files[name] = out / f"{name}.pem"
        files[f"{name}_key"] = out / f"{name}-key.pem"
        _write_cert(cert, files[name])
        _write_key(key, files[f"{name}_key"])
    return files
