"""The kopf glue: observe, call the pure decisions, carry out what they return. Registered into a given
registry, so tests run the operator with their own settings and clusters (main.py registers
into kopf's default one). Kopf cannot watch member clusters: timers notice what changes there."""

from __future__ import annotations

import base64
import datetime
import json
import logging
import os
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any

import kopf
from pydantic import ValidationError

from sparrowrl.auth import pki
from sparrowrl.auth.pki import Issued
from sparrowrl.spec.kubespec import MAX_NODES
from sparrowrl_operator import builders
from sparrowrl_operator.builders import JobRef
from sparrowrl_operator.clusters import (
    SWEPT,
    Kube,
    KubeConfigError,
    Members,
    MemberState,
    Unreachable,
    check_kubeconfig,
    connect,
)
from sparrowrl_operator.conditions import find, set_condition
from sparrowrl_operator.constants import (
    CA_KEY,
    CERT_KEY,
    CLEANED,
    CLUSTERS,
    FINALIZER,
    GROUP,
    JOBS,
    MANAGED_BY_LABEL,
    MANAGER,
    PROGRESS_PREFIX,
    RECONNECTED,
    RETAINED,
    TOKEN_KEY,
    UID_LABEL,
    UNREACHABLE,
    VERSION,
)
from sparrowrl_operator.credentials import secret_value
from sparrowrl_operator.cycle import NETWORK_ENV, Key, Network
from sparrowrl_operator.model import ClusterSpec, ClusterStatus
from sparrowrl_operator.pods import Cluster
from sparrowrl_operator.reconcile import Actions, Backoff, Member, Observed, reconcile
from sparrowrl_operator.times import stamp
from sparrowrl_operator.trainer_api import trainer_status


@dataclass(frozen=True)
class Config:
    image: str  # for jobs that name none
    interval: float = 10.0  # seconds between reconciles of a job: what changes in member clusters is seen by then
    probe_interval: float = 30.0  # between probes of a member cluster
    backoff: Backoff = Backoff()
    network: Network = Network()

    @classmethod
    def from_env(cls) -> Config:
        network = Network.from_json(os.environ[NETWORK_ENV]) if os.environ.get(NETWORK_ENV) else Network()
        return cls(
            image=os.environ.get("SPARROWRL_RUNTIME_IMAGE", "localhost/sparrowrl/sparrowrl-runtime:0.1.0"),
            network=network,
        )


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def merge_patch(old: dict, new: dict) -> dict:
    """The JSON merge patch from `old` to `new`: removed keys become None."""
    out: dict[str, Any] = {k: None for k in old if k not in new}
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(old.get(k), dict):
            if sub := merge_patch(old[k], v):
                out[k] = sub
        elif old.get(k) != v:
            out[k] = v
    return out


