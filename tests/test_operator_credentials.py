"""Relays' and worker slots' tokens (credentials.py), decided: each expires an hour after it is
minted and is minted anew in its Secret when half of that is left, the pods unchanged (they read
the file again); a slot's replacement pod gets a token of a newer generation, which revokes the
old one once it calls in."""

from __future__ import annotations

import base64
import copy

from test_operator_decisions import World, at, body
from test_operator_placements import crash, single

from sparrowrl.auth.signing import Verifier, parse_public
from sparrowrl.auth.tokens import Gate, Principal, claims
from sparrowrl_operator.builders import credentials
from sparrowrl_operator.credentials import LIFETIME, REFRESH

SLOT = "add-grpo-u-1-worker-eu-0-token"


def token(w: World, name: str = SLOT, cluster="eu-west") -> str:
    return base64.b64decode(w.objects[cluster]["Secret", name]["data"]["token"]).decode()


def generation(pod: dict) -> int:
    return int(pod["metadata"]["annotations"]["sparrowrl.dev/token-generation"])


def test_tokens_expire_an_hour_on_and_are_minted_anew_with_half_left_the_pods_untouched():
    w, job = World(), body()
    job["spec"]["runPolicy"].pop("activeDeadlineSeconds", None)
    w.step(job, 0)
    w.step(job, 0)
    first = claims(token(w))
    pod = w.pods["eu-west"]["add-grpo-u-1-worker-eu-0-0"]
    assert first.expires == int(at(0).timestamp()) + LIFETIME and first.generation == generation(pod)
    assert first.who == Principal("worker", "add-grpo-u-1-worker-eu-0-*")
    due = LIFETIME * (1 - REFRESH)
    assert w.step(job, due - 60).apply == []  # more than half left: the same token, nothing written
    actions = w.step(job, due + 60)
    refreshed = {(c, m["metadata"]["name"]) for c, m in actions.apply if m["kind"] == "Secret"}
    assert ("eu-west", SLOT) in refreshed and (None, "add-grpo-relay-us-token") in refreshed
    assert not [r for _, r, _ in actions.events if r == "Corrected"]  # a refresh is no correction
    assert actions.create == [] and actions.delete == []  # no pod made again: they read the new file
    second = claims(token(w))
    assert second.expires == int(at(due + 60).timestamp()) + LIFETIME and second.generation == first.generation
    gate = Gate(None, Verifier(parse_public(_key(w))))
    late = at(LIFETIME + 400).timestamp()  # past the first token's expiry and the skew bound
    assert isinstance(gate.check(f"Bearer {token(w)}", late), Principal)
    assert gate.check(f"Bearer {first_token(w, first)}", late).startswith("the token expired at")


def _key(w: World) -> str:
    return base64.b64decode(w.objects["eu-west"]["Secret", SLOT]["data"]["trainer-key"]).decode()


def first_token(w: World, first) -> str:
    """The first token again: signing is deterministic, so minting its claims again gives it."""
    return credentials("tok", "worker", first.who.name, first.expires, first.generation)[0]


def test_a_replaced_workers_slot_gets_a_token_of_a_newer_generation_that_revokes_the_old():
    w, job = single()
    w.step(job, 1)  # the slots' Secrets, once the job's secret is stored
    old = token(w, "add-grpo-worker-us-1-token", None)
    crash(w, "add-grpo-worker-us-1-0", 50)
    w.step(job, 100)
    new_pod = w.pods[None]["add-grpo-worker-us-1-1"]
    new = token(w, "add-grpo-worker-us-1-token", None)
    assert claims(new).generation == generation(new_pod) > claims(old).generation
    assert claims(new).who == claims(old).who  # the slot's name: its pods' names all match it
    key = base64.b64decode(w.objects[None]["Secret", "add-grpo-worker-us-1-token"]["data"]["trainer-key"]).decode()
    gate = Gate(None, Verifier(parse_public(key)))
    now = at(100).timestamp()
    assert isinstance(gate.check(f"Bearer {old}", now), Principal)  # until the new pod calls in
    assert isinstance(gate.check(f"Bearer {new}", now), Principal)
    assert "was replaced by generation" in gate.check(f"Bearer {old}", now)
    other = token(w, "add-grpo-worker-us-0-token", None)
    assert isinstance(gate.check(f"Bearer {other}", now), Principal)  # the other slot's is its own


