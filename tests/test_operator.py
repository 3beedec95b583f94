"""The operator under kopf, against emulated clusters (tests/support/kube.py): what it writes into the
home cluster and the members, its conditions and Events, its finalizer, a member going away."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml
from support.bounded import free_port
from support.kube import SERVICES, clusters, now, until
from support.operator_run import add_member, operator

pytestmark = pytest.mark.kube


JOBS = "sparrowrl.dev/v1alpha1/sparrowrljobs"
CLUSTERS = "sparrowrl.dev/v1alpha1/sparrowclusters"
JOB = {
    "apiVersion": "sparrowrl.dev/v1alpha1",
    "kind": "SparrowRLJob",
    "metadata": {"name": "grpo", "namespace": "default"},
    "spec": {
        "steps": 3,
        "model": {"tiny": {"hidden": 32, "layers": 1, "heads": 2}},
        "task": {"builtin": "add"},
        "trainer": {"service": {"url": "https://203.0.113.5:8470"}},
        "placements": [{"region": "us", "replicas": 1}, {"region": "eu", "cluster": "east", "replicas": 2}],
    },
}


def names(cluster, namespace, resource="v1/pods") -> set[str]:
    return {o["metadata"]["name"] for o in cluster.list(resource, namespace)}


def condition(obj: dict | None, type_: str) -> dict | None:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == type_), None)


def connected(home, name: str) -> None:
    until(
        lambda: (condition(home.get(CLUSTERS, None, name), "Active") or {}).get("status") == "True",
        30,
        f"member {name} connected",
    )


def reasons(cluster) -> set[str]:
    return {e.get("reason") for e in cluster.list("v1/events", "default")}


@pytest.mark.timeout(120)
def test_a_job_spans_clusters_and_its_delete_cleans_them():
    with clusters("home", "east") as (home, east), operator(home) as op:
        add_member(home, east, "east")
        connected(home, "east")
        uid = home.create(copy.deepcopy(JOB))["metadata"]["uid"]
        m = "grpo-" + uid[:5]  # names in a member carry the uid's start
        until(
            lambda: names(east, "sparrowrl") == {f"{m}-relay-eu-0", f"{m}-worker-eu-0-0", f"{m}-worker-eu-1-0"},
            30,
            "the member's relay and workers",
        )
        assert names(home, "default") == {"grpo-trainer-0", "grpo-relay-us-0", "grpo-worker-us-0-0"}
        until(
            lambda: (
                names(east, "sparrowrl", "v1/secrets")
                == {
                    f"{m}-relay-eu-token",
                    f"{m}-relay-eu-tls",
                    f"{m}-worker-eu-tls",
                    f"{m}-worker-eu-0-token",
                    f"{m}-worker-eu-1-token",
                }
            ),
            30,
            "each relay's and worker slot's own token, their certificates, and not the job's secret",
        )
        worker = east.get("v1/pods", "sparrowrl", f"{m}-worker-eu-0-0")
        assert worker["spec"]["containers"][0]["args"][:3] == ["worker", "--trainer", "https://203.0.113.5:8470"]
        job = until(lambda: (j := home.get(JOBS, "default", "grpo")) and condition(j, "Created") and j, 30, "a status")
        assert condition(job, "Created")["status"] == "True" and job["status"]["phase"] == "Pending"
        assert job["status"]["display"]["rollout"] == "0/3"
        assert "sparrowrl.dev/cleanup" in job["metadata"]["finalizers"]
        assert "Created" in reasons(home)
        home.delete(JOBS, "default", "grpo")
        until(
            lambda: (
                not names(east, "sparrowrl")
                and not names(east, "sparrowrl", "v1/services")
                and not names(east, "sparrowrl", "v1/secrets")
            ),
            30,
            "the member's objects deleted",
        )
        until(lambda: home.get(JOBS, "default", "grpo") is None, 30, "the finalizer released")
        assert (
            uid not in op._locks and uid not in op._written
        )  # an operator of many jobs over time keeps nothing of this one


@pytest.mark.timeout(120)
def test_an_unreachable_member_degrades_the_job_and_the_others_go_on():
    with clusters("home", "east") as (home, east), operator(home):
        add_member(home, east, "east")
        connected(home, "east")
        east.unreachable()
        until(
            lambda: (
                (condition(home.get(CLUSTERS, None, "east"), "Active") or {}).get("reason") == "ClientConnectionFailed"
            ),
            30,
            "the probe noticed",
        )
        home.create(copy.deepcopy(JOB))
        job = until(lambda: (j := home.get(JOBS, "default", "grpo")) and condition(j, "Degraded") and j, 30, "Degraded")
        assert condition(job, "Degraded")["status"] == "True" and "east" in condition(job, "Degraded")["message"]
        until(lambda: "grpo-worker-us-0-0" in names(home, "default"), 30, "the home placement goes on")
        east.reachable()
        connected(home, "east")  # reconnected, with backoff
        until(lambda: len(names(east, "sparrowrl")) == 3, 30, "the member's pods once it answers")
        until(lambda: condition(home.get(JOBS, "default", "grpo"), "Degraded")["status"] == "False", 30, "not Degraded")
        assert {"MemberUnreachable", "MemberReconnected"} <= reasons(home)


def applied_by(obj: dict | None) -> set[str]:
    """The managers whose server-side applies made the object what it is."""
    return {
        e["manager"]
        for e in ((obj or {}).get("metadata") or {}).get("managedFields") or []
        if e["operation"] == "Apply"
    }


def applies(cluster) -> int:
    """Server-side applies the operator has sent to the cluster so far."""
    served = cluster.emulator.served
    return sum(n for r, n in served.items() if r.method == "PATCH" and r.field_manager == "sparrowrl-operator")


def service_lists(cluster) -> int:
    """Lists of Services: the operator makes one per job reconcile, so they count its cycles."""
    served = cluster.emulator.served
    return sum(n for r, n in served.items() if r.method == "GET" and r.resource == SERVICES and r.name is None)


def corrected(cluster) -> set[str]:
    """What the operator's Corrected Events name (the message up to its colon)."""
    return {e["message"].split(":")[0] for e in cluster.list("v1/events", "default") if e.get("reason") == "Corrected"}


