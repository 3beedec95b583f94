"""Manifests from the job: pure functions with deterministic names and labels. Pods run the
roles of `sparrowrl.layout.processes`, the commands the local runner starts, with Kubernetes' own
ways of handing them the rest: credentials from Secrets (the job's secret to the trainer alone; to
each relay and worker slot its own token and the trainer's public key), the job from a ConfigMap,
the trainer's state on a PersistentVolumeClaim, the pod's name and IP from the downward API."""

from __future__ import annotations

import base64
import copy
import functools
import ipaddress
from dataclasses import dataclass, replace
from typing import Any

import yaml

from sparrowrl.auth.pki import Issued
from sparrowrl.auth.signing import Signer, public_text
from sparrowrl.auth.tokens import Role, mint
from sparrowrl.spec.job import API_VERSION, JobSpec
from sparrowrl.spec.kubespec import IssuerRef, Scheduling
from sparrowrl.spec.layout import Process
from sparrowrl_operator.constants import (
    ATTEMPT_LABEL,
    CA_KEY,
    CERT_KEY,
    CREDENTIALS_DIR,
    JOB_LABEL,
    KEY_KEY,
    MANAGED_BY_LABEL,
    MANAGER,
    METRICS_PORT,
    METRICS_SCHEME_LABEL,
    REGION_LABEL,
    RELAY_PORT,
    ROLE_LABEL,
    SLOT_LABEL,
    STEPS_ANNOTATION,
    TLS_DIR,
    TOKEN_GENERATION_ANNOTATION,
    TOKEN_KEY,
    TRAINER_KEY_KEY,
    TRAINER_PORT,
    UID_LABEL,
    WORKDIR,
    WORKER_PORT,
)

PORTS = {"trainer": TRAINER_PORT, "relay": RELAY_PORT, "worker": WORKER_PORT}
TLS_KEYS = (CERT_KEY, KEY_KEY)  # a serving Secret's files in a pod
USER = 65532  # the runtime image's user
JOB_KEY = "job.yaml"  # the job ConfigMap's key, and the job file in the trainer's working folder
CHECK = "sparrowrl-check"  # the trainer pod's init container that checks the job where it will run
FIXED = ("managedBy", "steps", "seed", "model", "task", "grpo", "sync")  # by the CRD's CEL rules (steps only grows)


@dataclass(frozen=True)
class JobRef:
    name: str
    namespace: str
    uid: str
    prefix: str = ""  # of its objects' names: the job's name, and in a member also its uid's start

    @property
    def base(self) -> str:
        return self.prefix or self.name

    def in_member(self) -> JobRef:
        """Jobs of one name from two namespaces may share a member's namespace: there the
        names carry the first characters of the job's uid (`grpo-3f2a1-worker-eu-0-0`)."""
        return replace(self, prefix=f"{self.name}-{self.uid[:5]}")


def labels(job: JobRef, role: str | None = None, region: str | None = None) -> dict[str, str]:
    out = {MANAGED_BY_LABEL: MANAGER, JOB_LABEL: job.name, UID_LABEL: job.uid}
    if role:
        out[ROLE_LABEL] = role
    if region:
        out[REGION_LABEL] = region
    return out


def owner(job: JobRef) -> list[dict]:
    """Home-cluster objects go with the job (garbage collection); member clusters' cannot point
    across clusters, so the finalizer and the orphan sweep remove those."""
    return [
        {
            "apiVersion": API_VERSION,
            "kind": "SparrowRLJob",
            "name": job.name,
            "uid": job.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]


def metadata(job: JobRef, name: str, namespace: str, home: bool, **label_args) -> dict:
    meta = {"name": name, "namespace": namespace, "labels": labels(job, **label_args)}
    return meta | {"ownerReferences": owner(job)} if home else meta


def token_name(job: JobRef) -> str:
    return f"{job.base}-token"


def trainer_name(job: JobRef) -> str:
    return f"{job.name}-trainer"


def relay_name(job: JobRef, region: str) -> str:
    return f"{job.base}-relay-{region}"


def pod_name(job: JobRef, role: Process, attempt: int) -> str:
    """`{job}-trainer-0`, `{job}-relay-eu-0`, `{job}-worker-eu-1-0`: the role's name, then the attempt
    (in a member, `{job}-{uid[:5]}-…`)."""
    return f"{job.base}-{role.name}-{attempt}"


def names_fit(job: JobRef, spec: JobSpec) -> str | None:
    """Why the job's name is too long for its Services' names (DNS labels), or None."""
    longest = max([trainer_name(job)] + [relay_name(job.in_member(), r.name) for r in spec.regions if r.relay], key=len)
    if len(longest) > 63:
        return f"metadata.name: {job.name!r} makes the Service name {longest!r}, over 63 characters"
    return None


def token_secret(job: JobRef, token: str, namespace: str, home: bool) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": metadata(job, token_name(job), namespace, home),
        "stringData": {TOKEN_KEY: token},
    }


