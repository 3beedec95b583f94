"""The operator's decisions, called directly: a job and what is observed → the plan. Each test
is a scenario: the observed state is built from the plans the operator made before, with the
pods' phases a kubelet would have written."""

from __future__ import annotations

import copy
import datetime
import json
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from sparrowrl.auth.signing import Verifier, parse_public
from sparrowrl.auth.tokens import Gate, Principal
from sparrowrl.spec.status import JobStatus as TrainerStatus
from sparrowrl.spec.status import WorkerStatus
from sparrowrl_operator.builders import credentials, merge, stored
from sparrowrl_operator.conditions import set_condition
from sparrowrl_operator.constants import ROLE_LABEL
from sparrowrl_operator.handlers import merge_patch, union
from sparrowrl_operator.reconcile import Backoff, Member, Observed, Plan, derive_phase, human_count, reconcile, stamp

ROOT = Path(__file__).resolve().parent.parent
T0 = datetime.datetime(2026, 12, 1, 12, 0, tzinfo=datetime.timezone.utc)
IMAGE = "sparrowrl-runtime:test"
MEMBERS = {"eu-west": Member("sparrowrl", True), "ap-south": Member("sparrowrl", True)}


def body(**spec_changes) -> dict:
    job = yaml.safe_load((ROOT / "examples" / "k8s" / "job.yaml").read_text())
    job["metadata"] |= {"uid": "u-1", "generation": 1}
    job["spec"].update(spec_changes)
    return job


def at(seconds: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=seconds)


class World:
    """The clusters as a plan leaves them: created and applied objects exist (as the API server
    stores them), deleted ones are gone."""

    def __init__(self, members=MEMBERS, lb: str | None = "203.0.113.7"):
        self.objects: dict = {}
        self.pods: dict = {}
        self.members = dict(members)
        self.lb = lb
        self.trainer: TrainerStatus | None = None

    def observe(self, now: datetime.datetime) -> Observed:
        svc = {"status": {"loadBalancer": {"ingress": [{"ip": self.lb}]}}} if self.lb else {}
        reachable = {None} | {m for m, x in self.members.items() if x.reachable}
        return Observed(
            now=now,
            token="tok",
            members=self.members,
            trainer_service=svc,
            trainer=self.trainer,
            pods={c: [copy.deepcopy(p) for p in ps.values()] for c, ps in self.pods.items() if c in reachable},
            objects={c: copy.deepcopy(o) for c, o in self.objects.items() if c in reachable},
        )

    def apply(self, plan: Plan, job: dict) -> None:
        for cluster, m in plan.create:
            if m["kind"] == "Pod":
                self.pods.setdefault(cluster, {}).setdefault(m["metadata"]["name"], m)
            else:
                self.objects.setdefault(cluster, {})[m["kind"], m["metadata"]["name"]] = copy.deepcopy(stored(m))
        for cluster, m in plan.apply:
            self.objects.setdefault(cluster, {})[m["kind"], m["metadata"]["name"]] = copy.deepcopy(stored(m))
        for cluster, kind, _ns, name, patch in plan.patch:
            self.objects[cluster][kind, name] = merge_patched(self.objects[cluster][kind, name], patch)
        for cluster, kind, _ns, name in plan.delete:
            assert kind == "Pod"
            self.pods[cluster].pop(name)
        if plan.status is not None:
            job["status"] = plan.status.model_dump(by_alias=True, exclude_none=True)

    def step(self, job: dict, seconds: float, **kw) -> Plan:
        plan = reconcile(job, self.observe(at(seconds)), IMAGE, **kw)
        self.apply(plan, job)
        return plan

    def set_phase(self, name: str, phase: str, ready: bool = True, finished: float | None = None, exit_code: int = 1):
        for pods in self.pods.values():
            if name in pods:
                st = {
                    "phase": phase,
                    "startTime": stamp(T0),
                    "conditions": [{"type": "Ready", "status": str(ready and phase == "Running")}],
                }
                if finished is not None:  # its own container, named as its role, ran from the pod's start
                    st["containerStatuses"] = [
                        {
                            "name": pods[name]["metadata"]["labels"][ROLE_LABEL],
                            "state": {
                                "terminated": {
                                    "exitCode": exit_code,
                                    "startedAt": stamp(T0),
                                    "finishedAt": at(finished).strftime("%Y-%m-%dT%H:%M:%SZ"),
                                }
                            },
                        }
                    ]
                pods[name]["status"] = st
                return
        raise KeyError(name)

    def run_all(self) -> None:
        for pods in self.pods.values():
            for name in pods:
                self.set_phase(name, "Running")

    def names(self, cluster=None) -> list[str]:
        return sorted(self.pods.get(cluster, {}))


