"""The job spec's fields that only a Kubernetes cluster reads: images, resources, scheduling, the
trainer's state volume and address, placements over member clusters, the run policy and health.
`sparrowrl run` accepts them (one YAML runs in both places) and uses the placements and
`runPolicy.backoffLimit`; the operator uses all of them. Bounds are Kubernetes' own where it has
them, else ours (docs/limits.md). Rules that span fields carry their CEL form
(`x-kubernetes-validations`) so the API server refuses what `parse` refuses."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field, model_validator

from sparrowrl.spec.section import Section

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
QUANTITY = r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)(([KMGTPE]i)|[numkMGTPE]|([eE][-+]?[0-9]+))?$"
LABEL_KEY = (
    r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"  # resource names too
)
LABEL_VALUE = r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$"
MAX_TEMPLATE_BYTES = 64 << 10
DAY = 86_400
MAX_NODES = 32  # a trainer's pods: beyond that, rendezvous and checkpoint fan-in want other tools
MAX_WORLD = 256  # a trainer's ranks over all its nodes
MAX_COST_PER_HOUR = 100_000.0  # dollars per pod-hour: far above any accelerator's price


Quantity = Annotated[str, Field(pattern=QUANTITY, max_length=64)]
CostPerHour = Annotated[float, Field(ge=0, le=MAX_COST_PER_HOUR)]
ResourceName = Annotated[str, Field(pattern=LABEL_KEY, max_length=317)]
LabelMap = Annotated[
    dict[
        Annotated[str, Field(pattern=LABEL_KEY, max_length=317)],
        Annotated[str, Field(pattern=LABEL_VALUE, max_length=63)],
    ],
    Field(max_length=64),
]


class Resources(Section):
    """A container's requests and limits, as in a Pod (`nvidia.com/gpu: 1` asks for a GPU)."""

    requests: Annotated[dict[ResourceName, Quantity], Field(max_length=32)] = {}
    limits: Annotated[dict[ResourceName, Quantity], Field(max_length=32)] = {}


class Toleration(Section):
    key: Annotated[str, Field(max_length=317)] | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: Annotated[str, Field(max_length=63)] | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(None, ge=0, le=365 * DAY)


class Scheduling(Section):
    resources: Resources = Resources()
    node_selector: LabelMap = {}
    tolerations: Annotated[list[Toleration], Field(max_length=32)] = []


class RetentionPolicy(Section):
    """What becomes of the state's claim when the job goes, as a StatefulSet's
    persistentVolumeClaimRetentionPolicy: the trained model is on it."""

    when_deleted: Literal["Retain", "Delete"] = Field(
        "Retain",
        description=(
            "Retain: the claim outlives the job (deleted, or by ttlSecondsAfterFinished), and a job of the same name "
            "made later resumes from it; Delete: it goes with the job."
        ),
    )


class StateVolume(Section):
    """The trainer's PersistentVolumeClaim: its checkpoints, store and journal, so a restarted
    trainer resumes instead of starting over; its final model and exports."""

    size: Quantity = "10Gi"
    storage_class_name: Annotated[str, Field(max_length=253)] | None = None
    access_modes: Annotated[
        list[Literal["ReadWriteOnce", "ReadWriteOncePod", "ReadWriteMany"]], Field(min_length=1, max_length=3)
    ] = ["ReadWriteOnce"]
    retention_policy: RetentionPolicy = RetentionPolicy()


class TrainerService(Section):
    """How workers reach the trainer. Inside its own cluster, a ClusterIP Service; workers in a
    member cluster need an address from outside: a LoadBalancer's or a NodePort's, which the
    operator reads back, or `url` (an ingress, a VPN address)."""

    type: Literal["ClusterIP", "LoadBalancer", "NodePort"] = "ClusterIP"
    url: Annotated[str, Field(pattern=r"^https?://[^\s/?#]+(:[0-9]{1,5})?/?$", max_length=253)] | None = None
    annotations: Annotated[
        dict[Annotated[str, Field(pattern=LABEL_KEY, max_length=317)], Annotated[str, Field(max_length=4096)]],
        Field(max_length=64),
    ] = {}


class CheckpointSpec(Section):
    every: int = Field(
        1,
        ge=1,
        le=1_000_000,
        description=(
            "Steps between checkpoints of the fp32 weights and optimizer state (the last step always has one). A "
            "trainer started again trains the steps after its newest checkpoint once more, from the journal's "
            "admitted results, and publishes from the version after the store's newest."
        ),
    )
    keep: int = Field(1, ge=1, le=1000, description="How many of the newest checkpoints are kept.")


