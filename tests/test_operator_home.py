"""The home cluster's objects (home.py): the job's ConfigMap keeps the document first written,
and the state's claim is made once, owned as its retention policy says, adopted from an earlier
job of the name, awaited while it goes, and left alone when it is not this operator's."""

from __future__ import annotations

import copy

import pytest
import yaml
from test_operator_decisions import World, body, claim, condition, settled


def test_the_job_configmap_keeps_the_document_first_written():
    """The trainer's state belongs to the job as it started: a later change of replicas or
    runPolicy leaves the ConfigMap alone; an edit of what the CRD keeps immutable is undone,
    and what was first written around it stays."""
    w, job = settled()
    key = ("ConfigMap", "add-grpo-job")
    first = yaml.safe_load(w.objects[None][key]["data"]["job.yaml"])
    job["spec"]["placements"][0]["replicas"] = 3
    job["spec"]["runPolicy"] = {"backoffLimit": 5}
    actions = w.step(job, 2)
    assert key not in {(m["kind"], m["metadata"]["name"]) for _, m in actions.apply}
    assert yaml.safe_load(w.objects[None][key]["data"]["job.yaml"]) == first
    edited = copy.deepcopy(first)
    edited["spec"]["steps"], edited["spec"]["model"]["tiny"]["layers"] = 7, 9
    w.objects[None][key]["data"]["job.yaml"] = yaml.safe_dump(edited)
    actions = w.step(job, 3)
    assert [(m["kind"], m["metadata"]["name"]) for _, m in actions.apply] == [key]
    assert yaml.safe_load(w.objects[None][key]["data"]["job.yaml"]) == first  # placements as first written
    assert w.step(job, 4).apply == []
    w.objects[None][key]["data"]["job.yaml"] = "a: &x [1]\nb: *x\n"  # aliases: not what the operator writes
    w.step(job, 5)
    assert yaml.safe_load(w.objects[None][key]["data"]["job.yaml"])["spec"] == job["spec"]


@pytest.mark.parametrize("when, owned", [(None, False), ("Retain", False), ("Delete", True)])
def test_the_state_claim_outlives_the_job_unless_told(when, owned):
    job = body()
    if when:
        job["spec"]["trainer"]["state"]["retentionPolicy"] = {"whenDeleted": when}
    w = World()
    actions = w.step(job, 0)
    (made,) = [m for _, m in actions.create if m["kind"] == "PersistentVolumeClaim"]
    assert ("ownerReferences" in made["metadata"]) == owned
    if owned:
        assert made["metadata"]["ownerReferences"][0] | {"uid": "u-1"} == made["metadata"]["ownerReferences"][0]
    assert "ownerReferences" in w.objects[None]["ConfigMap", "add-grpo-job"]["metadata"]  # the rest goes with the job


def test_a_changed_retention_policy_moves_the_claims_owner_and_keeps_others():
    w, job = settled()
    claim(w)["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "Backup", "name": "b", "uid": "b-1"}]
    assert w.step(job, 2).patch == []
    job["spec"]["trainer"]["state"]["retentionPolicy"] = {"whenDeleted": "Delete"}
    actions = w.step(job, 3)
    assert [(k, n) for _, k, _, n, _ in actions.patch] == [("PersistentVolumeClaim", "add-grpo-state")]
    assert [r["kind"] for r in claim(w)["metadata"]["ownerReferences"]] == ["Backup", "SparrowRLJob"]
    job["spec"]["trainer"]["state"]["retentionPolicy"] = {"whenDeleted": "Retain"}
    w.step(job, 4)
    assert [r["kind"] for r in claim(w)["metadata"]["ownerReferences"]] == ["Backup"]
    assert w.step(job, 5).patch == []


def test_a_claim_retained_from_an_earlier_job_of_the_name_is_adopted():
    w, job = settled()
    kept = claim(w)
    w2 = World()
    w2.objects[None] = {("PersistentVolumeClaim", "add-grpo-state"): kept}
    job2 = body()
    job2["metadata"]["uid"] = "u-2"
    actions = w2.step(job2, 100)
    assert not [m for _, m in actions.create if m["kind"] == "PersistentVolumeClaim"]
    assert claim(w2)["metadata"]["labels"]["sparrowrl.dev/job-uid"] == "u-2"
    assert claim(w2)["spec"] == kept["spec"]  # what it holds is untouched
    assert [r for _, r, _ in actions.events if r == "Adopted"] == ["Adopted"]
    assert "add-grpo-trainer-0" in w2.names()  # it resumes from it (and refuses another job's state)
    assert "Adopted" not in [r for _, r, _ in w2.step(job2, 101).events]  # said once


def test_a_claim_an_earlier_job_of_the_name_owned_is_not_adopted_but_awaited():
    """An earlier job of this name with whenDeleted: Delete owned it: the garbage collector will
    take it, so the new job waits for it to go, then makes its own, rather than keep it by
    dropping the reference."""
    job0 = body()
    job0["spec"]["trainer"]["state"]["retentionPolicy"] = {"whenDeleted": "Delete"}
    w0 = World()
    w0.step(job0, 0)
    w2, job2 = World(), body()
    w2.objects[None] = {("PersistentVolumeClaim", "add-grpo-state"): claim(w0)}
    job2["metadata"]["uid"] = "u-2"
    actions = w2.step(job2, 100)
    assert actions.patch == [] and not [m for _, m in actions.create if m["kind"] == "PersistentVolumeClaim"]
    assert "add-grpo-trainer-0" not in w2.names() and condition(job2, "TrainerReady")["reason"] == "WaitingForClaim"
    assert claim(w2)["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    del w2.objects[None]["PersistentVolumeClaim", "add-grpo-state"]  # collected
    actions = w2.step(job2, 101)
    (made,) = [m for _, m in actions.create if m["kind"] == "PersistentVolumeClaim"]
    assert made["metadata"]["labels"]["sparrowrl.dev/job-uid"] == "u-2"
    w2.step(job2, 102)
    assert "add-grpo-trainer-0" in w2.names()


def test_a_claim_this_operator_did_not_make_is_left_alone():
    w = World()
    foreign = {"metadata": {"name": "add-grpo-state", "labels": {"app": "db"}}, "spec": {"resources": {}}}
    w.objects[None] = {("PersistentVolumeClaim", "add-grpo-state"): copy.deepcopy(foreign)}
    job = body()
    actions = w.step(job, 0)
    failed = condition(job, "Failed")
    assert (
        failed["reason"] == "StateClaimConflict" and "PersistentVolumeClaim add-grpo-state exists" in failed["message"]
    )
    assert actions.patch == [] and not [m for _, m in actions.create if m["kind"] == "Pod"]
    assert claim(w) == foreign