def merge_patched(obj, patch):
    """A JSON merge patch (RFC 7386) applied, as the API server does: lists replaced whole."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(obj) if isinstance(obj, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patched(out.get(k), v)
    return out


def condition(job: dict, type_: str) -> dict:
    return next(c for c in job["status"]["conditions"] if c["type"] == type_)


def test_a_new_job_becomes_its_objects_in_each_cluster():
    w, job = World(), body()
    plan = w.step(job, 0)
    assert {c for c, _ in plan.create} == {None}  # members wait for the token's Secret, which they get a copy of
    plan = w.step(job, 0)
    made = plan.create + plan.apply  # Services, Secrets and ConfigMaps are applied
    kinds = sorted((c or "home", m["kind"], m["metadata"]["name"]) for c, m in made)
    assert ("home", "PersistentVolumeClaim", "add-grpo-state") not in kinds  # made in the first cycle
    assert ("eu-west", "Pod", "add-grpo-u-1-worker-eu-1-0") in kinds
    assert ("ap-south", "Secret", "add-grpo-u-1-token") not in kinds  # the job's secret stays with the trainer
    secrets = {(c, m["metadata"]["name"]): m["stringData"] for c, m in made if m["kind"] == "Secret"}
    assert {n for c, n in secrets if c == "ap-south"} == {
        "add-grpo-u-1-relay-ap-token",
        "add-grpo-u-1-worker-ap-0-token",
    }
    mine = secrets["ap-south", "add-grpo-u-1-worker-ap-0-token"]  # a slot's own token, and the trainer's key
    gate = Gate(None, Verifier(parse_public(mine["trainer-key"])))  # as the relay checks its workers
    assert gate.principal(f"Bearer {mine['token']}") == Principal("worker", "add-grpo-u-1-worker-ap-0-*")
    assert Gate.of("tok", None).principal(f"Bearer {mine['token']}") is not None  # from the secret the trainer holds
    before = credentials.cache_info()
    w.step(job, 10)  # a cycle builds each slot's Secret again (to judge drift), and signs nothing again
    after = credentials.cache_info()
    assert after.hits >= before.hits + len(secrets) - 1 and after.misses == before.misses
    env = {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in w.pods["ap-south"]["add-grpo-u-1-worker-ap-0-0"]["spec"]["containers"][0]["env"]
        if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]
    }
    assert env == {
        "SPARROWRL_TOKEN": {"name": "add-grpo-u-1-worker-ap-0-token", "key": "token"},
        "SPARROWRL_TRAINER_KEY": {"name": "add-grpo-u-1-worker-ap-0-token", "key": "trainer-key"},
    }
    assert w.names("eu-west") == ["add-grpo-u-1-relay-eu-0", "add-grpo-u-1-worker-eu-0-0", "add-grpo-u-1-worker-eu-1-0"]
    assert job["status"]["phase"] == "Pending"
    worker = w.pods["eu-west"]["add-grpo-u-1-worker-eu-0-0"]
    args = worker["spec"]["containers"][0]["args"]
    assert args[:5] == [
        "worker",
        "--trainer",
        "http://203.0.113.7:8470",
        "--relay",
        "http://add-grpo-u-1-relay-eu.sparrowrl.svc:8471",
    ]  # the load balancer; the region's relay
    home = w.pods[None]["add-grpo-worker-us-0-0"]["spec"]["containers"][0]["args"]
    assert home[2] == "http://add-grpo-trainer.default.svc:8470"
    assert w.pods["ap-south"]["add-grpo-u-1-worker-ap-0-0"]["spec"]["tolerations"] == [
        {"key": "spot", "operator": "Exists", "effect": "NoSchedule"}
    ]  # the placement's template
    assert "ownerReferences" in w.pods[None]["add-grpo-trainer-0"]["metadata"]
    assert "ownerReferences" not in worker["metadata"]  # no owner across clusters: the finalizer cleans up
    again = w.step(job, 1)
    assert again.create == [] and again.delete == []  # idempotent: a replayed watch changes nothing
    assert again.apply == [] and again.events == []


def test_a_sharded_trainer_gets_shared_memory_for_its_ranks():
    w, job = World(), body()
    job["spec"]["trainer"]["ranks"] = 2
    w.step(job, 0), w.step(job, 0)
    trainer = w.pods[None]["add-grpo-trainer-0"]["spec"]
    assert {"name": "shm", "emptyDir": {"medium": "Memory"}} in trainer["volumes"]
    assert {"name": "shm", "mountPath": "/dev/shm"} in trainer["containers"][0]["volumeMounts"]
    w, job = World(), body()
    w.step(job, 0), w.step(job, 0)
    assert "shm" not in str(w.pods[None]["add-grpo-trainer-0"]["spec"]["volumes"])


def test_workers_in_members_wait_for_the_trainers_outside_address():
    w, job = World(lb=None), body()
    w.step(job, 0)
    assert "eu-west" not in w.pods and w.names(None)
    assert "address" in condition(job, "RolloutReady")["message"]
    w.lb = "198.51.100.1"
    w.step(job, 5)
    assert w.names("eu-west") and job["status"]["trainerAddress"] == "http://198.51.100.1:8470"


def test_an_unreachable_member_degrades_the_job_and_the_others_go_on():
    w, job = World(members={**MEMBERS, "ap-south": Member("sparrowrl", False, "connection refused")}), body()
    plan = w.step(job, 0)
    plan.events += w.step(job, 0).events
    assert "ap-south" not in w.pods
    assert w.names("eu-west") and w.names(None)
    d = condition(job, "Degraded")
    assert d["status"] == "True" and "ap-south (connection refused)" in d["message"]
    assert ("Warning", "MemberUnreachable") in [(t, r) for t, r, _ in plan.events]
    w.members["ap-south"] = Member("sparrowrl", True)
    w.step(job, 10)
    assert condition(job, "Degraded")["status"] == "False" and w.names("ap-south")


def test_a_member_not_probed_yet_is_waited_for_not_degraded():
    w, job = World(members={**MEMBERS, "ap-south": Member("", None, "connecting")}), body()
    w.step(job, 0)
    w.step(job, 0)
    assert "ap-south" not in w.pods and w.names("eu-west")
    assert not any(c["type"] == "Degraded" for c in job["status"]["conditions"])
    assert "connecting to ap-south" in condition(job, "RolloutReady")["message"]


def test_the_trainer_restarts_with_backoff_up_to_the_limit():
    w, job = World(), body(runPolicy={"backoffLimit": 2})
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    w.set_phase("add-grpo-trainer-0", "Failed", finished=100)
    plan = w.step(job, 101, backoff=Backoff(base=10))
    assert plan.create == [] and job["status"]["phase"] == "Restarting"  # within its backoff (10 s)
    plan = w.step(job, 111, backoff=Backoff(base=10))
    assert [m["metadata"]["name"] for _, m in plan.create] == ["add-grpo-trainer-1"]
    assert "add-grpo-trainer-0" not in w.names() and job["status"]["restarts"] == 1
    w.set_phase("add-grpo-trainer-1", "Failed", finished=200)
    w.step(job, 300, backoff=Backoff(base=10))  # the second backoff is 20 s
    assert "add-grpo-trainer-2" in w.names()
    w.set_phase("add-grpo-trainer-2", "Failed", finished=400)
    plan = w.step(job, 1000)
    failed = condition(job, "Failed")
    assert job["status"]["phase"] == "Failed" and failed["reason"] == "BackoffLimitExceeded"
    assert "3 times" in failed["message"]
    running = [n for ps in w.pods.values() for n, p in ps.items() if p["status"]["phase"] == "Running"]
    assert running == []  # a failed job frees its machines
    assert w.names() == ["add-grpo-trainer-2"]  # the failed trainer stays for its logs
    assert w.step(job, 2000).create == []  # Failed is terminal


def test_a_failed_worker_is_replaced_after_its_backoff():
    w, job = World(), body()
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    w.set_phase("add-grpo-u-1-worker-eu-1-0", "Failed", finished=50)
    assert w.step(job, 52).create == []
    assert job["status"]["placements"][1]["failed"] == 1
    plan = w.step(job, 61)
    assert [m["metadata"]["name"] for _, m in plan.create] == ["add-grpo-u-1-worker-eu-1-1"]
    assert any(r == "Replaced" for _, r, _ in plan.events)
    assert "add-grpo-u-1-worker-eu-1-0" not in w.names("eu-west")
    w.run_all()
    w.step(job, 62)
    eu = job["status"]["placements"][1]
    assert (eu["region"], eu["desired"], eu["ready"], eu["failed"], eu["replaced"]) == ("eu", 2, 2, 0, 1)


def trainer_status(workers: list[tuple[str, float, str | None]], step: int = 5) -> TrainerStatus:
    return TrainerStatus(
        phase="Running",
        step=step,
        steps=300,
        version=step,
        reward_last=0.5,
        leases_active=3,
        last_payload_bytes=12_345,
        last_changed_fraction=0.012,
        commits_verified=7,
        workers=[
            WorkerStatus(
                name=n, seconds_since_seen=s, committed_version=step, staleness=0, last_verification=v, leases_held=1
            )
            for n, s, v in workers
        ],
    )


def test_a_stale_worker_is_reported_and_replaced():
    w, job = World(), body()
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    w.trainer = trainer_status([("add-grpo-worker-us-0-0", 2.0, "ok"), ("add-grpo-u-1-worker-eu-0-0", 400.0, "ok")])
    plan = w.step(job, 310)
    lh = condition(job, "LeasesHealthy")
    assert lh["status"] == "False" and lh["reason"] == "StaleWorkers" and "add-grpo-u-1-worker-eu-0-0" in lh["message"]
    assert ("Warning", "StaleWorker") in [(t, r) for t, r, _ in plan.events]
    assert "add-grpo-u-1-worker-eu-0-1" in w.names("eu-west") and "add-grpo-u-1-worker-eu-0-0" not in w.names("eu-west")
    assert job["status"]["leases"] | {"oldestHeartbeatSeconds": 0} == {
        "active": 3,
        "healthy": 2,
        "expired": 0,
        "requeued": 0,
        "staleWorkers": ["add-grpo-u-1-worker-eu-0-0"],
        "oldestHeartbeatSeconds": 0,
    }
    w.run_all()
    w.step(job, 320)  # the trainer still lists the old name; its pod is gone, so it no longer counts
    assert condition(job, "LeasesHealthy")["status"] == "True"


def test_a_stale_worker_gets_one_event_and_many_get_one_between_them():
    """Not an Event per stale worker per cycle (4,000 stale workers made 4,000 every cycle):
    one as each goes stale while the status can name them all, then one when their count changes."""
    stale = lambda plan: [m for _, r, m in plan.events if r == "StaleWorker"]  # noqa: E731
    places = [{"region": "us", "replicas": 40}, {"region": "eu", "cluster": "eu-west", "replicas": 40}]
    w, job = World(), body(placements=places, health={"staleAfterSeconds": 60, "onStale": "Ignore"})
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    workers = [n for c in (None, "eu-west") for n in w.names(c) if "-worker-" in n]
    assert len(workers) == 80
    w.trainer = trainer_status([(n, 61.0, "ok") for n in workers[:2]])
    assert len(stale(w.step(job, 70))) == 2
    assert stale(w.step(job, 80)) == []  # still the same two
    w.trainer = trainer_status([(n, 61.0, "ok") for n in workers[:3]])
    assert [m.split()[1] for m in stale(w.step(job, 90))] == [workers[2]]
    w.trainer = trainer_status([(n, 61.0, "ok") for n in workers[:64]])  # as many as the status names
    assert len(stale(w.step(job, 95))) == 61
    w.trainer = trainer_status([(n, 61.0, "ok") for n in workers[1:65]])  # one back, one more gone
    assert [m.split()[1] for m in stale(w.step(job, 97))] == [workers[64]]
    w.trainer = trainer_status([(n, 61.0, "ok") for n in workers])  # more than the status lists
    (many,) = stale(w.step(job, 100))
    assert many.startswith("80 workers not heard from")
    assert stale(w.step(job, 110)) == []
    assert job["status"]["progress"]["workerCounts"]["stale"] == 80


def test_no_worker_is_stale_while_the_trainer_has_just_started():
    """After a trainer restart every worker looks silent: they were backing off while it was down."""
    w, job = World(), body()
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    w.set_phase("add-grpo-trainer-0", "Running")
    w.pods[None]["add-grpo-trainer-0"]["status"]["startTime"] = stamp(at(1000))
    w.trainer = trainer_status([("add-grpo-worker-us-0-0", 400.0, "ok")])
    w.step(job, 1200)  # up 200 s, under staleAfterSeconds (300)
    assert condition(job, "LeasesHealthy")["status"] == "True" and "add-grpo-worker-us-0-0" in w.names()
    w.step(job, 1301)
    assert condition(job, "LeasesHealthy")["status"] == "False" and "add-grpo-worker-us-0-1" in w.names()


@pytest.mark.parametrize("on_stale, phase", [("Ignore", "Running"), ("FailJob", "Failed")])
def test_on_stale(on_stale, phase):
    w, job = World(), body(health={"staleAfterSeconds": 60, "onStale": on_stale})
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    w.trainer = trainer_status([("add-grpo-worker-us-0-0", 61.0, "ok")])
    w.step(job, 70)
    assert job["status"]["phase"] == phase
    assert ("add-grpo-worker-us-0-0" in w.names()) == (on_stale == "Ignore")
    if on_stale == "FailJob":
        assert condition(job, "Failed")["reason"] == "StaleWorkers"


def test_weights_in_sync_and_a_hash_mismatch():
    w, job = World(), body()
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    w.trainer = trainer_status([("add-grpo-worker-us-0-0", 1.0, "ok"), ("add-grpo-worker-us-1-0", 1.0, "ok")])
    w.step(job, 5)
    assert condition(job, "WeightsInSync")["status"] == "True"
    assert job["status"]["phase"] == "Running"
    assert job["status"]["display"] == {
        "step": "5/300",
        "rollout": "5/5",
        "leases": "3/3",
        "clusters": "3/3",
        "payload": "12.3 kB (1.20%)",
    }
    w.trainer = trainer_status([("add-grpo-worker-us-0-0", 1.0, "ok"), ("add-grpo-worker-us-1-0", 1.0, "mismatch")])
    plan = w.step(job, 6)
    ws = condition(job, "WeightsInSync")
    assert (ws["status"], ws["reason"]) == ("False", "HashMismatch") and "add-grpo-worker-us-1-0" in ws["message"]
    assert any(r == "HashMismatch" for _, r, _ in plan.events)


def test_a_status_of_hundreds_of_workers_counts_them_all_and_lists_the_worst_64():
    """The trainer lists every worker; the custom resource gets counts of them all and the worst
    64, however many there are: mismatches, then those with most refused samples, then stale ones,
    then the furthest behind, then those refusing answers (not the first 64 by name), in a status
    far under a CR's size limit."""
    w = World(members={})
    job = body(placements=[{"region": f"r{i}", "replicas": 64} for i in range(8)], health={"onStale": "Ignore"})
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    names = [n for n in w.names() if "-worker-" in n]
    assert len(names) == 512
    last = names[-64:]  # the worst all sort last by name
    mismatched, stale, behind, refusing = last[-3:], last[-9:-3], last[-20:-9], last[-24:-20]
    untrusted = {last[-26]: 2, last[-25]: 9}  # refused samples: the more, the worse
    workers = [
        WorkerStatus(
            name=n,
            committed_version=2 if n in behind else 5,
            staleness=3 if n in behind else 0,
            last_verification="mismatch" if n in mismatched else "ok",
            seconds_since_seen=400.0 if n in stale else 1.0,
            refused_answers=7 if n in refusing else 0,
            refused_samples=untrusted.get(n, 0),
        )
        for n in names + ["add-grpo-worker-gone-0-0"]  # a pod gone, that the trainer still lists
    ]
    w.trainer = trainer_status([]).model_copy(update={"workers": workers})
    w.step(job, 310)  # the trainer has been up past staleAfterSeconds (300)
    progress = job["status"]["progress"]
    listed = [x["name"] for x in progress["workers"]]
    assert len(listed) == 64
    assert listed[:3] == sorted(mismatched) and listed[3:5] == [last[-25], last[-26]]
    assert set(listed[5:11]) == set(stale) and set(listed[11:22]) == set(behind)
    assert listed[22:26] == sorted(refusing) and listed[26] == names[0]  # then the rest, by name
    assert progress["workers"][3] == {
        "name": last[-25],
        "committedVersion": 5,
        "verification": "ok",
        "behind": 0,
        "refusedSamples": 9,
    }
    assert progress["workers"][0] == {
        "name": mismatched[0],
        "committedVersion": 5,
        "verification": "mismatch",
        "behind": 0,
    }
    assert progress["workerCounts"] == {
        "total": 513,
        "live": 512,
        "stale": 6,
        "mismatched": 3,
        "behind": 11,
        "refusing": 4,
        "untrusted": 2,
        "byStaleness": {"current": 501, "one": 0, "two": 0, "threeOrMore": 11, "unknown": 0},
    }
    assert job["status"]["leases"]["staleWorkers"] == sorted(stale)
    assert condition(job, "WeightsInSync")["reason"] == "HashMismatch"
    w.trainer = trainer_status([]).model_copy(
        update={
            "workers": [
                x.model_copy(update={"last_verification": "ok", "staleness": 0, "seconds_since_seen": 1.0})
                for x in workers
            ]
        }
    )
    w.step(job, 320)
    assert "512 workers within" in condition(job, "WeightsInSync")["message"]  # all of them, not the 64 listed
    assert len(json.dumps(job["status"]).encode()) < 64 << 10


