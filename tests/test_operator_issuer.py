"""Certificates from cert-manager (tls.issuerRef, issuer.py), decided. cert-manager cannot run
here: `cert_manager` below stands in for it at the edge, issuing each Certificate's Secret as it
would (tls.crt, tls.key, ca.crt, the secretTemplate's labels) from a CA of its own."""

from __future__ import annotations

import base64

import pytest
from cryptography import x509
from test_operator_decisions import T0, World, body, condition
from test_operator_tls import names_in, secret, signed_by

from sparrowrl.auth import pki
from sparrowrl.spec.job import JobError, parse

ISSUER_CA = pki.authority("cert-manager's CA", now=T0)
REF = {"name": "team", "kind": "Issuer"}


def issuer(ready: bool = True, message: str = "") -> dict:
    cond = {"type": "Ready", "status": str(ready), "reason": "x", "message": message}
    return {"metadata": {"name": "team", "namespace": "default"}, "status": {"conditions": [cond]}}


def cert_manager(w: World, ca: pki.Issued = ISSUER_CA, with_ca: bool = True) -> list[str]:
    """Issue every Certificate in the operator's cluster whose Secret is missing or names too little,
    as cert-manager would; the names of the Secrets written."""
    done = []
    for (kind, name), cert in list(w.objects.get(None, {}).items()):
        if kind != "Certificate":
            continue
        spec = cert["spec"]
        names = spec.get("dnsNames", []) + spec.get("ipAddresses", [])
        have = w.objects[None].get(("Secret", spec["secretName"]))
        if have is not None and set(names) <= names_in(base64.b64decode(have["data"]["tls.crt"])):
            continue
        served = pki.serving(ca, names, now=T0)
        data = {"tls.crt": served.cert, "tls.key": served.key} | ({"ca.crt": ca.cert} if with_ca else {})
        w.objects[None]["Secret", spec["secretName"]] = {
            "metadata": {
                "name": spec["secretName"],
                "namespace": "default",
                "labels": spec["secretTemplate"]["labels"],
            },
            "type": "kubernetes.io/tls",
            "data": {k: base64.b64encode(v).decode() for k, v in data.items()},
        }
        done.append(spec["secretName"])
    return done


def job() -> dict:
    return body(tls={"issuerRef": REF})


def test_a_missing_or_unready_issuer_is_named_and_nothing_starts():
    w, j = World(), job()
    w.step(j, 0)
    e = condition(j, "Encrypted")
    assert (
        e["reason"] == "IssuerNotFound" and "tls.issuerRef: Issuer team in namespace default not found" in e["message"]
    )
    assert not w.pods and "add-grpo-ca" not in {n for _, n in w.objects[None]}  # no CA of the operator's
    w.objects[None]["Issuer", "team"] = issuer(False, "the CA Secret team-ca is missing")
    w.step(j, 1)
    e = condition(j, "Encrypted")
    assert e["reason"] == "IssuerNotReady" and "the CA Secret team-ca is missing" in e["message"] and not w.pods


def test_cert_manager_issues_every_serving_certificate_and_the_pods_trust_its_ca():
    w, j = World(), job()
    w.objects[None] = {("Issuer", "team"): issuer()}
    w.step(j, 0)
    cert = w.objects[None]["Certificate", "add-grpo-trainer-tls"]
    assert cert["spec"]["issuerRef"] == {"name": "team", "kind": "Issuer", "group": "cert-manager.io"}
    assert cert["spec"]["ipAddresses"] == ["203.0.113.7"] and "add-grpo-trainer.default.svc" in cert["spec"]["dnsNames"]
    assert condition(j, "Encrypted")["reason"] == "Issuing" and not w.pods  # waits for cert-manager
    assert cert_manager(w) == ["add-grpo-trainer-tls"]
    w.step(j, 1)
    assert condition(j, "Encrypted")["status"] == "True"
    assert w.names(None)  # the trainer, and the home region's relay and workers
    relays = {n for k, n in w.objects[None] if k == "Certificate"} - {"add-grpo-trainer-tls"}
    assert relays == {f"add-grpo-{k}-{r}-tls" for k in ("relay", "worker") for r in ("us", "eu", "ap")}
    eu = w.objects[None]["Certificate", "add-grpo-relay-eu-tls"]["spec"]
    assert "add-grpo-u-1-relay-eu.sparrowrl.svc" in eu["dnsNames"]  # the member's names, issued at home
    cert_manager(w)
    w.step(j, 2)
    copy = secret(w, "add-grpo-u-1-relay-eu-tls", "eu-west")  # delivered to the member, as issued
    assert signed_by(copy["tls.crt"], ISSUER_CA.cert) and copy["ca.crt"] == ISSUER_CA.cert
    assert secret(w, "add-grpo-u-1-worker-eu-0-token", "eu-west")["ca.crt"] == ISSUER_CA.cert
    written = [m["metadata"]["name"] for s in (w.step(j, 3),) for _, m in s.apply]
    assert "add-grpo-trainer-tls" not in written  # cert-manager's Secret, never the operator's


def test_an_address_that_appears_later_goes_into_the_certificate_for_cert_manager_to_reissue():
    w, j = World(lb=None), job()
    w.objects[None] = {("Issuer", "team"): issuer()}
    w.step(j, 0)
    assert "ipAddresses" not in w.objects[None]["Certificate", "add-grpo-trainer-tls"]["spec"]
    cert_manager(w)
    w.step(j, 1)
    cert_manager(w)  # the relays'
    w.lb = "198.51.100.1"
    w.step(j, 2)
    assert w.objects[None]["Certificate", "add-grpo-trainer-tls"]["spec"]["ipAddresses"] == ["198.51.100.1"]
    assert "add-grpo-trainer-tls" in cert_manager(w)  # reissued (and the members' relays' first)
    issued = secret(w, "add-grpo-trainer-tls")["tls.crt"]
    assert "198.51.100.1" in names_in(issued) and x509.load_pem_x509_certificate(issued)


def test_an_issuer_that_gives_no_ca_is_refused_by_name():
    w, j = World(), job()
    w.objects[None] = {("Issuer", "team"): issuer()}
    w.step(j, 0)
    cert_manager(w, with_ca=False)
    w.step(j, 1)
    e = condition(j, "Encrypted")
    assert e["reason"] == "InvalidCA" and "no CA certificate (ca.crt)" in e["message"] and not w.pods


@pytest.mark.parametrize(
    "tls, why",
    [
        ({"issuerRef": REF, "caSecretName": "x"}, "give caSecretName or issuerRef, not both"),
        ({"issuerRef": REF, "mode": "Disabled"}, "issuerRef 'team' is for mode Enabled"),
        ({"issuerRef": {"name": "team", "kind": "Vault"}}, "kind"),
    ],
)
def test_an_issuer_ref_that_contradicts_the_spec_is_refused(tls, why):
    j = body(tls=tls)
    with pytest.raises(JobError, match=why):
        parse({k: j[k] for k in ("apiVersion", "kind", "metadata", "spec")}, "default/add-grpo")
