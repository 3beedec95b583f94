"""The job's certificates (tls.py), decided: a CA made once per job, or the user's read; a serving
certificate for the trainer and each relay for every name it is reached at, issued anew when a
load balancer's address appears, when it nears its end, or when it is unfit; pods that mount them
whole and speak HTTPS; and a job that cannot be encrypted waits, saying why, never plain."""

from __future__ import annotations

import base64
import datetime

import pytest
from cryptography import x509
from test_operator_decisions import CA, T0, World, body, condition

from sparrowrl.auth import pki
from sparrowrl.spec.job import JobError, parse
from sparrowrl_operator.tls import RENEW


def secret(w: World, name: str, cluster=None) -> dict[str, bytes]:
    data = w.objects[cluster]["Secret", name]["data"]
    return {k: base64.b64decode(v) for k, v in data.items()}


def names_in(cert: bytes) -> set[str]:
    sans = x509.load_pem_x509_certificate(cert).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(n) for n in sans.get_values_for_type(x509.DNSName)} | {
        str(a) for a in sans.get_values_for_type(x509.IPAddress)
    }


def signed_by(cert: bytes, ca: bytes) -> bool:
    try:
        x509.load_pem_x509_certificate(cert).verify_directly_issued_by(x509.load_pem_x509_certificate(ca))
        return True
    except Exception:
        return False


def tls_secret(name: str, cert: bytes, key: bytes) -> dict:
    return {
        "metadata": {"name": name, "namespace": "default"},
        "type": "kubernetes.io/tls",
        "data": {"tls.crt": base64.b64encode(cert).decode(), "tls.key": base64.b64encode(key).decode()},
    }


def issued(actions, reason: str = "CertificateIssued") -> list[str]:
    return [m for _, r, m in actions.events if r == reason]


def test_a_job_is_encrypted_by_default_every_hop_from_its_own_ca():
    w, job = World(), body()
    w.step(job, 0)
    w.step(job, 0)
    ca = secret(w, "add-grpo-ca")
    assert ca["tls.crt"] == CA.cert and w.objects[None]["Secret", "add-grpo-ca"]["type"] == "kubernetes.io/tls"
    assert "ownerReferences" in w.objects[None]["Secret", "add-grpo-ca"]["metadata"]  # it goes with the job
    trainer = secret(w, "add-grpo-trainer-tls")
    assert trainer["ca.crt"] == CA.cert and signed_by(trainer["tls.crt"], CA.cert)
    assert names_in(trainer["tls.crt"]) == {
        "add-grpo-trainer",
        "add-grpo-trainer.default",
        "add-grpo-trainer.default.svc",
        "add-grpo-trainer.default.svc.cluster.local",
        "203.0.113.7",  # the load balancer's address, where the members' workers reach it
    }
    relay = secret(w, "add-grpo-u-1-relay-eu-tls", "eu-west")  # in the member, with the member's names
    assert signed_by(relay["tls.crt"], CA.cert) and "add-grpo-u-1-relay-eu.sparrowrl.svc" in names_in(relay["tls.crt"])
    assert "tls.key" not in secret(w, "add-grpo-u-1-worker-eu-0-token", "eu-west")  # a worker serves nothing
    assert secret(w, "add-grpo-u-1-worker-eu-0-token", "eu-west")["ca.crt"] == CA.cert  # the CA, to each member
    assert condition(job, "Encrypted")["status"] == "True"

    pod = w.pods[None]["add-grpo-trainer-0"]["spec"]
    main = pod["containers"][0]
    assert main["args"][-4:] == ["--tls-cert", "tls/tls.crt", "--tls-key", "tls/tls.key"]
    mount = next(m for m in main["volumeMounts"] if m["name"] == "tls")
    assert "subPath" not in mount  # a subPath is never updated in the pod: renewals would not reach it
    tls_files = [{"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"}]
    assert {"name": "tls", "secret": {"secretName": "add-grpo-trainer-tls", "items": tls_files}} in pod["volumes"]
    assert main["readinessProbe"]["httpGet"]["scheme"] == main["startupProbe"]["httpGet"]["scheme"] == "HTTPS"
    relay_pod = w.pods["eu-west"]["add-grpo-u-1-relay-eu-0"]["spec"]["containers"][0]
    assert relay_pod["args"][relay_pod["args"].index("--upstream") + 1] == "https://203.0.113.7:8470"
    assert relay_pod["args"][-6:] == [
        "--tls-cert",
        "tls/tls.crt",
        "--tls-key",
        "tls/tls.key",
        "--ca-cert",
        "credentials/ca.crt",
    ]
    worker = w.pods["eu-west"]["add-grpo-u-1-worker-eu-0-0"]["spec"]
    assert worker["containers"][0]["args"][-6:] == [
        "--tls-cert",
        "tls/tls.crt",
        "--tls-key",
        "tls/tls.key",
        "--ca-cert",
        "credentials/ca.crt",
    ]  # its own ports (probes, metrics) HTTPS too, with its placement's certificate
    assert worker["containers"][0]["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert {"name": "tls", "secret": {"secretName": "add-grpo-u-1-worker-eu-tls", "items": tls_files}} in worker[
        "volumes"
    ]
    shared = secret(w, "add-grpo-u-1-worker-eu-tls", "eu-west")
    assert signed_by(shared["tls.crt"], CA.cert) and names_in(shared["tls.crt"]) == {"add-grpo-u-1-worker-eu.sparrowrl"}
    files = [{"key": "token", "path": "token"}, {"key": "ca.crt", "path": "ca.crt"}]
    assert {
        "name": "credentials",
        "secret": {"secretName": "add-grpo-u-1-worker-eu-0-token", "items": files},
    } in worker["volumes"]

    again = w.step(job, 1)
    assert again.apply == [] and again.create == [] and issued(again) == []  # nothing issued twice