def refused_status(refused: dict[str, int], names: list[str], **job) -> TrainerStatus:
    """The trainer's status with each of `names` reporting, `refused` its samples refused per worker."""
    t = trainer_status([(n, 1.0, "ok") for n in names])
    workers = [w.model_copy(update={"refused_samples": refused.get(w.name, 0)}) for w in t.workers]
    return t.model_copy(update={"workers": workers, "samples_refused": sum(refused.values()), **job})


def dropped_by_crd(status: dict) -> list[str]:
    """The fields of a written status that the CRD's schema lacks: a real API server drops them."""
    crd = yaml.safe_load((ROOT / "crds" / "sparrowrl.dev_sparrowrljobs.yaml").read_text())
    out: list[str] = []

    def walk(schema: dict, obj, at: str) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                if k not in schema.get("properties", {}):
                    out.append(f"{at}.{k}")
                else:
                    walk(schema["properties"][k], v, f"{at}.{k}")
        elif isinstance(obj, list):
            for x in obj:
                walk(schema["items"], x, f"{at}[]")

    walk(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"], status, "status")
    return out


def refused_events(plan: Plan) -> list[tuple[str, str]]:
    return [(t, m) for t, r, m in plan.events if r == "SamplesRefused"]


def test_a_worker_sending_false_samples_is_named_in_a_condition_an_event_and_the_listing():
    """The trainer refuses samples whose log-probs are false; the worker that sent them shows in
    WorkersTrusted, in one Warning as its count grows (not every cycle), and first in the listing
    after hash mismatches. The run goes on: the phase is not the condition's."""
    w, job = World(), body()
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    liar, other = "add-grpo-worker-us-1-0", "add-grpo-worker-us-0-0"
    w.trainer = refused_status({}, [other, liar])
    plan = w.step(job, 5)
    wt = condition(job, "WorkersTrusted")
    assert (wt["status"], wt["reason"]) == ("True", "AllSamplesTrusted") and refused_events(plan) == []
    assert job["status"]["progress"]["workerCounts"]["untrusted"] == 0

    w.trainer = refused_status({liar: 3}, [other, liar])
    plan = w.step(job, 15)
    wt = condition(job, "WorkersTrusted")
    assert (wt["status"], wt["reason"]) == ("False", "FalseSamples") and f"{liar} (3)" in wt["message"]
    assert other not in wt["message"]
    ((kind, message),) = refused_events(plan)
    assert kind == "Warning" and message.startswith(f"worker {liar} has had 3 samples refused")
    assert "kubectl logs add-grpo-trainer-0" in message
    assert ("Warning", "FalseSamples") in [(t, r) for t, r, _ in plan.events]  # the condition going False
    progress = job["status"]["progress"]
    assert progress["workers"][0] == {
        "name": liar,
        "committedVersion": 5,
        "verification": "ok",
        "behind": 0,
        "refusedSamples": 3,
    }
    assert all("refusedSamples" not in x for x in progress["workers"][1:])
    assert progress["workerCounts"]["untrusted"] == 1 and progress["samplesRefused"] == 3
    assert job["status"]["phase"] == "Running"  # not a failure of the job
    assert dropped_by_crd(job["status"]) == []

    plan = w.step(job, 25)  # the same count: no Event again, the condition holds
    assert refused_events(plan) == [] and "FalseSamples" not in [r for _, r, _ in plan.events]
    assert condition(job, "WorkersTrusted")["reason"] == "FalseSamples"

    w.trainer = refused_status({liar: 5}, [other, liar])
    ((_, message),) = refused_events(w.step(job, 35))
    assert message.startswith(f"worker {liar} has had 5 samples refused (2 since the last count)")

    w.pods[None][liar]["metadata"]["deletionTimestamp"] = stamp(at(40))  # its pod going: the trainer still lists it
    plan = w.step(job, 45)
    assert condition(job, "WorkersTrusted")["status"] == "True" and refused_events(plan) == []
    assert job["status"]["progress"]["workerCounts"]["untrusted"] == 0


def test_false_samples_get_an_event_per_worker_and_many_workers_one_between_them():
    """As the stale workers: one Event per worker while the status lists them all, then one
    Event when the job's refused samples grow, however many workers send them."""
    places = [{"region": "us", "replicas": 40}, {"region": "eu", "cluster": "eu-west", "replicas": 40}]
    w, job = World(), body(placements=places)
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    workers = [n for c in (None, "eu-west") for n in w.names(c) if "-worker-" in n]
    assert len(workers) == 80
    w.trainer = refused_status({n: 1 for n in workers[:3]}, workers)
    assert sorted(m.split()[1] for _, m in refused_events(w.step(job, 10))) == sorted(workers[:3])
    w.trainer = refused_status({n: 1 for n in workers}, workers)  # more than the status lists
    (many,) = refused_events(w.step(job, 20))
    assert many[1].startswith("80 workers had samples refused") and "77 more since the last count" in many[1]
    assert refused_events(w.step(job, 30)) == []
    w.trainer = refused_status({n: 1 + (n == workers[5]) for n in workers}, workers)
    (more,) = refused_events(w.step(job, 40))
    assert more[1].startswith("80 workers had samples refused, the most: " + workers[5] + " (2)")
    assert job["status"]["progress"]["workerCounts"]["untrusted"] == 80
    assert "and 72 more" in condition(job, "WorkersTrusted")["message"]


def test_skipped_steps_reach_the_status_with_an_event_as_they_grow():
    w, job = World(), body()
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    names = ["add-grpo-worker-us-0-0"]
    skipped = lambda plan: [(t, m) for t, r, m in plan.events if r == "StepsSkipped"]  # noqa: E731
    w.trainer = refused_status({}, names)
    assert skipped(w.step(job, 5)) == [] and job["status"]["progress"]["stepsSkipped"] == 0
    w.trainer = refused_status({}, names, steps_skipped=2)
    ((kind, message),) = skipped(w.step(job, 15))
    assert kind == "Normal" and message.startswith("2 more steps changed no weight (2 of 5 so far)")
    assert job["status"]["progress"]["stepsSkipped"] == 2
    assert skipped(w.step(job, 25)) == []
    w.trainer = refused_status({}, names, steps_skipped=3)
    ((_, message),) = skipped(w.step(job, 35))
    assert message.startswith("1 more step changed no weight (3 of 5 so far)")
    assert job["status"]["phase"] == "Running"


def test_a_priced_jobs_cost_and_tokens_per_dollar_reach_the_status_and_its_column():
    """`kubectl get` shows tokens per dollar as a string: a number column would print 1.44e+07."""
    from support.operator_run import columns

    crd = yaml.safe_load((ROOT / "crds" / "sparrowrl.dev_sparrowrljobs.yaml").read_text())
    w, job = World(), body()
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    w.trainer = trainer_status([("add-grpo-worker-us-0-0", 1.0, "ok")])
    w.step(job, 5)
    assert "tokensPerDollar" not in job["status"]["display"] and columns(crd, job)["Tokens/$"] == "<none>"
    w.trainer = w.trainer.model_copy(update={"cost_dollars": 1.234567, "tokens_per_dollar": 14_412_345.67})
    w.step(job, 6)
    p = job["status"]["progress"]
    assert p["costDollars"] == 1.2346 and p["tokensPerDollar"] == 14_412_345.7
    assert job["status"]["display"]["tokensPerDollar"] == "14.4M" and columns(crd, job)["Tokens/$"] == "14.4M"


def test_suspend_deletes_the_pods_and_resume_continues():
    w, job = World(), body()
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    job["spec"]["runPolicy"] = {"suspend": True}
    plan = w.step(job, 10)
    assert job["status"]["phase"] == "Suspended" and not any(w.pods.values())
    assert ("Normal", "Suspended") in [(t, r) for t, r, _ in plan.events]
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
    plan = w.step(job, 100)
    assert job["status"]["phase"] == "Succeeded" and not plan.delete_job
    assert w.names(None) == ["add-grpo-trainer-0"] and not w.names("eu-west")  # the rollout's machines freed
    assert job["status"]["completionTime"] == "2026-12-01T12:01:40Z"
    assert job["status"]["display"]["step"] == "300/300"  # exit 0: every step trained, whatever was last polled
    assert w.step(job, 159).delete_job is False
    assert w.step(job, 160).delete_job is True


def job_document(w: World) -> dict:
    return yaml.safe_load(w.objects[None]["ConfigMap", "add-grpo-job"]["data"]["job.yaml"])


def annotated_steps(w: World) -> str:
    return w.pods[None]["add-grpo-trainer-0"]["metadata"]["annotations"]["sparrowrl.dev/steps"]


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
    plan = w.step(job, 10)
    assert job_document(w) == first | {"spec": first["spec"] | {"steps": 400}}
    assert [(t, r, m) for t, r, m in plan.events if r in ("StepsRaised", "Corrected")] == [
        ("Normal", "StepsRaised", "spec.steps raised from 300 to 400: the trainer trains on from its state")
    ]
    assert plan.delete == [(None, "Pod", "default", "add-grpo-trainer-0")] and plan.create == []
    assert job["status"]["phase"] == "Restarting" and job["status"]["display"]["step"] == "120/400"
    assert "raised from 300 to 400" in condition(job, "TrainerReady")["message"]
    w.trainer = None
    plan = w.step(job, 11)
    assert [m["metadata"]["name"] for _, m in plan.create] == ["add-grpo-trainer-0"]  # the same attempt
    assert annotated_steps(w) == "400" and job["status"]["restarts"] == 0
    assert {c: w.names(c) for c in w.pods} == pods
    w.run_all()
    w.trainer = trainer_status([("add-grpo-worker-us-0-0", 1.0, "ok")], step=121).model_copy(update={"steps": 400})
    plan = w.step(job, 12)
    assert (plan.create, plan.delete, plan.apply, plan.events) == ([], [], [], [])
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
    plan = w.step(job, 7)
    assert plan.delete == [(None, "Pod", "default", "add-grpo-trainer-0")]
    assert not [r for _, r, _ in plan.events if r == "StepsRaised"]  # the document had them already


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
    plan = w.step(job, 5000)  # long past activeDeadlineSeconds: it counts again from now
    assert job["status"]["phase"] == "Restarting" and "completionTime" not in job["status"]
    succeeded = condition(job, "Succeeded")
    assert (succeeded["status"], succeeded["reason"]) == ("False", "StepsRaised")
    assert "from 300 to 350" in succeeded["message"]
    assert ("Normal", "StepsRaised") in [(t, r) for t, r, _ in plan.events]
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
    plan = w.step(job, 5002)
    assert [m["metadata"]["name"] for _, m in plan.create] == ["add-grpo-worker-us-0-1"]
    assert ("Normal", "Replaced") in [(t, r) for t, r, _ in plan.events]
    assert job["status"]["phase"] == "Running"
    w.set_phase("add-grpo-trainer-0", "Succeeded", finished=5100, exit_code=0)
    plan = w.step(job, 5100)
    assert job["status"]["phase"] == "Succeeded" and condition(job, "Succeeded")["message"] == "trained 350 steps"
    assert job["status"]["display"]["step"] == "350/350" and ("Normal", "Succeeded") in [
        (t, r) for t, r, _ in plan.events
    ]


def test_a_failed_job_stays_failed_when_its_steps_are_raised():
    w, job = World(), body(runPolicy={"backoffLimit": 0})
    w.step(job, 0)
    w.step(job, 0)
    w.set_phase("add-grpo-trainer-0", "Failed", finished=10)
    w.step(job, 20)
    assert job["status"]["phase"] == "Failed"
    job["spec"]["steps"] = 400
    plan = w.step(job, 30)
    assert job["status"]["phase"] == "Failed" and plan.create == [] and plan.events == []


def test_an_invalid_spec_fails_with_the_field_and_why():
    w, job = World(), body()
    job["spec"]["model"]["tiny"]["hidden"] = 130
    plan = w.step(job, 0)
    failed = condition(job, "Failed")
    assert failed["reason"] == "InvalidSpec" and "hidden (130) must be a multiple of heads (4)" in failed["message"]
    assert plan.create == [] and job["status"]["phase"] == "Failed"
    assert ("Warning", "InvalidSpec") in [(t, r) for t, r, _ in plan.events]


def test_a_name_too_long_for_its_services():
    job = body()
    job["metadata"]["name"] = "a" * 55
    plan = reconcile(job, World().observe(T0), IMAGE)
    assert plan.create == [] and plan.status.phase == "Failed"
    assert "over 63 characters" in plan.status.conditions[-1].message


def test_another_controller_manages_it():
    plan = reconcile(body(managedBy="kueue.x-k8s.io/multikueue"), World().observe(T0), IMAGE)
    assert plan == Plan()


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


@pytest.mark.parametrize(
    "service, node, address",
    [
        ({"type": "NodePort"}, "198.51.100.9", "http://198.51.100.9:30123"),
        ({"type": "NodePort"}, None, None),  # no node address yet: members wait
        ({"url": "https://trainer.example.com:443/"}, None, "https://trainer.example.com:443"),
    ],
)
def test_how_members_reach_the_trainer(service, node, address):
    w, job = World(lb=None), body(trainer={"service": service})
    w.step(job, 0)
    obs = w.observe(at(1))
    svc = {"spec": {"type": "NodePort", "ports": [{"port": 8470, "nodePort": 30123}]}}
    plan = reconcile(job, Observed(**{**obs.__dict__, "trainer_service": svc, "node_address": node}), IMAGE)
    remote = [m for c, m in plan.create if c == "eu-west" and m["kind"] == "Pod"]
    if address is None:
        assert remote == [] and plan.status.trainer_address is None
    else:
        assert plan.status.trainer_address == address
        assert remote[0]["spec"]["containers"][0]["args"][1:3] == ["--upstream", address]  # the relay


def fields_v1(value: dict) -> dict:
    """FieldsV1 as an API server records an apply of `value`: `f:` per map key, a "." for a map's
    own presence, `k:` for list items (here by position, which is enough: they are not followed)."""
    out: dict = {}
    for k, v in value.items():
        if isinstance(v, dict):
            out[f"f:{k}"] = {".": {}, **fields_v1(v)}
        elif isinstance(v, list):
            out[f"f:{k}"] = {f'k:{{"i":{i}}}': fields_v1(x) if isinstance(x, dict) else {} for i, x in enumerate(v)}
        else:
            out[f"f:{k}"] = {}
    return out


def as_served(obj: dict, extra: dict) -> dict:
    """An object as a real API server answers a list: no apiVersion and kind, identity metadata,
    this operator's apply recorded in managedFields, and `extra` merged in (server defaults)."""
    out = {k: v for k, v in copy.deepcopy(obj).items() if k not in ("apiVersion", "kind")}
    applied = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind")}
    applied["metadata"] = {k: v for k, v in obj["metadata"].items() if k not in ("name", "namespace")}
    out["metadata"] |= {
        "uid": "x-1",
        "resourceVersion": "42",
        "creationTimestamp": "2026-12-01T12:00:00Z",
        "managedFields": [
            {
                "manager": "sparrowrl-operator",
                "operation": "Apply",
                "fieldsType": "FieldsV1",
                "fieldsV1": fields_v1(applied),
            },
            {"manager": "kube-controller-manager", "operation": "Update", "fieldsV1": {"f:status": {}}},
        ],
    }
    return merge(out, extra)


def settled() -> tuple[World, dict]:
    """A job whose objects all exist, as the operator applied them."""
    w, job = World(), body()
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    assert w.step(job, 1).apply == []
    return w, job


def corrected(plan: Plan) -> list[str]:
    return [m for _, r, m in plan.events if r == "Corrected"]


def test_what_the_server_adds_is_no_drift():
    """Defaults, allocated addresses, identity metadata, managedFields and others' labels: what the
    operator decides is all there, so nothing is applied, cycle after cycle."""
    w, job = settled()
    server = {
        "Service": {
            "spec": {
                "clusterIP": "10.0.0.7",
                "clusterIPs": ["10.0.0.7"],
                "sessionAffinity": "None",
                "ipFamilies": ["IPv4"],
                "ipFamilyPolicy": "SingleStack",
                "externalTrafficPolicy": "Cluster",
            },
            "status": {"loadBalancer": {"ingress": [{"ip": "203.0.113.7"}]}},
        },
        "Secret": {"metadata": {"annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}"}}},
        "ConfigMap": {"metadata": {"labels": {"team": "rl"}}},
    }
    for cluster, objects in w.objects.items():
        for (kind, _), obj in objects.items():
            extra = copy.deepcopy(server.get(kind, {}))
            if kind == "Service":  # a node port in each port (named: merged into the port of that name)
                extra["spec"]["ports"] = [
                    {"name": p["name"], "nodePort": 31234 + i} for i, p in enumerate(obj["spec"]["ports"])
                ]
            obj.update(as_served(obj, extra))
    assert w.objects[None]["Secret", "add-grpo-token"]["data"] == {"token": "dG9r"}  # base64, as served
    assert w.objects[None]["Service", "add-grpo-trainer"]["spec"]["ports"][0]["nodePort"] == 31234
    for t in (2, 3):
        plan = w.step(job, t)
        assert plan.apply == [] and plan.create == [] and corrected(plan) == []


