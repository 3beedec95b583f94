"""The operator's decisions, called directly: a job and what is observed → the actions. Each
test is a scenario: the observed state is built from the actions the operator took before, with
the pods' phases a kubelet would have written. Here, that world (which each concern's
tests/test_operator_*.py builds its scenarios on) and the cycle as a whole (reconcile.py)."""

from __future__ import annotations

import copy
import datetime
from pathlib import Path

import yaml

from sparrowrl.auth import pki
from sparrowrl.auth.signing import Verifier, parse_public
from sparrowrl.auth.tokens import Gate, Principal
from sparrowrl.spec.status import TrainerStatus, WorkerStatus
from sparrowrl_operator.builders import credentials, merge, stored
from sparrowrl_operator.constants import ROLE_LABEL
from sparrowrl_operator.handlers import merge_patch, union
from sparrowrl_operator.reconcile import Actions, Member, Observed, reconcile
from sparrowrl_operator.times import stamp

ROOT = Path(__file__).resolve().parent.parent
T0 = datetime.datetime(2026, 12, 1, 12, 0, tzinfo=datetime.timezone.utc)
IMAGE = "sparrowrl-runtime:test"
MEMBERS = {"eu-west": Member("sparrowrl", True), "ap-south": Member("sparrowrl", True)}
CA = pki.authority("sparrowrl test", now=T0)  # the CA the operator makes for a job whose Secret is missing


def body(**spec_changes) -> dict:
    job = yaml.safe_load((ROOT / "examples" / "k8s" / "job.yaml").read_text())
    job["metadata"] |= {"uid": "u-1", "generation": 1}
    job["spec"].update(spec_changes)
    return job


def at(seconds: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=seconds)


