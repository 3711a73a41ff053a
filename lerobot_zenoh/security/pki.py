"""A development certificate authority and one certificate per identity (server, router, engine, robot, monitor).

Zenoh's TLS link (rustls) verifies the peer's chain against `root_ca_certificate`; with mutual
TLS each side presents a certificate, and Zenoh's access control matches the remote
certificate's **common name** against `cert_common_names`. So the common name of every
certificate is the identity the ACL knows it by: a server's `server_id`, an engine's `engine_id`,
a client's `client_uuid`, a monitor's name.

Certificates are issued by role, so that only a server (or router) can pose as what a robot dials:

- **server** and **router** certificates carry the host names and addresses robots and monitors
  dial (subject alternative names; `DEFAULT_HOSTS` when none are given) and both TLS usages
  (serverAuth, to listen; clientAuth, to connect to a router or to the primary a standby watches);
- an **engine** certificate names only the hosts its edge scheduler dials it at, never a default,
  and `lerobot-zenoh-secure` refuses a name that a server or router certificate of the deployment
  carries (`identities.check_engine_names`). So it can serve TLS to its scheduler only: a robot
  dialling a server name refuses it. An engine that listens nowhere (it dials a router, or its
  scheduler) gets a client-only certificate, like a robot;
- **client** (robot) and **monitor** certificates are client-only: clientAuth alone, no subject
  alternative name.

A connecting side checks the listener's certificate (rustls: serverAuth usage, and with
`verify_name_on_connect` a SAN equal to the host it dialled), so neither a robot's, a monitor's nor
an engine's certificate can serve as a server's TLS identity (tested in tests/test_security.py).

Keys are ECDSA P-256 in unencrypted PKCS#8 PEM (what rustls reads), written with mode 0600.
This is a development CA: it has no revocation, and its key sits in a file. Production
deployments bring their own PKI (docs/security.md); only the common names must follow the ids.
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

from lerobot_zenoh.errors import ConfigError

#: Names every server and router certificate answers to, so loopback deployments verify without extra flags.
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
#: role -> which names its certificate may serve as a TLS listener:
#:   "dialled": the names robots and monitors dial (servers, routers; DEFAULT_HOSTS when none are given);
#:   "own": only the names given, no default (engines: where their scheduler dials them; none: client-only);
#:   None: none at all (robots, monitors: client-only).
ROLES = {"server": "dialled", "router": "dialled", "engine": "own", "client": None, "monitor": None}
DEFAULT_VALID_DAYS = 365
CA_COMMON_NAME = "lerobot-zenoh development CA"


@dataclass(frozen=True)
class CertificateAuthority:
    """A CA certificate and its private key, in memory."""

    certificate: x509.Certificate
    private_key: ec.EllipticCurvePrivateKey

    @property
    def cert_pem(self) -> bytes:
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        return _key_pem(self.private_key)


@dataclass(frozen=True)
class IssuedCertificate:
    common_name: str
    cert_pem: bytes
    key_pem: bytes


@dataclass(frozen=True)
class IdentityFiles:
    """Where one identity's certificate and key were written."""

    name: str
    certificate: Path
    private_key: Path