@pytest.mark.parametrize(
    ("cluster", "kind", "name", "edit", "where"),
    [
        (None, "Service", "add-grpo-trainer", lambda o: o["spec"]["ports"][0].update(port=9999), "spec.ports[0]"),
        (None, "Service", "add-grpo-trainer", lambda o: o["spec"].update(type="ClusterIP"), "spec.type"),
        (None, "Secret", "add-grpo-token", lambda o: o["metadata"]["labels"].pop("sparrowrl.dev/job"), "metadata"),
        (None, "ConfigMap", "add-grpo-job", lambda o: o["data"].update({"job.yaml": "not: [a job"}), "data"),
        ("eu-west", "Secret", "add-grpo-u-1-worker-eu-0-token", lambda o: o["data"].update(token="eA=="), "data"),
        ("eu-west", "Service", "add-grpo-u-1-relay-eu", lambda o: o["spec"].pop("selector"), "spec.selector"),
    ],
)
def test_an_edited_object_is_applied_again(cluster, kind, name, edit, where):
    w, job = settled()
    before = copy.deepcopy(w.objects[cluster][kind, name])
    edit(w.objects[cluster][kind, name])
    plan = w.step(job, 2)
    assert [(c, m["kind"], m["metadata"]["name"]) for c, m in plan.apply] == [(cluster, kind, name)]
    assert plan.create == [] and plan.delete == []
    assert w.objects[cluster][kind, name] == before  # applied as first decided
    (message,) = corrected(plan)
    assert message.startswith(f"{kind} {name}" + (f" in cluster {cluster}" if cluster else "")) and where in message
    assert w.step(job, 3).apply == []


