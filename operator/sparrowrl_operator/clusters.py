"""The clusters the operator talks to: its own, and the members that SparrowClusters name, each
through a kubeconfig from a Secret. Objects travel as plain dicts (what the API serves), a
create that finds the object there is done, a delete that finds it gone is done, and an apply
(server-side, as the operator's field manager) makes an object what the operator decides."""

from __future__ import annotations

import datetime
import ipaddress
import json
import threading
import urllib.parse
from dataclasses import dataclass

import kubernetes.client
import kubernetes.config
import yaml
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from sparrowrl_operator.builders import stored
from sparrowrl_operator.constants import GROUP, MANAGED_BY_LABEL, MANAGER, VERSION

MAX_KUBECONFIG_BYTES = 64 << 10
APPLY = "application/apply-patch+yaml"  # server-side apply; JSON is YAML
TIMEOUT = (5, 30)  # connect, read: an unreachable member must not hold a reconcile for long
PATHS = {  # kind → (API prefix, plural)
    "Pod": ("/api/v1", "pods"),
    "Service": ("/api/v1", "services"),
    "Secret": ("/api/v1", "secrets"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "PersistentVolumeClaim": ("/api/v1", "persistentvolumeclaims"),
    "Node": ("/api/v1", "nodes"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "Certificate": ("/apis/cert-manager.io/v1", "certificates"),
    "Issuer": ("/apis/cert-manager.io/v1", "issuers"),
    "ClusterIssuer": ("/apis/cert-manager.io/v1", "clusterissuers"),
    "SparrowRLJob": (f"/apis/{GROUP}/{VERSION}", "sparrowrljobs"),
    "SparrowCluster": (f"/apis/{GROUP}/{VERSION}", "sparrowclusters"),
}
SWEPT = ("Pod", "Service", "Secret", "NetworkPolicy")  # what the operator puts into member clusters


class Unreachable(Exception):
    """A cluster did not answer, or refused us (the message says which)."""


class KubeConfigError(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason  # BadKubeConfig or InsecureKubeConfig


def _path(kind: str, namespace: str | None, name: str | None = None) -> str:
    prefix, plural = PATHS[kind]
    out = f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"
    return f"{out}/{name}" if name else out


class Kube:
    """One cluster's API."""

    def __init__(self, api: kubernetes.client.ApiClient):
        self.api = api

    def _call(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        query: list | None = None,
        ok: tuple[int, ...] = (),
        content_type: str = "application/json",
    ) -> dict | None:
        try:
            request = self.api.param_serialize(
                method,
                path,
                query_params=query or [],
                body=body,
                header_params={"Content-Type": content_type, "Accept": "application/json"},
                auth_settings=["BearerToken"],
            )
            r = self.api.call_api(*request, _request_timeout=TIMEOUT)
            data = r.read()
        except ApiException as e:
            raise Unreachable(f"{method} {path}: {e.reason or e}") from None
        except (HTTPError, OSError, ValueError) as e:
            raise Unreachable(f"{method} {path}: {e}") from None
        if r.status in ok:
            return None
        if r.status >= 300:
            raise Unreachable(f"{method} {path}: HTTP {r.status} {data[:300].decode(errors='replace')}")
        try:
            return json.loads(data or b"{}")
        except ValueError:
            raise Unreachable(f"{method} {path}: not JSON") from None

    def list(self, kind: str, namespace: str | None, labels: dict[str, str] | None = None) -> list[dict]:
        """Objects of `kind`; those carrying all of `labels` (checked here too: a selector is a hint)."""
        query = [("labelSelector", ",".join(f"{k}={v}" for k, v in labels.items()))] if labels else []
        items = (self._call("GET", _path(kind, namespace), query=query) or {}).get("items") or []
        want = (labels or {}).items()
        return [x for x in items if want <= ((x.get("metadata") or {}).get("labels") or {}).items()]

    def get(self, kind: str, namespace: str | None, name: str) -> dict | None:
        return self._call("GET", _path(kind, namespace, name), ok=(404,))

    def create(self, obj: dict) -> None:
        """For what is made once: pods (replaced, never changed) and the claim (its spec is immutable)."""
        self._call("POST", _path(obj["kind"], obj["metadata"].get("namespace")), body=obj, ok=(409,))

    def apply(self, obj: dict) -> dict | None:
        """Server-side apply as the operator's field manager, made or updated: every field the
        operator decides is set (forced: another manager's edit is overruled), what it decided
        before and no longer does is removed, what others set stays. A Secret goes as stored, so
        the manager owns its data, not the write-only stringData."""
        meta = obj["metadata"]
        return self._call(
            "PATCH",
            _path(obj["kind"], meta.get("namespace"), meta["name"]),
            body=stored(obj),
            query=[("fieldManager", MANAGER), ("force", "true")],
            content_type=APPLY,
        )

    def patch(self, kind: str, namespace: str | None, name: str, patch: dict) -> None:
        """A JSON merge patch: for the metadata of the state's claim, made by a create (not an apply)."""
        self._call("PATCH", _path(kind, namespace, name), body=patch, content_type="application/merge-patch+json")

    def delete(self, kind: str, namespace: str | None, name: str) -> None:
        self._call("DELETE", _path(kind, namespace, name), ok=(404,))


def check_kubeconfig(text: str) -> dict:
    """The kubeconfig of a member, refused if it names files or programs on the operator's machine
    (it came from a Secret that a namespace's user may write), skips TLS verification, or sends a
    token in clear text beyond this host."""
    if len(text.encode()) > MAX_KUBECONFIG_BYTES:
        raise KubeConfigError("BadKubeConfig", f"over {MAX_KUBECONFIG_BYTES:,} bytes")
    try:
        cfg = yaml.safe_load(text)
        ctx_name = cfg["current-context"]
        ctx = next(c["context"] for c in cfg["contexts"] if c["name"] == ctx_name)
        cluster = next(c["cluster"] for c in cfg["clusters"] if c["name"] == ctx["cluster"])
        user: dict = next((u["user"] for u in cfg.get("users") or [] if u["name"] == ctx.get("user")), {}) or {}
        server = urllib.parse.urlsplit(cluster["server"])
    except (yaml.YAMLError, KeyError, TypeError, StopIteration, AttributeError, ValueError) as e:
        raise KubeConfigError(
            "BadKubeConfig", f"not a kubeconfig with a current context ({type(e).__name__}: {e})"
        ) from None
    if cluster.get("insecure-skip-tls-verify"):
        raise KubeConfigError("InsecureKubeConfig", "insecure-skip-tls-verify is set")
    files = [k for k in ("certificate-authority",) if k in cluster] + [
        k for k in ("client-certificate", "client-key", "tokenFile", "exec", "auth-provider") if k in user
    ]
    if files:
        raise KubeConfigError(
            "InsecureKubeConfig",
            f"{', '.join(files)}: names a file or a program on the operator's "
            f"machine; inline the data (…-data fields, token)",
        )
    if server.scheme != "https" and not _loopback(server.hostname or ""):
        raise KubeConfigError("InsecureKubeConfig", f"server {cluster['server']}: not https")
    return cfg


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def connect(kubeconfig: dict) -> Kube:
    return Kube(kubernetes.config.new_client_from_config_dict(kubeconfig))


@dataclass
class MemberState:
    namespace: str
    kube: Kube | None = None
    reachable: bool = False
    reason: str = "not probed yet"
    failures: int = 0
    last_probe: datetime.datetime | None = None


class Members:
    """What the probes learnt of each member; the job reconciles read it. Shared between kopf's
    handler threads."""

    def __init__(self):
        self._lock = threading.Lock()
        self._state: dict[str, MemberState] = {}

    def get(self, name: str) -> MemberState | None:
        with self._lock:
            return self._state.get(name)

    def put(self, name: str, state: MemberState) -> None:
        with self._lock:
            self._state[name] = state

    def forget(self, name: str) -> None:
        with self._lock:
            self._state.pop(name, None)

    def mark_unreachable(self, name: str, reason: str) -> None:
        """A job's call failed: say so at once rather than at the next probe."""
        with self._lock:
            if s := self._state.get(name):
                s.reachable, s.reason = False, reason


def ours(obj: dict) -> bool:
    return ((obj.get("metadata") or {}).get("labels") or {}).get(MANAGED_BY_LABEL) == MANAGER
