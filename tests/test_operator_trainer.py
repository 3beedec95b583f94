"""The trainer's slot (trainer.py): restarted after a failure with a backoff up to its limit,
restarted to read raised steps, and a job its spec check refuses failed rather than restarted."""

from __future__ import annotations

import pytest
from test_operator_decisions import World, annotated_steps, at, body, condition, job_document, settled, trainer_status

from sparrowrl_operator.reconcile import Backoff
from sparrowrl_operator.times import stamp


def test_the_trainer_restarts_with_backoff_up_to_the_limit():
    w, job = World(), body(runPolicy={"backoffLimit": 2})
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    w.set_phase("add-grpo-trainer-0", "Failed", finished=100)
    actions = w.step(job, 101, backoff=Backoff(base=10))
    assert actions.create == [] and job["status"]["phase"] == "Restarting"  # within its backoff (10 s)
    actions = w.step(job, 111, backoff=Backoff(base=10))
    assert [m["metadata"]["name"] for _, m in actions.create] == ["add-grpo-trainer-1"]
    assert "add-grpo-trainer-0" not in w.names() and job["status"]["restarts"] == 1
    w.set_phase("add-grpo-trainer-1", "Failed", finished=200)
    w.step(job, 300, backoff=Backoff(base=10))  # the second backoff is 20 s
    assert "add-grpo-trainer-2" in w.names()
    w.set_phase("add-grpo-trainer-2", "Failed", finished=400)
    actions = w.step(job, 1000)
    failed = condition(job, "Failed")
    assert job["status"]["phase"] == "Failed" and failed["reason"] == "BackoffLimitExceeded"
    assert "3 times" in failed["message"]
    running = [n for ps in w.pods.values() for n, p in ps.items() if p["status"]["phase"] == "Running"]
    assert running == []  # a failed job frees its machines
    assert w.names() == ["add-grpo-trainer-2"]  # the failed trainer stays for its logs
    assert w.step(job, 2000).create == []  # Failed is terminal


def test_raised_steps_restart_a_running_trainer_which_trains_on():
    """The ConfigMap gets the new steps (and keeps the rest as first written); the trainer's pod
    is restarted to read them, not counted as a failure; workers and relays keep running."""
    w, job = settled()
    first = job_document(w)
    assert annotated_steps(w) == "300"
    w.trainer = trainer_status([("add-grpo-worker-us-0-0", 1.0, "ok")], step=120)
    w.step(job, 5)
    job["spec"]["placements"][0]["replicas"] = 2  # later than the document: it stays out of it
    w.step(job, 6)
    pods = {c: w.names(c) for c in w.pods}
    job["spec"]["steps"] = 400
    actions = w.step(job, 10)
    assert job_document(w) == first | {"spec": first["spec"] | {"steps": 400}}
    assert [(t, r, m) for t, r, m in actions.events if r in ("StepsRaised", "Corrected")] == [
        ("Normal", "StepsRaised", "spec.steps raised from 300 to 400: the trainer trains on from its state")
    ]
    assert actions.delete == [(None, "Pod", "default", "add-grpo-trainer-0")] and actions.create == []
    assert job["status"]["phase"] == "Restarting" and job["status"]["display"]["step"] == "120/400"
    assert "raised from 300 to 400" in condition(job, "TrainerReady")["message"]
    w.trainer = None
    actions = w.step(job, 11)
    assert [m["metadata"]["name"] for _, m in actions.create] == ["add-grpo-trainer-0"]  # the same attempt
    assert annotated_steps(w) == "400" and job["status"]["restarts"] == 0
    assert {c: w.names(c) for c in w.pods} == pods
    w.run_all()
    w.trainer = trainer_status([("add-grpo-worker-us-0-0", 1.0, "ok")], step=121).model_copy(update={"steps": 400})
    actions = w.step(job, 12)
    assert (actions.create, actions.delete, actions.apply, actions.events) == ([], [], [], [])
    assert job["status"]["phase"] == "Running" and job["status"]["display"]["step"] == "121/400"


def test_a_trainer_that_read_fewer_steps_than_its_pod_was_made_with_restarts():
    """The trainer's own word wins: a pod that read its ConfigMap before the raise reached it."""
    w, job = settled()
    job["spec"]["steps"] = 400
    w.step(job, 5)
    w.step(job, 6)
    w.run_all()
    assert annotated_steps(w) == "400"
    w.trainer = trainer_status([])  # steps=300
    actions = w.step(job, 7)
    assert actions.delete == [(None, "Pod", "default", "add-grpo-trainer-0")]
    assert not [r for _, r, _ in actions.events if r == "StepsRaised"]  # the document had them already