def test_an_object_without_its_labels_is_applied_not_created():
    """It no longer shows in the operator's labelled lists: applied, it gets them back (a create
    would have met a 409 and left it so)."""
    w, job = settled()
    del w.objects["ap-south"]["Service", "add-grpo-u-1-relay-ap"]
    plan = w.step(job, 2)
    assert [(c, m["metadata"]["name"]) for c, m in plan.apply] == [("ap-south", "add-grpo-u-1-relay-ap")]
    assert corrected(plan) == []  # missing is not drift: its Event would say nothing useful


def test_a_field_no_longer_decided_is_dropped():
    """An annotation the job no longer asks for: its apply removes it. One someone else added
    (not in this operator's managedFields) is theirs, and no reason to apply."""
    w, job = World(), body()
    job["spec"]["trainer"]["service"]["annotations"] = {"lb.example.com/internal": "true"}
    w.step(job, 0)
    key = ("Service", "add-grpo-trainer")
    svc = w.objects[None][key] = as_served(w.objects[None][key], {"metadata": {"annotations": {"mine": "yes"}}})
    w.step(job, 1)  # the rest of the job's objects
    assert w.step(job, 2).apply == []
    job["spec"]["trainer"]["service"]["annotations"] = {}
    plan = w.step(job, 3)
    assert [m["metadata"]["name"] for _, m in plan.apply] == ["add-grpo-trainer"]
    assert "metadata.annotations" in corrected(plan)[0]
    assert "lb.example.com/internal" in str(svc["metadata"]["managedFields"])


