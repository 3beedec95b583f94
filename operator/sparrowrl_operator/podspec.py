"""A role's pod, as `sparrowrl.layout.processes` starts it: the command `sparrowrl run` runs,
with Kubernetes' own ways of handing it the rest: its credentials and certificates as Secrets
mounted whole (so the kubelet updates them in place), the job from a ConfigMap, the trainer's
state on a PersistentVolumeClaim, its name and IP from the downward API, and the probes."""

from __future__ import annotations

import copy
from typing import Any

from sparrowrl.spec.job import JobSpec
from sparrowrl.spec.kubespec import Scheduling
from sparrowrl.spec.layout import Process
from sparrowrl_operator.builders import (
    CHECK,
    JOB_KEY,
    JobRef,
    claim_name,
    config_name,
    credentials_name,
    encrypted,
    merge,
    metadata,
    pod_name,
    rendezvous,
    serving_name,
    token_name,
)
from sparrowrl_operator.constants import (
    ATTEMPT_LABEL,
    CA_KEY,
    CERT_KEY,
    CREDENTIALS_DIR,
    KEY_KEY,
    METRICS_PORT,
    METRICS_SCHEME_LABEL,
    NODE_LABEL,
    RELAY_PORT,
    RENDEZVOUS_PORT,
    SLOT_LABEL,
    STEPS_ANNOTATION,
    TLS_DIR,
    TOKEN_GENERATION_ANNOTATION,
    TOKEN_KEY,
    TRAINER_KEY_KEY,
    TRAINER_PORT,
    WORKDIR,
    WORKER_PORT,
)

PORTS = {"trainer": TRAINER_PORT, "relay": RELAY_PORT, "worker": WORKER_PORT}
TLS_KEYS = (CERT_KEY, KEY_KEY)  # a serving Secret's files in a pod
USER = 65532  # the runtime image's user
# What a role's container may do: write only to its volumes (a read-only root; /tmp an emptyDir of
# its own, where numba's kernels and a data set's cache go), and gain nothing.
SECURITY = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": True}
TMP = "tmp"  # that volume's name: a template's volume of this name replaces it
# Caches in that /tmp. An emptyDir is writable by all and not sticky (2777 with fsGroup), where
# sparrowrl.cachedir makes no folder of its own (another user could swap it): so they are named
# outright, in a folder only this pod's containers reach. Under HOME: `datasets`', matplotlib's,
# CuPy's, and vLLM's, Triton's and FlashInfer's kernels.
CACHES = [{"name": "HOME", "value": "/tmp"}, {"name": "NUMBA_CACHE_DIR", "value": "/tmp/numba"}]


def _items(keys: list[str] | tuple[str, ...]) -> list[dict]:
    """A Secret's keys as files of the same names: only these (the trainer's key stays out)."""
    return [{"key": k, "path": k} for k in keys]