def credentials_name(job: JobRef, role: Process) -> str:
    """A relay's Secret, or a worker slot's (every attempt of the slot uses it)."""
    return f"{job.base}-{role.name}-token"


def credentials_secret(
    job: JobRef,
    role: Process,
    secret: str,
    namespace: str,
    home: bool,
    ca: bytes | None = None,
    expires: int | None = None,
    generation: int | None = None,
) -> dict:
    """What a relay or a worker slot's pods get instead of the job's secret: a token for their role,
    signed with the job's key (a worker's names its slot's pods, `{job}-worker-R-I-*`), refused
    after `expires` and once a newer `generation` (the slot's next pod's) has called in; the
    trainer's public key, to check what the relay serves and who asks; and the job's CA (`ca`,
    when the job is encrypted), the one CA its workers trust."""
    token, key = credentials(secret, role.kind, token_subject(job, role), expires, generation)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": metadata(job, credentials_name(job, role), namespace, home, role=role.kind, region=role.region),
        "stringData": {TOKEN_KEY: token, TRAINER_KEY_KEY: key},
        **({"data": _encoded({CA_KEY: ca})} if ca else {}),
    }


def _encoded(values: dict[str, bytes]) -> dict[str, str]:
    """A Secret's `data`: bytes as they are (a CA or key read back may hold any bytes beside its PEM)."""
    return {k: base64.b64encode(v).decode() for k, v in values.items()}


def _items(keys: list[str] | tuple[str, ...]) -> list[dict]:
    """A Secret's keys as files of the same names: only these (the trainer's key stays out)."""
    return [{"key": k, "path": k} for k in keys]


def encrypted(spec: JobSpec) -> bool:
    return spec.tls.mode == "Enabled"


def authority_name(job: JobRef, spec: JobSpec) -> str:
    """The Secret holding the job's CA: the user's, or the one the operator makes."""
    return spec.tls.ca_secret_name or f"{job.name}-ca"


def authority_secret(job: JobRef, ca: Issued) -> dict:
    """The CA the operator makes for a job, in the job's namespace; it goes with the job."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "metadata": metadata(job, f"{job.name}-ca", job.namespace, True),
        "data": _encoded({CERT_KEY: ca.cert, KEY_KEY: ca.key}),
    }


def serving_name(job: JobRef, role: Process) -> str:
    """The trainer's or a relay's serving certificate, or the one a placement's workers share
    (their probes and metrics: no client asks for a worker by name)."""
    if role.kind == "worker":
        return f"{job.base}-worker-{role.region}-tls"
    return f"{trainer_name(job) if role.kind == 'trainer' else relay_name(job, role.region or '')}-tls"


def worker_names(job: JobRef, region: str, namespace: str) -> list[str]:
    """What a placement's workers' certificate names: their placement, in their namespace."""
    return [f"{job.base}-worker-{region}.{namespace}"]


def serving_secret(job: JobRef, role: Process, namespace: str, home: bool, served: Issued, ca: bytes) -> dict:
    """A serving certificate, its key and the CA that signed it, as cert-manager writes one."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "metadata": metadata(job, serving_name(job, role), namespace, home, role=role.kind, region=role.region),
        "data": _encoded({CERT_KEY: served.cert, KEY_KEY: served.key, CA_KEY: ca}),
    }