def test_the_trainer_keeps_the_jobs_secret_and_roles_read_their_token_from_a_file():
    w, job = World(), body()
    w.step(job, 0)
    w.step(job, 0)
    trainer = {e["name"] for e in w.pods[None]["add-grpo-trainer-0"]["spec"]["containers"][0]["env"]}
    assert "SPARROWRL_TOKEN" in trainer and "SPARROWRL_TOKEN_FILE" not in trainer
    relay = w.pods["eu-west"]["add-grpo-u-1-relay-eu-0"]["spec"]["containers"][0]
    assert {"name": "SPARROWRL_TOKEN_FILE", "value": "credentials/token"} in relay["env"]
    assert "SPARROWRL_TOKEN" not in {e["name"] for e in relay["env"]}
    mount = next(m for m in relay["volumeMounts"] if m["name"] == "credentials")
    assert "subPath" not in mount and mount["readOnly"]


def test_what_a_slots_secret_says_is_not_taken_on_its_word():
    """A member cluster's admin can write the slot's Secret: a token there that the job's key did
    not sign (a generation or an expiry of their choosing) is minted anew, as is a pod's
    generation annotation out of range."""
    from sparrowrl.auth.signing import Signer
    from sparrowrl.auth.tokens import mint

    w, job = World(), body()
    w.step(job, 0)
    w.step(job, 0)
    pod = w.pods["eu-west"]["add-grpo-u-1-worker-eu-0-0"]
    forged = mint(Signer("not the job's"), "worker", "add-grpo-u-1-worker-eu-0-*", expires=2**53 - 1, generation=7)
    w.objects["eu-west"]["Secret", SLOT]["data"]["token"] = base64.b64encode(forged.encode()).decode()
    pod["metadata"]["annotations"]["sparrowrl.dev/token-generation"] = str(2**60)
    w.step(job, 10)
    now = claims(token(w))
    assert now.expires == int(at(10).timestamp()) + LIFETIME  # an hour, whatever was written there
    assert now.generation is not None and int(at(10).timestamp()) <= now.generation < 2**53  # a fresh one


def test_a_replacement_that_could_not_be_made_keeps_its_generation_and_none_goes_back():
    w, job = single()
    w.step(job, 1)
    crash(w, "add-grpo-worker-us-1-0", 50)
    failed = copy.deepcopy(w.pods[None]["add-grpo-worker-us-1-0"])
    actions = w.step(job, 100)
    (made,) = [m for _, m in actions.create]
    pending = generation(made)
    assert pending > generation(failed)
    del w.pods[None][made["metadata"]["name"]]  # its creation failed (a quota, say), and the old pod stays
    w.pods[None]["add-grpo-worker-us-1-0"] = failed
    assert claims(token(w, "add-grpo-worker-us-1-token", None)).generation == pending
    actions = w.step(job, 200)  # tried again: the generation handed out, not a newer one
    (again,) = [m for _, m in actions.create]
    assert generation(again) == pending == claims(token(w, "add-grpo-worker-us-1-token", None)).generation


def test_while_certificates_cannot_be_issued_no_pod_is_made_and_tokens_stay_fresh():
    """A CA that breaks mid-run: running pods keep their tokens refreshed, with the CA they trust;
    nothing new starts until it can sign again."""
    w, job = World(), body()
    job["spec"]["runPolicy"].pop("activeDeadlineSeconds", None)
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    ca_before = base64.b64decode(w.objects["eu-west"]["Secret", SLOT]["data"]["ca.crt"])
    w.objects[None]["Secret", "add-grpo-ca"]["data"]["tls.key"] = base64.b64encode(b"broken").decode()
    del w.pods["eu-west"]["add-grpo-u-1-worker-eu-1-0"]  # a pod gone: not made again while the CA is broken
    actions = w.step(job, LIFETIME * (1 - REFRESH) + 60)
    assert not [m for _, m in actions.create if m["kind"] == "Pod"]
    refreshed = claims(token(w))
    assert refreshed.expires == int(at(LIFETIME * (1 - REFRESH) + 60).timestamp()) + LIFETIME
    assert base64.b64decode(w.objects["eu-west"]["Secret", SLOT]["data"]["ca.crt"]) == ca_before