OWN_KEYS = ("sparrowrl.dev/", "app.kubernetes.io/managed-by")  # labels and annotations the operator finds its pods by
OWN_METADATA = ("name", "generateName", "namespace", "ownerReferences", "finalizers")
OWN_SPEC = ("restartPolicy",)  # the check's refusal and a role's exit are read from a pod that ran once


def _template(patch: dict[str, Any], container: str) -> dict[str, Any]:
    """A patch of pods whose one container is named `container`. It may change that container
    (containers merge by name) and add native sidecars (init containers with restartPolicy:
    Always), but not add containers: a pod whose sidecar runs on never finishes, so a trainer that
    exited 0 would hold its job and a crashing worker would never count as failed. Nor may it touch
    what the operator finds and judges its pods by. Never null: that would remove what it patches."""
    if set(patch) - {"metadata", "spec"}:
        raise ValueError(
            f"a pod template patch holds metadata and spec only, not {sorted(set(patch) - {'metadata', 'spec'})}"
        )
    size = len(json.dumps(patch))
    if size > MAX_TEMPLATE_BYTES:
        raise ValueError(f"a pod template patch of {size:,} bytes (limit {MAX_TEMPLATE_BYTES:,})")
    for part in ("metadata", "spec"):
        if part in patch and not isinstance(patch[part], dict):
            raise ValueError(f"{part}: an object (null would remove the pod's {part})")
    meta, spec = patch.get("metadata") or {}, patch.get("spec") or {}
    if owned := [k for k in OWN_METADATA if k in meta]:
        raise ValueError(f"metadata.{owned[0]}: the operator sets it")
    for kind in ("labels", "annotations"):
        keys = meta.get(kind) or {}
        if not isinstance(keys, dict):
            raise ValueError(f"metadata.{kind}: an object of strings")
        if owned := [k for k in keys if isinstance(k, str) and k.startswith(OWN_KEYS)]:
            raise ValueError(f"metadata.{kind}[{owned[0]!r}]: the operator finds and counts its pods by it")
    if owned := [k for k in OWN_SPEC if k in spec]:
        raise ValueError(f"spec.{owned[0]}: the operator sets it (Never)")
    for key in ("containers", "initContainers"):
        if key not in spec:
            continue
        if not isinstance(spec[key], list):
            raise ValueError(f"spec.{key}: a list of containers, each with its name")
        for i, c in enumerate(spec[key]):
            where = f"spec.{key}[{i}]"
            if not isinstance(c, dict) or not isinstance(c.get("name"), str):
                raise ValueError(f"{where}: a container needs a name (containers merge by name)")
            if "image" in c and not isinstance(c["image"], str):
                raise ValueError(f"{where} ({c['name']!r}): image must be a string")
            if key == "containers" and c["name"] != container:
                raise ValueError(
                    f"{where} ({c['name']!r}): the pod's one container is {container!r}; add a sidecar as an init "
                    f"container with restartPolicy: Always (a native sidecar, which lets the pod finish)"
                )
            if key == "initContainers" and not c.get("image"):
                raise ValueError(f"{where} ({c['name']!r}): an init container needs its image")
            mounts = c.get("volumeMounts") if key == "containers" else None
            if any(
                isinstance(m, dict) and m.get("name") == "tmp" and m.get("mountPath") != "/tmp" for m in mounts or []
            ):
                raise ValueError(
                    f"{where} ({c['name']!r}): volume 'tmp' is the pod's /tmp, and its mount merges by name with the "
                    "operator's: mount it at /tmp, or give yours another name"
                )
    return patch


def _patch_of(container: str) -> AfterValidator:
    """The check of a pod template patch for pods whose container is named `container`."""
    return AfterValidator(lambda patch: _template(patch, container))


# the types of those patches, spelt out: a type checker reads an alias, not a function's result
WorkerTemplate = Annotated[dict[str, Any], _patch_of("worker")]
RelayTemplate = Annotated[dict[str, Any], _patch_of("relay")]
TrainerTemplate = Annotated[dict[str, Any], _patch_of("trainer")]


