"""The job's run as a whole (lifecycle.py): suspend and resume, success and its TTL, deadlines,
and a finished job given more steps."""

from __future__ import annotations

import pytest
from test_operator_decisions import World, annotated_steps, at, body, claim, condition, job_document, trainer_status

from sparrowrl_operator.times import stamp


def test_suspend_deletes_the_pods_and_resume_continues():
    w, job = World(), body()
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    job["spec"]["runPolicy"] = {"suspend": True}
    actions = w.step(job, 10)
    assert job["status"]["phase"] == "Suspended" and not any(w.pods.values())
    assert ("Normal", "Suspended") in [(t, r) for t, r, _ in actions.events]
    assert ("PersistentVolumeClaim", "add-grpo-state") in w.objects[None]  # the state stays
    job["spec"]["runPolicy"] = {"suspend": False, "activeDeadlineSeconds": 100}
    w.step(job, 500)  # the deadline counts from the resume
    assert job["status"]["phase"] == "Pending" and "add-grpo-trainer-0" in w.names()
    assert job["status"]["activeSince"] == "2026-12-01T12:08:20Z"
    w.step(job, 601)
    assert condition(job, "Failed")["reason"] == "DeadlineExceeded"


def test_success_and_ttl():
    w, job = World(), body(runPolicy={"ttlSecondsAfterFinished": 60})
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    w.set_phase("add-grpo-trainer-0", "Succeeded", finished=100, exit_code=0)
    actions = w.step(job, 100)
    assert job["status"]["phase"] == "Succeeded" and not actions.delete_job
    assert w.names(None) == ["add-grpo-trainer-0"] and not w.names("eu-west")  # the rollout's machines freed
    assert job["status"]["completionTime"] == "2026-12-01T12:01:40Z"
    assert job["status"]["display"]["step"] == "300/300"  # exit 0: every step trained, whatever was last polled
    assert w.step(job, 159).delete_job is False
    assert w.step(job, 160).delete_job is True


def test_a_succeeded_job_with_raised_steps_trains_on():
    w, job = World(), body(runPolicy={"activeDeadlineSeconds": 1000})
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    w.set_phase("add-grpo-worker-us-0-0", "Succeeded", finished=90, exit_code=0)  # told the job was done
    w.set_phase("add-grpo-trainer-0", "Succeeded", finished=100, exit_code=0)
    w.step(job, 100)
    assert job["status"]["phase"] == "Succeeded" and w.names(None) == ["add-grpo-trainer-0", "add-grpo-worker-us-0-0"]
    assert w.step(job, 5000).events == []
    job["spec"]["steps"] = 350
    actions = w.step(job, 5000)  # long past activeDeadlineSeconds: it counts again from now
    assert job["status"]["phase"] == "Restarting" and "completionTime" not in job["status"]
    succeeded = condition(job, "Succeeded")
    assert (succeeded["status"], succeeded["reason"]) == ("False", "StepsRaised")
    assert "from 300 to 350" in succeeded["message"]
    assert ("Normal", "StepsRaised") in [(t, r) for t, r, _ in actions.events]
    assert job["status"]["display"]["step"] == "300/350" and job["status"]["activeSince"] == stamp(at(5000))
    assert job_document(w)["spec"]["steps"] == 350
    assert "add-grpo-trainer-0" not in w.names(None)  # restarted once it is gone: the same name
    assert "add-grpo-relay-us-0" in w.names(None) and w.names("eu-west")  # what the finish freed, made again
    w.step(job, 5001)
    assert annotated_steps(w) == "350"
    assert "add-grpo-worker-us-0-0" in w.names(None)  # the trainer is not running yet
    w.run_all()
    w.set_phase("add-grpo-worker-us-0-0", "Succeeded", finished=90, exit_code=0)
    w.pods[None]["add-grpo-trainer-0"]["status"]["startTime"] = stamp(at(5001))
    w.trainer = trainer_status([]).model_copy(update={"steps": 350, "step": 300})
    actions = w.step(job, 5002)
    assert [m["metadata"]["name"] for _, m in actions.create] == ["add-grpo-worker-us-0-1"]
    assert ("Normal", "Replaced") in [(t, r) for t, r, _ in actions.events]
    assert job["status"]["phase"] == "Running"
    w.set_phase("add-grpo-trainer-0", "Succeeded", finished=5100, exit_code=0)
    actions = w.step(job, 5100)
    assert job["status"]["phase"] == "Succeeded" and condition(job, "Succeeded")["message"] == "trained 350 steps"
    assert job["status"]["display"]["step"] == "350/350" and ("Normal", "Succeeded") in [
        (t, r) for t, r, _ in actions.events
    ]