class World:
    """The clusters as the actions leave them: created and applied objects exist (as the API server
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
            authority=CA,
            members=self.members,
            trainer_service=svc,
            trainer=self.trainer,
            pods={c: [copy.deepcopy(p) for p in ps.values()] for c, ps in self.pods.items() if c in reachable},
            objects={c: copy.deepcopy(o) for c, o in self.objects.items() if c in reachable},
        )

    def apply(self, actions: Actions, job: dict) -> None:
        for cluster, m in actions.create:
            if m["kind"] == "Pod":
                self.pods.setdefault(cluster, {}).setdefault(m["metadata"]["name"], m)
            else:
                self.objects.setdefault(cluster, {})[m["kind"], m["metadata"]["name"]] = copy.deepcopy(stored(m))
        for cluster, m in actions.apply:
            self.objects.setdefault(cluster, {})[m["kind"], m["metadata"]["name"]] = copy.deepcopy(stored(m))
        for cluster, kind, _ns, name, patch in actions.patch:
            self.objects[cluster][kind, name] = merge_patched(self.objects[cluster][kind, name], patch)
        for cluster, kind, _ns, name in actions.delete:
            if kind == "Pod":
                self.pods[cluster].pop(name)
            else:
                self.objects[cluster].pop((kind, name))
        if actions.status is not None:
            job["status"] = actions.status.model_dump(by_alias=True, exclude_none=True)

    def step(self, job: dict, seconds: float, **kw) -> Actions:
        actions = reconcile(job, self.observe(at(seconds)), IMAGE, **kw)
        self.apply(actions, job)
        return actions

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


def settled() -> tuple[World, dict]:
    """A job whose objects all exist, as the operator applied them."""
    w, job = World(), body()
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    assert w.step(job, 1).apply == []
    return w, job


def claim(w: World) -> dict:
    return w.objects[None]["PersistentVolumeClaim", "add-grpo-state"]


def job_document(w: World) -> dict:
    return yaml.safe_load(w.objects[None]["ConfigMap", "add-grpo-job"]["data"]["job.yaml"])


def annotated_steps(w: World) -> str:
    return w.pods[None]["add-grpo-trainer-0"]["metadata"]["annotations"]["sparrowrl.dev/steps"]


def test_a_new_job_becomes_its_objects_in_each_cluster():
    w, job = World(), body()
    actions = w.step(job, 0)
    assert {c for c, _ in actions.create} == {None}  # members wait for the token's Secret, which they get a copy of
    actions = w.step(job, 0)
    made = actions.create + actions.apply  # Services, Secrets and ConfigMaps are applied
    kinds = sorted((c or "home", m["kind"], m["metadata"]["name"]) for c, m in made)
    assert ("home", "PersistentVolumeClaim", "add-grpo-state") not in kinds  # made in the first cycle
    assert ("eu-west", "Pod", "add-grpo-u-1-worker-eu-1-0") in kinds
    assert ("ap-south", "Secret", "add-grpo-u-1-token") not in kinds  # the job's secret stays with the trainer
    secrets = {(c, m["metadata"]["name"]): m.get("stringData", {}) for c, m in made if m["kind"] == "Secret"}
    assert {n for c, n in secrets if c == "ap-south"} == {
        "add-grpo-u-1-relay-ap-token",
        "add-grpo-u-1-relay-ap-tls",  # the relay's serving certificate
        "add-grpo-u-1-worker-ap-tls",  # the placement's workers' (their probes and metrics)
        "add-grpo-u-1-worker-ap-0-token",
    }
    mine = secrets["ap-south", "add-grpo-u-1-worker-ap-0-token"]  # a slot's own token, and the trainer's key
    gate = Gate(None, Verifier(parse_public(mine["trainer-key"])))  # as the relay checks its workers
    now = at(0).timestamp()  # the tokens expire an hour after they are minted
    assert gate.check(f"Bearer {mine['token']}", now) == Principal("worker", "add-grpo-u-1-worker-ap-0-*")
    assert isinstance(Gate.of("tok", None).check(f"Bearer {mine['token']}", now), Principal)  # from the trainer's
    before = credentials.cache_info()
    w.step(job, 10)  # a cycle builds each slot's Secret again (to judge drift), and signs nothing again
    after = credentials.cache_info()
    tokens = [n for _, n in secrets if n.endswith("-token")]
    assert after.hits >= before.hits + len(tokens) - 1 and after.misses == before.misses
    env = {
        e["name"]: e.get("value") or e["valueFrom"]["secretKeyRef"]
        for e in w.pods["ap-south"]["add-grpo-u-1-worker-ap-0-0"]["spec"]["containers"][0]["env"]
        if e["name"].startswith("SPARROWRL_T")
    }
    assert env == {
        "SPARROWRL_TOKEN_FILE": "credentials/token",  # a file: refreshed in place, read again where it runs
        "SPARROWRL_TRAINER_KEY": {"name": "add-grpo-u-1-worker-ap-0-token", "key": "trainer-key"},
    }
    assert w.names("eu-west") == ["add-grpo-u-1-relay-eu-0", "add-grpo-u-1-worker-eu-0-0", "add-grpo-u-1-worker-eu-1-0"]
    assert job["status"]["phase"] == "Pending"
    worker = w.pods["eu-west"]["add-grpo-u-1-worker-eu-0-0"]
    args = worker["spec"]["containers"][0]["args"]
    assert args[:5] == [
        "worker",
        "--trainer",
        "https://203.0.113.7:8470",
        "--relay",
        "https://add-grpo-u-1-relay-eu.sparrowrl.svc:8471",
    ]  # the load balancer; the region's relay: HTTPS by default
    home = w.pods[None]["add-grpo-worker-us-0-0"]["spec"]["containers"][0]["args"]
    assert home[2] == "https://add-grpo-trainer.default.svc:8470"
    assert w.pods["ap-south"]["add-grpo-u-1-worker-ap-0-0"]["spec"]["tolerations"] == [
        {"key": "spot", "operator": "Exists", "effect": "NoSchedule"}
    ]  # the placement's template
    assert "ownerReferences" in w.pods[None]["add-grpo-trainer-0"]["metadata"]
    assert "ownerReferences" not in worker["metadata"]  # no owner across clusters: the finalizer cleans up
    again = w.step(job, 1)
    assert again.create == [] and again.delete == []  # idempotent: a replayed watch changes nothing
    assert again.apply == [] and again.events == []


def test_an_invalid_spec_fails_with_the_field_and_why():
    w, job = World(), body()
    job["spec"]["model"]["tiny"]["hidden"] = 130
    actions = w.step(job, 0)
    failed = condition(job, "Failed")
    assert failed["reason"] == "InvalidSpec" and "hidden (130) must be a multiple of heads (4)" in failed["message"]
    assert actions.create == [] and job["status"]["phase"] == "Failed"
    assert ("Warning", "InvalidSpec") in [(t, r) for t, r, _ in actions.events]


def test_a_name_too_long_for_its_services():
    job = body()
    job["metadata"]["name"] = "a" * 55
    actions = reconcile(job, World().observe(T0), IMAGE)
    assert actions.create == [] and actions.status.phase == "Failed"
    assert "over 63 characters" in actions.status.conditions[-1].message


def test_another_controller_manages_it():
    actions = reconcile(body(managedBy="kueue.x-k8s.io/multikueue"), World().observe(T0), IMAGE)
    assert actions == Actions()


def test_a_status_patch_brings_either_base_to_the_new_status():
    """A handler may hold a body older than the status the last cycle wrote (tests/test_operator.py's
    unreachable member showed it): the patch works from both."""
    old = {"phase": "Pending", "progress": {"step": 0, "reward": 0.1}, "trainerAddress": "http://a"}
    written = {"phase": "Running", "progress": {"step": 3, "reward": 0.5}, "restarts": 1}
    new = {"phase": "Running", "progress": {"step": 4}, "restarts": 1}
    change = union(merge_patch(old, new), merge_patch(written, new))
    assert merge(old, change) == new and merge(written, change) == new