class TrainerSpec(Scheduling):
    ranks: int = Field(
        1,
        ge=1,
        le=64,
        description=(
            "Processes per node the trainer shards its model over (FSDP2), one per GPU where there are GPUs (give "
            "the pod as many in resources); each diffs and publishes its own shard of every version."
        ),
    )
    nodes: int = Field(
        1,
        ge=1,
        le=MAX_NODES,
        description=(
            "Machines (pods) the trainer spans, each running `ranks` of its processes; they meet through "
            "torch.distributed's TCP store at node 0's pod, start together and restart together. Node 0 serves "
            "the store and the API, as a one-node trainer does."
        ),
    )
    sharding: Literal["full", "hybrid"] = Field(
        "full",
        description=(
            "How the ranks of several nodes share the model: full shards it over every rank (FSDP2); hybrid "
            "shards it within a node and replicates it across nodes (HSDP: less traffic between nodes, more "
            "memory per rank)."
        ),
    )
    join_timeout_seconds: int = Field(
        600,
        ge=10,
        le=DAY,
        description=(
            "How long node 0 waits for every node to join before its first collective (torchrun's "
            "join_timeout); then the trainer stops, naming the nodes that did not join, and is started again "
            "as after any failure."
        ),
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description=(
            "Where one rank trains: auto takes the GPU when torch sees one (bf16 compute, fp32 master weights and "
            "AdamW state), else the CPU (fp32); cuda without a GPU fails at start. Sharded ranks take a GPU each "
            "when there are GPUs."
        ),
    )
    checkpoint: CheckpointSpec = CheckpointSpec()
    state: StateVolume = StateVolume()
    service: TrainerService = TrainerService()
    template: TrainerTemplate = Field(
        {},
        description=(
            "Merged into the trainer's pod (a JSON merge patch of {metadata, spec}; containers, env, volumes and "
            "volumeMounts merge by name): the user's volumes and their mounts, env (HF_TOKEN from a Secret), "
            "serviceAccountName, imagePullSecrets, affinity, priorityClassName. Its spec check (an init container) "
            "gets the trainer container's env and mounts."
        ),
    )
    cost_per_hour: CostPerHour | None = Field(
        None,
        description=(
            "What the trainer's pod costs, in dollars an hour (each node's, for a trainer of several nodes). With "
            "placements' costPerHour, the job's cost and its tokens per dollar are reported."
        ),
    )


class Placement(Section):
    """One region of rollout workers (and its relay) in one cluster: a `SparrowCluster`, or the
    operator's own cluster when `cluster` is absent."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.minReplicas) || !has(self.replicas) || self.minReplicas <= self.replicas",
                    "message": "minReplicas must not exceed replicas",
                }
            ]
        }
    )
    region: str = Field(pattern=DNS_LABEL.replace("{0,61}", "{0,30}"), max_length=32)
    cluster: Annotated[str, Field(pattern=r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$", max_length=253)] | None = None
    replicas: int = Field(1, ge=0, le=64)
    min_replicas: int = Field(1, ge=0, le=64, description="Workers that must be up before rollouts start.")
    relay: bool = True
    cost_per_hour: CostPerHour | None = Field(
        None,
        description=(
            "What one worker's pod of this placement costs, in dollars an hour, counted while the worker is live."
        ),
    )
    template: WorkerTemplate = Field(
        {},
        description=(
            "Merged into each worker pod of this placement, not its relay's (a JSON merge patch of {metadata, spec}; "
            "containers merge by name: 'worker' is the worker's; sidecars are init containers with restartPolicy: "
            "Always)."
        ),
    )

    @model_validator(mode="after")
    def _min(self) -> Placement:
        if self.min_replicas > self.replicas:
            raise ValueError(f"minReplicas ({self.min_replicas}) must not exceed replicas ({self.replicas})")
        return self


class RelaySpec(Scheduling):
    """Every relay's pod. A relay fetches each version once and serves its region's workers: CPU,
    memory and network, no GPU; it takes nothing of the workers' resources or templates."""

    template: RelayTemplate = Field(
        {},
        description=(
            "Merged into each relay pod (a JSON merge patch of {metadata, spec}; containers merge by name: 'relay' "
            "is the relay's; sidecars are init containers with restartPolicy: Always)."
        ),
    )