def test_a_load_balancer_address_that_appears_later_is_added_by_a_new_certificate_not_a_restart():
    w, job = World(lb=None), body()
    w.step(job, 0)
    w.step(job, 0)
    first = secret(w, "add-grpo-trainer-tls")["tls.crt"]
    assert "198.51.100.1" not in names_in(first)
    w.lb = "198.51.100.1"
    actions = w.step(job, 5)
    now = secret(w, "add-grpo-trainer-tls")["tls.crt"]
    assert "198.51.100.1" in names_in(now) and signed_by(now, CA.cert)
    assert issued(actions) and "does not name 198.51.100.1" in issued(actions)[0]
    assert not [d for d in actions.delete if d[1] == "Pod"]  # the trainer reads the new pair where it runs


def test_certificates_are_renewed_when_a_third_of_their_life_is_left():
    w, job = World(), body()
    job["spec"]["runPolicy"].pop("activeDeadlineSeconds", None)  # a job that runs for months
    w.step(job, 0)
    w.step(job, 0)
    first = secret(w, "add-grpo-trainer-tls")["tls.crt"]
    end = x509.load_pem_x509_certificate(first).not_valid_after_utc
    start = x509.load_pem_x509_certificate(first).not_valid_before_utc
    due = (end - (end - start) * RENEW - T0).total_seconds()
    assert issued(w.step(job, due - 3600)) == []
    actions = w.step(job, due + 3600)
    renewed = {m.split("(Secret ")[1].split(")")[0] for m in issued(actions)}
    assert "add-grpo-trainer-tls" in renewed and "add-grpo-u-1-relay-eu-tls in cluster eu-west" in renewed
    after = x509.load_pem_x509_certificate(secret(w, "add-grpo-trainer-tls")["tls.crt"])
    assert after.not_valid_after_utc > end
    assert issued(w.step(job, due + 7200)) == []