@pytest.mark.timeout(120)
def test_what_the_operator_decides_is_kept():
    """Edited behind the operator's back, the trainer's Service and the job's ConfigMap at home and
    a worker slot's token Secret in a member are applied again as its field manager; once they
    are as decided, cycles go by without another apply."""
    with clusters("home", "east") as (home, east), operator(home):
        add_member(home, east, "east")
        connected(home, "east")
        m = "grpo-" + home.create(copy.deepcopy(JOB))["metadata"]["uid"][:5]
        objects = [
            (home, "v1/services", "default", "grpo-trainer"),
            (home, "v1/configmaps", "default", "grpo-job"),
            (east, "v1/secrets", "sparrowrl", f"{m}-worker-eu-0-token"),
        ]
        first = [until(lambda o=o: o[0].get(*o[1:]), 30, f"{o[3]} made") for o in objects]
        assert all("sparrowrl-operator" in applied_by(o) for o in first)
        home.patch("v1/services", "default", "grpo-trainer", {"spec": {"ports": [{"name": "http", "port": 9999}]}})
        home.patch("v1/configmaps", "default", "grpo-job", {"data": {"job.yaml": "edited"}})
        east.patch("v1/secrets", "sparrowrl", f"{m}-worker-eu-0-token", {"data": {"trainer-key": "ZWRpdGVk"}})
        until(
            lambda: [p["port"] for p in home.get("v1/services", "default", "grpo-trainer")["spec"]["ports"]] == [8470],
            30,
            "the trainer's port as decided",
        )
        for (cluster, *key), before in zip(objects[1:], first[1:]):
            until(lambda c=cluster, k=key, b=before: c.get(*k)["data"] == b["data"], 30, f"{key[-1]} as decided")
        svc = home.get("v1/services", "default", "grpo-trainer")
        assert svc["spec"]["ports"][0] == {"name": "http", "port": 8470, "targetPort": "http", "protocol": "TCP"}
        assert svc["spec"]["clusterIP"] == first[0]["spec"]["clusterIP"], "what the server set stays"
        assert "sparrowrl-operator" in applied_by(svc)
        expected = {"Service grpo-trainer", "ConfigMap grpo-job", f"Secret {m}-worker-eu-0-token in cluster east"}
        assert until(lambda: corrected(home) >= expected and corrected(home), 30, "Corrected Events") == expected
        sent, cycles = applies(home) + applies(east), service_lists(home)
        until(lambda: service_lists(home) >= cycles + 3, 30, "three more reconciles")
        assert applies(home) + applies(east) == sent, "nothing drifted: nothing applied"