def _args(role: Process, spec: JobSpec, job: JobRef, node: int) -> list[str]:
    """As `sparrowrl run` starts each role (runner.argv), inside a pod: listening on the pod's IP."""
    if node:  # another node of the trainer: it serves nothing
        return ["trainer", JOB_KEY, "--state-dir", "state", "--node", str(node), "--rendezvous", rendezvous(job)]
    serve = ["--host", "$(POD_IP)", "--port", str(PORTS[role.kind]), "--metrics-port", str(METRICS_PORT)]
    serve += ["--rate-mbit", str(role.rate_mbit)] if role.rate_mbit else []  # a topology region's bandwidthMbit
    tls = encrypted(spec)
    served = ["--tls-cert", f"{TLS_DIR}/{CERT_KEY}", "--tls-key", f"{TLS_DIR}/{KEY_KEY}"] if tls else []  # every role
    trusts = ["--ca-cert", f"{CREDENTIALS_DIR}/{CA_KEY}"] if tls else []
    if role.kind == "trainer":
        meet = ["--rendezvous", rendezvous(job)] if spec.trainer.nodes > 1 else []
        return ["trainer", JOB_KEY, "--state-dir", "state", *serve, *served, *meet]
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
    node: int = 0,
) -> dict:
    """A role's pod; `generation`: that of the token its Secret holds for it (a relay's, a worker's);
    `node`: a trainer's node, of a trainer of several (1..: one that serves nothing)."""
    if node:
        return _node_pod(
            job, role, spec, namespace=namespace, attempt=attempt, image=image, node=node, template=template
        )
    sched = {"trainer": spec.trainer, "relay": spec.relays, "worker": spec.rollout}[role.kind]
    mounts: list[dict] = []
    volumes: list[dict] = []
    if role.kind == "trainer":
        mounts, volumes = _trainer_volumes(job, spec, 0)
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
    container: dict[str, Any] = {
        "name": role.kind,
        "image": image,
        "command": ["sparrowrl"],
        "args": _args(role, spec, job, 0),
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
        "securityContext": copy.deepcopy(SECURITY),
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
    manifest = _manifest(meta, container, volumes, sched)
    if role.kind == "trainer" and spec.trainer.nodes > 1:  # where the other nodes meet it
        meta["labels"][NODE_LABEL] = "0"
        container["ports"].append({"name": "rendezvous", "containerPort": RENDEZVOUS_PORT})
    if role.kind == "trainer":
        # the end of its log, when it fails (a node that did not join), in its status
        container["terminationMessagePolicy"] = "FallbackToLogsOnError"
        # until it listens (imports, on a cold node); then it answers while it loads
        container["startupProbe"] = {
            "httpGet": {"path": "/healthz"} | get,
            "periodSeconds": 10,
            "failureThreshold": 60,
        }
    manifest = _templated(manifest, template)
    return with_check(manifest) if role.kind == "trainer" else manifest


def _manifest(meta: dict, container: dict, volumes: list[dict], sched: Scheduling) -> dict:
    """A pod of one container, as every role's is made: run once (the operator replaces a failed
    pod, and counts it), as the image's user, with a /tmp of its own, on the nodes `sched` picks."""
    container["volumeMounts"] = [*container["volumeMounts"], {"name": TMP, "mountPath": "/tmp"}]
    container["env"] = [*container["env"], *copy.deepcopy(CACHES)]
    volumes = [*volumes, {"name": TMP, "emptyDir": {}}]
    manifest: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {
            "restartPolicy": "Never",
            "enableServiceLinks": False,
            "automountServiceAccountToken": False,  # no role calls the Kubernetes API
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
    return manifest


def _templated(manifest: dict, template: dict | None) -> dict:
    """The pod with the user's template merged in. A template's volume named `tmp`, or one it
    mounts at /tmp, takes the place of the pod's own /tmp (merged, the two would be one invalid
    volume, or two mounts at one path). One that names a service account gets its token as that
    account says, unless the template says otherwise."""
    if not template:
        return manifest
    spec = template.get("spec") or {}
    if any(isinstance(v, dict) and v.get("name") == TMP for v in spec.get("volumes") or []):
        manifest = copy.deepcopy(manifest)
        manifest["spec"]["volumes"] = [v for v in manifest["spec"]["volumes"] if v["name"] != TMP]
    out = merge(manifest, template)
    if ("serviceAccountName" in spec or "serviceAccount" in spec) and "automountServiceAccountToken" not in spec:
        del out["spec"]["automountServiceAccountToken"]
    containers = out["spec"]["containers"] + out["spec"].get("initContainers", [])
    for c in containers:
        mounts = c.get("volumeMounts") or []
        if any(m.get("mountPath") == "/tmp" and m.get("name") != TMP for m in mounts):
            c["volumeMounts"] = [m for m in mounts if m.get("name") != TMP]
    used = {m.get("name") for c in containers for m in c.get("volumeMounts") or []}
    if TMP not in used:
        out["spec"]["volumes"] = [v for v in out["spec"]["volumes"] if v.get("name") != TMP]
    return out


def _trainer_volumes(job: JobRef, spec: JobSpec, node: int) -> tuple[list[dict], list[dict]]:
    """A trainer node's mounts and volumes: the job, its node's state claim, and the ranks' shared
    memory (NCCL; a pod's own /dev/shm is 64 MiB)."""
    mounts: list[dict] = [
        # the file itself in the working folder: the job's relative paths (model.path: inputs/model) are
        # relative to it, so to where a trainer.template mounts the user's volumes under WORKDIR
        {"name": "job", "mountPath": f"{WORKDIR}/{JOB_KEY}", "subPath": JOB_KEY, "readOnly": True},
        {"name": "state", "mountPath": f"{WORKDIR}/state"},
    ]
    volumes: list[dict] = [
        {"name": "job", "configMap": {"name": config_name(job)}},
        {"name": "state", "persistentVolumeClaim": {"claimName": claim_name(job, node)}},
    ]
    if spec.trainer.ranks > 1:
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory"}})
    return mounts, volumes


def _node_pod(
    job: JobRef,
    role: Process,
    spec: JobSpec,
    *,
    namespace: str,
    attempt: int,
    image: str,
    node: int,
    template: dict | None,
) -> dict:
    """Node `node` (1..) of a trainer of several: its ranks only, on a state claim of its own. It
    serves nothing (no probes, no token, no certificate): it meets node 0 at the rendezvous, and
    its process ends with the gang's."""
    mounts, volumes = _trainer_volumes(job, spec, node)
    container = {
        "name": role.kind,
        "image": image,
        "command": ["sparrowrl"],
        "args": _args(role, spec, job, node),
        "workingDir": WORKDIR,
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
            {"name": "SPARROWRL_LOG_FORMAT", "value": "json"},
        ],
        "volumeMounts": mounts,
        "resources": _resources(spec.trainer),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": copy.deepcopy(SECURITY),
    }
    meta = metadata(job, pod_name(job, role, attempt), namespace, True, role=role.kind)
    meta["labels"] |= {ATTEMPT_LABEL: str(attempt), SLOT_LABEL: str(node), NODE_LABEL: str(node)}
    return _templated(_manifest(meta, container, volumes, spec.trainer), template)


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