def test_a_serving_certificate_another_ca_signed_is_issued_anew():
    w, job = World(), body()
    w.step(job, 0)
    w.step(job, 0)
    stranger = pki.serving(pki.authority("someone else"), ["add-grpo-trainer"], now=T0)
    w.objects[None]["Secret", "add-grpo-trainer-tls"]["data"]["tls.crt"] = base64.b64encode(stranger.cert).decode()
    actions = w.step(job, 1)
    assert "did not sign" in issued(actions)[0] or "not the key" in issued(actions)[0]
    assert signed_by(secret(w, "add-grpo-trainer-tls")["tls.crt"], CA.cert)


def test_tls_disabled_runs_plain_and_says_so():
    w, job = World(), body(tls={"mode": "Disabled"})
    actions = w.step(job, 0)
    actions.events += w.step(job, 0).events
    assert not [n for c in w.objects.values() for k, n in c if n.endswith(("-tls", "-ca"))]
    e = condition(job, "Encrypted")
    assert e["status"] == "False" and e["reason"] == "Unencrypted" and "runs unencrypted" in e["message"]
    assert ("Warning", "Unencrypted") in [(t, r) for t, r, _ in actions.events]
    worker = w.pods["eu-west"]["add-grpo-u-1-worker-eu-0-0"]["spec"]["containers"][0]
    assert worker["args"][2] == "http://203.0.113.7:8470" and "--ca-cert" not in worker["args"]
    assert "--tls-cert" not in w.pods[None]["add-grpo-trainer-0"]["spec"]["containers"][0]["args"]


def test_a_users_ca_is_waited_for_then_issued_from_and_never_written():
    w, job = World(), body(tls={"caSecretName": "team-ca"})
    actions = w.step(job, 0)
    e = condition(job, "Encrypted")
    assert (
        e["reason"] == "CANotFound" and "tls.caSecretName: Secret team-ca is not in namespace default" in e["message"]
    )
    assert not [m for _, m in actions.create if m["kind"] == "Pod"]  # nothing starts that could not be encrypted
    assert condition(job, "TrainerReady")["reason"] == "WaitingForCertificate"
    team = pki.authority("team", now=T0)
    w.objects[None]["Secret", "team-ca"] = tls_secret("team-ca", team.cert, team.key)
    w.step(job, 1)
    actions = w.step(job, 1)
    assert condition(job, "Encrypted")["status"] == "True"
    assert signed_by(secret(w, "add-grpo-trainer-tls")["tls.crt"], team.cert)
    assert secret(w, "add-grpo-u-1-worker-eu-0-token", "eu-west")["ca.crt"] == team.cert
    assert w.names(None) and "add-grpo-ca" not in {n for _, n in w.objects[None]}
    written = [m["metadata"]["name"] for s in (w.step(job, 2), actions) for _, m in s.apply + s.create]
    assert "team-ca" not in written


@pytest.mark.parametrize(
    "which, why",
    [
        ("garbage cert", "tls.caSecretName: Secret team-ca: tls.crt is not a PEM certificate"),
        ("garbage key", "tls.key is not an unencrypted PEM private key"),
        ("other key", "tls.key is not the key of the certificate in tls.crt"),
        ("not a CA", "tls.crt is not a CA certificate"),
        ("expired", "tls.crt expired at 2026-11-30T12:00:00Z"),
    ],
)
def test_a_users_ca_that_cannot_sign_is_named_and_nothing_runs_plain(which, why):
    team = pki.authority("team", now=T0 - datetime.timedelta(days=10), days=9)
    good = pki.authority("team", now=T0)
    leaf = pki.serving(good, ["x"], now=T0)
    cert, key = {
        "garbage cert": (b"-----BEGIN CERTIFICATE-----\nnope\n", good.key),
        "garbage key": (good.cert, b"nope"),
        "other key": (good.cert, team.key),
        "not a CA": (leaf.cert, leaf.key),
        "expired": (team.cert, team.key),
    }[which]
    w, job = World(), body(tls={"caSecretName": "team-ca"})
    w.objects[None] = {("Secret", "team-ca"): tls_secret("team-ca", cert, key)}
    actions = w.step(job, 0)
    e = condition(job, "Encrypted")
    assert e["status"] == "False" and e["reason"] == "InvalidCA" and why in e["message"], e
    assert ("Warning", "InvalidCA") in [(t, r) for t, r, _ in actions.events]
    assert not w.pods and not [n for c in w.objects.values() for _, n in c if n.endswith("-tls")]