@pytest.mark.parametrize("reported", [False, True])
def test_a_trainer_pod_made_before_the_steps_annotation_goes_by_the_steps_last_reported(reported):
    w, job = settled()
    del w.pods[None]["add-grpo-trainer-0"]["metadata"]["annotations"]
    if reported:
        w.trainer = trainer_status([])
        w.step(job, 2)
        w.trainer = None  # it stopped answering
    job["spec"]["steps"] = 400
    deleted = [(None, "Pod", "default", "add-grpo-trainer-0")] if reported else []  # else nothing to go by
    assert w.step(job, 3).delete == deleted


def refusing(w: World, name: str, exit_code: int, message: str) -> None:
    """The trainer pod as a kubelet leaves it when its check exited: Failed, never initialized."""
    w.set_phase(name, "Failed")
    status = w.pods[None][name]["status"]
    status["conditions"] = [{"type": "Initialized", "status": "False", "lastTransitionTime": stamp(at(10))}]
    status["initContainerStatuses"] = [
        {"name": "sparrowrl-check", "state": {"terminated": {"exitCode": exit_code, "message": message}}}
    ]
    status["containerStatuses"] = [{"name": "trainer", "state": {"waiting": {"reason": "PodInitializing"}}}]


def test_a_job_its_trainers_check_refuses_fails_as_invalid_spec_not_restarted():
    w, job = World(), body()
    w.step(job, 0), w.step(job, 0)
    w.run_all()
    log = "Some weights were not used\nerror: job.yaml: spec.task: reward 'x': no file /var/lib/sparrowrl/r/x.py\n"
    refusing(w, "add-grpo-trainer-0", 3, log)
    others = {n for ps in w.pods.values() for n in ps} - {"add-grpo-trainer-0"}
    actions = w.step(job, 11)
    failed = condition(job, "Failed")
    assert failed["reason"] == "InvalidSpec" and job["status"]["phase"] == "Failed"
    assert failed["message"] == (
        "the trainer's check in pod add-grpo-trainer-0: "
        "job.yaml: spec.task: reward 'x': no file /var/lib/sparrowrl/r/x.py"
    )
    assert actions.create == [] and job["status"]["restarts"] == 0
    assert {n for _, _, _, n in actions.delete} == others  # relays and workers freed at once
    assert ("Warning", "InvalidSpec") in [(t, r) for t, r, _ in actions.events]


def test_a_check_that_dies_otherwise_is_a_trainer_failure():
    w, job = World(), body()
    w.step(job, 0), w.step(job, 0)
    w.run_all()
    refusing(w, "add-grpo-trainer-0", 137, "")  # killed: out of memory, a node lost; the job may be fine
    w.step(job, 11)
    assert job["status"]["phase"] == "Restarting" and not any(
        c["type"] == "Failed" for c in job["status"]["conditions"]
    )
    w.step(job, 3600)  # its container never ran: the backoff counts from when the pod failed
    assert "add-grpo-trainer-1" in w.names() and "add-grpo-trainer-0" not in w.names()
    assert job["status"]["restarts"] == 1


def two_nodes(**run_policy) -> dict:
    job = body(runPolicy=run_policy)
    job["spec"]["trainer"] |= {"nodes": 2, "ranks": 1, "joinTimeoutSeconds": 60}
    return job


def test_a_trainer_of_two_nodes_is_two_pods_that_meet_at_node_0():
    """Node 0 serves as a one-node trainer does; node 1 serves nothing, on a claim of its own,
    and finds node 0 through a headless Service published before node 0 is ready. The trainer's
    Service sends workers to node 0 alone."""
    w, job = World(), two_nodes()
    created = [*w.step(job, 0).create, *w.step(job, 1).create]
    made = {
        m["metadata"]["name"]: m
        for c, m in created
        if c is None and m["kind"] == "Pod" and m["metadata"]["labels"]["sparrowrl.dev/role"] == "trainer"
    }
    assert sorted(made) == ["add-grpo-trainer-0", "add-grpo-trainer-node1-0"]
    zero, one = made["add-grpo-trainer-0"], made["add-grpo-trainer-node1-0"]
    meet = ["--rendezvous", "add-grpo-trainer-nodes.default.svc:29500"]
    assert zero["spec"]["containers"][0]["args"][-2:] == meet
    assert one["spec"]["containers"][0]["args"] == ["trainer", "job.yaml", "--state-dir", "state", "--node", "1", *meet]
    assert {"name": "rendezvous", "containerPort": 29500} in zero["spec"]["containers"][0]["ports"]
    claims = {
        v["persistentVolumeClaim"]["claimName"]
        for p in (zero, one)
        for v in p["spec"]["volumes"]
        if "persistentVolumeClaim" in v
    }
    assert claims == {"add-grpo-state", "add-grpo-state-node1"}
    assert "readinessProbe" not in one["spec"]["containers"][0] and not one["spec"].get("initContainers")
    assert not [e for e in one["spec"]["containers"][0]["env"] if "TOKEN" in e["name"]]  # it serves nothing
    assert (
        zero["metadata"]["labels"]["sparrowrl.dev/trainer-node"],
        one["metadata"]["labels"]["sparrowrl.dev/trainer-node"],
    ) == ("0", "1")
    objects = w.objects[None]
    assert ("PersistentVolumeClaim", "add-grpo-state-node1") in objects
    nodes = objects["Service", "add-grpo-trainer-nodes"]["spec"]
    assert nodes["clusterIP"] == "None" and nodes["publishNotReadyAddresses"] is True
    assert nodes["selector"]["sparrowrl.dev/trainer-node"] == "0"
    assert objects["Service", "add-grpo-trainer"]["spec"]["selector"]["sparrowrl.dev/trainer-node"] == "0"


