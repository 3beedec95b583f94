"""The operator's decisions, as one pure function: a job, what is observed in each cluster and
from the trainer, and the time → the objects to create, apply and delete, the status, the Events.
The kopf handlers only observe, call `reconcile` and carry out its plan; tests call it with
tables of scenarios. It decides from the current state, never from the event that woke it,
so running it twice does no harm (watches replay)."""

from __future__ import annotations

import datetime
import functools
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ValidationError

from sparrowrl.spec import layout
from sparrowrl.spec.job import JobError, parse
from sparrowrl.spec.kubespec import MANAGED_BY
from sparrowrl.spec.layout import INVALID_EXIT, Process
from sparrowrl.spec.status import JobStatus as TrainerStatus
from sparrowrl.spec.status import WorkerStatus
from sparrowrl_operator import builders
from sparrowrl_operator.builders import JobRef
from sparrowrl_operator.conditions import find, is_true, reopen, set_condition
from sparrowrl_operator.constants import (
    ADOPTED,
    ATTEMPT_LABEL,
    CLAIM_CONFLICT,
    CORRECTED,
    CRASH_LOOP,
    CREATED,
    FAILURES_ANNOTATION,
    INVALID,
    JOB_LABEL,
    MANAGED_BY_LABEL,
    MANAGER,
    REGION_LABEL,
    REPLACED,
    RESTARTED,
    RESUMED,
    ROLE_LABEL,
    SAMPLES_REFUSED,
    SLOT_LABEL,
    STALE,
    STEPS_ANNOTATION,
    STEPS_RAISED,
    STEPS_SKIPPED,
    SUCCEEDED,
    SUSPENDED,
    TRAINER_PORT,
    TTL_EXPIRED,
    UID_LABEL,
    UNREACHABLE,
    WORKERS_FAILED,
)
from sparrowrl_operator.model import (
    MAX_LISTED,
    Display,
    LeaseHealth,
    PlacementStatus,
    Progress,
    SparrowRLJobStatus,
    Staleness,
    WorkerCounts,
    WorkerProgress,
)

Cluster = str | None  # a SparrowCluster's name; None: the operator's own
Key = tuple[str, str]  # kind, name
RESET_AFTER = 600.0  # seconds a pod must run for its failure not to continue its slot's row (as the kubelet's)


@dataclass(frozen=True)
class Member:
    """What the operator knows of a member cluster that a placement names."""

    namespace: str
    reachable: bool | None  # None: its first probe has not answered yet
    reason: str = ""  # why not, when not


@dataclass(frozen=True)
class Backoff:
    base: float = 10.0
    cap: float = 300.0

    def delay(self, attempt: int) -> float:
        return min(self.base * 2 ** min(attempt, 30), self.cap)


@dataclass(frozen=True)
class Observed:
    now: datetime.datetime
    token: str  # the job's transport token: the Secret's, or a new one
    pods: dict[Cluster, list[dict]] = field(default_factory=dict)  # this job's pods, per reachable cluster
    objects: dict[Cluster, dict[Key, dict]] = field(default_factory=dict)  # this job's Services, Secrets...
    members: dict[str, Member] = field(default_factory=dict)
    trainer_service: dict | None = None  # for its load balancer's or node port's address
    node_address: str | None = None  # a node's external address, for a NodePort trainer
    trainer: TrainerStatus | None = None  # GET /v1/status, when the trainer answered


@dataclass
class Plan:
    create: list[tuple[Cluster, dict]] = field(default_factory=list)  # pods, the state's claim: made once
    apply: list[tuple[Cluster, dict]] = field(default_factory=list)  # missing or drifted: server-side apply
    patch: list[tuple[Cluster, str, str, str, dict]] = field(default_factory=list)  # kind, ns, name, merge patch
    delete: list[tuple[Cluster, str, str, str]] = field(default_factory=list)  # cluster, kind, namespace, name
    status: SparrowRLJobStatus | None = None  # None: leave the status alone (another controller manages the job)
    events: list[tuple[Literal["Normal", "Warning"], str, str]] = field(default_factory=list)
    delete_job: bool = False  # its ttlSecondsAfterFinished ran out


def stamp(t: datetime.datetime) -> str:
    return t.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def since(t: str | None, now: datetime.datetime) -> float:
    if not t:
        return 0.0
    return (now - datetime.datetime.fromisoformat(t.replace("Z", "+00:00"))).total_seconds()


def previous(body: dict) -> SparrowRLJobStatus:
    """The status as last written; one that does not parse (edited by hand) starts afresh."""
    try:
        return SparrowRLJobStatus.model_validate(body.get("status") or {})
    except ValidationError:
        return SparrowRLJobStatus()


def phase_of(pod: dict) -> str:
    return (pod.get("status") or {}).get("phase") or "Pending"


def ready(pod: dict) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def ended(pod: dict) -> dict:
    """The terminated state of the pod's own container (named as its role), else {}."""
    role = pod["metadata"].get("labels", {}).get(ROLE_LABEL)
    for s in (pod.get("status") or {}).get("containerStatuses") or []:
        if s.get("name") == role:
            return (s.get("state") or {}).get("terminated") or {}
    return {}


def finished_at(pod: dict) -> str | None:
    return ended(pod).get("finishedAt")


def failed_at(pod: dict) -> str | None:
    """When a failed pod ended: its container's finish, else (a pod that failed without one, e.g.
    evicted) its newest condition's change, else its creation."""
    conds = (pod.get("status") or {}).get("conditions") or []
    changed = max((c["lastTransitionTime"] for c in conds if c.get("lastTransitionTime")), default=None)
    return finished_at(pod) or changed or started_at(pod) or pod["metadata"].get("creationTimestamp")


def in_a_row(pod: dict) -> int:
    """The failures in a row of a failed pod's slot, this one included: those before it (its
    annotation, set when it replaced a failed pod), unless it ran RESET_AFTER seconds, which
    ends a row, as the kubelet resets its crash-loop backoff."""
    try:
        before = int(pod["metadata"].get("annotations", {})[FAILURES_ANNOTATION])
    except (KeyError, ValueError):
        before = 0
    start, end = ended(pod).get("startedAt"), finished_at(pod)  # the container's run, not the image pull before it
    ran = since(start, datetime.datetime.fromisoformat(end.replace("Z", "+00:00"))) if start and end else 0.0
    return 1 if ran >= RESET_AFTER else before + 1