def test_the_job_configmap_keeps_the_document_first_written():
    """The trainer's state belongs to the job as it started: a later change of replicas or
    runPolicy leaves the ConfigMap alone; an edit of what the CRD keeps immutable is undone,
    and what was first written around it stays."""
    w, job = settled()
    key = ("ConfigMap", "add-grpo-job")
    first = yaml.safe_load(w.objects[None][key]["data"]["job.yaml"])
    job["spec"]["placements"][0]["replicas"] = 3
    job["spec"]["runPolicy"] = {"backoffLimit": 5}
    plan = w.step(job, 2)
    assert key not in {(m["kind"], m["metadata"]["name"]) for _, m in plan.apply}
    assert yaml.safe_load(w.objects[None][key]["data"]["job.yaml"]) == first
    edited = copy.deepcopy(first)
    edited["spec"]["steps"], edited["spec"]["model"]["tiny"]["layers"] = 7, 9
    w.objects[None][key]["data"]["job.yaml"] = yaml.safe_dump(edited)
    plan = w.step(job, 3)
    assert [(m["kind"], m["metadata"]["name"]) for _, m in plan.apply] == [key]
    assert yaml.safe_load(w.objects[None][key]["data"]["job.yaml"]) == first  # placements as first written
    assert w.step(job, 4).apply == []
    w.objects[None][key]["data"]["job.yaml"] = "a: &x [1]\nb: *x\n"  # aliases: not what the operator writes
    w.step(job, 5)
    assert yaml.safe_load(w.objects[None][key]["data"]["job.yaml"])["spec"] == job["spec"]


def test_a_status_patch_brings_either_base_to_the_new_status():
    """A handler may hold a body older than the status the last cycle wrote (tests/test_operator.py's
    unreachable member showed it): the patch works from both."""
    old = {"phase": "Pending", "progress": {"step": 0, "reward": 0.1}, "trainerAddress": "http://a"}
    written = {"phase": "Running", "progress": {"step": 3, "reward": 0.5}, "restarts": 1}
    new = {"phase": "Running", "progress": {"step": 4}, "restarts": 1}
    change = union(merge_patch(old, new), merge_patch(written, new))
    assert merge(old, change) == new and merge(written, change) == new


@pytest.mark.parametrize(
    ("conditions", "serving", "want"),
    [
        ([], False, "Pending"),
        ([("TrainerReady", False, "Creating")], False, "Pending"),
        ([("TrainerReady", True, "Ready")], False, "Starting"),
        ([("TrainerReady", True, "Ready")], True, "Running"),
        ([("TrainerReady", False, "Restarting")], True, "Restarting"),
        ([("TrainerReady", False, "Suspended"), ("Suspended", True, "Suspended")], False, "Suspended"),
        ([("Suspended", False, "Resumed"), ("TrainerReady", True, "Ready")], True, "Running"),
        ([("Succeeded", True, "Succeeded"), ("TrainerReady", False, "Finished")], False, "Succeeded"),
        ([("Succeeded", False, "StepsRaised"), ("TrainerReady", False, "Restarting")], False, "Restarting"),
        ([("Failed", True, "BackoffLimitExceeded"), ("Suspended", True, "Suspended")], False, "Failed"),
    ],
)
def test_the_phase_is_derived_from_the_conditions_alone(conditions, serving, want):
    conds = []
    for type_, status, reason in conditions:
        conds = set_condition(conds, type_, status, reason, "", "2026-12-02T00:00:00Z")
    assert derive_phase(conds, serving) == want


# --- relays: their own resources and template ---


def documented_example() -> str:
    """The job docs/operator.md shows for GPU workers, checked to be examples/k8s/gpu-workers.yaml."""
    doc = (ROOT / "docs" / "operator.md").read_text()
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", doc, re.S) if "\n  relays:\n" in b]
    assert len(blocks) == 1, "docs/operator.md shows one job with relays"
    assert blocks[0] == (ROOT / "examples" / "k8s" / "gpu-workers.yaml").read_text()
    return blocks[0]


def test_relay_pods_take_neither_gpus_nor_a_workers_template():
    """The documented example: workers with a GPU each and a template that adds a variable and a
    volume; the relay gets its own resources, no GPU, no toleration of GPU nodes, and one container
    with an image. Every pod is valid for Kubernetes' own schema."""
    job = yaml.safe_load(documented_example())
    job["metadata"] |= {"uid": "u-1", "generation": 1}
    w = World(members={})
    w.step(job, 0)
    pods = w.pods[None]
    assert sorted(pods) == [
        "gpu-grpo-relay-us-0",
        "gpu-grpo-trainer-0",
        "gpu-grpo-worker-us-0-0",
        "gpu-grpo-worker-us-1-0",
    ]
    for pod in pods.values():
        kubernetes_validate.validate(pod, latest_version(), strict=True)
        assert all(c.get("image") for c in pod["spec"]["containers"])
    relay = pods["gpu-grpo-relay-us-0"]["spec"]
    assert [c["name"] for c in relay["containers"]] == ["relay"]
    assert relay["containers"][0]["resources"] == {"requests": {"cpu": "2", "memory": "4Gi"}}
    assert "nvidia.com/gpu" not in str(relay) and "tolerations" not in relay
    assert "HF_HOME" not in str(relay) and "hf-cache" not in str(relay)
    worker = pods["gpu-grpo-worker-us-0-0"]["spec"]
    (c,) = worker["containers"]
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert {"name": "HF_HOME", "value": "/cache"} in c["env"]
    assert {"name": "hf-cache", "mountPath": "/cache"} in c["volumeMounts"]
    assert {"name": "hf-cache", "emptyDir": {"sizeLimit": "20Gi"}} in worker["volumes"]


def test_a_native_sidecar_is_added_to_workers_and_relays_get_their_template():
    proxy = {"name": "proxy", "image": "envoyproxy/envoy:v1.33", "restartPolicy": "Always"}
    job = body(
        placements=[{"region": "us", "template": {"spec": {"initContainers": [proxy]}}}],
        relays={"template": {"metadata": {"labels": {"team": "net"}}, "spec": {"priorityClassName": "relay"}}},
    )
    w = World(members={})
    w.step(job, 0)
    worker, relay = w.pods[None]["add-grpo-worker-us-0-0"], w.pods[None]["add-grpo-relay-us-0"]
    assert [c["name"] for c in worker["spec"]["containers"]] == ["worker"]
    assert worker["spec"]["initContainers"] == [proxy]
    assert [c["name"] for c in relay["spec"]["containers"]] == ["relay"] and "initContainers" not in relay["spec"]
    assert relay["metadata"]["labels"]["team"] == "net" and relay["spec"]["priorityClassName"] == "relay"
    assert "team" not in worker["metadata"]["labels"] and "priorityClassName" not in worker["spec"]