def certificate(job: JobRef, role: Process, names: list[str], ref: IssuerRef) -> dict:
    """A cert-manager Certificate of a serving certificate, in the job's namespace: cert-manager
    writes its Secret, labelled as the job's (so it is seen, and cleaned up, with the job's)."""
    name = serving_name(job, role)
    dns, ips = [n for n in names if not _is_ip(n)], [n for n in names if _is_ip(n)]
    spec: dict[str, Any] = {
        "secretName": name,
        "secretTemplate": {"labels": labels(job, role.kind, role.region)},
        "issuerRef": {"name": ref.name, "kind": ref.kind, "group": ref.group},
        "duration": "2160h",
        "renewBefore": "720h",
        "privateKey": {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always"},
        "usages": ["server auth", "digital signature"],
    }
    spec |= {"dnsNames": dns} if dns else {}
    spec |= {"ipAddresses": ips} if ips else {}
    return {
        "apiVersion": "cert-manager.io/v1",
        "kind": "Certificate",
        "metadata": metadata(job, name, job.namespace, True, role=role.kind, region=role.region),
        "spec": spec,
    }


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def service_names(name: str, namespace: str) -> list[str]:
    """The names a Service is reached at inside its cluster."""
    return [name, f"{name}.{namespace}", f"{name}.{namespace}.svc", f"{name}.{namespace}.svc.cluster.local"]


def token_subject(job: JobRef, role: Process) -> str:
    """Whom a relay's or worker slot's token names: the relay's region, every pod of the slot."""
    return (role.region or "") if role.kind == "relay" else f"{job.base}-{role.name}-*"


@functools.lru_cache(maxsize=1 << 15)
def credentials(
    secret: str, kind: Role, name: str, expires: int | None = None, generation: int | None = None
) -> tuple[str, str]:
    """A role's token and the trainer's public key. Signing is deterministic, so a cycle that
    builds a slot's Secret again need not sign it again: a 4,000-worker job signed 4,000
    tokens every cycle. The bound holds the slots of 8 jobs of 4,096 workers (a few MB); past
    it, cycles sign again, as before."""
    signer = Signer(secret)
    return mint(signer, kind, name, expires, generation), public_text(signer.key)


def config_name(job: JobRef) -> str:
    return f"{job.name}-job"


def job_config(job: JobRef, spec: dict, written: str | None = None) -> dict:
    """The job as the trainer reads it; `written`: the document the ConfigMap holds now, if any."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(job, config_name(job), job.namespace, True),
        "data": {JOB_KEY: job_document(job, spec, written)},
    }


def job_document(job: JobRef, spec: dict, written: str | None) -> str:
    """The document first written is kept: the trainer's state belongs to the whole job as it
    started (its state dir's job.json), and later changes to runPolicy or placements must not make
    a restarted trainer refuse it. What the CRD guards (FIXED) is taken from the job: raised steps,
    or an edit of the ConfigMap undone; a document that is not this job's is written anew."""
    old = _this_jobs(job, written)
    if old is not None:
        kept = {k: v for k, v in old["spec"].items() if k not in FIXED} | {k: spec[k] for k in FIXED if k in spec}
        if kept == old["spec"] and written is not None:  # not None: old was read from it
            return written
        spec = kept
    return yaml.safe_dump(_head(job) | {"spec": spec}, sort_keys=False)


def _head(job: JobRef) -> dict:
    return {"apiVersion": API_VERSION, "kind": "SparrowRLJob", "metadata": {"name": job.name}}


def _this_jobs(job: JobRef, written: str | None) -> dict | None:
    """The ConfigMap's document, if it is this job's as the operator writes it, else None."""
    old, head = _plain_yaml(written) if written else None, _head(job)
    if isinstance(old, dict) and isinstance(old.get("spec"), dict) and {k: old.get(k) for k in head} == head:
        return old
    return None


def raised_from(job: JobRef, spec: dict, written: str | None) -> int | None:
    """The steps of the ConfigMap's document when the job's are more and nothing else it keeps
    differs (a raise, not an edit to undo), else None."""
    old = _this_jobs(job, written)
    steps = old["spec"].get("steps") if old is not None else None
    if not isinstance(steps, int) or not isinstance(spec.get("steps"), int) or steps >= spec["steps"]:
        return None
    return steps if job_document(job, spec | {"steps": steps}, written) == written else None


def _plain_yaml(text: str) -> Any:
    """YAML without anchors and aliases (never in what safe_dump makes of a job), else None: an
    alias bomb in an edited ConfigMap must not hold the operator."""
    try:
        if any(isinstance(e, yaml.AliasEvent) for e in yaml.parse(text, Loader=yaml.SafeLoader)):
            return None
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return None


def claim_name(job: JobRef) -> str:
    return f"{job.name}-state"


def retained(spec: JobSpec) -> bool:
    return spec.trainer.state.retention_policy.when_deleted == "Retain"


def state_claim(job: JobRef, spec: JobSpec) -> dict:
    """The trainer's claim. Retained (the default), it has no owner: the job's deletion, or its
    TTL, leaves the trained model; with `whenDeleted: Delete` it goes with the job."""
    s = spec.trainer.state
    claim = {"accessModes": list(s.access_modes), "resources": {"requests": {"storage": s.size}}}
    if s.storage_class_name:
        claim["storageClassName"] = s.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": metadata(job, claim_name(job), job.namespace, not retained(spec)),
        "spec": claim,
    }


def claim_patch(job: JobRef, spec: JobSpec, claim: dict) -> dict | None:
    """The merge patch that makes an existing claim of ours this job's, as its retention policy
    says (a claim retained from an earlier job of this name: its uid label; a policy changed: the
    job's ownerReference added or taken off; others' references stay), or None."""
    meta = claim.get("metadata") or {}
    refs = meta.get("ownerReferences") or []
    others = [r for r in refs if not (r.get("kind") == "SparrowRLJob" and r.get("name") == job.name)]
    want = others + ([] if retained(spec) else owner(job))
    patch: dict = {}
    if (meta.get("labels") or {}).get(UID_LABEL) != job.uid:
        patch["labels"] = {UID_LABEL: job.uid}
    if refs != want:
        patch["ownerReferences"] = want
    return {"metadata": patch} if patch else None


def trainer_service(job: JobRef, spec: JobSpec) -> dict:
    svc = spec.trainer.service
    meta = metadata(job, trainer_name(job), job.namespace, True, role="trainer")
    if svc.annotations:
        meta["annotations"] = dict(svc.annotations)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "type": svc.type,
            "selector": {UID_LABEL: job.uid, ROLE_LABEL: "trainer"},
            "ports": [{"name": "http", "port": TRAINER_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def relay_service(job: JobRef, region: str, namespace: str, home: bool) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(job, relay_name(job, region), namespace, home, role="relay", region=region),
        "spec": {
            "type": "ClusterIP",
            "selector": {UID_LABEL: job.uid, ROLE_LABEL: "relay", REGION_LABEL: region},
            "ports": [{"name": "http", "port": RELAY_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def scheme(spec: JobSpec) -> str:
    return "https" if encrypted(spec) else "http"


def trainer_url(job: JobRef, spec: JobSpec) -> str:
    """The trainer as pods of its own cluster reach it."""
    return f"{scheme(spec)}://{trainer_name(job)}.{job.namespace}.svc:{TRAINER_PORT}"


def relay_url(job: JobRef, spec: JobSpec, region: str, namespace: str) -> str:
    return f"{scheme(spec)}://{relay_name(job, region)}.{namespace}.svc:{RELAY_PORT}"


def _args(role: Process, spec: JobSpec) -> list[str]:
    """As `sparrowrl run` starts each role (runner.argv), inside a pod: listening on the pod's IP."""
    serve = ["--host", "$(POD_IP)", "--port", str(PORTS[role.kind]), "--metrics-port", str(METRICS_PORT)]
    serve += ["--rate-mbit", str(role.rate_mbit)] if role.rate_mbit else []  # a topology region's bandwidthMbit
    tls = encrypted(spec)
    served = ["--tls-cert", f"{TLS_DIR}/{CERT_KEY}", "--tls-key", f"{TLS_DIR}/{KEY_KEY}"] if tls else []  # every role
    trusts = ["--ca-cert", f"{CREDENTIALS_DIR}/{CA_KEY}"] if tls else []
    if role.kind == "trainer":
        return ["trainer", JOB_KEY, "--state-dir", "state", *serve, *served]
    assert role.trainer is not None and role.region is not None  # a relay's and a worker's (layout.processes)
    if role.kind == "relay":
        return [
            "relay",
            "--upstream",
            role.trainer,
            "--cache",
            "cache",
            "--streams",
            str(spec.sync.streams),
            *serve,
            *served,
            *trusts,
        ]
    return [
        "worker",
        "--trainer",
        role.trainer,
        *(["--relay", role.relay] if role.relay else []),
        "--region",
        role.region,
        *serve,
        *served,
        *trusts,
    ]


def _resources(s: Scheduling) -> dict:
    r = {k: dict(v) for k, v in (("requests", s.resources.requests), ("limits", s.resources.limits)) if v}
    return r


def pod(
    job: JobRef,
    role: Process,
    spec: JobSpec,
    *,
    namespace: str,
    attempt: int,
    image: str,
    home: bool,
    slot: int | None = None,
    template: dict | None = None,
    generation: int | None = None,
) -> dict:
    """A role's pod; `generation`: that of the token its Secret holds for it (a relay's, a worker's)."""
    sched = {"trainer": spec.trainer, "relay": spec.relays, "worker": spec.rollout}[role.kind]
    mounts, volumes = [], []
    if role.kind == "trainer":
        mounts = [
            # the file itself in the working folder: the job's relative paths (model.path: inputs/model) are
            # relative to it, so to where a trainer.template mounts the user's volumes under WORKDIR
            {"name": "job", "mountPath": f"{WORKDIR}/{JOB_KEY}", "subPath": JOB_KEY, "readOnly": True},
            {"name": "state", "mountPath": f"{WORKDIR}/state"},
        ]
        volumes = [
            {"name": "job", "configMap": {"name": config_name(job)}},
            {"name": "state", "persistentVolumeClaim": {"claimName": claim_name(job)}},
        ]
        if spec.trainer.ranks > 1:  # the ranks' shared memory (NCCL); a pod's own /dev/shm is 64 MiB
            mounts.append({"name": "shm", "mountPath": "/dev/shm"})
            volumes.append({"name": "shm", "emptyDir": {"medium": "Memory"}})
    elif role.kind == "relay":
        mounts = [{"name": "cache", "mountPath": f"{WORKDIR}/cache"}]
        volumes = [{"name": "cache", "emptyDir": {}}]
    secret = token_name(job) if role.kind == "trainer" else credentials_name(job, role)
    # whole Secrets, never a subPath: the kubelet updates them in place, and the roles read a refreshed
    # token or a renewed certificate where they run
    if role.kind != "trainer":
        keys = [TOKEN_KEY, *([CA_KEY] if encrypted(spec) else [])]
        mounts.append({"name": "credentials", "mountPath": f"{WORKDIR}/{CREDENTIALS_DIR}", "readOnly": True})
        volumes.append({"name": "credentials", "secret": {"secretName": secret, "items": _items(keys)}})
    if encrypted(spec):
        mounts.append({"name": "tls", "mountPath": f"{WORKDIR}/{TLS_DIR}", "readOnly": True})
        volumes.append({"name": "tls", "secret": {"secretName": serving_name(job, role), "items": _items(TLS_KEYS)}})
    env = [
        *(
            [{"name": "SPARROWRL_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret, "key": TOKEN_KEY}}}]
            if role.kind == "trainer"  # the job's secret, which never changes
            else [
                {"name": "SPARROWRL_TOKEN_FILE", "value": f"{CREDENTIALS_DIR}/{TOKEN_KEY}"},
                {
                    "name": "SPARROWRL_TRAINER_KEY",
                    "valueFrom": {"secretKeyRef": {"name": secret, "key": TRAINER_KEY_KEY}},
                },
            ]
        ),
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": "SPARROWRL_LOG_FORMAT", "value": "json"},  # one object per line, for the cluster's log pipeline
    ]
    # the kubelet does not check a serving certificate
    get = {"port": "http"} | ({"scheme": "HTTPS"} if encrypted(spec) else {})
    probe = {"httpGet": {"path": "/readyz"} | get, "periodSeconds": 5, "failureThreshold": 3}
    container = {
        "name": role.kind,
        "image": image,
        "command": ["sparrowrl"],
        "args": _args(role, spec),
        "workingDir": WORKDIR,
        "env": env,
        "ports": [
            {"name": "http", "containerPort": PORTS[role.kind]},
            {"name": "metrics", "containerPort": METRICS_PORT},
        ],
        "readinessProbe": probe,
        "livenessProbe": {"httpGet": {"path": "/healthz"} | get, "periodSeconds": 10, "failureThreshold": 6},
        "volumeMounts": mounts,
        "resources": _resources(sched),
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    meta = metadata(job, pod_name(job, role, attempt), namespace, home, role=role.kind, region=role.region)
    meta["labels"][ATTEMPT_LABEL] = str(attempt)
    if encrypted(spec):  # its metrics port is HTTPS too: the PodMonitor reads this
        meta["labels"][METRICS_SCHEME_LABEL] = "https"
    if role.kind == "trainer":  # what it reads from the ConfigMap, applied before the pod is made
        meta["annotations"] = {STEPS_ANNOTATION: str(spec.steps)}
    if slot is not None:
        meta["labels"][SLOT_LABEL] = str(slot)
    if generation is not None:
        meta["annotations"] = {TOKEN_GENERATION_ANNOTATION: str(generation)}
    manifest: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {
            "restartPolicy": "Never",  # the operator replaces a failed pod, and counts it
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 30,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": USER,
                "fsGroup": USER,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [container],
            "volumes": volumes,
        },
    }
    if sched.node_selector:
        manifest["spec"]["nodeSelector"] = dict(sched.node_selector)
    if sched.tolerations:
        manifest["spec"]["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in sched.tolerations]
    if role.kind == "trainer":  # until it listens (imports, on a cold node); then it answers while it loads
        container["startupProbe"] = {
            "httpGet": {"path": "/healthz"} | get,
            "periodSeconds": 10,
            "failureThreshold": 60,
        }
    manifest = merge(manifest, template) if template else manifest
    return with_check(manifest) if role.kind == "trainer" else manifest


def with_check(manifest: dict) -> dict:
    """The trainer's pod with `sparrowrl check` as its last init container (after any of the user's,
    which may fetch the inputs): the trainer container's image, env, mounts and resources, the
    user's from trainer.template included, so it finds what the trainer will find. A job that
    cannot run ends it with layout.INVALID_EXIT and one line naming the field and path; the kubelet
    keeps that line as the container's termination message (FallbackToLogsOnError) and the
    operator fails the job with InvalidSpec instead of restarting it. It gets no job secret."""
    out = copy.deepcopy(manifest)
    trainer = next(c for c in out["spec"]["containers"] if c["name"] == "trainer")
    keep = ("image", "imagePullPolicy", "workingDir", "envFrom", "volumeMounts", "resources", "securityContext")
    check = {"name": CHECK} | {k: copy.deepcopy(trainer[k]) for k in keep if k in trainer}
    check |= {
        "command": ["sparrowrl"],
        "args": ["check", JOB_KEY, "--state-dir", "state"],
        "env": [e for e in trainer.get("env", []) if e["name"] != "SPARROWRL_TOKEN"],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    out["spec"]["initContainers"] = [*out["spec"].get("initContainers", []), check]
    return out


def stored(manifest: dict) -> dict:
    """A manifest as the API server stores it: a Secret's write-only stringData moved into its
    base64 data, what an apply then owns and what an observed Secret is compared with."""
    if manifest.get("kind") != "Secret" or "stringData" not in manifest:
        return manifest
    out = {k: v for k, v in manifest.items() if k != "stringData"}
    encoded = {k: base64.b64encode(v.encode()).decode() for k, v in manifest["stringData"].items()}
    return out | {"data": (manifest.get("data") or {}) | encoded}


def merge(base: Any, patch: Any) -> Any:
    """A JSON merge patch (RFC 7386), except that lists of named items (containers, env, volumes,
    ports, volumeMounts) merge by name, so a template can add one variable to a container."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = merge(out.get(k), v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and _named(base) and _named(patch):
        items = [copy.deepcopy(x) for x in base]
        at = {x["name"]: i for i, x in enumerate(items)}
        for item in patch:
            if item["name"] in at:
                items[at[item["name"]]] = merge(items[at[item["name"]]], item)
            else:
                items.append(copy.deepcopy(item))
        return items
    return copy.deepcopy(patch)


def _named(items: list) -> bool:
    return all(isinstance(x, dict) and isinstance(x.get("name"), str) for x in items)