def test_a_node_that_waits_is_named_with_why():
    w, job = World(), two_nodes()
    w.step(job, 0)
    w.step(job, 1)
    w.run_all()
    pod = w.pods[None]["add-grpo-trainer-node1-0"]
    pod["status"] = {
        "phase": "Pending",
        "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes have 8 GPUs"}
        ],
    }
    w.step(job, 2)
    ready = condition(job, "TrainerReady")
    assert (ready["status"], ready["reason"]) == ("False", "WaitingForNodes")
    assert ready["message"].startswith(
        "node 1: pod add-grpo-trainer-node1-0 is Pending (Unschedulable: 0/3 nodes have 8 GPUs) (node 0 waits "
        "trainer.joinTimeoutSeconds, 60 s, for every node)"
    )
    assert [(n["node"], n["pod"], n["phase"]) for n in job["status"]["trainerNodes"]] == [
        (0, "add-grpo-trainer-0", "Running"),
        (1, "add-grpo-trainer-node1-0", "Pending"),
    ]
    w.set_phase("add-grpo-trainer-node1-0", "Running")
    w.step(job, 3)
    assert condition(job, "TrainerReady")["reason"] == "Ready"


def test_one_node_failing_restarts_the_gang_counted_once():
    """Node 1 dies: after the backoff both pods are made again as the next attempt, the old ones
    deleted, one restart counted; past the backoff limit the job fails naming the node."""
    w, job = World(), two_nodes(backoffLimit=1)
    w.step(job, 0)
    w.step(job, 1)
    w.run_all()
    w.set_phase("add-grpo-trainer-node1-0", "Failed", finished=100, exit_code=137)
    actions = w.step(job, 101, backoff=Backoff(base=10))
    assert actions.create == [] and job["status"]["phase"] == "Restarting"
    said = condition(job, "TrainerReady")["message"]
    assert said.startswith("the trainer failed (node 1: pod add-grpo-trainer-node1-0, exit code 137)")
    assert said.endswith(": all 2 nodes restart together")
    actions = w.step(job, 111, backoff=Backoff(base=10))
    assert actions.create == []  # not before both are gone: no new node meets an old one
    assert sorted(n for _, _, _, n in actions.delete) == ["add-grpo-trainer-0", "add-grpo-trainer-node1-0"]
    assert job["status"]["restarts"] == 1
    assert [r for _, r, m in actions.events if "all 2 nodes restart" in m] == ["TrainerRestarted"]
    actions = w.step(job, 112, backoff=Backoff(base=10))
    made = sorted(m["metadata"]["name"] for _, m in actions.create)
    assert made == ["add-grpo-trainer-1", "add-grpo-trainer-node1-1"] and job["status"]["restarts"] == 1
    zero = next(m for _, m in actions.create if m["metadata"]["name"] == "add-grpo-trainer-1")
    assert "--tls-cert" in zero["spec"]["containers"][0]["args"]  # node 1 (serving nothing) did not make it plain
    w.run_all()
    w.set_phase("add-grpo-trainer-1", "Failed", finished=200)  # node 0 this time (it saw node 1 go, say)
    w.step(job, 300, backoff=Backoff(base=10))
    failed = condition(job, "Failed")
    assert job["status"]["phase"] == "Failed" and failed["reason"] == "BackoffLimitExceeded"
    assert "failed 2 times (last: node 0: pod add-grpo-trainer-1" in failed["message"]


def test_a_node_pod_never_made_or_deleted_is_made_again_uncounted():
    """Its create refused (a quota), or the pod deleted by hand: made again as this attempt, not
    counted. (A node deleted while the gang ran fails node 0's next collective: then the gang
    restarts, counted, as after any failure.)"""
    w, job = World(), two_nodes()
    w.step(job, 0)
    w.step(job, 1)
    w.run_all()
    del w.pods[None]["add-grpo-trainer-node1-0"]
    actions = w.step(job, 2, backoff=Backoff(base=10))
    assert [m["metadata"]["name"] for _, m in actions.create] == ["add-grpo-trainer-node1-0"]
    assert actions.delete == [] and job["status"]["restarts"] == 0
    assert condition(job, "TrainerReady")["reason"] == "Creating"
