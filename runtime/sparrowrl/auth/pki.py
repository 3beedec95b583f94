"""A job's own certificate authority: a CA made for the job, and the serving certificates it
signs for the names and addresses a role is reached at. Clients trust the job's CA alone, so a
certificate from anywhere else is refused, and nothing needs a public authority.

Keys are ECDSA P-256 (fast handshakes, small certificates); certificates are X.509 v3 with
the names as subjectAltName, as clients check them (RFC 6125: never the common name). A pair
read back (a Kubernetes TLS Secret's) is judged by the names of that Secret's keys, tls.crt and
tls.key, so what is wrong with it reads as the field to fix."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SIGNING = (ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey)  # what a CA's key may be: what every TLS client checks
SKEW = datetime.timedelta(minutes=5)  # a certificate is valid from this long before it is made: clocks differ


@dataclass(frozen=True)
class Issued:
    """A certificate and its private key, as PEM."""

    cert: bytes
    key: bytes


def _pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def authority(name: str, days: int = 3650, now: datetime.datetime | None = None) -> Issued:
    """A new CA named `name` (a job's), valid `days` from `now`."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name[:64])])
    now = now or datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - SKEW)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _pem(key))


def serving(ca: Issued, names: list[str], days: int = 30, now: datetime.datetime | None = None) -> Issued:
    """A serving certificate signed by `ca` for `names`: DNS names and IP addresses (a Service's
    cluster names, a load balancer's hostname or address, 127.0.0.1), valid `days` from `now`
    and no longer than the CA. ValueError: none given."""
    if not names:
        raise ValueError("a serving certificate needs at least one name or address")
    ca_cert = x509.load_pem_x509_certificate(ca.cert)
    ca_key = serialization.load_pem_private_key(ca.key, None)
    assert isinstance(ca_key, SIGNING)  # authority()'s, or one read_authority() took
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = []
    for n in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            sans.append(x509.DNSName(n))
    now = now or datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0][:64])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - SKEW)
        .not_valid_after(min(now + datetime.timedelta(days=days), ca_cert.not_valid_after_utc))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(True, False, False, False, False, False, False, False, False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _pem(key))


def read_certificate(cert: bytes) -> x509.Certificate | None:
    """A PEM certificate parsed, or None."""
    try:
        return x509.load_pem_x509_certificate(cert)
    except ValueError:
        return None


def read_pair(cert: bytes, key: bytes) -> tuple[x509.Certificate, PrivateKeyTypes]:
    """A PEM certificate and its key, parsed. ValueError: which of the two is wrong, and why."""
    try:
        parsed = x509.load_pem_x509_certificate(cert)
    except ValueError:
        raise ValueError("tls.crt is not a PEM certificate") from None
    try:
        private = serialization.load_pem_private_key(key, None)
    except (ValueError, TypeError):  # TypeError: encrypted
        raise ValueError("tls.key is not an unencrypted PEM private key") from None
    if private.public_key().public_bytes(*_SPKI) != parsed.public_key().public_bytes(*_SPKI):
        raise ValueError("tls.key is not the key of the certificate in tls.crt")
    return parsed, private


_SPKI = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def read_authority(cert: bytes, key: bytes, now: datetime.datetime) -> Issued:
    """A CA kept in a Secret, checked before it signs anything: ValueError saying what is wrong."""
    parsed, private = read_pair(cert, key)
    try:
        constraints = parsed.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        constraints = None
    if constraints is None or not constraints.ca:
        raise ValueError("tls.crt is not a CA certificate (its basicConstraints do not say CA)")
    if not isinstance(private, SIGNING):
        raise ValueError(f"tls.key is a {type(private).__name__.removeprefix('_')}: the CA's key must be ECDSA or RSA")
    if now >= parsed.not_valid_after_utc:
        raise ValueError(f"tls.crt expired at {stamp(parsed.not_valid_after_utc)}")
    if now < parsed.not_valid_before_utc - SKEW:
        raise ValueError(f"tls.crt is not valid before {stamp(parsed.not_valid_before_utc)}")
    return Issued(cert, key)


def unfit(served: Issued, ca: Issued, names: list[str], now: datetime.datetime, renew: float) -> str | None:
    """Why a serving certificate must be issued anew, or None: it does not parse, `ca` did not
    sign it, it misses one of `names`, or less than `renew` of its lifetime is left."""
    try:
        parsed, _ = read_pair(served.cert, served.key)
    except ValueError as e:
        return str(e)
    try:
        parsed.verify_directly_issued_by(x509.load_pem_x509_certificate(ca.cert))
    except (ValueError, TypeError, InvalidSignature):
        return "the job's CA did not sign it"
    try:
        sans = parsed.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        have = {str(n) for n in sans.get_values_for_type(x509.DNSName)}
        have |= {str(a) for a in sans.get_values_for_type(x509.IPAddress)}
    except x509.ExtensionNotFound:
        have = set()
    if missing := [n for n in names if str(_name(n)) not in have]:
        return f"it does not name {', '.join(missing)}"
    start, end = parsed.not_valid_before_utc, parsed.not_valid_after_utc
    if now >= end - (end - start) * renew:
        return f"it expires at {stamp(end)}"
    return None


def _name(n: str) -> str | ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        return ipaddress.ip_address(n)
    except ValueError:
        return n


def stamp(t: datetime.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")
