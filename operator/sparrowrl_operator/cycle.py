"""What one cycle is given, knows and decides. `Observed` is what the handlers saw; `Facts` the
job as every concern reads it; `Outcome` the status and `Actions` the concerns add to, in turn.
Each concern takes them as arguments: what a policy reads and writes is in its signature."""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass, field
from typing import Literal

from sparrowrl.auth.pki import Issued
from sparrowrl.spec.job import JobSpec
from sparrowrl.spec.layout import Process
from sparrowrl.spec.status import TrainerStatus
from sparrowrl_operator import podspec
from sparrowrl_operator.builders import JobRef
from sparrowrl_operator.conditions import find, is_true, set_condition
from sparrowrl_operator.constants import CREATED, FAILURES_ANNOTATION
from sparrowrl_operator.model import SparrowRLJobStatus
from sparrowrl_operator.pods import Cluster, Pods, terminating

Key = tuple[str, str]  # kind, name
NETWORK_ENV = "SPARROWRL_NETWORK_POLICY"  # the chart's NetworkPolicy settings, as JSON


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
class Network:
    """The operator's defaults, from its chart."""

    jobs: bool = True  # a policy for jobs that set no networkPolicy.mode
    metrics_from: tuple[dict, ...] = ({"namespaceSelector": {}},)  # NetworkPolicyPeers that scrape; () none
    operator: dict | None = None  # the NetworkPolicyPeer of the operator's pods (None: outside any cluster)

    @classmethod
    def from_json(cls, text: str) -> Network:
        """The chart's settings. ValueError: what is wrong, naming the key."""
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{NETWORK_ENV}: not JSON ({e})") from None
        if not isinstance(raw, dict) or set(raw) - {"jobs", "metricsFrom", "operator"}:
            raise ValueError(f"{NETWORK_ENV}: an object of jobs, metricsFrom and operator")
        jobs, peers, operator = raw.get("jobs", True), raw.get("metricsFrom", []), raw.get("operator")
        if not isinstance(jobs, bool):
            raise ValueError(f"{NETWORK_ENV}: jobs must be true or false")
        if not isinstance(peers, list) or not all(isinstance(p, dict) and p for p in peers):
            raise ValueError(f"{NETWORK_ENV}: metricsFrom must be a list of NetworkPolicyPeers")
        if operator is not None and not (isinstance(operator, dict) and operator):
            raise ValueError(f"{NETWORK_ENV}: operator must be a NetworkPolicyPeer")
        return cls(jobs, tuple(peers), operator)


@dataclass(frozen=True)
class Observed:
    now: datetime.datetime
    token: str  # the job's transport token: the Secret's, or a new one
    authority: Issued | None = None  # a CA made for the job, for when its Secret is not there yet
    pods: dict[Cluster, list[dict]] = field(default_factory=dict)  # this job's pods, per reachable cluster
    objects: dict[Cluster, dict[Key, dict]] = field(default_factory=dict)  # this job's Services, Secrets...
    members: dict[str, Member] = field(default_factory=dict)
    trainer_service: dict | None = None  # for its load balancer's or node port's address
    node_address: str | None = None  # a node's external address, for a NodePort trainer
    trainer: TrainerStatus | None = None  # GET /v1/status, when the trainer answered


@dataclass
class Actions:
    """What a cycle decided: the handlers carry it out."""

    create: list[tuple[Cluster, dict]] = field(default_factory=list)  # pods, the state's claim: made once
    apply: list[tuple[Cluster, dict]] = field(default_factory=list)  # missing or drifted: server-side apply
    patch: list[tuple[Cluster, str, str, str, dict]] = field(default_factory=list)  # kind, ns, name, merge patch
    delete: list[tuple[Cluster, str, str, str]] = field(default_factory=list)  # cluster, kind, namespace, name
    status: SparrowRLJobStatus | None = None  # None: leave the status alone (another controller manages the job)
    events: list[tuple[Literal["Normal", "Warning"], str, str]] = field(default_factory=list)
    delete_job: bool = False  # its ttlSecondsAfterFinished ran out


@dataclass(frozen=True)
class Facts:
    """The job, its spec parsed, and what was observed: read by every concern, changed by none."""

    job: JobRef
    spec: JobSpec
    document: dict  # the spec as stored, which the job's ConfigMap is written from
    obs: Observed
    image: str  # for a job that names none
    backoff: Backoff
    prev: SparrowRLJobStatus  # the status as last written
    pods: Pods
    network: Network = Network()

    def seen(self, cluster: Cluster, kind: str, name: str) -> dict | None:
        return self.obs.objects.get(cluster, {}).get((kind, name))

    def pod(
        self,
        cluster: Cluster,
        role: Process,
        n: int,
        slot: int | None,
        namespace: str | None = None,
        template: dict | None = None,
        failures: int = 0,
        generation: int | None = None,
        node: int = 0,
    ) -> dict:
        """A slot's pod, attempt `n`. `failures`: the slot's failures in a row before it, which it
        carries (an annotation: what the row is counted from survives the operator's restarts)."""
        job = self.job if cluster is None else self.job.in_member()
        manifest = podspec.pod(
            job,
            role,
            self.spec,
            namespace=namespace or self.job.namespace,
            attempt=n,
            image=self.spec.image or self.image,
            home=cluster is None,
            slot=slot,
            template=template,
            generation=generation,
            node=node,
        )
        if failures:
            manifest["metadata"].setdefault("annotations", {})[FAILURES_ANNOTATION] = str(failures)
        return manifest


class Outcome:
    """The status and the actions as each concern adds to them: a condition set, with an Event
    when it changes; a pod made or deleted."""

    def __init__(self, prev: SparrowRLJobStatus, now: str, generation: int | None):
        self.now, self.generation = now, generation
        self.status = prev.model_copy(update={"observed_generation": generation})
        self.actions = Actions()

    @property
    def terminal(self) -> bool:
        return is_true(self.status.conditions, "Succeeded") or is_true(self.status.conditions, "Failed")

    def update(self, **fields) -> None:
        self.status = self.status.model_copy(update=fields)

    def condition(self, type_: str, status: bool | None, reason: str, message: str = "") -> None:
        conds = set_condition(list(self.status.conditions), type_, status, reason, message, self.now, self.generation)
        self.update(conditions=conds)

    def event(self, reason: str, message: str, warning: bool = False) -> None:
        self.actions.events.append(("Warning" if warning else "Normal", reason, message))

    def transition(self, type_: str, status: bool, reason: str, message: str, warning: bool = False) -> None:
        """Set a condition, with an Event when it changes."""
        old = find(self.status.conditions, type_)
        if old is None or old.status != str(status) or old.reason != reason:
            self.event(reason, message, warning)
        self.condition(type_, status, reason, message)

    def fail(self, reason: str, message: str) -> None:
        self.transition("Failed", True, reason, message, warning=True)
        self.update(completion_time=self.status.completion_time or self.now)

    def create_pod(self, cluster: Cluster, manifest: dict) -> None:
        self.actions.create.append((cluster, manifest))
        self.event(
            CREATED, f"created pod {manifest['metadata']['name']}" + (f" in cluster {cluster}" if cluster else "")
        )

    def remove(self, cluster: Cluster, pod: dict) -> None:
        if not terminating(pod):
            self.actions.delete.append((cluster, "Pod", pod["metadata"]["namespace"], pod["metadata"]["name"]))