@pytest.mark.timeout(60)
def test_a_succeeded_job_given_more_steps_trains_on():
    """Steps raised on a job that succeeded: its ConfigMap gets them, the trainer's pod is made
    again under its name to read them, the relay comes back, and the status says why."""
    job = copy.deepcopy(JOB)
    job["spec"]["placements"] = [{"region": "us", "replicas": 1}]
    with clusters("home") as (home,), operator(home):
        home.create(job)
        first = until(lambda: home.get("v1/pods", "default", "grpo-trainer-0"), 30, "the trainer's pod")
        assert first["metadata"]["annotations"]["sparrowrl.dev/steps"] == "3"
        done = {"terminated": {"exitCode": 0, "finishedAt": first["metadata"]["creationTimestamp"]}}
        home.patch(
            "v1/pods",
            "default",
            "grpo-trainer-0",
            {"status": {"phase": "Succeeded", "containerStatuses": [{"name": "trainer", "state": done}]}},
            subresource="status",
        )
        until(lambda: (home.get(JOBS, "default", "grpo").get("status") or {}).get("phase") == "Succeeded", 30, "done")
        until(lambda: names(home, "default") == {"grpo-trainer-0"}, 30, "the relay and worker freed")
        home.patch(JOBS, "default", "grpo", {"spec": {"steps": 5}})

        def again() -> dict | None:
            pod = home.get("v1/pods", "default", "grpo-trainer-0")
            return pod if pod and pod["metadata"]["uid"] != first["metadata"]["uid"] else None

        pod = until(again, 30, "a new trainer pod under the same name")
        assert pod["metadata"]["annotations"]["sparrowrl.dev/steps"] == "5"
        assert (
            yaml.safe_load(home.get("v1/configmaps", "default", "grpo-job")["data"]["job.yaml"])["spec"]["steps"] == 5
        )
        until(lambda: {"grpo-relay-us-0", "grpo-worker-us-0-0"} <= names(home, "default"), 30, "the rollout again")
        status = until(
            lambda: (s := home.get(JOBS, "default", "grpo")["status"])["phase"] == "Pending" and s, 30, "Pending"
        )
        assert (condition({"status": status}, "Succeeded") or {}).get("reason") == "StepsRaised"
        assert status["display"]["step"] == "3/5" and "completionTime" not in status
        raised = [e["message"] for e in home.list("v1/events", "default") if e.get("reason") == "StepsRaised"]
        assert raised == ["spec.steps raised from 3 to 5: the trainer trains on from its state"]


@pytest.mark.timeout(60)
def test_a_bad_spec_is_a_condition_not_a_crash():
    bad = copy.deepcopy(JOB)
    bad["spec"]["model"]["tiny"]["hidden"] = 33  # the emulator has no CEL: the operator's parse catches it
    with clusters("home") as (home,), operator(home):
        home.create(bad)
        job = until(lambda: (j := home.get(JOBS, "default", "grpo")) and condition(j, "Failed") and j, 30, "Failed")
        failed = condition(job, "Failed")
        assert failed["reason"] == "InvalidSpec" and "hidden (33) must be a multiple of heads (2)" in failed["message"]
        assert names(home, "default") == set()
        assert "InvalidSpec" in reasons(home)