@pytest.mark.parametrize(
    "template, why",
    [
        ({"spec": {"containers": [{"name": "sidecar", "env": []}]}}, "spec.containers[0] ('sidecar'): the pod's one"),
        (
            {"spec": {"containers": [{"name": "proxy", "image": "envoy"}]}},
            "spec.containers[0] ('proxy'): the pod's one container is 'worker'; add a sidecar",
        ),
        ({"spec": {"initContainers": [{"name": "fetch"}]}}, "spec.initContainers[0] ('fetch'): an init container"),
        ({"spec": None}, "spec: an object"),
        ({"metadata": None}, "metadata: an object"),
        ({"metadata": {"labels": {"sparrowrl.dev/job-uid": "x"}}}, "metadata.labels['sparrowrl.dev/job-uid']"),
        ({"metadata": {"labels": {"app.kubernetes.io/managed-by": "me"}}}, "metadata.labels['app.kubernetes.io"),
        ({"metadata": {"annotations": {"sparrowrl.dev/steps": "9"}}}, "metadata.annotations['sparrowrl.dev/steps']"),
        ({"metadata": {"name": "mine"}}, "metadata.name: the operator sets it"),
        ({"spec": {"restartPolicy": "OnFailure"}}, "spec.restartPolicy: the operator sets it"),
    ],
)
def test_a_template_that_would_break_the_pods_fails_the_job(template, why):
    """An image-less container would be refused by the API server; an added container would keep a
    finished pod running; the operator's labels, a name or a restart policy would hide its pods
    from it or its check's refusal from the job."""
    job = body(placements=[{"region": "us", "template": template}])
    plan = reconcile(job, World(members={}).observe(T0), IMAGE)
    failed = next(c for c in plan.status.conditions if c.type == "Failed")
    assert failed.reason == "InvalidSpec" and plan.create == []
    assert "spec.placements.0.template: " + why in failed.message, failed.message


# --- a worker in a crash loop ---


def crash(w: World, name: str, at_s: float, started_s: float = 0.0) -> None:
    """The pod failed as a container exiting 3 does: its reason, exit code and message."""
    w.set_phase(name, "Failed", finished=at_s, exit_code=3)
    status = w.pods.get(None, {}).get(name) or next(ps[name] for ps in w.pods.values() if name in ps)
    status["status"]["startTime"] = stamp(at(0))  # when it was scheduled: the image pull comes after
    status["status"]["containerStatuses"][0]["state"]["terminated"] |= {
        "reason": "Error",
        "message": "CUDA OOM\n",
        "startedAt": stamp(at(started_s)),
    }


def single(**changes) -> tuple[World, dict]:
    job = body(placements=[{"region": "us", "replicas": 2}], **changes)
    w = World(members={})
    w.step(job, 0)
    w.run_all()
    return w, job


def test_a_worker_failing_in_a_row_backs_off_then_is_given_up():
    w, job = single(runPolicy={"workerBackoffLimit": 2})
    b = Backoff(base=10)
    crash(w, "add-grpo-worker-us-1-0", 50)
    assert w.step(job, 59, backoff=b).create == []  # its first backoff: 10 s
    plan = w.step(job, 60, backoff=b)
    assert [m["metadata"]["name"] for _, m in plan.create] == ["add-grpo-worker-us-1-1"]
    replaced = [m for _, r, m in plan.events if r == "Replaced"]
    assert replaced == [
        "pod add-grpo-worker-us-1-0 failed (Error, exit code 3: CUDA OOM), 1 in a row; replaced it (replacement 1)"
    ]
    assert w.pods[None]["add-grpo-worker-us-1-1"]["metadata"]["annotations"] == {"sparrowrl.dev/failures-in-a-row": "1"}
    crash(w, "add-grpo-worker-us-1-1", 100, started_s=60)
    assert w.step(job, 119, backoff=b).create == []  # the second: 20 s
    w.step(job, 120, backoff=b)
    assert w.pods[None]["add-grpo-worker-us-1-2"]["metadata"]["annotations"] == {"sparrowrl.dev/failures-in-a-row": "2"}
    assert not any(c["type"] == "Degraded" for c in job["status"]["conditions"])
    crash(w, "add-grpo-worker-us-1-2", 200, started_s=120)
    plan = w.step(job, 10_000, backoff=b)
    assert plan.create == [] and "add-grpo-worker-us-1-2" in w.names()  # kept, for its logs
    degraded = condition(job, "Degraded")
    why = (
        "worker worker-us-1 failed 3 times in a row (runPolicy.workerBackoffLimit: 2); "
        "pod add-grpo-worker-us-1-2: Error, exit code 3: CUDA OOM"
    )
    assert (degraded["status"], degraded["reason"], degraded["message"]) == ("True", "CrashLoop", why)
    assert [(t, r, m) for t, r, m in plan.events if r == "CrashLoop"] == [
        ("Warning", "CrashLoop", why + "; no longer replaced: delete the pod to try again")
    ]
    assert job["status"]["placements"][0]["givenUp"] == ["add-grpo-worker-us-1-2"]
    assert job["status"]["phase"] != "Failed"  # the other worker goes on
    again = w.step(job, 10_010, backoff=b)
    assert again.create == [] and again.events == []  # said once; nothing spins
    del w.pods[None]["add-grpo-worker-us-1-2"]  # deleted by hand: the slot tries again, its row from 0
    plan = w.step(job, 10_020, backoff=b)
    (made,) = [m for _, m in plan.create]
    assert made["metadata"]["name"] == "add-grpo-worker-us-1-0" and "annotations" not in made["metadata"]
    assert condition(job, "Degraded")["status"] == "False" and job["status"]["placements"][0]["givenUp"] == []


def test_a_pod_that_ran_ten_minutes_breaks_the_row():
    w, job = single(runPolicy={"workerBackoffLimit": 1})
    crash(w, "add-grpo-worker-us-0-0", 50)
    w.step(job, 100)
    assert "add-grpo-worker-us-0-1" in w.names()
    crash(w, "add-grpo-worker-us-0-1", 800, started_s=100)  # ran 700 s: a failure, not a crash loop
    plan = w.step(job, 900)
    assert [m["metadata"]["name"] for _, m in plan.create] == ["add-grpo-worker-us-0-2"]
    assert w.pods[None]["add-grpo-worker-us-0-2"]["metadata"]["annotations"] == {"sparrowrl.dev/failures-in-a-row": "1"}


def test_a_failed_pod_without_a_finish_time_is_still_replaced():
    """Evicted before its container ran: no containerStatuses. Its backoff counts from its last
    condition's change, and the reason is the pod's own."""
    w, job = single()
    pod = w.pods[None]["add-grpo-worker-us-0-0"]
    pod["status"] = {
        "phase": "Failed",
        "reason": "Evicted",
        "message": "The node was low on resource: memory.",
        "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": stamp(at(40))}],
    }
    assert w.step(job, 45).create == []
    plan = w.step(job, 50)
    assert [m["metadata"]["name"] for _, m in plan.create] == ["add-grpo-worker-us-0-1"]
    assert "(Evicted: The node was low on resource: memory.)" in next(m for _, r, m in plan.events if r == "Replaced")


def test_a_job_whose_workers_are_all_given_up_fails():
    w, job = World(members={}), body(placements=[{"region": "us", "replicas": 1}], runPolicy={"workerBackoffLimit": 0})
    w.step(job, 0)
    w.run_all()
    crash(w, "add-grpo-worker-us-0-0", 50)
    plan = w.step(job, 51)
    failed = condition(job, "Failed")
    assert job["status"]["phase"] == "Failed" and failed["reason"] == "WorkersFailed"
    assert "pod add-grpo-worker-us-0-0: Error, exit code 3: CUDA OOM" in failed["message"]
    assert condition(job, "Degraded")["reason"] == "CrashLoop"
    assert plan.create == [] and sorted(n for _, _, _, n in plan.delete) == [
        "add-grpo-relay-us-0",
        "add-grpo-trainer-0",
    ]
    assert w.step(job, 5000).create == []


def test_a_relay_given_up_degrades_its_placement_and_its_workers_go_on():
    w, job = single(runPolicy={"workerBackoffLimit": 0})
    crash(w, "add-grpo-relay-us-0", 50)
    plan = w.step(job, 100)
    assert plan.create == [] and job["status"]["phase"] != "Failed"
    assert "the relay of us failed 1 times in a row" in condition(job, "Degraded")["message"]
    assert any("workers fetch from the trainer meanwhile" in m for _, r, m in plan.events if r == "CrashLoop")
    assert {"add-grpo-worker-us-0-0", "add-grpo-worker-us-1-0"} <= set(w.names())


# --- results that outlive the job ---


def claim(w: World) -> dict:
    return w.objects[None]["PersistentVolumeClaim", "add-grpo-state"]