def union(a: dict, b: dict) -> dict:
    """Two merge patches toward the same object as one, which brings either's base to it."""
    out = dict(a)
    for k, v in b.items():
        out[k] = union(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@dataclass
class Operator:
    """What the handlers share: the clusters, and one lock per job, so that a timer and a change
    handler never reconcile the same job at once."""

    cfg: Config
    home: Kube
    members: Members = field(default_factory=Members)
    _locks: dict = field(default_factory=dict)
    _written: dict[str, dict] = field(default_factory=dict)  # job uid → the status its last cycle wrote
    _guard: threading.Lock = field(default_factory=threading.Lock)

    def lock(self, uid: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(uid, threading.Lock())

    # --- jobs ---

    def token(self, job: JobRef) -> tuple[str, bool]:
        s = self.home.get("Secret", job.namespace, builders.token_name(job))
        if s and (data := secret_value(s, TOKEN_KEY)):  # data as an API server keeps it; the emulator's stringData
            return data.decode(), True
        return secrets.token_urlsafe(32), False

    def authority(self, job: JobRef, spec: dict) -> tuple[dict | None, Issued | None]:
        """The Secret holding the job's CA, by name (the user's carries none of our labels), and a CA
        made now for when it is missing and the operator makes it; (None, None): not encrypted."""
        tls = spec.get("tls") or {}
        if tls.get("mode", "Enabled") != "Enabled" or tls.get("issuerRef"):
            return None, None
        name = tls.get("caSecretName") or f"{job.name}-ca"
        seen = self.home.get("Secret", job.namespace, name)
        return seen, None if seen is not None or tls.get("caSecretName") else pki.authority(f"sparrowrl {job.name}")

    def issued(self, job: JobRef, ref: dict, mine: dict[str, str]) -> dict[Key, dict]:
        """cert-manager's issuer that tls.issuerRef names, and the job's Certificates: none where
        cert-manager (its CRDs) is not installed."""
        kind, name = ref.get("kind", "Issuer"), ref.get("name", "")
        out: dict[Key, dict] = {}
        try:
            if found := self.home.get(kind, job.namespace if kind == "Issuer" else None, name):
                out[kind, name] = found
            out |= listed(self.home, job.namespace, mine, ("Certificate",))
        except Unreachable:
            pass  # no such resource: the Encrypted condition says the issuer is not found
        return out

    def observe(self, body: dict, logger: kopf.Logger) -> Observed:
        meta = body["metadata"]
        job = JobRef(meta["name"], meta["namespace"], meta["uid"])
        mine = {UID_LABEL: job.uid}
        token, _ = self.token(job)
        ca_secret, authority = self.authority(job, body.get("spec") or {})
        pods: dict[Cluster, list[dict]] = {None: self.home.list("Pod", job.namespace, mine)}
        objects: dict[Cluster, dict[Key, dict]] = {
            None: listed(self.home, job.namespace, mine, ("Service", "Secret", "ConfigMap", "NetworkPolicy"))
        }
        # by name: a claim retained from an earlier job of this name carries that job's uid
        for k in range(_nodes(body)):
            if claim := self.home.get("PersistentVolumeClaim", job.namespace, builders.claim_name(job, k)):
                objects[None]["PersistentVolumeClaim", builders.claim_name(job, k)] = claim
        if ca_secret is not None:
            objects[None]["Secret", ca_secret["metadata"]["name"]] = ca_secret
        ca = (secret_value(ca_secret, CERT_KEY) or b"") if ca_secret is not None else None
        if ref := ((body.get("spec") or {}).get("tls") or {}).get("issuerRef"):
            objects[None] |= self.issued(job, ref, mine)
            served = objects[None].get(("Secret", f"{builders.trainer_name(job)}-tls"))
            ca = (secret_value(served, CA_KEY) or b"") if served is not None else None
        members = {}
        for name in sorted({p.get("cluster") for p in (body.get("spec") or {}).get("placements") or []} - {None}):
            state = self.members.get(name)
            if state is None:  # not probed yet, or no such SparrowCluster
                if self.home.get("SparrowCluster", None, name) is not None:
                    members[name] = Member("", None, "connecting")
                continue
            if state.reachable and state.kube:
                try:
                    pods[name] = state.kube.list("Pod", state.namespace, mine)
                    objects[name] = listed(state.kube, state.namespace, mine, ("Service", "Secret", "NetworkPolicy"))
                except Unreachable as e:
                    logger.warning(f"member {name}: {e}")
                    self.members.mark_unreachable(name, str(e))
            members[name] = Member(state.namespace, state.reachable, state.reason)
        service = self.home.get("Service", job.namespace, builders.trainer_name(job))
        node = None
        if ((service or {}).get("spec") or {}).get("type") == "NodePort":
            node = node_address(self.home.list("Node", None))
        return Observed(
            now=now(),
            token=token,
            pods=pods,
            objects=objects,
            members=members,
            trainer_service=service,
            node_address=node,
            authority=authority,
            trainer=trainer_status(pods[None], token, ca, f"{builders.trainer_name(job)}.{job.namespace}.svc"),
        )

    def carry_out(self, actions: Actions, body: dict, logger: kopf.Logger) -> None:
        """Applies (the home cluster's first: the Secrets, ConfigMap and Services that pods
        use) and patches, then creates in order, then deletes. A home failure stops the cycle (kopf
        retries); a member's marks it unreachable, and the others go on."""
        steps: list[tuple[Cluster, str, Any]] = [
            (c, "apply", o) for c, o in sorted(actions.apply, key=lambda x: x[0] is not None)
        ]
        steps += [(c, "patch", (k, ns, n, p)) for c, k, ns, n, p in actions.patch]
        steps += [(c, "create", o) for c, o in actions.create]
        steps += [(c, "delete", (k, ns, n)) for c, k, ns, n in actions.delete]
        for cluster, verb, obj in steps:
            kube = self.home if cluster is None else (self.members.get(cluster) or MemberState("")).kube
            if kube is None:
                continue
            try:
                if verb == "apply":
                    kube.apply(obj)
                elif verb == "patch":
                    kube.patch(*obj)
                elif verb == "create":
                    kube.create(obj)
                else:
                    kube.delete(*obj)
            except Unreachable as e:
                if cluster is None:
                    raise kopf.TemporaryError(str(e), delay=self.cfg.interval) from None
                logger.warning(f"member {cluster}: {e}")
                self.members.mark_unreachable(cluster, str(e))
        for type_, reason, message in actions.events:
            kopf.event(body, type=type_, reason=reason, message=message)
        if actions.delete_job:
            self.home.delete("SparrowRLJob", body["metadata"]["namespace"], body["metadata"]["name"])

    def reconcile_job(self, body: dict, patch: kopf.Patch, logger: kopf.Logger) -> None:
        """One cycle, from the newest status known: a handler's body can predate the status the
        previous cycle wrote (a timer's body is copied before it waits for the lock, and kopf
        writes a handler's patch after it returns), and a cycle from an older status would undo
        conditions and repeat Events. The patch brings either status to the new one."""
        uid = body["metadata"]["uid"]
        with self.lock(uid):
            seen = dict(body.get("status") or {})
            known = self._written.get(uid, seen)
            for _ in range(2):  # once more when home objects were just made: members wait for the token Secret
                current = {**body, "status": self._written.get(uid, seen)}
                observed = self.observe(current, logger)
                actions = reconcile(current, observed, self.cfg.image, self.cfg.backoff, self.cfg.network)
                try:
                    self.carry_out(actions, body, logger)
                finally:  # the status is written even when the home cluster refused a step (kopf retries)
                    if actions.status is not None:
                        new = self._written[uid] = actions.status.model_dump(
                            by_alias=True, exclude_none=True, mode="json"
                        )
                        if change := union(merge_patch(seen, new), merge_patch(known, new)):
                            patch["status"] = change
                        else:
                            patch.pop("status", None)
                if not any(c is None for c, _ in actions.create + actions.apply):
                    break

    def cleanup_job(self, body: dict, logger: kopf.Logger) -> None:
        """On delete, behind the finalizer: the job's objects in member clusters (the home
        cluster's go with their owner). A member that does not answer is left to the sweep."""
        uid = body["metadata"]["uid"]
        with self.lock(uid):  # after a cycle under way, which would write `_written` again
            self._written.pop(uid, None)
            with self._guard:
                self._locks.pop(uid, None)
        self.say_retained(body)
        self.drop_issued(body)
        for name in sorted({p.get("cluster") for p in (body.get("spec") or {}).get("placements") or []} - {None}):
            state = self.members.get(name)
            try:
                if state is None or state.kube is None:
                    raise Unreachable("not connected")
                n = sweep(state.kube, state.namespace, keep=lambda u: u != uid)
                kopf.event(body, type="Normal", reason=CLEANED, message=f"deleted {n} objects in cluster {name}")
            except Unreachable as e:
                kopf.event(
                    body,
                    type="Warning",
                    reason=UNREACHABLE,
                    message=f"cluster {name}: {e}; its objects go when it answers (the orphan sweep)",
                )

    def drop_issued(self, body: dict) -> None:
        """The Secrets cert-manager issued for the job (tls.issuerRef): they carry its labels but no
        owner, and hold private keys; its Certificates go with the job."""
        if not (((body.get("spec") or {}).get("tls") or {}).get("issuerRef")):
            return
        meta = body["metadata"]
        try:
            for s in self.home.list("Secret", meta["namespace"], {UID_LABEL: meta["uid"]}):
                if not s["metadata"].get("ownerReferences"):
                    self.home.delete("Secret", meta["namespace"], s["metadata"]["name"])
        except Unreachable as e:
            kopf.event(body, type="Warning", reason=UNREACHABLE, message=f"the job's certificates' Secrets: {e}")

    def say_retained(self, body: dict) -> None:
        """An Event on the job deleted, when its state's claim (with the trained model) stays."""
        job = JobRef(body["metadata"]["name"], body["metadata"]["namespace"], body["metadata"]["uid"])
        try:
            claims = [
                c
                for node in range(_nodes(body))
                if (c := self.home.get("PersistentVolumeClaim", job.namespace, builders.claim_name(job, node)))
            ]
        except Unreachable:
            return
        kept = [
            c["metadata"]["name"]
            for c in claims
            if (c["metadata"].get("labels") or {}).get(UID_LABEL) == job.uid
            and job.uid not in {r.get("uid") for r in c["metadata"].get("ownerReferences") or []}
        ]
        if kept:
            what = f"the volume claim {kept[0]}" if len(kept) == 1 else f"the volume claims {', '.join(kept)}"
            kopf.event(
                body,
                type="Normal",
                reason=RETAINED,
                message=f"{what}, with the trained model, is kept "
                "(trainer.state.retentionPolicy.whenDeleted: Retain); a job of this name made later resumes from it; "
                f"kubectl delete pvc {' '.join(kept)} frees it",
            )

    # --- member clusters ---

    def probe_cluster(self, body: dict, patch: kopf.Patch) -> None:
        """Connect (or reconnect, with exponential backoff) and sweep orphans."""
        t = now()
        try:
            status = ClusterStatus.model_validate(body.get("status") or {})
        except ValidationError:
            status = ClusterStatus()
        last = status.last_probe_time
        if (
            status.failures
            and last
            and (t - datetime.datetime.fromisoformat(last.replace("Z", "+00:00"))).total_seconds()
            < self.cfg.backoff.delay(status.failures - 1)
        ):
            return
        try:
            spec = ClusterSpec.model_validate(body.get("spec") or {})
        except ValidationError as e:
            return self._cluster_result(body, patch, status, t, MemberState(""), "BadSpec", str(e))
        state = MemberState(spec.namespace)
        try:
            ref = spec.kubeconfig.secret_ref
            secret = self.home.get("Secret", ref.namespace, ref.name)
            data = ((secret or {}).get("data") or {}).get(spec.kubeconfig.key)
            text = (
                base64.b64decode(data).decode()
                if data
                else ((secret or {}).get("stringData") or {}).get(spec.kubeconfig.key)
            )
            if text is None:
                raise KubeConfigError(
                    "BadKubeConfig", f"Secret {ref.namespace}/{ref.name} has no key {spec.kubeconfig.key!r}"
                )
            state.kube = connect(check_kubeconfig(text))
            state.kube.list("Pod", spec.namespace, {MANAGED_BY_LABEL: MANAGER})
            state.reachable, state.reason = True, ""
            n = sweep(state.kube, spec.namespace, keep=self.live_uids().__contains__)
            if n:
                kopf.event(body, type="Normal", reason=CLEANED, message=f"deleted {n} objects of deleted jobs")
            reason = "Connected"
        except KubeConfigError as e:
            reason, state.reason = e.reason, str(e)
        except (Unreachable, ValueError) as e:
            reason, state.reason = "ClientConnectionFailed", str(e)
        self._cluster_result(body, patch, status, t, state, reason, state.reason)

    def _cluster_result(self, body, patch, status: ClusterStatus, t, state: MemberState, reason: str, message: str):
        name = body["metadata"]["name"]
        was = find(status.conditions, "Active")
        state.failures = 0 if state.reachable else status.failures + 1
        self.members.put(name, state)
        if was is None or was.reason != reason:
            kopf.event(
                body,
                type="Normal" if state.reachable else "Warning",
                reason=RECONNECTED if state.reachable else UNREACHABLE,
                message=f"cluster {name}: {message or 'connected'}",
            )
        conds = set_condition(
            list(status.conditions), "Active", state.reachable, reason, message or "the API server answers", stamp(t)
        )
        new = ClusterStatus(conditions=conds, last_probe_time=stamp(t), failures=state.failures)
        patch.setdefault("status", {}).update(new.model_dump(by_alias=True, exclude_none=True, mode="json"))

    def live_uids(self) -> set[str]:
        return {j["metadata"]["uid"] for j in self.home.list("SparrowRLJob", None)}


def _nodes(body: dict) -> int:
    """The trainer's nodes, as the job's body says (before it is parsed: bounded, else 1)."""
    nodes = ((body.get("spec") or {}).get("trainer") or {}).get("nodes", 1)
    return nodes if isinstance(nodes, int) and 1 <= nodes <= MAX_NODES else 1


def listed(kube: Kube, namespace: str, labels: dict[str, str], kinds: tuple[str, ...]) -> dict[tuple[str, str], dict]:
    """The objects of these kinds carrying `labels`, by (kind, name): what drift is judged on."""
    return {(k, o["metadata"]["name"]): o for k in kinds for o in kube.list(k, namespace, labels)}


def sweep(kube: Kube, namespace: str, keep) -> int:
    """Delete our objects in `namespace` whose job uid `keep` refuses; how many."""
    n = 0
    for kind in SWEPT:
        for obj in kube.list(kind, namespace, {MANAGED_BY_LABEL: MANAGER}):
            uid = obj["metadata"].get("labels", {}).get(UID_LABEL)
            if uid and not keep(uid):
                kube.delete(kind, namespace, obj["metadata"]["name"])
                n += 1
    return n


def node_address(nodes: list[dict]) -> str | None:
    """A node's external address (else its internal one), for a NodePort trainer."""
    for kind in ("ExternalIP", "ExternalDNS", "InternalIP"):
        for n in nodes:
            for a in (n.get("status") or {}).get("addresses") or []:
                if a.get("type") == kind and a.get("address"):
                    return a["address"]
    return None


def register(registry: kopf.OperatorRegistry, op: Operator) -> None:
    """The handlers, thin: each calls one method of `op`."""

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_) -> None:
        settings.persistence.finalizer = FINALIZER
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PROGRESS_PREFIX)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=PROGRESS_PREFIX)
        settings.posting.level = logging.WARNING  # our own Events say what happened; kopf's logs stay logs
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330

    @kopf.on.resume(GROUP, VERSION, JOBS, registry=registry)
    @kopf.on.create(GROUP, VERSION, JOBS, registry=registry)
    @kopf.on.update(GROUP, VERSION, JOBS, registry=registry)
    @kopf.timer(GROUP, VERSION, JOBS, interval=op.cfg.interval, registry=registry)
    def job_changed(body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger, **_) -> None:
        op.reconcile_job(json.loads(json.dumps(dict(body))), patch, logger)

    @kopf.on.delete(GROUP, VERSION, JOBS, registry=registry)
    def job_deleted(body: kopf.Body, logger: kopf.Logger, **_) -> None:
        op.cleanup_job(dict(body), logger)

    # the timer innermost, as job_changed's: kopf types each decorator's result as its own kind of
    # handler, and a timer's signature fits the change handlers' where theirs does not fit a timer's
    @kopf.on.create(GROUP, VERSION, CLUSTERS, registry=registry)
    @kopf.on.update(GROUP, VERSION, CLUSTERS, registry=registry)
    @kopf.timer(GROUP, VERSION, CLUSTERS, interval=op.cfg.probe_interval, registry=registry)
    def cluster_changed(body: kopf.Body, patch: kopf.Patch, **_) -> None:
        op.probe_cluster(json.loads(json.dumps(dict(body))), patch)

    @kopf.on.delete(GROUP, VERSION, CLUSTERS, optional=True, registry=registry)
    def cluster_deleted(name: str, **_) -> None:
        op.members.forget(name)