def termination(pod: dict) -> str:
    """Why a pod failed, as `kubectl describe pod` says it: its container's reason, exit code and
    message (the role's container first), else the pod's reason and message (evicted)."""
    st = pod.get("status") or {}
    role = pod["metadata"].get("labels", {}).get(ROLE_LABEL)
    statuses = sorted(st.get("containerStatuses") or [], key=lambda c: c.get("name") != role)
    for c in statuses:
        t = (c.get("state") or {}).get("terminated") or (c.get("lastState") or {}).get("terminated")
        if t:
            head = ", ".join(x for x in (t.get("reason"), f"exit code {t.get('exitCode')}") if x)
            return head + (f": {t['message'].strip()[:300]}" if (t.get("message") or "").strip() else "")
    head = ": ".join(x for x in (st.get("reason"), (st.get("message") or "")[:300]) if x)
    return head or "no reason given"


def refused(pod: dict) -> str | None:
    """Why the trainer pod's spec check refused the job (its init container exited with
    INVALID_EXIT), or None. The kubelet keeps the end of its log as its termination
    message: the last line is `error: FIELD: why`."""
    for s in (pod.get("status") or {}).get("initContainerStatuses") or []:
        end = (s.get("state") or {}).get("terminated") or {}
        if s.get("name") == builders.CHECK and end.get("exitCode") == INVALID_EXIT:
            lines = [x.strip() for x in (end.get("message") or "").splitlines() if x.strip()]
            why = lines[-1].removeprefix("error: ") if lines else "no reason given"
            return f"the trainer's check in pod {pod['metadata']['name']}: {why}"
    return None


def attempt(pod: dict) -> int:
    try:
        return int(pod["metadata"]["labels"][ATTEMPT_LABEL])
    except (KeyError, ValueError):
        return 0


def started_at(pod: dict) -> str | None:
    return (pod.get("status") or {}).get("startTime")


def terminating(pod: dict) -> bool:
    return bool(pod["metadata"].get("deletionTimestamp"))


def slot_key(pod: dict) -> tuple[str, str | None, str | None]:
    lb = pod["metadata"].get("labels", {})
    return lb.get(ROLE_LABEL, ""), lb.get(REGION_LABEL), lb.get(SLOT_LABEL)


def rounded(x: float | None, digits: int) -> float | None:
    """What a person reads in `kubectl describe`; the trainer's /v1/status has every digit."""
    return None if x is None else round(x, digits)


def human_count(x: float) -> str:
    """14.4M, not the 1.44e+07 that a number column would show; short at any size (the column's
    field has a length bound)."""
    for unit in ("", "k", "M", "G", "T"):
        if x < 1000:
            return f"{x:.0f}" if not unit else f"{x:.1f}{unit}"
        x /= 1000
    return f"{x * 1e15:.2g}"


def counted(n: int, what: str) -> str:
    """`1 sample`, `3 samples`."""
    return f"{n} {what}" + ("" if n == 1 else "s")


