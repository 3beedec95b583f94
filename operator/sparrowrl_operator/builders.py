"""Manifests from the job: pure functions with deterministic names and labels. The job's
Secrets (the job's secret to the trainer alone; to each relay and worker slot its own token and
the trainer's public key; the CA and serving certificates), its ConfigMap, claim and Services,
and the names the pods (podspec.py) mount and reach them by."""

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
from sparrowrl.spec.kubespec import IssuerRef
from sparrowrl.spec.layout import Process
from sparrowrl_operator.constants import (
    CA_KEY,
    CERT_KEY,
    JOB_LABEL,
    KEY_KEY,
    MANAGED_BY_LABEL,
    MANAGER,
    NODE_LABEL,
    REGION_LABEL,
    RELAY_PORT,
    RENDEZVOUS_PORT,
    ROLE_LABEL,
    TOKEN_KEY,
    TRAINER_KEY_KEY,
    TRAINER_PORT,
    UID_LABEL,
)

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
    longest = max(
        [trainer_name(job), *([nodes_name(job)] if spec.trainer.nodes > 1 else [])]
        + [relay_name(job.in_member(), r.name) for r in spec.regions if r.relay],
        key=len,
    )
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


def claim_name(job: JobRef, node: int = 0) -> str:
    """The trainer's state claim: node 0's (the store, the journal, its shards), or another
    node's (its own shards and copy of the hub's files)."""
    return f"{job.name}-state" + (f"-node{node}" if node else "")


def nodes_name(job: JobRef) -> str:
    """The headless Service by which a trainer's nodes find node 0."""
    return f"{job.name}-trainer-nodes"


def rendezvous(job: JobRef) -> str:
    return f"{nodes_name(job)}.{job.namespace}.svc:{RENDEZVOUS_PORT}"


def nodes_service(job: JobRef) -> dict:
    """Node 0's address for the other nodes: headless (the pod's own IP, no proxy in between for
    the TCP store), and published before node 0 is ready: it is ready only once they joined."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(job, nodes_name(job), job.namespace, True, role="trainer"),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {UID_LABEL: job.uid, ROLE_LABEL: "trainer", NODE_LABEL: "0"},
            "ports": [
                {"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT, "protocol": "TCP"}
            ],
        },
    }


def retained(spec: JobSpec) -> bool:
    return spec.trainer.state.retention_policy.when_deleted == "Retain"


def state_claim(job: JobRef, spec: JobSpec, node: int = 0) -> dict:
    """A trainer node's claim. Retained (the default), it has no owner: the job's deletion, or its
    TTL, leaves the trained model; with `whenDeleted: Delete` it goes with the job."""
    s = spec.trainer.state
    claim = {"accessModes": list(s.access_modes), "resources": {"requests": {"storage": s.size}}}
    if s.storage_class_name:
        claim["storageClassName"] = s.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": metadata(job, claim_name(job, node), job.namespace, not retained(spec)),
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
            # node 0 alone serves, when the trainer has several nodes (nodes is immutable)
            "selector": {UID_LABEL: job.uid, ROLE_LABEL: "trainer"}
            | ({NODE_LABEL: "0"} if spec.trainer.nodes > 1 else {}),
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
    ports, volumeMounts) merge by name, so a template can add one variable to a container. A
    variable of the same name replaces ours whole: its `valueFrom` beside our `value` would be
    refused."""
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
            if item["name"] in at and ("value" in item or "valueFrom" in item):  # an env variable
                items[at[item["name"]]] = copy.deepcopy(item)
            elif item["name"] in at:
                items[at[item["name"]]] = merge(items[at[item["name"]]], item)
            else:
                items.append(copy.deepcopy(item))
        return items
    return copy.deepcopy(patch)


def _named(items: list) -> bool:
    return all(isinstance(x, dict) and isinstance(x.get("name"), str) for x in items)