@pytest.mark.timeout(60)
def test_an_insecure_kubeconfig_is_refused():
    with clusters("home", "east") as (home, east), operator(home):
        config = east.kubeconfig()
        config["clusters"][0]["cluster"]["insecure-skip-tls-verify"] = True
        add_member(home, east, "east", kubeconfig=config)
        active = until(lambda: condition(home.get(CLUSTERS, None, "east"), "Active"), 30, "a probe")
        assert (active["status"], active["reason"]) == ("False", "InsecureKubeConfig")


@pytest.mark.timeout(60)
def test_the_sweep_removes_orphans_and_nothing_else():
    """Objects of a job that no longer exists (its delete came while the member was away) go;
    a live job's, and anything the operator did not write, stay."""

    def pod(name: str, labels: dict) -> dict:
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": "sparrowrl", "labels": labels},
            "spec": {"containers": [{"name": "c", "image": "x"}]},
        }

    ours = {"app.kubernetes.io/managed-by": "sparrowrl-operator"}
    with clusters("home", "east") as (home, east), operator(home):
        add_member(home, east, "east")
        connected(home, "east")
        live = home.create(copy.deepcopy(JOB))
        east.create(pod("orphan", ours | {"sparrowrl.dev/job-uid": "a-deleted-job"}))
        east.create(pod("someone-elses", {"sparrowrl.dev/job-uid": "a-deleted-job"}))
        east.create(pod("live", ours | {"sparrowrl.dev/job-uid": live["metadata"]["uid"]}))
        until(lambda: "orphan" not in names(east, "sparrowrl"), 30, "the orphan swept")
        assert {"someone-elses", "live"} <= names(east, "sparrowrl")


