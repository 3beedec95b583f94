"""Serving certificates from cert-manager (tls.issuerRef), for users who run it: a Certificate
per serving certificate, in the job's namespace of the operator's cluster, for every name the
trainer or a relay is reached at; cert-manager issues it into the Secret the pods mount, and
reissues and renews it (its defaults: 90 days, renewed with 30 left). A relay in a member cluster
gets a copy of its Secret there, as the operator delivers everything else. The issuer must give a
ca.crt (a CA or self-signed issuer): the job's pods trust it alone."""

from __future__ import annotations

from sparrowrl.auth import pki
from sparrowrl.auth.pki import Issued
from sparrowrl.spec.layout import Process
from sparrowrl_operator import builders
from sparrowrl_operator.constants import CA_INVALID, CA_KEY, CERT_KEY, KEY_KEY
from sparrowrl_operator.credentials import secret_value
from sparrowrl_operator.cycle import Facts, Outcome
from sparrowrl_operator.drift import ensure
from sparrowrl_operator.pods import Cluster
from sparrowrl_operator.trainer import ROLE


def authority(c: Facts, out: Outcome, trainer_names: list[str]) -> bytes | None:
    """The CA certificate cert-manager's issuer gives, once it has issued the trainer's; None
    until then, or when the issuer is missing or not ready (the Encrypted condition says so)."""
    ref, job = c.spec.tls.issuer_ref, c.job
    assert ref is not None
    where = f"{ref.kind} {ref.name}" + (f" in namespace {job.namespace}" if ref.kind == "Issuer" else "")
    found = c.seen(None, ref.kind, ref.name)
    if found is None:
        out.transition(
            "Encrypted",
            False,
            "IssuerNotFound",
            f"tls.issuerRef: {where} not found (is cert-manager installed, with its CRDs?)",
            warning=True,
        )
        return None
    if (why := _not_ready(found)) is not None:
        out.transition(
            "Encrypted", False, "IssuerNotReady", f"tls.issuerRef: {where} is not ready: {why}", warning=True
        )
        return None
    ensure(c, out, None, builders.certificate(job, ROLE, trainer_names, ref))
    name = builders.serving_name(job, ROLE)
    issued = c.seen(None, "Secret", name)
    ca = secret_value(issued, CA_KEY) if issued is not None else None
    if issued is None or secret_value(issued, CERT_KEY) is None:
        why = _not_ready(c.seen(None, "Certificate", name) or {}) or "not issued yet"
        out.condition("Encrypted", False, "Issuing", f"waiting for cert-manager to issue Certificate {name}: {why}")
        return None
    if not ca or pki.read_certificate(ca) is None:
        out.transition(
            "Encrypted",
            False,
            CA_INVALID,
            f"tls.issuerRef: {where} gave Secret {name} no CA certificate (ca.crt) that parses; the job's pods trust "
            "that alone: use a CA or self-signed issuer",
            warning=True,
        )
        return None
    out.transition(
        "Encrypted",
        True,
        "CertificatesIssued",
        f"every hop is HTTPS, with certificates {where} issues; relays and workers trust its CA alone",
    )
    return ca


def _not_ready(obj: dict) -> str | None:
    """Why a cert-manager object's Ready condition is not True (None: it is, or says nothing yet)."""
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready" and cond.get("status") != "True":
            return str(cond.get("message") or cond.get("reason") or "not ready")[:500]
    return None


def serve(c: Facts, out: Outcome, ca: bytes, cluster: Cluster, role: Process, namespace: str, names: list[str]) -> None:
    """A relay's Certificate, and in a member cluster the copy of what cert-manager issued (the
    trainer's Certificate is `authority`'s)."""
    ref = c.spec.tls.issuer_ref
    if role.kind == "trainer" or ref is None:
        return
    ensure(c, out, None, builders.certificate(c.job, role, names, ref))
    if cluster is None:
        return  # the pods mount cert-manager's Secret itself
    issued = c.seen(None, "Secret", builders.serving_name(c.job, role))
    cert, key = (secret_value(issued, k) for k in (CERT_KEY, KEY_KEY)) if issued else (None, None)
    if cert and key:  # until then, the relay's pod waits for its Secret
        copy = builders.serving_secret(c.job.in_member(), role, namespace, False, Issued(cert, key), ca)
        ensure(c, out, cluster, copy, expected=True)