def human_bytes(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def unmet(want: Any, have: Any, path: str = "") -> str | None:
    """The first place where `have` lacks what `want` holds, or None: dicts key by key, each item
    of a list in some item of the observed list (another manager may add items; the server
    orders them), anything else equal. Empty maps and lists count as met: the API drops them."""
    if isinstance(want, (dict, list)) and not want:
        return None
    if isinstance(want, dict):
        if not isinstance(have, dict):
            return path or "."
        for k, v in want.items():
            if (hit := unmet(v, have.get(k), f"{path}.{k}" if path else k)) is not None:
                return hit
        return None
    if isinstance(want, list):
        if not isinstance(have, list):
            return path
        for i, v in enumerate(want):
            if all(unmet(v, h) is not None for h in have):
                return f"{path}[{i}]"
        return None
    return None if want == have else path


def applied_fields(obj: dict) -> dict:
    """The fields (managedFields' FieldsV1) that this operator's last apply set on `obj`."""
    out: dict = {}
    for entry in (obj.get("metadata") or {}).get("managedFields") or []:
        if entry.get("manager") == MANAGER and entry.get("operation") == "Apply":
            out = builders.merge(out, entry.get("fieldsV1") or {})
    return out


def dropped(fields: dict, want: dict, path: str = "") -> str | None:
    """A field applied before (FieldsV1: `f:name` keys; items of lists are not followed) that
    `want` no longer has: an apply removes it, so it is a difference too."""
    for key, sub in fields.items():
        if not key.startswith("f:"):
            continue
        name = key[2:]
        at = f"{path}.{name}" if path else name
        if name not in want:
            return at
        if isinstance(sub, dict) and isinstance(want[name], dict) and (hit := dropped(sub, want[name], at)):
            return hit
    return None


def drift(desired: dict, observed: dict) -> str | None:
    """Where the observed object differs from the manifest decided for it, or None. What the server
    or others add (a cluster IP, defaults, resourceVersion, other labels) is no difference; a Secret
    is compared as stored (data), and apiVersion and kind are left out (a list's items lack them)."""
    want = builders.stored(desired)
    body = {k: v for k, v in want.items() if k not in ("apiVersion", "kind")}
    return unmet(body, observed) or dropped(applied_fields(observed), want)


def derive_phase(conditions: list, trainer_serving: bool) -> str:
    """The phase `kubectl get` shows, from the conditions alone (as JobSet derives its terminal
    state): terminal ones first, then suspension, then how the trainer's pod is."""
    trainer = find(conditions, "TrainerReady")
    for type_ in ("Failed", "Succeeded", "Suspended"):
        if is_true(conditions, type_):
            return type_
    if trainer is not None and trainer.reason == "Restarting":
        return "Restarting"
    if trainer is not None and trainer.status == "True":
        return "Running" if trainer_serving else "Starting"  # serving: its own status is past Pending
    return "Pending"


class _Cycle:
    """One reconcile: the plan and the status grow as each part of the job is looked at."""

    def __init__(self, body: dict, obs: Observed, image: str, backoff: Backoff):
        meta = body["metadata"]
        self.body, self.obs, self.image, self.backoff = body, obs, image, backoff
        self.job = JobRef(meta["name"], meta["namespace"], meta["uid"])
        self.generation = meta.get("generation")
        self.now = stamp(obs.now)
        self.prev = previous(body)
        self.status = self.prev.model_copy(update={"observed_generation": self.generation})
        self.plan = Plan()
        self.clusters = (0, 0)  # reachable, used
        self.crashed: list[str] = []  # why each slot given up was
        self.workers_alive = 0  # worker slots not given up
        self.claim_going = False  # the state claim is an earlier job's, being deleted

    def condition(self, type_: str, status: bool | None, reason: str, message: str = "") -> None:
        conds = set_condition(list(self.status.conditions), type_, status, reason, message, self.now, self.generation)
        self.status = self.status.model_copy(update={"conditions": conds})

    def update(self, **fields) -> None:
        self.status = self.status.model_copy(update=fields)

    def event(self, reason: str, message: str, warning: bool = False) -> None:
        self.plan.events.append(("Warning" if warning else "Normal", reason, message))

    def transition(self, type_: str, status: bool, reason: str, message: str, warning: bool = False) -> None:
        """Set a condition, with an Event when it changes."""
        old = find(self.status.conditions, type_)
        if old is None or old.status != str(status) or old.reason != reason:
            self.event(reason, message, warning)
        self.condition(type_, status, reason, message)

    def fail(self, reason: str, message: str) -> None:
        self.transition("Failed", True, reason, message, warning=True)
        self.update(completion_time=self.status.completion_time or self.now)

    # --- the parts of a cycle ---

    def run(self) -> Plan:
        try:
            job = parse(
                {k: self.body[k] for k in ("apiVersion", "kind", "metadata", "spec")},
                f"{self.job.namespace}/{self.job.name}",
            )
        except JobError as e:
            return self.invalid(str(e))
        except KeyError as e:
            return self.invalid(f"{e.args[0]}: missing")
        spec = job.spec
        if spec.manager != MANAGED_BY:
            self.plan.status = None  # e.g. kueue.x-k8s.io/multikueue: another controller runs it
            return self.plan
        if why := builders.names_fit(self.job, spec):
            return self.invalid(why)
        self.spec = spec
        self.reopen()
        if self.terminal():
            self.finish()
        elif spec.run_policy.suspend:
            self.suspend()
        else:
            self.active()
        self.display()
        return self.done()

    def invalid(self, message: str) -> Plan:
        if not self.terminal():  # a finished job's spec no longer matters
            self.fail(INVALID, message)
        self.cleanup_running()
        return self.done()

    def done(self) -> Plan:
        """The cycle's status, with its phase derived once, from the conditions."""
        t = self.obs.trainer
        self.update(phase=derive_phase(self.status.conditions, t is not None and t.phase != "Pending"))
        self.plan.status = self.status
        return self.plan

    def reopen(self) -> None:
        """A job that succeeded and whose steps were raised since trains on from the trainer's
        state: no longer finished, its deadline counting from now."""
        done = self.status.progress.steps
        conds = self.status.conditions
        if not is_true(conds, "Succeeded") or is_true(conds, "Failed") or self.spec.steps <= done:
            return
        message = f"spec.steps raised from {done} to {self.spec.steps} after the job succeeded: it trains on"
        self.update(
            conditions=reopen(list(conds), "Succeeded", STEPS_RAISED, message, self.now, self.generation),
            completion_time=None,
            active_since=None,
            progress=self.status.progress.model_copy(update={"steps": self.spec.steps}),
        )

    def terminal(self) -> bool:
        return is_true(self.status.conditions, "Succeeded") or is_true(self.status.conditions, "Failed")

    def all_pods(self):
        for cluster, pods in self.obs.pods.items():
            for p in pods:
                yield cluster, p

    def remove(self, cluster: Cluster, p: dict) -> None:
        if not terminating(p):
            self.plan.delete.append((cluster, "Pod", p["metadata"]["namespace"], p["metadata"]["name"]))

    def cleanup_running(self) -> None:
        """A finished job frees its machines; finished pods stay for their logs."""
        for cluster, p in self.all_pods():
            if phase_of(p) not in ("Succeeded", "Failed"):
                self.remove(cluster, p)

    def finish(self) -> None:
        self.cleanup_running()
        settled = self.claim_as_decided()
        ttl = self.spec.run_policy.ttl_seconds_after_finished
        if ttl is not None and since(self.status.completion_time, self.obs.now) >= ttl and settled:
            self.plan.delete_job = True
            claim = builders.claim_name(self.job)
            if builders.retained(self.spec):
                self.event(
                    TTL_EXPIRED,
                    f"deleted after runPolicy.ttlSecondsAfterFinished ({ttl} s); its volume claim {claim}, with "
                    "the trained model, is kept (trainer.state.retentionPolicy.whenDeleted: Retain)",
                )
            else:
                self.event(
                    TTL_EXPIRED,
                    f"deleted after runPolicy.ttlSecondsAfterFinished ({ttl} s); its volume claim {claim}, with "
                    "the trained model, goes with it (trainer.state.retentionPolicy.whenDeleted: Delete)",
                    warning=True,
                )

    def suspend(self) -> None:
        for cluster, p in self.all_pods():
            self.remove(cluster, p)
        if not is_true(self.status.conditions, "Suspended"):
            self.event(SUSPENDED, "suspended: pods deleted; the trainer's state is kept")
        self.condition("Suspended", True, "Suspended", "runPolicy.suspend is set")
        self.condition("TrainerReady", False, "Suspended")
        self.condition("RolloutReady", False, "Suspended")
        self.update(active_since=None)

    def active(self) -> None:
        if is_true(self.status.conditions, "Suspended"):
            self.event(RESUMED, "resumed: the trainer continues from its state")
        if find(self.status.conditions, "Suspended") is not None:
            self.condition("Suspended", False, "Resumed")
        self.update(start_time=self.status.start_time or self.now, active_since=self.status.active_since or self.now)
        if self.deadlines():
            return
        self.home_objects()
        if self.terminal():  # the state's claim is someone else's
            self.finish()
            return
        self.trainer()
        if self.terminal():
            self.finish()
            return
        self.placements()
        if self.terminal():  # every worker given up
            self.finish()
            return
        self.progress()
        self.health()
        self.trust()

    def deadlines(self) -> bool:
        rp, active = self.spec.run_policy, since(self.status.active_since, self.obs.now)
        if rp.active_deadline_seconds is not None and active > rp.active_deadline_seconds:
            self.fail(
                "DeadlineExceeded",
                f"running for {active:.0f} s, over runPolicy.activeDeadlineSeconds ({rp.active_deadline_seconds})",
            )
        elif rp.startup_deadline_seconds is not None and not self.started() and active > rp.startup_deadline_seconds:
            self.fail(
                "DeadlineExceeded",
                f"no rollout after {active:.0f} s, over runPolicy.startupDeadlineSeconds "
                f"({rp.startup_deadline_seconds})",
            )
        else:
            return False
        self.finish()
        return True

    def started(self) -> bool:
        t = self.obs.trainer
        return self.prev.progress.step > 0 or (t is not None and t.phase != "Pending")

    def seen(self, cluster: Cluster, kind: str, name: str) -> dict | None:
        return self.obs.objects.get(cluster, {}).get((kind, name))

    def ensure(self, cluster: Cluster, manifest: dict, expected: bool = False) -> bool:
        """The object as decided: a missing one made, a drifted one applied again, with a Corrected
        Event unless the change is `expected`. Whether it existed."""
        kind, name = manifest["kind"], manifest["metadata"]["name"]
        seen = self.seen(cluster, kind, name)
        if seen is None:
            self.plan.apply.append((cluster, manifest))
        elif where := drift(manifest, seen):
            self.plan.apply.append((cluster, manifest))
            if not expected:
                self.event(
                    CORRECTED,
                    f"{kind} {name}" + (f" in cluster {cluster}" if cluster else "") + f": {where} differed from "
                    "what the operator decides; applied it again",
                )
        return seen is not None

    def home_objects(self) -> None:
        job, spec = self.job, self.spec
        config = self.seen(None, "ConfigMap", builders.config_name(job)) or {}
        written = (config.get("data") or {}).get(builders.JOB_KEY)
        raised = builders.raised_from(job, self.body["spec"], written)
        if raised is not None:
            self.event(
                STEPS_RAISED, f"spec.steps raised from {raised} to {spec.steps}: the trainer trains on from its state"
            )
        manifests = [
            builders.token_secret(job, self.obs.token, job.namespace, home=True),
            builders.job_config(job, self.body["spec"], written),
            builders.trainer_service(job, spec),
        ]
        raise_only = raised is not None  # the ConfigMap's apply is the raise, not a correction
        missing = [m["kind"] for m in manifests if not self.ensure(None, m, m["kind"] == "ConfigMap" and raise_only)]
        if not self.state_claim():
            missing.insert(2, "PersistentVolumeClaim")
        self.condition(
            "Created",
            not missing,
            "ObjectsCreated" if not missing else "Creating",
            "the trainer's Secret, ConfigMap, volume claim and Service exist"
            if not missing
            else f"creating {', '.join(missing)}",
        )

    def state_claim(self) -> bool:
        """The trainer's claim (observed by name, whatever its labels): made once; one retained
        from an earlier job of this name is adopted (the trainer resumes from it, and refuses
        another job's state); its owner follows the retention policy. One this operator did not
        make for a job of this name is never touched: the job fails. Whether it exists."""
        job, name = self.job, builders.claim_name(self.job)
        seen = self.seen(None, "PersistentVolumeClaim", name)
        if seen is None:
            self.plan.create.append((None, builders.state_claim(job, self.spec)))
            return False
        labels = seen["metadata"].get("labels") or {}
        if labels.get(MANAGED_BY_LABEL) != MANAGER or labels.get(JOB_LABEL) != job.name:
            self.fail(
                CLAIM_CONFLICT,
                f"PersistentVolumeClaim {name} exists and is not one this operator made for a job named {job.name}; "
                "it is left alone: delete it, or give the job another name",
            )
            return True
        refs = seen["metadata"].get("ownerReferences") or []
        if seen["metadata"].get("deletionTimestamp") or any(
            r.get("kind") == "SparrowRLJob" and r.get("name") == job.name and r.get("uid") != job.uid for r in refs
        ):
            self.claim_going = True  # its owner, an earlier job of this name, went: made again once gone
            return False
        if patch := builders.claim_patch(job, self.spec, seen):
            self.plan.patch.append((None, "PersistentVolumeClaim", job.namespace, name, patch))
            if labels.get(UID_LABEL) != job.uid:
                self.event(
                    ADOPTED,
                    f"PersistentVolumeClaim {name}, retained from an earlier job of this name, holds this job's "
                    "state now: the trainer resumes from it, and refuses it if it is another job's (then delete "
                    "the claim to start afresh)",
                )
        return True

    def claim_as_decided(self) -> bool:
        """A finished job's claim follows its retention policy as it is now: a user who switches to
        Retain to keep the model keeps it. Whether it follows it already (the job may go)."""
        name = builders.claim_name(self.job)
        seen = self.seen(None, "PersistentVolumeClaim", name)
        if seen is None or (seen["metadata"].get("labels") or {}).get(UID_LABEL) != self.job.uid:
            return True  # none of this job's
        if patch := builders.claim_patch(self.job, self.spec, seen):
            self.plan.patch.append((None, "PersistentVolumeClaim", self.job.namespace, name, patch))
            return False
        return True

    def current(self, cluster: Cluster, key: tuple) -> tuple[dict | None, list[dict]]:
        """The newest attempt's pod of a slot, and the older ones still there."""
        pods = self._slots.get((cluster, key), [])
        return (pods[-1], pods[:-1]) if pods else (None, [])

    @functools.cached_property
    def _slots(self) -> dict[tuple[Cluster, tuple], list[dict]]:
        """Each slot's pods, oldest attempt first: indexed once, where a search per slot would
        cost a job of thousands of workers millions of comparisons a cycle."""
        out: dict[tuple[Cluster, tuple], list[dict]] = {}
        for cluster, p in self.all_pods():
            out.setdefault((cluster, slot_key(p)), []).append(p)
        return {k: sorted(v, key=attempt) for k, v in out.items()}

    def trains_for(self, pod: dict) -> int | None:
        """The steps the trainer pod trains toward: what it says when it runs and answers (it may
        have read its ConfigMap before a change reached it), else the steps it was made with
        (a pod made before that annotation: those it last reported)."""
        t = self.obs.trainer
        if t is not None and phase_of(pod) == "Running":
            return t.steps
        try:
            return int(pod["metadata"]["annotations"][STEPS_ANNOTATION])
        except (KeyError, ValueError):
            return self.prev.progress.steps or None

    def trainer(self) -> None:
        """The trainer pod: created, and restarted after a failure up to backoffLimit, or when it
        trains toward fewer steps than the job's (they were raised); the job succeeds when it
        exits 0 having trained every step."""
        role = Process("trainer", "trainer")
        pod, older = self.current(None, ("trainer", None, None))
        for p in older:
            self.remove(None, p)
        limit = self.spec.run_policy.backoff_limit
        if pod is None and self.claim_going:
            self.condition(
                "TrainerReady",
                False,
                "WaitingForClaim",
                f"PersistentVolumeClaim {builders.claim_name(self.job)}, an earlier job's of this name, is being "
                "deleted with it: the trainer starts on a new one",
            )
            return
        if pod is None:
            self.create_pod(None, role, self.status.restarts, None, template=self.spec.trainer.template)
            self.condition("TrainerReady", False, "Creating", "creating the trainer pod")
            return
        n, phase = attempt(pod), phase_of(pod)
        if terminating(pod):  # its successor is created once it is gone (the same name)
            self.condition("TrainerReady", False, "Terminating", f"pod {pod['metadata']['name']} is being deleted")
            return
        behind = self.trains_for(pod)
        if phase != "Failed" and behind is not None and behind < self.spec.steps:
            self.remove(None, pod)  # its successor, made once it is gone, reads the raised steps
            self.condition(
                "TrainerReady",
                False,
                "Restarting",
                f"spec.steps raised from {behind} to {self.spec.steps}: restarting pod {pod['metadata']['name']}, "
                "which goes on from its volume",
            )
            self.update(progress=self.status.progress.model_copy(update={"steps": self.spec.steps}))
            return
        if phase == "Succeeded":
            self.condition("TrainerReady", False, "Finished", "the trainer finished the job")
            self.transition("Succeeded", True, SUCCEEDED, f"trained {self.spec.steps} steps")
            self.update(
                completion_time=self.status.completion_time or self.now,
                # it exits 0 only once every step is trained; its last /v1/status may have been missed
                progress=self.status.progress.model_copy(
                    update={"step": self.spec.steps, "steps": self.spec.steps, "policy_version": self.spec.steps}
                ),
            )
            return
        if phase == "Failed" and (why := refused(pod)):  # the same job would fail again: no restart
            self.fail(INVALID, why)
            return
        if phase == "Failed":
            if n >= limit:
                self.fail(
                    "BackoffLimitExceeded", f"the trainer failed {n + 1} times; runPolicy.backoffLimit is {limit}"
                )
                return
            self.condition("TrainerReady", False, "Restarting", f"the trainer failed (pod {pod['metadata']['name']})")
            if since(failed_at(pod), self.obs.now) >= self.backoff.delay(n):  # its container may never have run
                self.create_pod(None, role, n + 1, None, template=self.spec.trainer.template)
                self.remove(None, pod)
                self.update(restarts=n + 1)
                self.event(
                    RESTARTED, f"the trainer failed; restart {n + 1} of {limit}, resuming from its volume", warning=True
                )
            return
        self.update(restarts=max(self.status.restarts, n))
        up = phase == "Running" and ready(pod)
        self.condition(
            "TrainerReady",
            up,
            "Ready" if up else "NotReady",
            f"pod {pod['metadata']['name']}" + ("" if up else f" is {phase}"),
        )

    def trainer_address(self) -> str | None:
        """How workers in member clusters reach the trainer."""
        s = self.spec.trainer.service
        if s.url:
            return s.url.rstrip("/")
        svc = self.obs.trainer_service or {}
        if s.type == "LoadBalancer":
            for ing in ((svc.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []:
                if host := ing.get("ip") or ing.get("hostname"):
                    return f"http://{host}:{TRAINER_PORT}"
        if s.type == "NodePort" and self.obs.node_address:
            for p in (svc.get("spec") or {}).get("ports") or []:
                if p.get("nodePort"):
                    return f"http://{self.obs.node_address}:{p['nodePort']}"
        return None

    def placements(self) -> None:
        job, spec = self.job, self.spec
        address = self.trainer_address()
        if address and address != self.status.trainer_address:
            self.update(trainer_address=address)
        where = {p.region: p for p in spec.placements or []}

        def namespace(region: str) -> str:
            p = where.get(region)
            return self.obs.members[p.cluster].namespace if p and p.cluster in self.obs.members else job.namespace

        def url(name: str, region: str) -> str:
            remote = where.get(region) is not None and where[region].cluster is not None
            if name == "trainer":
                return (address or "") if remote else builders.trainer_url(job)
            return builders.relay_url(
                job.in_member() if remote else job, name.removeprefix("relay-"), namespace(region)
            )

        roles = [r for r in layout.processes(spec, url) if r.kind != "trainer"]
        statuses, unreachable, connecting, total, reachable = [], [], [], set(), set()
        for region in spec.regions:
            p = where.get(region.name)
            cluster = p.cluster if p else None
            total.add(cluster)
            prev = next((s for s in self.prev.placements if s.region == region.name), None)
            member = self.obs.members.get(cluster) if cluster else None
            if cluster and (member is None or not member.reachable):
                if member is not None and member.reachable is None:
                    connecting.append(cluster)
                else:
                    unreachable.append(f"{cluster} ({member.reason if member else 'no such SparrowCluster'})")
                statuses.append(prev or PlacementStatus(region=region.name, cluster=cluster, desired=region.workers))
                self.workers_alive += region.workers  # not seen: not given up
                continue
            reachable.add(cluster)
            mine = [r for r in roles if r.region == region.name]
            if cluster and (not address or ("Secret", builders.token_name(job)) not in self.obs.objects.get(None, ())):
                statuses.append(PlacementStatus(region=region.name, cluster=cluster, desired=region.workers))
                self.workers_alive += region.workers
                continue  # its pods need the trainer's outside address, and their tokens the job's secret first
            statuses.append(self.placement(cluster, namespace(region.name), region.name, mine, p))
        crashed = "; ".join(self.crashed)
        if unreachable:
            self.transition(
                "Degraded",
                True,
                UNREACHABLE,
                "unreachable: "
                + ", ".join(unreachable)
                + "; the other placements go on"
                + (crashed and f"; {crashed}"),
                warning=True,
            )
        elif crashed:  # each slot given up has had its Event
            self.condition("Degraded", True, CRASH_LOOP, crashed)
        elif find(self.status.conditions, "Degraded") is not None:
            self.transition(
                "Degraded", False, "AllHealthy", "every member cluster answers, and no worker or relay is given up"
            )
        self.update(placements=statuses)
        if not self.workers_alive:  # a job has a worker (parse)
            self.fail(WORKERS_FAILED, f"every worker failed past runPolicy.workerBackoffLimit: {crashed}")
        self.clusters = (len(reachable), len(total))  # the operator's own counts as one
        waiting = [
            s.region for s in statuses if s.ready < (where[s.region].min_replicas if s.region in where else s.desired)
        ]
        self.condition(
            "RolloutReady",
            not waiting,
            "MinReplicasReady" if not waiting else "Waiting",
            "every placement has its minimum of ready workers"
            if not waiting
            else f"waiting for workers in {', '.join(waiting)}"
            + (
                ""
                if address or not any(where[r].cluster for r in waiting if r in where)
                else " (the trainer's address from outside is not known yet)"
            )
            + (f" (connecting to {', '.join(connecting)})" if connecting else ""),
        )

    def placement(self, cluster: Cluster, namespace: str, region: str, roles: list[Process], p) -> PlacementStatus:
        home = cluster is None
        job = self.job if home else self.job.in_member()
        secret_kept = ("Secret", builders.token_name(self.job)) in self.obs.objects.get(None, ())
        prev = next((s for s in self.prev.placements if s.region == region), PlacementStatus(region=region))
        failed = replaced = ready_n = 0
        given_up: list[str] = []  # the failed pods of slots given up
        lost = 0  # worker slots given up
        workers = [r for r in roles if r.kind == "worker"]
        for r in roles:
            # a placement's template is its workers'; relays have their own
            template = self.spec.relays.template if r.kind == "relay" else p.template if p is not None else None
            if secret_kept:  # tokens from the secret the trainer keeps, not from one about to be made
                self.ensure(cluster, builders.credentials_secret(job, r, self.obs.token, namespace, home))
            if r.kind == "relay":
                self.ensure(cluster, builders.relay_service(job, region, namespace, home))
            slot = workers.index(r) if r.kind == "worker" else None
            key = (r.kind, region, None if slot is None else str(slot))
            pod, older = self.current(cluster, key)
            for old in older:
                self.remove(cluster, old)
            if pod is None:
                self.create_pod(cluster, r, 0, slot, namespace, template)
                continue
            if terminating(pod):
                continue  # suspended or scaled down a moment ago: its successor waits for the name
            n = attempt(pod)
            replaced += n
            phase = phase_of(pod)
            if r.kind == "worker" and ready(pod) and phase == "Running":
                ready_n += 1
            if phase == "Failed":
                failed += 1
                name, row, why = pod["metadata"]["name"], in_a_row(pod), termination(pod)
                if row > self.spec.run_policy.worker_backoff_limit:
                    given_up.append(name)
                    lost += r.kind == "worker"
                    self.give_up(region, r, name, row, why, name not in prev.given_up)
                elif since(failed_at(pod), self.obs.now) >= self.backoff.delay(row - 1):
                    why = f"pod {name} failed ({why}), {row} in a row"
                    self.replace(cluster, pod, r, n, slot, namespace, template, why, failures=row)
            elif phase == "Succeeded" and self.before_trainer(pod):
                why = f"pod {pod['metadata']['name']} finished before the trainer started again"
                self.replace(cluster, pod, r, n, slot, namespace, template, why, warning=False)
            elif r.kind == "worker" and self.stale(pod) and self.spec.health.on_stale == "Replace":
                self.replace(
                    cluster, pod, r, n, slot, namespace, template, f"worker {pod['metadata']['name']} is stale"
                )
        for stray in self.obs.pods.get(cluster, []):  # scaled down
            role, reg, slot = slot_key(stray)
            if role == "worker" and reg == region and slot is not None and int(slot) >= len(workers):
                self.remove(cluster, stray)
        self.workers_alive += len(workers) - lost
        return PlacementStatus(
            region=region,
            cluster=cluster,
            desired=len(workers),
            ready=ready_n,
            failed=failed,
            replaced=replaced,
            given_up=given_up,
        )

    def give_up(self, region: str, role: Process, pod: str, row: int, why: str, new: bool) -> None:
        """A slot past runPolicy.workerBackoffLimit: its failed pod stays (its logs, its reason), and
        the placement is Degraded; an Event says so once."""
        limit = self.spec.run_policy.worker_backoff_limit
        what = f"the relay of {region}" if role.kind == "relay" else f"worker {role.name}"
        message = f"{what} failed {row} times in a row (runPolicy.workerBackoffLimit: {limit}); pod {pod}: {why}"
        self.crashed.append(message)
        if new:
            self.event(
                CRASH_LOOP,
                message
                + "; no longer replaced: delete the pod to try again"
                + ("; workers fetch from the trainer meanwhile" if role.kind == "relay" else ""),
                warning=True,
            )

    def create_pod(
        self,
        cluster: Cluster,
        role: Process,
        n: int,
        slot: int | None,
        namespace: str | None = None,
        template: dict | None = None,
        failures: int = 0,
    ) -> None:
        """`failures`: the slot's failures in a row before this pod, which it carries (an
        annotation: what the row is counted from survives the operator's restarts)."""
        job = self.job if cluster is None else self.job.in_member()
        manifest = builders.pod(
            job,
            role,
            self.spec,
            namespace=namespace or self.job.namespace,
            attempt=n,
            image=self.spec.image or self.image,
            home=cluster is None,
            slot=slot,
            template=template,
        )
        if failures:
            manifest["metadata"].setdefault("annotations", {})[FAILURES_ANNOTATION] = str(failures)
        self.plan.create.append((cluster, manifest))
        self.event(
            CREATED, f"created pod {manifest['metadata']['name']}" + (f" in cluster {cluster}" if cluster else "")
        )

    def replace(
        self,
        cluster: Cluster,
        pod: dict,
        role: Process,
        n: int,
        slot: int | None,
        namespace: str,
        template: dict | None,
        why: str,
        warning: bool = True,
        failures: int = 0,
    ) -> None:
        self.create_pod(cluster, role, n + 1, slot, namespace, template, failures)
        self.remove(cluster, pod)
        self.event(REPLACED, f"{why}; replaced it (replacement {n + 1})", warning=warning)

    def before_trainer(self, pod: dict) -> bool:
        """Whether `pod` exited (a worker told the job was done) before the running trainer
        started: that trainer may have steps to train (they were raised), so the slot runs again
        (after a failure restart instead, its new worker is told done at once)."""
        trainer, _ = self.current(None, ("trainer", None, None))
        if trainer is None or terminating(trainer) or phase_of(trainer) != "Running":
            return False
        start, end = started_at(trainer), finished_at(pod)
        return bool(start and end) and since(end, self.obs.now) >= since(start, self.obs.now)

    @functools.cached_property
    def _stale(self) -> dict[str, float]:
        """Workers whose pods run, that the trainer has not heard from for staleAfterSeconds. Not
        while the trainer itself has been up for less: a trainer that was down was heard by no one,
        and its workers are still backing off."""
        t = self.obs.trainer
        limit = self.spec.health.stale_after_seconds
        trainer, _ = self.current(None, ("trainer", None, None))
        up = since((trainer or {}).get("status", {}).get("startTime"), self.obs.now) if trainer else 0.0
        if t is None or up <= limit:
            return {}
        alive = {p["metadata"]["name"] for _, p in self.all_pods() if phase_of(p) == "Running" and not terminating(p)}
        return {w.name: w.seconds_since_seen for w in t.workers if w.name in alive and w.seconds_since_seen > limit}

    def stale_names(self) -> dict[str, float]:
        return self._stale  # once a cycle: asked for each pod

    @functools.cached_property
    def alive(self) -> set[str]:
        """The names of the pods not being deleted, in every cluster answering."""
        return {p["metadata"]["name"] for _, p in self.all_pods() if not terminating(p)}

    def stale(self, pod: dict) -> bool:
        return pod["metadata"]["name"] in self.stale_names()

    def progress(self) -> None:
        t = self.obs.trainer
        if t is None:
            return
        stale = self.stale_names()
        listed, counts = worker_view(t, self.alive, stale, self.spec.sync.staleness)
        held_by_stale = sum(w.leases_held for w in t.workers if w.name in stale)
        self.update(
            progress=Progress(
                step=t.step,
                steps=self.spec.steps,  # a trainer about to restart with raised steps still says the old ones
                policy_version=t.version,
                reward=rounded(t.reward_last, 4),
                recent_reward=rounded(t.reward_mean_10, 4),
                tokens_per_second=rounded(t.tokens_per_second, 1),
                payload_bytes=t.last_payload_bytes,
                changed_fraction=rounded(t.last_changed_fraction, 5),
                commits_verified=t.commits_verified,
                commits_mismatched=t.commits_mismatched,
                steps_skipped=t.steps_skipped,
                samples_refused=t.samples_refused,
                cost_dollars=rounded(t.cost_dollars, 4),
                tokens_per_dollar=rounded(t.tokens_per_dollar, 1),
                worker_counts=counts,
                workers=listed,
            ),
            leases=LeaseHealth(
                active=t.leases_active,
                healthy=max(t.leases_active - held_by_stale, 0),
                expired=t.leases_expired,
                requeued=t.prompt_groups_requeued,
                stale_workers=sorted(stale, key=lambda n: (-stale[n], n))[:MAX_LISTED],
                oldest_heartbeat_seconds=rounded(
                    max((w.seconds_since_seen for w in t.workers if w.name in self.alive), default=None), 1
                ),
            ),
        )

    def stale_events(self, stale: dict[str, float]) -> None:
        """An Event per worker as it goes stale, not one per stale worker per cycle: 4,000 stale
        workers made 4,000 Events every cycle. The last status lists up to MAX_LISTED stale
        workers; beyond that many, one Event says how many when the count changes."""
        on_stale = self.spec.health.on_stale
        before, named_all = self.prev.leases.stale_workers, self.prev.progress.worker_counts.stale <= MAX_LISTED
        if len(stale) <= MAX_LISTED and named_all:
            for n in sorted(set(stale) - set(before)):
                self.event(STALE, f"worker {n} not heard from for {stale[n]:.0f} s; health.onStale is {on_stale}", True)
        elif len(stale) != self.prev.progress.worker_counts.stale:
            worst = ", ".join(f"{n} ({s:.0f} s)" for n, s in sorted(stale.items(), key=lambda x: -x[1])[:8])
            self.event(
                STALE, f"{len(stale)} workers not heard from, the longest {worst}; health.onStale is {on_stale}", True
            )

    def health(self) -> None:
        t = self.obs.trainer
        if t is None:
            return
        stale = self.stale_names()
        if stale:
            names = ", ".join(f"{n} ({s:.0f} s)" for n, s in sorted(stale.items())[:8])
            self.transition("LeasesHealthy", False, "StaleWorkers", f"not heard from: {names}", warning=True)
            self.stale_events(stale)
            if self.spec.health.on_stale == "FailJob":
                self.fail("StaleWorkers", f"not heard from: {names}; health.onStale is FailJob")
                self.finish()
        else:
            self.condition(
                "LeasesHealthy",
                True,
                "AllWorkersReporting",
                f"{t.leases_active} leases active, {t.leases_expired} expired",
            )
        alive = self.alive  # every live worker, not only those the status lists
        reported = [w for w in t.workers if w.name in alive and w.committed_version is not None]
        bad = [w.name for w in reported if w.last_verification == "mismatch"]
        behind = [w.name for w in reported if (w.staleness or 0) > self.spec.sync.staleness]
        if bad:
            self.transition(
                "WeightsInSync",
                False,
                "HashMismatch",
                f"committed weights differ from the trainer's: {', '.join(bad[:8])}",
                warning=True,
            )
        elif behind:
            self.condition(
                "WeightsInSync",
                False,
                "Behind",
                f"beyond sync.staleness ({self.spec.sync.staleness}): {', '.join(behind[:8])}",
            )
        elif reported:
            self.condition(
                "WeightsInSync",
                True,
                "Verified",
                f"{len(reported)} workers within "
                f"{self.spec.sync.staleness} version(s) of v{t.version}, each commit hash-verified",
            )

    def trainer_logs(self) -> str:
        """The command that shows the running trainer's log."""
        pod, _ = self.current(None, ("trainer", None, None))
        name = pod["metadata"]["name"] if pod else builders.pod_name(self.job, Process("trainer", "trainer"), 0)
        return f"kubectl logs {name}"

    def trust(self) -> None:
        """WorkersTrusted, from the trainer's count of each live worker's refused samples: samples
        whose log-probs were further from the trainer's than grpo.behaviour.refuseGap, from a
        worker sending false numbers (compromised, broken or buggy). Not a failure, and no part of
        the phase: the run goes on, those samples are not trained. A count is the trainer's over
        the job, for the worker's pod name, so the condition holds while that pod lives. Then the
        steps that changed no weight, with an Event when there are more."""
        t = self.obs.trainer
        if t is None:
            return
        refused = {w.name: w.refused_samples for w in t.workers if w.name in self.alive and w.refused_samples}
        if refused:
            worst = sorted(refused, key=lambda n: (-refused[n], n))
            names = ", ".join(f"{n} ({refused[n]})" for n in worst[:8])
            more = f" and {len(worst) - 8} more" if len(worst) > 8 else ""
            self.transition(
                "WorkersTrusted",
                False,
                "FalseSamples",
                f"samples refused, their log-probs further from the trainer's than grpo.behaviour.refuseGap: "
                f"{names}{more}",
                warning=True,
            )
            self.refused_events(refused, worst)
        else:
            self.condition("WorkersTrusted", True, "AllSamplesTrusted", "no live worker has had a sample refused")
        grew = t.steps_skipped - self.prev.progress.steps_skipped
        if grew > 0:
            self.event(
                STEPS_SKIPPED,
                f"{counted(grew, 'more step')} changed no weight ({t.steps_skipped} of {t.step} so far): nothing "
                "to train (every group scored alike), every sample refused, or a loss not finite; "
                f"{self.trainer_logs()} says which, step by step",
            )  # Normal: a solved task's batches have nothing to train, which is no fault

    def refused_events(self, refused: dict[str, int], worst: list[str]) -> None:
        """An Event per worker as its refused samples grow, not one per such worker per cycle. The
        last status's listing holds each one's last count while it lists every such worker (they
        sort right after hash mismatches); beyond that, one Event when the job's count grows."""
        prev, logs = self.prev.progress, self.trainer_logs()
        before = {w.name: w.refused_samples for w in prev.workers if w.refused_samples}
        named_all = len(before) == prev.worker_counts.untrusted
        names_all = sum(bool(w.refused_samples) for w in self.status.progress.workers) == len(refused)
        if named_all and names_all:
            for n in worst:
                if refused[n] > before.get(n, 0):
                    self.event(
                        SAMPLES_REFUSED,
                        f"worker {n} has had {counted(refused[n], 'sample')} refused ({refused[n] - before.get(n, 0)} "
                        "since the last count): their log-probs were further from the trainer's than "
                        f"grpo.behaviour.refuseGap, so they are not trained; {logs} says which steps "
                        f"(`refused N samples of worker {n}`)",
                        True,
                    )
        elif (t := self.obs.trainer) is not None and t.samples_refused > prev.samples_refused:
            most = ", ".join(f"{n} ({refused[n]})" for n in worst[:8])
            self.event(
                SAMPLES_REFUSED,
                f"{counted(len(refused), 'worker')} had samples refused, the most: {most}; "
                f"{t.samples_refused - prev.samples_refused} more since the last count, {t.samples_refused} in all: "
                f"their log-probs were further from the trainer's than grpo.behaviour.refuseGap; {logs} says which",
                True,
            )

    def display(self) -> None:
        s, p = self.status, self.status.progress
        placements = s.placements
        reachable, used = self.clusters
        payload = (
            ""
            if p.payload_bytes is None
            else human_bytes(p.payload_bytes)
            + (f" ({p.changed_fraction:.2%})" if p.changed_fraction is not None else "")
        )
        self.update(
            display=Display(
                step=f"{p.step}/{p.steps or self.spec.steps}",
                rollout=f"{sum(x.ready for x in placements)}/{sum(x.desired for x in placements)}",
                leases=f"{s.leases.healthy}/{s.leases.active}",
                clusters=f"{reachable}/{used}" if used else "",
                payload=payload,
                tokens_per_dollar=None if p.tokens_per_dollar is None else human_count(p.tokens_per_dollar),
            )
        )


def worker_view(
    t: TrainerStatus, alive: set[str], stale: dict[str, float], sync_staleness: int
) -> tuple[list[WorkerProgress], WorkerCounts]:
    """The trainer's workers as the status shows them: every live one counted, and the worst
    MAX_LISTED listed (a hash mismatch, then most refused samples (false log-probs), then stale,
    then most versions behind, then most refused answers, then longest unheard), so a status of
    thousands of workers stays small and shows what needs looking at. Workers whose pods are gone
    are left out: the trainer still lists them for a while."""
    live = [w for w in t.workers if w.name in alive]

    def badness(w: WorkerStatus) -> tuple:
        return (
            w.last_verification != "mismatch",
            -w.refused_samples,
            w.name not in stale,
            -(w.staleness or 0),
            -w.refused_answers,
            -w.seconds_since_seen,
            w.name,
        )

    by = {"current": 0, "one": 0, "two": 0, "three_or_more": 0, "unknown": 0}
    for w in live:
        if w.committed_version is None or w.staleness is None:
            by["unknown"] += 1
        else:
            by[("current", "one", "two")[w.staleness] if w.staleness < 3 else "three_or_more"] += 1
    counts = WorkerCounts(
        total=len(t.workers),
        live=len(live),
        stale=sum(w.name in stale for w in live),
        mismatched=sum(w.last_verification == "mismatch" for w in live),
        behind=sum(w.committed_version is not None and (w.staleness or 0) > sync_staleness for w in live),
        refusing=sum(w.refused_answers > 0 for w in live),
        untrusted=sum(w.refused_samples > 0 for w in live),
        by_staleness=Staleness(**by),
    )
    listed = [
        WorkerProgress(
            name=w.name,
            region=w.region,
            committed_version=w.committed_version,
            verification=w.last_verification,
            behind=w.staleness,
            stale=True if w.name in stale else None,
            refused_answers=w.refused_answers or None,
            refused_samples=w.refused_samples or None,
        )
        for w in sorted(live, key=badness)[:MAX_LISTED]
    ]
    return listed, counts


def reconcile(body: dict, observed: Observed, image: str, backoff: Backoff = Backoff()) -> Plan:
    """The plan for one job, from its body (as stored) and what is observed."""
    return _Cycle(body, observed, image, backoff).run()