def create_ca(common_name: str = CA_COMMON_NAME, valid_days: int = 3650) -> CertificateAuthority:
    """A fresh self-signed CA that may sign end-entity certificates only (path length 0)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=valid_days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return CertificateAuthority(cert, key)


def issue(ca: CertificateAuthority, common_name: str, hosts: tuple[str, ...] | list[str] = (),
          valid_days: int = DEFAULT_VALID_DAYS, *, role: str = "client") -> IssuedCertificate:
    """A certificate for `common_name` with `role`, signed by `ca`.

    A server or router certificate is usable as TLS server and TLS client and names `hosts`
    (default: DEFAULT_HOSTS) as subject alternative names: IP addresses as IP entries, anything
    else as DNS names. An engine certificate names exactly `hosts` (no default) and is a TLS server
    only when given some; without, it is client-only. A client or monitor certificate is TLS-client
    only and names no host: giving it `hosts` is an error. The common name is never added as a
    name (ids such as `robot_a4b9` are not host names).
    """
    if role not in ROLES:
        raise ConfigError("role", f"{role!r} is not one of {', '.join(ROLES)}")
    if not common_name or any(ch in common_name for ch in "/*$?#@") or any(ch.isspace() for ch in common_name):
        raise ConfigError("common_name", f"{common_name!r} must be a non-empty id without / * $ ? # @ or whitespace")
    serves = ROLES[role]
    if hosts and not serves:
        raise ConfigError("hosts", f"a {role} certificate names no host: only server, router and engine certificates "
                                   f"may serve TLS (got {list(hosts)} for {common_name!r})")
    hosts = tuple(hosts) or (DEFAULT_HOSTS if serves == "dialled" else ())
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH] if hosts else [ExtendedKeyUsageOID.CLIENT_AUTH]
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca.certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=valid_days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, key_cert_sign=False,
                                     crl_sign=False, content_commitment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.private_key.public_key()), critical=False)
    )
    names = _subject_alt_names(hosts)
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(ca.private_key, hashes.SHA256())
    return IssuedCertificate(common_name, cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def host_names(cert_pem: bytes) -> list[str]:
    """The DNS names and IP addresses a certificate names (its subject alternative names)."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return list(sans.get_values_for_type(x509.DNSName)) + [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)]


def can_serve_tls(cert_pem: bytes) -> bool:
    """Whether a certificate allows the TLS server usage (no EKU extension means any usage)."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return True
    return ExtendedKeyUsageOID.SERVER_AUTH in usages or ExtendedKeyUsageOID.ANY_EXTENDED_KEY_USAGE in usages


def served_names(cert_pem: bytes) -> list[str]:
    """The names a certificate may be accepted under as a TLS listener (by a node that checks names):
    its subject alternative names if it allows serverAuth, else none."""
    return host_names(cert_pem) if can_serve_tls(cert_pem) else []


def common_name(cert_pem: bytes) -> str:
    """The subject common name of a PEM certificate (what Zenoh's ACL matches)."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    attrs = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not attrs:
        raise ConfigError("certificate", "has no subject common name; Zenoh's ACL cannot identify it")
    return str(attrs[0].value)


# -- files --------------------------------------------------------------------------------------


def save_ca(ca: CertificateAuthority, out_dir: str | Path) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = out / "ca.pem", out / "ca.key"
    cert_path.write_bytes(ca.cert_pem)
    _write_private(key_path, ca.key_pem)
    return cert_path, key_path


def load_ca(cert_path: str | Path, key_path: str | Path) -> CertificateAuthority:
    """Load a CA brought by the user (PEM certificate + unencrypted PEM private key)."""
    try:
        cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigError("ca_cert", f"cannot read a PEM certificate from {cert_path}: {exc}") from None
    try:
        key = serialization.load_pem_private_key(Path(key_path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError("ca_key", f"cannot read an unencrypted PEM private key from {key_path}: {exc}") from None
    if key.public_key().public_numbers() != cert.public_key().public_numbers():
        raise ConfigError("ca_key", f"{key_path} is not the key of {cert_path}")
    try:
        basic = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        basic = None
    if basic is None or not basic.ca:
        raise ConfigError("ca_cert", f"{cert_path} is not a CA certificate (BasicConstraints CA:TRUE is missing)")
    return CertificateAuthority(cert, key)


def write_identity(ca: CertificateAuthority, name: str, out_dir: str | Path,
                   hosts: tuple[str, ...] | list[str] = (), valid_days: int = DEFAULT_VALID_DAYS, *,
                   role: str = "client") -> IdentityFiles:
    """Issue a certificate for `name` (see `issue`) and write `<name>.pem` and `<name>.key` into `out_dir`."""
    issued = issue(ca, name, hosts, valid_days, role=role)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = out / f"{name}.pem", out / f"{name}.key"
    cert_path.write_bytes(issued.cert_pem)
    _write_private(key_path, issued.key_pem)
    return IdentityFiles(name, cert_path, key_path)


# -- internals ----------------------------------------------------------------------------------


def _subject_alt_names(hosts) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):  # keep order, drop duplicates
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write_private(path: Path, data: bytes) -> None:
    """Write a private key readable by its owner only (created 0600, never world-readable)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)