@pytest.mark.timeout(120)
def test_the_images_command_runs_the_operator(tmp_path):
    """`kopf run --standalone -m sparrowrl_operator.main`, as operator/Dockerfile starts it (all
    namespaces, a liveness endpoint), logged in through a kubeconfig: it serves /healthz and
    reconciles a job."""
    with clusters("home") as (home,):
        config = tmp_path / "kubeconfig"
        config.write_text(yaml.safe_dump(home.kubeconfig()))
        port = free_port()
        p = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "kopf"),
                "run",
                "--standalone",
                "--all-namespaces",
                f"--liveness=http://127.0.0.1:{port}/healthz",
                "-m",
                "sparrowrl_operator.main",
            ],
            env={**os.environ, "KUBECONFIG": str(config)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:

            def alive() -> bool:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                        return r.status == 200
                except OSError:
                    return p.poll() is not None and pytest.fail(p.stdout.read())

            until(alive, 60, "the liveness endpoint")
            bad = copy.deepcopy(JOB)
            del bad["spec"]["task"]
            home.create(bad)
            job = until(lambda: condition(home.get(JOBS, "default", "grpo"), "Failed"), 30, "the job reconciled")
            assert job["reason"] == "InvalidSpec" and "spec.task: Field required" in job["message"]
        finally:
            p.terminate()
            out, _ = p.communicate(timeout=30)
        assert p.returncode == 0, out[-3000:]


def crashed(home, name: str) -> None:
    """The pod's container exited 3, as a kubelet reports it (restartPolicy Never: the pod failed)."""
    t = now()
    done = {"exitCode": 3, "reason": "Error", "message": "CUDA out of memory", "startedAt": t, "finishedAt": t}
    home.patch(
        "v1/pods",
        "default",
        name,
        {
            "status": {
                "phase": "Failed",
                "startTime": t,
                "containerStatuses": [{"name": "worker", "state": {"terminated": done}}],
            }
        },
        subresource="status",
    )


@pytest.mark.timeout(90)
def test_a_worker_in_a_crash_loop_is_given_up_and_the_job_fails():
    """Its only worker keeps exiting 3: replaced once (workerBackoffLimit: 1) after a backoff, then
    given up: Degraded with the pod's reason, the job Failed, and no more pods, cycle after cycle."""
    job = copy.deepcopy(JOB)
    job["spec"]["placements"] = [{"region": "us", "replicas": 1}]
    job["spec"]["runPolicy"] = {"workerBackoffLimit": 1}
    with clusters("home") as (home,), operator(home):
        home.create(job)
        until(lambda: home.get("v1/pods", "default", "grpo-worker-us-0-0"), 30, "the worker's pod")
        crashed(home, "grpo-worker-us-0-0")
        again = until(lambda: home.get("v1/pods", "default", "grpo-worker-us-0-1"), 30, "its replacement")
        assert again["metadata"]["annotations"]["sparrowrl.dev/failures-in-a-row"] == "1"
        crashed(home, "grpo-worker-us-0-1")
        status = until(
            lambda: (s := home.get(JOBS, "default", "grpo").get("status") or {}).get("phase") == "Failed" and s,
            30,
            "the job failed",
        )
        degraded, failed = condition({"status": status}, "Degraded"), condition({"status": status}, "Failed")
        assert (degraded["status"], degraded["reason"]) == ("True", "CrashLoop")
        assert "pod grpo-worker-us-0-1: Error, exit code 3: CUDA out of memory" in degraded["message"]
        assert failed["reason"] == "WorkersFailed" and "grpo-worker-us-0-1" in failed["message"]
        assert status["placements"][0]["givenUp"] == ["grpo-worker-us-0-1"]
        cycles = service_lists(home)
        until(lambda: service_lists(home) >= cycles + 3, 30, "three more reconciles")
        assert {"grpo-worker-us-0-1"} == {n for n in names(home, "default") if "worker" in n}  # kept, not replaced
        events = [e for e in home.list("v1/events", "default") if e.get("reason") in ("CrashLoop", "Replaced")]
        assert sorted(e["reason"] for e in events) == ["CrashLoop", "Replaced"]


@pytest.mark.timeout(90)
def test_a_deleted_jobs_state_claim_stays_and_a_job_of_its_name_adopts_it():
    """The emulator, like the tests' other clusters, does not garbage-collect by ownerReferences,
    so what keeps the claim in a real cluster is asserted: it has none. A job made again under the
    name takes it over (its uid label) instead of making another."""
    job = copy.deepcopy(JOB)
    job["spec"]["placements"] = [{"region": "us", "replicas": 1}]
    with clusters("home") as (home,), operator(home):
        uid = home.create(copy.deepcopy(job))["metadata"]["uid"]
        claim = until(lambda: home.get("v1/persistentvolumeclaims", "default", "grpo-state"), 30, "the state's claim")
        assert "ownerReferences" not in claim["metadata"]
        assert (
            "ownerReferences"
            in until(lambda: home.get("v1/configmaps", "default", "grpo-job"), 30, "its ConfigMap")["metadata"]
        )
        home.delete(JOBS, "default", "grpo")
        until(lambda: home.get(JOBS, "default", "grpo") is None, 30, "the job deleted")
        kept = home.get("v1/persistentvolumeclaims", "default", "grpo-state")
        assert kept["metadata"]["uid"] == claim["metadata"]["uid"] and "ownerReferences" not in kept["metadata"]
        said = [e["message"] for e in home.list("v1/events", "default") if e.get("reason") == "StateRetained"]
        assert len(said) == 1 and "kubectl delete pvc grpo-state" in said[0]
        job["spec"]["trainer"]["state"] = {"retentionPolicy": {"whenDeleted": "Delete"}}
        new = home.create(job)["metadata"]["uid"]
        assert new != uid
        adopted = until(
            lambda: (
                (c := home.get("v1/persistentvolumeclaims", "default", "grpo-state"))["metadata"]["labels"][
                    "sparrowrl.dev/job-uid"
                ]
                == new
                and c
            ),
            30,
            "the claim adopted",
        )
        assert adopted["metadata"]["uid"] == claim["metadata"]["uid"]
        assert [r["uid"] for r in adopted["metadata"]["ownerReferences"]] == [new]  # now it goes with the job
        until(lambda: "Adopted" in reasons(home), 30, "an Adopted Event")
        until(lambda: "grpo-trainer-0" in names(home, "default"), 30, "the trainer, on the adopted claim")