def test_a_failed_job_stays_failed_when_its_steps_are_raised():
    w, job = World(), body(runPolicy={"backoffLimit": 0})
    w.step(job, 0)
    w.step(job, 0)
    w.set_phase("add-grpo-trainer-0", "Failed", finished=10)
    w.step(job, 20)
    assert job["status"]["phase"] == "Failed"
    job["spec"]["steps"] = 400
    actions = w.step(job, 30)
    assert job["status"]["phase"] == "Failed" and actions.create == [] and actions.events == []


def test_a_startup_deadline_counts_until_the_first_rollout():
    w, job = World(), body(runPolicy={"startupDeadlineSeconds": 120})
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    w.step(job, 119)
    assert job["status"]["phase"] == "Starting"  # the trainer runs; no rollout yet
    w.step(job, 121)
    failed = condition(job, "Failed")
    assert failed["reason"] == "DeadlineExceeded" and "startupDeadlineSeconds (120)" in failed["message"]
    w2, job2 = World(), body(runPolicy={"startupDeadlineSeconds": 120})
    w2.step(job2, 0)
    w2.step(job2, 0)
    w2.run_all()
    w2.trainer = trainer_status([("add-grpo-worker-us-0-0", 1.0, "ok")], step=1)
    w2.step(job2, 500)  # rollouts began: the startup deadline no longer applies
    assert job2["status"]["phase"] == "Running"


@pytest.mark.parametrize("when, kept", [("Retain", True), ("Delete", False)])
def test_the_ttl_says_what_becomes_of_the_model(when, kept):
    w, job = World(), body(runPolicy={"ttlSecondsAfterFinished": 60})
    job["spec"]["trainer"]["state"]["retentionPolicy"] = {"whenDeleted": when}
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    w.set_phase("add-grpo-trainer-0", "Succeeded", finished=100, exit_code=0)
    w.step(job, 100)
    actions = w.step(job, 160)
    assert actions.delete_job
    ((kind, message),) = [(t, m) for t, r, m in actions.events if r == "TTLExpired"]
    assert ("is kept" in message) == kept and ("goes with it" in message) == (not kept)
    assert kind == ("Normal" if kept else "Warning") and "add-grpo-state" in message


def test_a_finished_job_switched_to_retain_keeps_its_model():
    """A user who sees the job finish with whenDeleted: Delete, and switches to Retain to keep the
    model, keeps it: the claim loses the job's ownerReference before the TTL deletes the job."""
    w, job = World(), body(runPolicy={"ttlSecondsAfterFinished": 60})
    job["spec"]["trainer"]["state"]["retentionPolicy"] = {"whenDeleted": "Delete"}
    w.step(job, 0), w.step(job, 0)
    w.run_all()
    w.set_phase("add-grpo-trainer-0", "Succeeded", finished=100, exit_code=0)
    w.step(job, 100)
    assert job["status"]["phase"] == "Succeeded" and claim(w)["metadata"]["ownerReferences"]
    job["spec"]["trainer"]["state"]["retentionPolicy"] = {"whenDeleted": "Retain"}
    actions = w.step(job, 160)
    assert not actions.delete_job and [k for _, k, _, _, _ in actions.patch] == ["PersistentVolumeClaim"]
    assert claim(w)["metadata"]["ownerReferences"] == []
    actions = w.step(job, 161)
    assert actions.delete_job
    ((message,),) = [(m,) for _, r, m in actions.events if r == "TTLExpired"]
    assert "is kept" in message
