"""Certificates and keys for a throwaway control plane on loopback.

The API server authenticates every component by client certificate, as a real cluster does, so RBAC decisions in
tests are the real ones: the admin is in `system:masters`, the controller manager and the scheduler use their
well-known user names, and the service-account signing key lets the controller manager mint tokens.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = dt.timedelta(days=2)


@dataclass(frozen=True)
class CertPair:
    cert: Path
    key: Path


OPERATOR_USER = "strata-operator"


@dataclass(frozen=True)
class ClusterPKI:
    ca: CertPair
    apiserver: CertPair
    admin: CertPair
    operator: CertPair  # a superuser like admin, under its own name so the audit log can tell its requests apart
    controller_manager: CertPair
    scheduler: CertPair
    service_account_key: Path
    service_account_pub: Path


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attrs)


def _issue(
    *,
    folder: Path,
    stem: str,
    subject: x509.Name,
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    server: bool = False,
) -> tuple[CertPair, x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    issuer_name, signing_key = (ca[0].subject, ca[1]) if ca else (subject, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
    )
    if ca is None:
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        builder = builder.add_extension(
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
    else:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    x509.DNSName("kubernetes.default.svc"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    x509.IPAddress(ipaddress.ip_address("10.0.0.1")),
                ]
            ),
            critical=False,
        )
    cert = builder.sign(signing_key, hashes.SHA256())
    pair = CertPair(cert=folder / f"{stem}.crt", key=folder / f"{stem}.key")
    pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(pair.key, key)
    return pair, cert, key


def create_pki(folder: Path) -> ClusterPKI:
    """Write a CA, the API server's serving certificate, client certificates and service-account keys."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_pair, ca_cert, ca_key = _issue(folder=folder, stem="ca", subject=_name("strata-testbed-ca"), ca=None)
    ca = (ca_cert, ca_key)
    apiserver, _, _ = _issue(folder=folder, stem="apiserver", subject=_name("kube-apiserver"), ca=ca, server=True)
    admin, _, _ = _issue(folder=folder, stem="admin", subject=_name("admin", "system:masters"), ca=ca)
    operator, _, _ = _issue(folder=folder, stem="operator", subject=_name(OPERATOR_USER, "system:masters"), ca=ca)
    kcm, _, _ = _issue(folder=folder, stem="controller-manager", subject=_name("system:kube-controller-manager"), ca=ca)
    scheduler, _, _ = _issue(folder=folder, stem="scheduler", subject=_name("system:kube-scheduler"), ca=ca)

    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    sa_key_path = folder / "service-account.key"
    sa_pub_path = folder / "service-account.pub"
    _write_key(sa_key_path, sa_key)
    sa_pub_path.write_bytes(
        sa_key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return ClusterPKI(
        ca=ca_pair,
        apiserver=apiserver,
        admin=admin,
        operator=operator,
        controller_manager=kcm,
        scheduler=scheduler,
        service_account_key=sa_key_path,
        service_account_pub=sa_pub_path,
    )
