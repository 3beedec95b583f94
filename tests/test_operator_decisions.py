"""The operator's decisions, called directly: a job and what is observed → the plan. Each test
is a scenario: the observed state is built from the plans the operator made before, with the
pods' phases a kubelet would have written."""

from __future__ import annotations

import copy
import datetime
from pathlib import Path

import pytest
import yaml

from sparrowrl.auth.signing import Verifier, parse_public
from sparrowrl.auth.tokens import Gate, Principal
from sparrowrl.spec.status import JobStatus as TrainerStatus
from sparrowrl.spec.status import WorkerStatus
from sparrowrl_operator.conditions import set_condition
from sparrowrl_operator.reconcile import Backoff, Member, Observed, Plan, derive_phase, reconcile, stamp

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
    """The clusters as a plan leaves them: created objects exist, deleted ones are gone."""

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
            objects={c: set(o) for c, o in self.objects.items() if c in reachable},
        )

    def apply(self, plan: Plan, job: dict) -> None:
        for cluster, m in plan.create:
            if m["kind"] == "Pod":
                self.pods.setdefault(cluster, {}).setdefault(m["metadata"]["name"], m)
            else:
                self.objects.setdefault(cluster, set()).add((m["kind"], m["metadata"]["name"]))
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
                if finished is not None:
                    st["containerStatuses"] = [
                        {
                            "name": "x",
                            "state": {
                                "terminated": {
                                    "exitCode": exit_code,
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


def condition(job: dict, type_: str) -> dict:
    return next(c for c in job["status"]["conditions"] if c["type"] == type_)


def test_a_new_job_becomes_its_objects_in_each_cluster():
    w, job = World(), body()
    plan = w.step(job, 0)
    assert {c for c, _ in plan.create} == {None}  # members wait for the token's Secret, which they get a copy of
    plan = w.step(job, 0)
    kinds = sorted((c or "home", m["kind"], m["metadata"]["name"]) for c, m in plan.create)
    assert ("home", "PersistentVolumeClaim", "add-grpo-state") not in kinds  # made in the first cycle
    assert ("eu-west", "Pod", "add-grpo-u-1-worker-eu-1-0") in kinds
    assert ("ap-south", "Secret", "add-grpo-u-1-token") not in kinds  # the job's secret stays with the trainer
    secrets = {(c, m["metadata"]["name"]): m["stringData"] for c, m in plan.create if m["kind"] == "Secret"}
    assert {n for c, n in secrets if c == "ap-south"} == {
        "add-grpo-u-1-relay-ap-token",
        "add-grpo-u-1-worker-ap-0-token",
    }
    mine = secrets["ap-south", "add-grpo-u-1-worker-ap-0-token"]  # a slot's own token, and the trainer's key
    gate = Gate(None, Verifier(parse_public(mine["trainer-key"])))  # as the relay checks its workers
    assert gate.principal(f"Bearer {mine['token']}") == Principal("worker", "add-grpo-u-1-worker-ap-0-*")
    assert Gate.of("tok", None).principal(f"Bearer {mine['token']}") is not None  # from the secret the trainer holds
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
        ([("Failed", True, "BackoffLimitExceeded"), ("Suspended", True, "Suspended")], False, "Failed"),
    ],
)
def test_the_phase_is_derived_from_the_conditions_alone(conditions, serving, want):
    conds = []
    for type_, status, reason in conditions:
        conds = set_condition(conds, type_, status, reason, "", "2026-12-02T00:00:00Z")
    assert derive_phase(conds, serving) == want
