"""The custom resources' models beside the job spec (which is the runtime's `JobSpec`): a
SparrowRLJob's status in Kubernetes form, and a SparrowCluster. `hack/gen-crds.py` makes the CRDs
from these, so what the operator writes is what the API server keeps (a real one drops status
fields its schema lacks). No kopf here: the generator imports it."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from sparrowrl.spec.kubespec import DNS_LABEL

Count = Annotated[int, Field(ge=0, le=2**62)]
Name = Annotated[str, Field(max_length=253)]
Time = Annotated[str, Field(max_length=64, json_schema_extra={"format": "date-time"})]
MAX_LISTED = 64  # workers and stale workers listed in a status (the worst first): `kubectl describe` stays readable


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True, allow_inf_nan=False
    )


class Condition(_Model):
    """metav1.Condition."""

    type: Annotated[str, Field(pattern=r"^[A-Za-z][A-Za-z0-9]*$", max_length=316)]
    status: Literal["True", "False", "Unknown"]
    reason: Annotated[str, Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", max_length=1024)]
    message: Annotated[str, Field(max_length=32768)] = ""
    last_transition_time: Time
    observed_generation: Count | None = None


Conditions = Annotated[
    list[Condition],
    Field(max_length=32, json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}),
]


class PlacementStatus(_Model):
    region: Name
    cluster: Name | None = None  # absent: the operator's own
    desired: Count = 0
    ready: Count = 0
    failed: Count = 0
    replaced: Count = 0
    given_up: Annotated[list[Name], Field(max_length=MAX_LISTED + 1)] = Field(
        [],
        description=(
            "Pods of worker or relay slots that failed past runPolicy.workerBackoffLimit in a row: no longer "
            "replaced (delete one to try its slot again)."
        ),
    )


class TrainerNode(_Model):
    """One node of a trainer of several, as `kubectl describe` shows it."""

    node: Count
    pod: Annotated[str, Field(max_length=253)] | None = None
    phase: Annotated[str, Field(max_length=32)] = "Pending"
    message: Annotated[str, Field(max_length=512)] | None = None  # why it waits or failed


class LeaseHealth(_Model):
    active: Count = 0
    healthy: Count = 0  # held by workers that are not stale
    expired: Count = 0
    requeued: Count = 0
    stale_workers: Annotated[list[Name], Field(max_length=MAX_LISTED)] = []
    oldest_heartbeat_seconds: Annotated[float, Field(ge=0, le=1e9)] | None = None


class WorkerProgress(_Model):
    name: Name
    region: Name | None = None
    committed_version: Annotated[int, Field(ge=-1, le=10**8)] | None = None
    verification: Literal["ok", "mismatch"] | None = None
    behind: Count | None = None  # versions behind the trainer's newest
    stale: bool | None = None  # only when True
    refused_answers: Count | None = None  # only when some: answers from its relay that did not verify
    refused_samples: Count | None = None  # only when some: its samples the trainer refused, their log-probs false


class Staleness(_Model):
    """Live workers by versions behind the trainer's newest."""

    current: Count = 0
    one: Count = 0
    two: Count = 0
    three_or_more: Count = 0
    unknown: Count = 0  # nothing committed yet


class WorkerCounts(_Model):
    """Every worker counted, where `workers` lists only the worst MAX_LISTED."""

    total: Count = 0  # in the trainer's status
    live: Count = 0  # of those, with a pod that is not being deleted
    stale: Count = 0  # live, running, not heard from for health.staleAfterSeconds
    mismatched: Count = 0  # live, last commit's hash differed from the trainer's
    behind: Count = 0  # live, beyond sync.staleness
    refusing: Count = 0  # live, refused answers from their relay
    untrusted: Count = 0  # live, had samples refused by the trainer (their log-probs were false): WorkersTrusted
    by_staleness: Staleness = Staleness()


class Progress(_Model):
    """Copied from the trainer's /v1/status (TrainerStatus)."""

    step: Count = 0
    steps: Count = 0
    policy_version: Annotated[int, Field(ge=-1, le=10**8)] = -1
    reward: float | None = None
    recent_reward: float | None = None  # mean over the last 10 steps
    tokens_per_second: Annotated[float, Field(ge=0)] | None = None
    payload_bytes: Count | None = None
    changed_fraction: Annotated[float, Field(ge=0, le=1)] | None = None
    commits_verified: Count = 0
    commits_mismatched: Count = 0
    steps_skipped: Count = 0  # steps that changed no weight
    samples_refused: Count = 0  # samples not trained: their worker's log-probs were false
    cost_dollars: Annotated[float, Field(ge=0)] | None = None  # with the spec's costPerHour
    tokens_per_dollar: Annotated[float, Field(ge=0)] | None = None
    worker_counts: WorkerCounts = WorkerCounts()
    workers: Annotated[list[WorkerProgress], Field(max_length=MAX_LISTED)] = Field(
        [],
        description=(
            "The worst live workers, at most 64: hash mismatches first, then those with most refused samples, "
            "then stale ones, then those most versions behind, then those with most refused answers; "
            "workerCounts counts them all."
        ),
    )


class Display(_Model):
    """What the printer columns show: the API server cannot compute "3/40" from two numbers."""

    step: Annotated[str, Field(max_length=64)] = ""
    rollout: Annotated[str, Field(max_length=64)] = ""
    leases: Annotated[str, Field(max_length=64)] = ""
    clusters: Annotated[str, Field(max_length=64)] = ""
    payload: Annotated[str, Field(max_length=64)] = ""
    tokens_per_dollar: Annotated[str, Field(max_length=64)] | None = None  # None: the spec gives no prices


Phase = Literal["Pending", "Starting", "Running", "Suspended", "Restarting", "Succeeded", "Failed"]


class SparrowRLJobStatus(_Model):
    observed_generation: Count | None = None
    phase: Phase = "Pending"
    conditions: Conditions = []
    placements: Annotated[list[PlacementStatus], Field(max_length=64)] = []
    leases: LeaseHealth = LeaseHealth()
    progress: Progress = Progress()
    display: Display = Display()
    trainer_address: Annotated[str, Field(max_length=512)] | None = None
    restarts: Count = 0  # trainer pods replaced after a failure (a trainer's nodes: once for them all)
    trainer_nodes: Annotated[list[TrainerNode], Field(max_length=32)] = Field(
        [], description="Each node's pod of a trainer of several (trainer.nodes), which start and restart together."
    )
    start_time: Time | None = None
    active_since: Time | None = None  # the last start or resume: activeDeadlineSeconds counts from it
    completion_time: Time | None = None


class SecretKeyRef(_Model):
    name: Annotated[str, Field(pattern=r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$", max_length=253)]
    namespace: Annotated[str, Field(pattern=DNS_LABEL, max_length=63)]


class KubeConfigRef(_Model):
    secret_ref: SecretKeyRef
    key: Annotated[str, Field(pattern=r"^[-._a-zA-Z0-9]+$", max_length=253)] = "kubeconfig"


class ClusterSpec(_Model):
    """A member cluster, as MultiKueue's MultiKueueCluster: a kubeconfig in a Secret."""

    kubeconfig: KubeConfigRef
    region: Annotated[str, Field(pattern=DNS_LABEL, max_length=63)] | None = None
    namespace: Annotated[str, Field(pattern=DNS_LABEL, max_length=63)] = Field(
        "default", description=("Where this cluster's relays and workers, and their token Secrets, go.")
    )


class ClusterStatus(_Model):
    conditions: Conditions = []
    last_probe_time: Time | None = None
    failures: Count = 0  # consecutive failed probes: the reconnect backoff grows with them