def test_a_ca_secret_of_the_jobs_name_the_operator_did_not_make_is_left_alone():
    w, job = World(), body()
    theirs = pki.authority("theirs", now=T0)
    w.objects[None] = {("Secret", "add-grpo-ca"): tls_secret("add-grpo-ca", theirs.cert, theirs.key)}
    actions = w.step(job, 0)
    e = condition(job, "Encrypted")
    assert e["reason"] == "InvalidCA" and "not one this operator made" in e["message"]
    assert not [m for _, m in actions.apply + actions.create if m["metadata"]["name"] == "add-grpo-ca"]
    assert not w.pods


def test_a_job_s_own_ca_that_was_damaged_says_how_to_start_afresh():
    w, job = World(), body()
    w.step(job, 0)
    w.objects[None]["Secret", "add-grpo-ca"]["data"]["tls.key"] = base64.b64encode(b"broken").decode()
    w.step(job, 5)
    e = condition(job, "Encrypted")
    assert e["reason"] == "InvalidCA" and "Secret add-grpo-ca (the job's CA): tls.key" in e["message"]
    assert "delete it" in e["message"]


def test_a_spec_that_contradicts_itself_is_refused():
    job = body(tls={"mode": "Disabled", "caSecretName": "x"})
    with pytest.raises(JobError, match="caSecretName 'x' is for mode Enabled"):
        parse({k: job[k] for k in ("apiVersion", "kind", "metadata", "spec")}, "default/add-grpo")


def test_a_plain_trainer_url_fails_a_new_job_and_spares_one_that_started_plain():
    job = body(trainer={"service": {"url": "http://trainer.example.com:8470"}})
    w = World()
    w.step(job, 0)
    failed = condition(job, "Failed")
    assert failed["reason"] == "InvalidSpec" and "spec.trainer.service.url 'http://trainer" in failed["message"]
    assert not w.pods


def test_a_job_that_started_before_tls_by_default_runs_on_plain_and_says_so():
    """Its pods were made by an operator that set no TLS: it goes on as it started (new and
    replaced pods plain too), rather than half its pods speaking a scheme the others do not; once
    every pod is gone (suspended), it starts again encrypted."""
    w, job = World(), body()
    job["spec"]["runPolicy"].pop("activeDeadlineSeconds", None)
    w.step(
        job,
        0,
    )
    for pods in w.pods.values():  # as the operator before TLS made them
        for p in pods.values():
            c = p["spec"]["containers"][0]
            flags = [i for i, a in enumerate(c["args"]) if a in ("--tls-cert", "--tls-key", "--ca-cert")]
            c["args"] = [a for i, a in enumerate(c["args"]) if i not in flags and i - 1 not in flags]
    w.run_all()
    w.step(job, 5)
    e = condition(job, "Encrypted")
    assert e["status"] == "False" and "started before" in e["message"] and "suspend and resume" in e["message"]
    w.step(job, 6)
    relay = w.pods["eu-west"]["add-grpo-u-1-relay-eu-0"]["spec"]["containers"][0]["args"]
    assert "--tls-cert" not in relay and relay[relay.index("--upstream") + 1].startswith("http://")
    job["spec"]["runPolicy"]["suspend"] = True
    w.step(job, 7)
    w.pods.clear()  # the kubelets finished deleting them
    job["spec"]["runPolicy"]["suspend"] = False
    w.step(job, 8)
    w.step(job, 8)
    assert condition(job, "Encrypted")["status"] == "True"
    assert "--tls-cert" in w.pods[None]["add-grpo-trainer-0"]["spec"]["containers"][0]["args"]
