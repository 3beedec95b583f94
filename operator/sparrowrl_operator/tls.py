"""The job's certificates. Its CA: made once into the Secret JOB-ca, or the user's
(tls.caSecretName), which is only read. A serving certificate for the trainer and for each relay,
for every name it is reached at, issued anew when a name appears (a load balancer's address comes
after its Service), when a third of its life is left, or when it is unfit in any other way. Roles
read a renewed pair at their next handshake, with no restart. With tls.issuerRef, cert-manager
issues them instead (issuer.py). Nothing falls back to plain HTTP: a job whose certificates
cannot be issued waits, and its Encrypted condition says why."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass

from sparrowrl.auth import pki
from sparrowrl.auth.pki import Issued
from sparrowrl.spec.job import JobSpec
from sparrowrl.spec.kubespec import TlsSpec
from sparrowrl.spec.layout import Process
from sparrowrl_operator import builders, issuer
from sparrowrl_operator.builders import JobRef
from sparrowrl_operator.constants import (
    CA_INVALID,
    CA_KEY,
    CERT_KEY,
    ISSUED,
    KEY_KEY,
    MANAGED_BY_LABEL,
    MANAGER,
    ROLE_LABEL,
    UID_LABEL,
    UNENCRYPTED,
)
from sparrowrl_operator.credentials import secret_value
from sparrowrl_operator.cycle import Facts, Outcome
from sparrowrl_operator.drift import ensure
from sparrowrl_operator.pods import Cluster, Pods, other_node

DAYS = 90  # a serving certificate's life, and RENEW of it left when it is issued anew: cert-manager's defaults
RENEW = 1 / 3


@dataclass(frozen=True)
class Trust:
    """What the job's pods trust (`ca_cert`), and its key where the operator issues (`ca`; None:
    cert-manager does)."""

    ca_cert: bytes
    ca: Issued | None = None


def authority(c: Facts, out: Outcome) -> Trust | None:
    """The job's CA, fit to sign (or cert-manager's, issuing); None when the job is not
    encrypted, or its certificates cannot be issued yet (the Encrypted condition says why,
    naming the field)."""
    job, spec = c.job, c.spec.tls
    if spec.mode == "Disabled" and ((c.document.get("tls") or {}).get("mode") or "Enabled") == "Enabled":
        out.transition(
            "Encrypted",
            False,
            UNENCRYPTED,
            "the job started before its operator encrypted jobs by default (its pods serve and fetch plain HTTP): "
            "it runs unencrypted until it starts again from nothing (suspend and resume it)",
            warning=True,
        )
        return None
    if spec.mode == "Disabled":
        out.transition(
            "Encrypted",
            False,
            UNENCRYPTED,
            "tls.mode is Disabled: the job runs unencrypted, and every hop (its tokens and its model's weights "
            "included) is plain HTTP; only a network or mesh that encrypts protects it",
            warning=True,
        )
        return None
    if spec.issuer_ref is not None:
        ca_cert = issuer.authority(c, out, trainer_names(c))
        return None if ca_cert is None else Trust(ca_cert)
    name = builders.authority_name(job, c.spec)
    field = f"tls.caSecretName: Secret {name}" if spec.ca_secret_name else f"Secret {name} (the job's CA)"
    seen = c.seen(None, "Secret", name)
    if seen is None and spec.ca_secret_name:
        out.transition("Encrypted", False, "CANotFound", f"{field} is not in namespace {job.namespace}", warning=True)
        return None
    if seen is None:
        made = c.obs.authority
        if made is None:
            out.condition("Encrypted", False, "Issuing", f"making the job's CA, Secret {name}")
            return None
        # made once, before the pods it certifies (a failed create: a new one next cycle, and what this one
        # signed is issued anew)
        out.actions.create.insert(0, (None, builders.authority_secret(job, made)))
        return _encrypted(out, name, Trust(made.cert, made))
    if not spec.ca_secret_name and not _ours(job, seen):
        out.transition(
            "Encrypted",
            False,
            CA_INVALID,
            f"Secret {name} exists and is not one this operator made for this job; it is left alone: name it in "
            "tls.caSecretName to issue from it, or delete it",
            warning=True,
        )
        return None
    try:
        ca = pki.read_authority(secret_value(seen, CERT_KEY) or b"", secret_value(seen, KEY_KEY) or b"", c.obs.now)
    except ValueError as e:
        fix = "" if spec.ca_secret_name else "; delete it, and the operator makes a new CA and issues anew"
        out.transition("Encrypted", False, CA_INVALID, f"{field}: {e}{fix}", warning=True)
        return None
    return _encrypted(out, name, Trust(ca.cert, ca))


def _encrypted(out: Outcome, name: str, trust: Trust) -> Trust:
    out.transition(
        "Encrypted",
        True,
        "CertificatesIssued",
        f"every hop is HTTPS, with certificates from the CA in Secret {name}; relays and workers trust it alone",
    )
    return trust


def effective(spec: JobSpec, pods: Pods) -> JobSpec:
    """The spec as the job runs: one that started before jobs were encrypted by default (a pod of
    it made without TLS) runs plain until every pod is made again, rather than half its pods
    speaking a scheme the others do not."""
    if not builders.encrypted(spec) or not any(_made_plain(p) for _, p in pods):
        return spec
    return spec.model_copy(update={"tls": TlsSpec(mode="Disabled")})


def _made_plain(pod: dict) -> bool:
    role = (pod["metadata"].get("labels") or {}).get(ROLE_LABEL)
    if other_node(pod):  # serves nothing, encrypted or not
        return False
    flag = "--ca-cert" if role == "worker" else "--tls-cert"
    containers = (pod.get("spec") or {}).get("containers") or []
    return role in ("trainer", "relay", "worker") and not any(flag in (c.get("args") or []) for c in containers)


def refused_url(spec: JobSpec) -> str | None:
    """Why trainer.service.url cannot be the encrypted trainer's address, or None (the CRD refuses
    it too, but not in a job that was stored before it did)."""
    url = spec.trainer.service.url
    if url is None or not builders.encrypted(spec) or url.startswith("https://"):
        return None
    return (
        f"spec.trainer.service.url {url!r}: the trainer serves HTTPS (tls.mode Enabled); give an https:// URL "
        "(a proxy in front must pass TLS through), or set tls.mode: Disabled"
    )


def _ours(job: JobRef, obj: dict) -> bool:
    labels = obj["metadata"].get("labels") or {}
    return labels.get(MANAGED_BY_LABEL) == MANAGER and labels.get(UID_LABEL) == job.uid


def serve(
    c: Facts, out: Outcome, trust: Trust, cluster: Cluster, role: Process, namespace: str, names: list[str]
) -> None:
    """The trainer's or a relay's serving certificate for `names`, kept, or issued anew."""
    if trust.ca is None:
        issuer.serve(c, out, trust.ca_cert, cluster, role, namespace, names)
        return
    ca = trust.ca
    home = cluster is None
    job = c.job if home else c.job.in_member()
    name = builders.serving_name(job, role)
    seen = c.seen(cluster, "Secret", name)
    if seen is not None:
        have = Issued(secret_value(seen, CERT_KEY) or b"", secret_value(seen, KEY_KEY) or b"")
        why = pki.unfit(have, ca, names, c.obs.now, RENEW)
        if why is None and secret_value(seen, CA_KEY) != ca.cert:
            why = "its ca.crt is not the job's CA"
        if why is None:
            ensure(c, out, cluster, builders.serving_secret(job, role, namespace, home, have, ca.cert))
            return
    served = pki.serving(ca, names, DAYS, c.obs.now)
    ensure(c, out, cluster, builders.serving_secret(job, role, namespace, home, served, ca.cert), expected=True)
    if seen is not None:
        what = {"trainer": "the trainer", "relay": f"the relay of {role.region}"}.get(
            role.kind, f"the workers of {role.region}"
        )
        where = f" in cluster {cluster}" if cluster else ""
        out.event(ISSUED, f"issued {what}'s serving certificate anew (Secret {name}{where}): {why}")


def trainer_names(c: Facts) -> list[str]:
    """Every name and address the trainer is reached at: its Service's names in the cluster, its load
    balancer's addresses, the node address its node port is published at, trainer.service.url's host."""
    names = builders.service_names(builders.trainer_name(c.job), c.job.namespace)
    svc = c.obs.trainer_service or {}
    if c.spec.trainer.service.type == "LoadBalancer":
        for ing in ((svc.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []:
            names += [h for h in (ing.get("ip"), ing.get("hostname")) if h]
    if c.spec.trainer.service.type == "NodePort" and c.obs.node_address:
        names.append(c.obs.node_address)
    if c.spec.trainer.service.url and (host := urllib.parse.urlsplit(c.spec.trainer.service.url).hostname):
        try:
            names.append(host.encode("idna").decode("ascii"))  # a certificate names A-labels
        except UnicodeError:
            pass  # not a name any client could ask for

    return list(dict.fromkeys(names))