class RunPolicy(Section):
    """As a Kubernetes Job's: suspend, deadlines, retries, clean-up."""

    suspend: bool = False
    active_deadline_seconds: int | None = Field(
        None,
        ge=1,
        le=365 * DAY,
        description=("Running time before the job fails; it starts again when a suspended job resumes."),
    )
    startup_deadline_seconds: int | None = Field(
        None, ge=1, le=7 * DAY, description=("Time from start to the first rollout before the job fails.")
    )
    backoff_limit: int = Field(3, ge=0, le=100, description="Trainer failures restarted before the job fails.")
    worker_backoff_limit: int = Field(
        5,
        ge=0,
        le=100,
        description=(
            "Failures in a row of one worker (or relay) that are replaced, with a growing backoff; the next gives "
            "its slot up and the placement is Degraded. A pod that ran 10 minutes breaks the row. The job fails "
            "when every worker has been given up."
        ),
    )
    ttl_seconds_after_finished: int | None = Field(None, ge=0, le=365 * DAY)


class IssuerRef(Section):
    """A cert-manager issuer of the job's serving certificates."""

    name: Annotated[str, Field(pattern=r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$", max_length=253)]
    kind: Literal["Issuer", "ClusterIssuer"] = "Issuer"
    group: Literal["cert-manager.io"] = "cert-manager.io"


class TlsSpec(Section):
    """Encryption of the job's hops in a cluster: the trainer and each relay serve HTTPS with
    certificates the operator issues from the job's CA, and relays and workers trust that CA
    alone. `sparrowrl run` stays plain on loopback (`--tls` turns it on)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.caSecretName) || !has(self.mode) || self.mode == 'Enabled'",
                    "message": "caSecretName is for mode Enabled",
                },
                {
                    "rule": "!has(self.issuerRef) || !has(self.mode) || self.mode == 'Enabled'",
                    "message": "issuerRef is for mode Enabled",
                },
                {
                    "rule": "!has(self.issuerRef) || !has(self.caSecretName)",
                    "message": "give caSecretName or issuerRef, not both",
                },
            ]
        }
    )
    mode: Literal["Enabled", "Disabled"] = Field(
        "Enabled",
        description=(
            "Disabled: every hop is plain HTTP, tokens and weights included (for a mesh that encrypts already: "
            "Istio, Linkerd, Cilium); the job's Encrypted condition says so."
        ),
    )
    ca_secret_name: Annotated[str, Field(pattern=r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$", max_length=253)] | None = (
        Field(
            None,
            description=(
                "A Secret in the job's namespace holding a CA of your own (tls.crt, tls.key) to issue the job's "
                "certificates from; the operator only reads it. Default: a CA made for the job, in the Secret "
                "JOB-ca."
            ),
        )
    )

    issuer_ref: IssuerRef | None = Field(
        None,
        description=(
            "A cert-manager Issuer (in the job's namespace) or ClusterIssuer that issues the trainer's and relays' "
            "certificates instead of the operator; it must give a ca.crt (a CA or self-signed issuer), which the "
            "job's pods trust alone."
        ),
    )

    @model_validator(mode="after")
    def _mode(self) -> TlsSpec:
        if self.ca_secret_name is not None and self.mode != "Enabled":
            raise ValueError(f"caSecretName {self.ca_secret_name!r} is for mode Enabled, not {self.mode}")
        if self.issuer_ref is not None and self.mode != "Enabled":
            raise ValueError(f"issuerRef {self.issuer_ref.name!r} is for mode Enabled, not {self.mode}")
        if self.issuer_ref is not None and self.ca_secret_name is not None:
            raise ValueError("give caSecretName or issuerRef, not both")
        return self


class NetworkPolicySpec(Section):
    """Which traffic reaches the job's pods, in each cluster where it runs."""

    mode: Literal["Enabled", "Disabled"] | None = Field(
        None,
        description=(
            "Enabled: a NetworkPolicy per cluster admits only the job's own pods to the trainer's and relays' "
            "ports, anyone to the trainer's where its Service is a LoadBalancer or NodePort (or url), the operator "
            "to the trainer's, and the metrics scraper to each pod's metrics port. Disabled: none. Unset: the "
            "operator's default (its chart's networkPolicy.jobs: on)."
        ),
    )


class Health(Section):
    stale_after_seconds: int = Field(
        300, ge=10, le=DAY, description=("A worker the trainer has not heard from for this long is stale.")
    )
    on_stale: Literal["Replace", "Ignore", "FailJob"] = "Replace"


MANAGED_BY = "sparrowrl.dev/operator"
ManagedBy = Annotated[
    str,
    Field(
        pattern=r"^[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?/[-A-Za-z0-9_.]{1,63}$",
        max_length=127,
        description=(
            f"The controller that reconciles this job: {MANAGED_BY} (default) or "
            "another, e.g. kueue.x-k8s.io/multikueue. Immutable."
        ),
    ),
]