@pytest.mark.parametrize("when, owned", [(None, False), ("Retain", False), ("Delete", True)])
def test_the_state_claim_outlives_the_job_unless_told(when, owned):
    job = body()
    if when:
        job["spec"]["trainer"]["state"]["retentionPolicy"] = {"whenDeleted": when}
    w = World()
    plan = w.step(job, 0)
    (made,) = [m for _, m in plan.create if m["kind"] == "PersistentVolumeClaim"]
    assert ("ownerReferences" in made["metadata"]) == owned
    if owned:
        assert made["metadata"]["ownerReferences"][0] | {"uid": "u-1"} == made["metadata"]["ownerReferences"][0]
    assert "ownerReferences" in w.objects[None]["ConfigMap", "add-grpo-job"]["metadata"]  # the rest goes with the job


def test_a_changed_retention_policy_moves_the_claims_owner_and_keeps_others():
    w, job = settled()
    claim(w)["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "Backup", "name": "b", "uid": "b-1"}]
    assert w.step(job, 2).patch == []
    job["spec"]["trainer"]["state"]["retentionPolicy"] = {"whenDeleted": "Delete"}
    plan = w.step(job, 3)
    assert [(k, n) for _, k, _, n, _ in plan.patch] == [("PersistentVolumeClaim", "add-grpo-state")]
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
    plan = w2.step(job2, 100)
    assert not [m for _, m in plan.create if m["kind"] == "PersistentVolumeClaim"]
    assert claim(w2)["metadata"]["labels"]["sparrowrl.dev/job-uid"] == "u-2"
    assert claim(w2)["spec"] == kept["spec"]  # what it holds is untouched
    assert [r for _, r, _ in plan.events if r == "Adopted"] == ["Adopted"]
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
    plan = w2.step(job2, 100)
    assert plan.patch == [] and not [m for _, m in plan.create if m["kind"] == "PersistentVolumeClaim"]
    assert "add-grpo-trainer-0" not in w2.names() and condition(job2, "TrainerReady")["reason"] == "WaitingForClaim"
    assert claim(w2)["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    del w2.objects[None]["PersistentVolumeClaim", "add-grpo-state"]  # collected
    plan = w2.step(job2, 101)
    (made,) = [m for _, m in plan.create if m["kind"] == "PersistentVolumeClaim"]
    assert made["metadata"]["labels"]["sparrowrl.dev/job-uid"] == "u-2"
    w2.step(job2, 102)
    assert "add-grpo-trainer-0" in w2.names()


def test_a_claim_this_operator_did_not_make_is_left_alone():
    w = World()
    foreign = {"metadata": {"name": "add-grpo-state", "labels": {"app": "db"}}, "spec": {"resources": {}}}
    w.objects[None] = {("PersistentVolumeClaim", "add-grpo-state"): copy.deepcopy(foreign)}
    job = body()
    plan = w.step(job, 0)
    failed = condition(job, "Failed")
    assert (
        failed["reason"] == "StateClaimConflict" and "PersistentVolumeClaim add-grpo-state exists" in failed["message"]
    )
    assert plan.patch == [] and not [m for _, m in plan.create if m["kind"] == "Pod"]
    assert claim(w) == foreign


@pytest.mark.parametrize("when, kept", [("Retain", True), ("Delete", False)])
def test_the_ttl_says_what_becomes_of_the_model(when, kept):
    w, job = World(), body(runPolicy={"ttlSecondsAfterFinished": 60})
    job["spec"]["trainer"]["state"]["retentionPolicy"] = {"whenDeleted": when}
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    w.set_phase("add-grpo-trainer-0", "Succeeded", finished=100, exit_code=0)
    w.step(job, 100)
    plan = w.step(job, 160)
    assert plan.delete_job
    ((kind, message),) = [(t, m) for t, r, m in plan.events if r == "TTLExpired"]
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
    plan = w.step(job, 160)
    assert not plan.delete_job and [k for _, k, _, _, _ in plan.patch] == ["PersistentVolumeClaim"]
    assert claim(w)["metadata"]["ownerReferences"] == []
    plan = w.step(job, 161)
    assert plan.delete_job
    ((message,),) = [(m,) for _, r, m in plan.events if r == "TTLExpired"]
    assert "is kept" in message


def trainer_pod(example: str) -> tuple[dict, World]:
    w, job = World(), yaml.safe_load_all((ROOT / "examples" / "k8s" / example).read_text())
    job = next(d for d in job if d["kind"] == "SparrowRLJob")
    job["metadata"] |= {"uid": "u-1", "generation": 1}
    w.step(job, 0), w.step(job, 0)
    return w.pods[None][f"{job['metadata']['name']}-trainer-0"], w


@pytest.mark.parametrize("example", ["job.yaml", "job-volumes.yaml", "job-hub.yaml", "job-image.yaml"])
def test_every_pod_of_the_examples_is_a_valid_pod(example):
    """What a real API server would refuse (an init container with a probe, a mount of no volume)."""
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    _, w = trainer_pod(example)
    for pods in w.pods.values():
        for pod in pods.values():
            kubernetes_validate.validate(pod, latest_version(), strict=True)
            spec = pod["spec"]
            volumes = {v["name"] for v in spec["volumes"]}
            for c in spec["containers"] + spec.get("initContainers", []):
                assert {m["name"] for m in c.get("volumeMounts", [])} <= volumes, (pod["metadata"]["name"], c["name"])


def test_the_trainer_pod_takes_its_template_and_checks_the_job_before_it_starts():
    pod, w = trainer_pod("job-volumes.yaml")
    spec = pod["spec"]
    assert {"name": "inputs", "persistentVolumeClaim": {"claimName": "grpo-inputs", "readOnly": True}} in spec[
        "volumes"
    ]
    trainer, (check,) = spec["containers"][0], spec["initContainers"]
    assert trainer["args"][:2] == ["trainer", "job.yaml"]  # in the working folder: relative paths are below it
    mounts = {m["mountPath"]: m for m in trainer["volumeMounts"]}
    assert mounts["/var/lib/sparrowrl/job.yaml"]["subPath"] == "job.yaml"
    assert mounts["/var/lib/sparrowrl/inputs"]["name"] == "inputs"  # the template's, merged by name
    assert check["name"] == "sparrowrl-check" and check["args"] == ["check", "job.yaml", "--state-dir", "state"]
    assert check["volumeMounts"] == trainer["volumeMounts"] and check["resources"] == trainer["resources"]
    assert check["image"] == trainer["image"] and check["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert "SPARROWRL_TOKEN" not in {e["name"] for e in check["env"]}  # it signs nothing
    assert trainer["startupProbe"]["httpGet"]["path"] == "/healthz"
    for name, worker in w.pods[None].items():  # the trainer's template is the trainer's alone
        if name != pod["metadata"]["name"]:
            assert "inputs" not in str(worker["spec"]) and "initContainers" not in worker["spec"]

    pod, _ = trainer_pod("job-hub.yaml")
    trainer, (check,) = pod["spec"]["containers"][0], pod["spec"]["initContainers"]
    token = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}
    assert token in trainer["env"] and token in check["env"]

    pod, _ = trainer_pod("job-image.yaml")
    spec = pod["spec"]
    assert spec["imagePullSecrets"] == [{"name": "registry-example-com"}]
    assert spec["serviceAccountName"] == "sparrowrl-trainer" and spec["priorityClassName"] == "training-high"
    assert "nodeAffinity" in spec["affinity"]
    assert spec["initContainers"][0]["image"] == "registry.example.com/team/sparrowrl-rewards:1.2.0-gpu"


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
    plan = w.step(job, 11)
    failed = condition(job, "Failed")
    assert failed["reason"] == "InvalidSpec" and job["status"]["phase"] == "Failed"
    assert failed["message"] == (
        "the trainer's check in pod add-grpo-trainer-0: "
        "job.yaml: spec.task: reward 'x': no file /var/lib/sparrowrl/r/x.py"
    )
    assert plan.create == [] and job["status"]["restarts"] == 0
    assert {n for _, _, _, n in plan.delete} == others  # relays and workers freed at once
    assert ("Warning", "InvalidSpec") in [(t, r) for t, r, _ in plan.events]


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


@pytest.mark.parametrize(
    "x, shown", [(999, "999"), (14_400_000, "14.4M"), (2.5e12, "2.5T"), (1e300, "1e+300"), (float("inf"), "inf")]
)
def test_the_tokens_per_dollar_column_is_short_at_any_size(x, shown):
    assert human_count(x) == shown and len(human_count(x)) <= 64  # the CRD's bound on the field
