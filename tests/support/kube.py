"""Emulated Kubernetes clusters for tests: no API server can run here, so each cluster is kmock's
emulator (by kopf's author) on a loopback port, in a thread with its own event loop.

`Emulator` adds to kmock what a real API server does and an operator relies on (its docstring
says what, and what is still missing); `Cluster` serves one behind a `Gate`, so a test can make
the cluster unreachable; `clusters()` starts several.

Addresses: every 127/8 address is loopback, so each cluster owns a /16, 127.A.0.0, with A unique
in this process and claimed against other processes (a socket bound to 127.A.254.254:65535):
127.A.0.x Services' cluster IPs, 127.A.1-253.x pods, 127.A.254.1 the node, 127.A.255.x load
balancers (the last three are tests/support/kubelet.py's).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import concurrent.futures
import contextlib
import copy
import datetime
import functools
import json
import random
import re
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Self, TypeVar

import aiohttp.web
import attrs
import jsonpatch
import jsonpointer
import kmock
import kubernetes
import yaml

from support.wait import until  # noqa: F401  (tests/test_operator*.py import it from here)

T = TypeVar("T")

CHART_CRDS = sorted((Path(__file__).resolve().parents[2] / "charts" / "sparrowrl-operator" / "crds").glob("*.yaml"))
NAMESPACES = kmock.resource("v1/namespaces")
PODS = kmock.resource("v1/pods")
SERVICES = kmock.resource("v1/services")
SECRETS = kmock.resource("v1/secrets")
# kmock reads /api/v1/namespaces/NAME as "namespace NAME" and fails on /api/v1/namespaces itself:
# Emulator.__call__ moves these URLs to a plural kmock parses, _handle moves them back.
_NAMESPACE_URL = re.compile(r"/api/v1/namespaces(/[^/]+)?(/status|/finalize)?/?")
_NAMESPACES_ALIAS = kmock.resource(group="", version="v1", plural="namespaces.emulated")
_WRITES = {kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE}
_IMMUTABLE = (
    "name",
    "namespace",
    "uid",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "generation",
)
APPLY = "application/apply-patch+yaml"
_UNOWNED = ("resourceVersion", "managedFields", *_IMMUTABLE)  # metadata that no apply owns


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def error(status: int, reason: str, message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=status, reason=reason, message=message, details={})


def selects(selector: str | None, labels: Mapping[str, str]) -> bool:
    """Whether a selector in its string form (a=b, a==b, a!=b, a in (b,c), a notin (b), a, !a)
    selects these labels or fields. Raises ValueError on a term it cannot read."""
    for term in (t.strip() for t in re.split(r",(?![^()]*\))", selector or "")):
        if not term:
            continue
        if m := re.fullmatch(r"(\S+?)\s*(==|=|!=)\s*(\S*)", term):
            if (labels.get(m[1]) == m[3]) != (m[2] != "!="):
                return False
        elif m := re.fullmatch(r"(\S+)\s+(in|notin)\s*\((.*)\)", term):
            if (labels.get(m[1]) in {v.strip() for v in m[3].split(",")}) != (m[2] == "in"):
                return False
        elif m := re.fullmatch(r"(!?)\s*([^\s!=()]+)", term):
            if (m[2] in labels) == bool(m[1]):
                return False
        else:
            raise ValueError(f"unreadable selector term {term!r}")
    return True


def _fields(obj: Mapping[str, Any]) -> dict[str, str]:
    """The fields a fieldSelector may name: every scalar, by its dotted path."""
    out: dict[str, str] = {}
    for key, value in obj.items():
        if isinstance(value, Mapping):
            out |= {f"{key}.{k}": v for k, v in _fields(value).items()}
        elif not isinstance(value, list):
            out[key] = str(value).lower() if isinstance(value, bool) else str(value)
    return out


def _encode(secret: dict[str, Any]) -> None:
    """A Secret's write-only stringData, moved into its data as the API server does."""
    for key, value in (secret.pop("stringData", None) or {}).items():
        secret.setdefault("data", {})[key] = base64.b64encode(value.encode()).decode()


def _owned(applied: Mapping[str, Any], top: bool = True) -> dict[str, Any]:
    """The fields an apply sets, as managedFields' FieldsV1 says them (`f:name` keys; a list is one
    field here: the emulator replaces lists whole); not apiVersion, kind or identity metadata."""
    out: dict[str, Any] = {}
    for key, value in applied.items():
        if top and key in ("apiVersion", "kind"):
            continue
        if top and key == "metadata" and isinstance(value, Mapping):
            value = {k: v for k, v in value.items() if k not in _UNOWNED}
            if not value:
                continue
        out[f"f:{key}"] = _owned(value, top=False) if isinstance(value, Mapping) else {}
    return out


def _disown(obj: dict[str, Any], before: Mapping[str, Any], after: Mapping[str, Any]) -> None:
    """Remove from `obj` the fields a manager applied `before` and no longer applies (`after`); a
    map left empty by it goes too. Other managers' claims on them are not emulated."""
    for key, sub in before.items():
        name = key.removeprefix("f:")
        if key not in after:
            obj.pop(name, None)
        elif sub and after[key] and isinstance(obj.get(name), dict):
            _disown(obj[name], sub, after[key])
            if not obj[name]:
                obj.pop(name)


def _header(request: kmock.Request, name: str) -> str:
    return next((v for k, v in request.headers.items() if k.lower() == name.lower()), "")


def _merge(target: Any, patch: Any) -> Any:
    """A JSON merge patch (RFC 7386) applied: dicts merge, None deletes, anything else replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge(out.get(key), value)
    return out


class Served(NamedTuple):
    """What kind of request an emulator served (the history itself is not kept: see HISTORY)."""

    method: str
    resource: Any
    name: str | None
    field_manager: str | None


HISTORY = 16  # requests an emulator remembers (see Emulator.__call__): more than are ever being matched at once


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator plus what a real API server does that an operator relies on:

    - create: the namespace from the URL (kmock's namespaced watches miss objects without one);
      a name from generateName; uid, resourceVersion, creationTimestamp, generation, apiVersion
      and kind; 201; `status` dropped where it is a subresource; pods start Pending; Services get
      defaults, a cluster IP (127.A.0.x) and node ports; a Secret's stringData moves to data;
      objects in a namespace that does not exist are refused (the NamespaceLifecycle admission
      plugin); unknown resources are 404;
    - patch (JSON merge patch, or JSON patch with `test` ops, as kopf sends): a new
      resourceVersion each time; a stale resourceVersion in a merge patch is a 409, a failed
      `test` a 422; generation counts changes outside metadata and status; `status` changes only
      through /status, and /status changes only `status`; a Service's defaults filled again;
    - server-side apply (PATCH as application/apply-patch+yaml, JSON or YAML): fieldManager is
      required (400); the object is created if missing (201), else the applied fields merge into
      it (maps key by key, lists whole) and the fields that manager applied before and no longer
      applies are removed; its `metadata.managedFields` entry (operation Apply, FieldsV1) records
      them; an apply that changes nothing writes nothing;
    - delete: a pod bound to a node (tests/support/kubelet.py binds them) gets a deletionTimestamp and
      stays until its kubelet has killed it and deletes it with gracePeriodSeconds=0;
    - list and watch: labelSelector and fieldSelector; a watch from a resourceVersion sends the
      objects changed since (as ADDED), then every change; it ends after timeoutSeconds;
    - Namespaces over HTTP and core discovery as kubectl reads it (kmock gets both URLs wrong);
      GET pods/NAME/log asks `pod_logs` (tests/support/kubelet.py sets it).

    Still not emulated: PUT (replace) and deletecollection (404), strategic merge patch (read as
    a JSON merge patch: lists are replaced), managedFields of other writes than applies, and so
    apply conflicts (every apply acts as force=true) and lists merged by key; apply to /status;
    schema validation and other admission, garbage
    collection by ownerReferences or of a deleted namespace's contents, deletions missed
    between a list and a watch (there is no history, so never a 410), exec/attach/port-forward.
    """

    subnet: int
    pod_logs: Callable[[str, str], str | None] | None = None
    _rv: int = attrs.field(default=0, init=False)
    _writes: asyncio.Lock = attrs.field(factory=asyncio.Lock, init=False)
    _service_ips: Iterator[int] = attrs.field(factory=lambda: iter(range(1, 255)), init=False)
    _node_ports: Iterator[int] = attrs.field(factory=lambda: iter(range(30000, 32768)), init=False)
    served: collections.Counter[Served] = attrs.field(factory=collections.Counter, init=False)  # every request, by kind

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # kmock keeps every request, and finds each new one's reaction by filtering that whole
        # history (`request in view`): over a long test each request cost more than the last,
        # until the cluster's thread spent all its time there. Only the newest are kept.
        if len(self._requests) > 2 * HISTORY:
            del self._requests[:-HISTORY]
        if m := _NAMESPACE_URL.fullmatch(raw_request.path):
            path = f"/api/v1/{_NAMESPACES_ALIAS.plural}{m[1] or ''}{m[2] or ''}"
            raw_request = raw_request.clone(rel_url=raw_request.rel_url.with_path(path, keep_query=True))
        return await super().__call__(raw_request)

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if request.resource == _NAMESPACES_ALIAS:  # in place: kmock's reactions match the request it recorded
            object.__setattr__(request, "resource", NAMESPACES)
        self.served[Served(request.method, request.resource, request.name, request.params.get("fieldManager"))] += 1
        if request.resource is None or request.resource.plural is None:  # discovery
            return await super()._handle(request)
        if request.resource not in self.resources:
            raise error(404, "NotFound", f"the server could not find the requested resource {request.resource}")
        if request.action == kmock.action.FETCH and request.subresource == "log":
            return self._log(request)
        if request.action not in _WRITES:
            return await super()._handle(request)
        info = self.resources[request.resource]
        async with self._writes:
            if request.action == kmock.action.CREATE:
                self._admit(request, info)
                response = await super()._handle(request)
                response.set_status(201)
                return response
            if request.action == kmock.action.UPDATE and _header(request, "Content-Type").startswith(APPLY):
                created = await self._apply(request, info)
                response = await kmock.RawHandler._handle(self, request)
                response.set_status(201 if created else 200)
                return response
            if request.action == kmock.action.UPDATE:
                await self._patch(request, info)
            elif not await self._mark_deleted(request):
                return await super()._handle(request)
            return await kmock.RawHandler._handle(self, request)  # the state is changed: only answer

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _live(self, resource: kmock.resource, namespace: str | None, name: str) -> dict[str, Any] | None:
        key = (resource, namespace, name)
        return self._objects[key].raw if key in self._objects and not self._objects[key].deleted else None

    def _admit(self, request: kmock.Request, info: kmock.ResourceInfo) -> None:
        self._admit_object(request.data, request.resource, request.namespace, info)

    def _admit_object(
        self, obj: Any, resource: kmock.resource, url_namespace: str | None, info: kmock.ResourceInfo
    ) -> None:
        """A new object as the API server stores it (changed in place), or an error."""
        if not isinstance(obj, dict):
            raise error(400, "BadRequest", "the body is not a JSON object")
        meta = obj.setdefault("metadata", {})
        if info.namespaced:
            namespace = url_namespace or meta.get("namespace")
            if not namespace or meta.get("namespace", namespace) != namespace:
                raise error(
                    400, "BadRequest", f"the namespace of the object ({meta.get('namespace')}) does not match the URL's"
                )
            if self._live(NAMESPACES, None, namespace) is None:
                raise error(404, "NotFound", f'namespaces "{namespace}" not found')
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise error(422, "Invalid", "metadata.name or metadata.generateName is required")
            meta["name"] = meta["generateName"] + "".join(random.choices("bcdfghjklmnpqrstvwxz2456789", k=5))
        for key in ("deletionTimestamp", "deletionGracePeriodSeconds"):
            meta.pop(key, None)
        meta.update(uid=str(uuid.uuid4()), resourceVersion=self._next_rv(), creationTimestamp=now(), generation=1)
        group, version = resource.group, resource.version
        obj["apiVersion"] = f"{group}/{version}" if group else version
        obj["kind"] = info.kind
        if "status" in info.subresources:
            obj.pop("status", None)
        if resource == PODS:
            obj["status"] = {"phase": "Pending"}
        if resource == SERVICES:
            self._allocate(obj.setdefault("spec", {}))
        if resource == SECRETS:
            _encode(obj)

    def _allocate(self, spec: dict[str, Any], before: Mapping[str, Any] | None = None) -> None:
        """What the API server fills in a Service: defaults, the cluster IP, node ports (a port
        that was there `before` keeps its node port)."""
        spec.setdefault("type", "ClusterIP")
        if spec["type"] != "ExternalName" and not spec.get("clusterIP"):
            spec["clusterIP"] = f"127.{self.subnet}.0.{next(self._service_ips)}"
            spec["clusterIPs"] = [spec["clusterIP"]]
        had = {(p.get("port"), p.get("protocol", "TCP")): p.get("nodePort") for p in (before or {}).get("ports", [])}
        for port in spec.get("ports", []):
            port.setdefault("protocol", "TCP")
            port.setdefault("targetPort", port.get("port"))
            if spec["type"] in ("NodePort", "LoadBalancer") and not port.get("nodePort"):
                port["nodePort"] = had.get((port.get("port"), port["protocol"])) or next(self._node_ports)

    async def _patch(self, request: kmock.Request, info: kmock.ResourceInfo) -> None:
        """Store what the API server would make of the patch, and tell the watchers."""
        if request.subresource not in (None, "status") or (request.subresource and "status" not in info.subresources):
            raise error(404, "NotFound", f"no subresource {request.subresource!r} of {request.resource}")
        old = self._live(request.resource, request.namespace, request.name)
        if old is None:
            raise error(404, "NotFound", f'{request.resource.plural} "{request.name}" not found')
        old = copy.deepcopy(old)
        patch = request.data
        wanted = patch.get("metadata", {}).get("resourceVersion") if isinstance(patch, Mapping) else None
        if wanted not in (None, old["metadata"]["resourceVersion"]):
            raise error(
                409,
                "Conflict",
                "the object has been modified; please apply your changes to the latest version and try again",
            )
        try:
            new = jsonpatch.apply_patch(old, patch) if isinstance(patch, list) else _merge(old, patch)
        except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException, TypeError) as e:
            raise error(422, "Invalid", f"the patch does not apply: {e}")
        if request.resource == SECRETS:
            _encode(new)
        if request.resource == SERVICES and request.subresource is None:
            self._allocate(new.setdefault("spec", {}), old.get("spec"))
        if request.subresource == "status":
            new = {
                **{k: v for k, v in old.items() if k != "status"},
                **({"status": new["status"]} if "status" in new else {}),
            }
        elif "status" in info.subresources:
            new = {
                **{k: v for k, v in new.items() if k != "status"},
                **({"status": old["status"]} if "status" in old else {}),
            }
        await self._write(request, old, new)

    async def _write(self, request: kmock.Request, old: dict[str, Any], new: dict[str, Any]) -> None:
        """Store the object's new version (identity metadata kept), and tell the watchers."""
        kept = {k: v for k, v in old["metadata"].items() if k in _IMMUTABLE}
        meta = new["metadata"] = kept | {k: v for k, v in (new.get("metadata") or {}).items() if k not in _IMMUTABLE}
        if {k: v for k, v in new.items() if k not in ("metadata", "status")} != {
            k: v for k, v in old.items() if k not in ("metadata", "status")
        }:
            meta["generation"] = meta.get("generation", 0) + 1
        meta["resourceVersion"] = self._next_rv()
        gone = meta.get("deletionTimestamp") and not meta.get("finalizers")
        async with self._lock:
            obj = self._objects[request.resource, request.namespace, request.name]
            obj.history.append(new)
            if gone:
                obj.delete()
            await self._buses[request.resource].put({"type": "DELETED" if gone else "MODIFIED", "object": new})

    async def _apply(self, request: kmock.Request, info: kmock.ResourceInfo) -> bool:
        """Server-side apply (see the class's docstring); whether it created the object."""
        manager = request.params.get("fieldManager")
        if not manager:
            raise error(400, "BadRequest", "PATCH requests of type apply require the fieldManager parameter")
        if request.subresource is not None:
            raise error(400, "BadRequest", f"apply to {request.subresource} is not emulated")
        applied = self._applied(request, info)
        entry = {
            "manager": manager,
            "operation": "Apply",
            "apiVersion": applied["apiVersion"],
            "time": now(),
            "fieldsType": "FieldsV1",
            "fieldsV1": _owned(applied),
        }
        old = self._live(request.resource, request.namespace, request.name)
        if old is None:
            applied["metadata"]["managedFields"] = [entry]
            self._admit_object(applied, request.resource, request.namespace, info)
            async with self._lock:
                key = (request.resource, applied["metadata"].get("namespace"), request.name)
                if key in self._objects:
                    self._objects[key].create(applied)
                else:
                    self._objects[key] = applied
                await self._buses[request.resource].put({"type": "ADDED", "object": self._objects[key].raw})
            return True
        old = copy.deepcopy(old)
        wanted = applied["metadata"].pop("resourceVersion", None)
        if wanted not in (None, old["metadata"]["resourceVersion"]):
            raise error(
                409, "Conflict", "the object has been modified; please apply your changes to the latest version"
            )
        entries = old["metadata"].get("managedFields") or []
        mine = next((e for e in entries if e.get("manager") == manager and e.get("operation") == "Apply"), None)
        new = copy.deepcopy(old)
        _disown(new, (mine or {}).get("fieldsV1") or {}, entry["fieldsV1"])
        new = _merge(new, applied)
        if request.resource == SERVICES:
            self._allocate(new.setdefault("spec", {}), old.get("spec"))
        if "status" in info.subresources:
            new = {k: v for k, v in new.items() if k != "status"} | (
                {"status": old["status"]} if "status" in old else {}
            )
        if new == old and mine is not None and mine.get("fieldsV1") == entry["fieldsV1"]:
            return False  # nothing changed: no write, no event
        new["metadata"]["managedFields"] = [e for e in entries if e is not mine] + [entry]
        await self._write(request, old, new)
        return False

    def _applied(self, request: kmock.Request, info: kmock.ResourceInfo) -> dict[str, Any]:
        """The applied configuration, checked as the API server checks it; a Secret's stringData moved into data."""
        applied = request.data
        if applied is None:
            try:
                applied = yaml.safe_load(request.text)
            except yaml.YAMLError as e:
                raise error(400, "BadRequest", f"the body is not YAML: {e}")
        if not isinstance(applied, dict):
            raise error(400, "BadRequest", "the body is not an object")
        group, version = request.resource.group, request.resource.version
        if (
            applied.get("apiVersion") != (f"{group}/{version}" if group else version)
            or applied.get("kind") != info.kind
        ):
            raise error(400, "BadRequest", f"apiVersion and kind must be those of {request.resource}")
        meta = applied.setdefault("metadata", {})
        if not isinstance(meta, dict) or meta.setdefault("name", request.name) != request.name:
            raise error(400, "BadRequest", "metadata.name does not match the URL's")
        if meta.get("managedFields") is not None:
            raise error(400, "BadRequest", "metadata.managedFields must be nil")
        if request.resource == SECRETS:
            _encode(applied)
        return applied

    async def _mark_deleted(self, request: kmock.Request) -> bool:
        """A pod on a node is only marked: its kubelet kills it, then deletes it for good."""
        pod = self._live(request.resource, request.namespace, request.name) if request.resource == PODS else None
        options = request.data if isinstance(request.data, Mapping) else {}
        grace = request.params.get("gracePeriodSeconds", options.get("gracePeriodSeconds"))
        if (
            pod is None
            or not pod.get("spec", {}).get("nodeName")
            or pod["metadata"].get("deletionTimestamp")
            or str(grace) == "0"
        ):
            return False
        grace = int(grace if grace is not None else pod["spec"].get("terminationGracePeriodSeconds", 30))
        async with self._lock:
            obj = self._objects[request.resource, request.namespace, request.name]
            obj.patch(
                {
                    "metadata": {
                        "deletionTimestamp": now(),
                        "deletionGracePeriodSeconds": grace,
                        "resourceVersion": self._next_rv(),
                    }
                }
            )
            await self._buses[request.resource].put({"type": "MODIFIED", "object": obj.raw})
        return True

    def _log(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        text = self.pod_logs(request.namespace, request.name) if self.pod_logs and request.resource == PODS else None
        if text is None:
            raise error(404, "NotFound", f'no log of pods "{request.name}"')
        return aiohttp.web.Response(text=text)

    def _selected(self, request: kmock.Request, obj: Mapping[str, Any]) -> bool:
        try:
            return selects(
                request.params.get("labelSelector"), obj.get("metadata", {}).get("labels") or {}
            ) and selects(request.params.get("fieldSelector"), _fields(obj))
        except ValueError as e:
            raise error(400, "BadRequest", str(e))

    async def _serve_version(self, request: kmock.Request) -> kmock.Payload:
        found = await super()._serve_version(request)
        found["groupVersion"] = found["groupVersion"].lstrip(
            "/"
        )  # kmock says "/v1": kubectl then finds no core resource
        return found

    async def _serve_list(self, request: kmock.Request) -> kmock.Payload:
        listed = await super()._serve_list(request)
        group, version = request.resource.group, request.resource.version
        return {
            "apiVersion": f"{group}/{version}" if group else version,
            "kind": f"{self.resources[request.resource].kind}List",
            "metadata": {"resourceVersion": str(self._rv)},
            "items": [obj for obj in listed["items"] if self._selected(request, obj)],
        }

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        """kmock's watch, with the bus subscribed to in the same step as the objects are read
        (kmock subscribes after streaming them, so a change in between was lost); given a
        resourceVersion, only objects changed since then (kmock replays all); ending after
        timeoutSeconds (kmock never ends: a client waiting for that would wait forever)."""
        yield b""  # the headers go out now, even if nothing happens
        since = int(request.params.get("resourceVersion") or 0)
        timeout = float(request.params["timeoutSeconds"]) if request.params.get("timeoutSeconds") else None
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        bus = self._buses[request.resource]
        async with self._lock:
            mark = await bus.mark()
            objs = [
                obj.raw
                for (resource, _, _), obj in self._objects.items()
                if resource == request.resource and not obj.deleted
            ]
        try:
            for obj in objs:
                if int(obj["metadata"].get("resourceVersion", 0)) > since and self._watched(request, obj):
                    yield {"type": "ADDED", "object": obj}
            events = aiter(bus.stream(since=mark))
            while True:
                left = None if deadline is None else deadline - asyncio.get_running_loop().time()
                try:
                    async with asyncio.timeout(left):
                        event = await anext(events)
                except TimeoutError:
                    return
                if self._watched(request, event["object"]):
                    yield event
        finally:
            await bus.unmark(mark)

    def _watched(self, request: kmock.Request, obj: Mapping[str, Any]) -> bool:
        meta = obj.get("metadata", {})
        return (
            request.namespace in (None, meta.get("namespace"))
            and request.name in (None, meta.get("name"))
            and self._selected(request, obj)
        )


class ApiError(Exception):
    """A request to an emulated cluster answered with an error status."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"{status}: {body[:2000]}")
        self.status, self.body = status, body


def path(resource: str, namespace: str | None = None, name: str | None = None, subresource: str | None = None) -> str:
    """The URL path of e.g. ("v1/pods", "ns", "p") or ("sparrowrl.dev/v1alpha1/sparrowrljobs", ...)."""
    *group, version, plural = resource.split("/")
    parts = [f"/apis/{group[0]}/{version}" if group else f"/api/{version}"]
    parts += [f"namespaces/{namespace}"] if namespace else []
    parts += [plural] + ([name] if name else []) + ([subresource] if subresource else [])
    return "/".join(parts)


Upstream = Callable[[], "tuple[str, int] | None"]


class Gate:
    """TCP listeners that forward each connection to an upstream picked when it arrives (None:
    the connection is reset, as kube-proxy rejects one to a Service without ready endpoints).

    A cluster's edge is one (its API endpoint here, its load balancers and node ports in
    tests/support/kubelet.py): `cut` makes it refuse connections and resets the open ones, or (hang=True)
    a black hole: connections are accepted and open ones stay open, but nothing flows until
    `heal`, which then delivers what was held, as TCP would after a partition heals."""

    def __init__(self) -> None:
        self._routes: dict[tuple[str, int], Upstream] = {}
        self._servers: dict[tuple[str, int], asyncio.Server] = {}
        self._connections: set[asyncio.StreamWriter] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._refusing = False

    async def listen(self, host: str, port: int, upstream: Upstream) -> int:
        """Forward host:port (0: any free port, returned) to upstream; OSError if taken."""
        server = await asyncio.start_server(functools.partial(self._forward, upstream), host, port)
        port = server.sockets[0].getsockname()[1]
        self._routes[host, port] = upstream
        self._servers[host, port] = server
        if self._refusing:
            server.close()
            del self._servers[host, port]
        return port

    async def unlisten(self, host: str, port: int) -> None:
        self._routes.pop((host, port), None)
        if server := self._servers.pop((host, port), None):
            server.close()

    async def cut(self, *, hang: bool = False) -> None:
        if hang:
            self._flowing.clear()
            return
        self._refusing = True
        for server in self._servers.values():
            server.close()
        self._servers.clear()
        for writer in list(self._connections):
            writer.transport.abort()

    async def heal(self) -> None:
        if self._refusing:
            self._refusing = False
            for (host, port), upstream in self._routes.items():
                self._servers[host, port] = await asyncio.start_server(
                    functools.partial(self._forward, upstream), host, port
                )
        self._flowing.set()

    async def close(self) -> None:
        await self.cut()
        self._routes.clear()

    async def _forward(self, upstream: Upstream, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        inner: asyncio.StreamWriter | None = None
        try:
            await self._flowing.wait()
            if (target := upstream()) is None:
                writer.transport.abort()
                return
            inner_reader, inner = await asyncio.open_connection(*target)
            self._connections.add(inner)
            await asyncio.gather(self._pipe(reader, inner, writer), self._pipe(inner_reader, writer, inner))
        except (OSError, asyncio.CancelledError):  # cancelled: the loop stops; asyncio would log it
            writer.transport.abort()
        finally:
            for w in (writer, inner):
                if w is not None:
                    self._connections.discard(w)
                    w.close()

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, other: asyncio.StreamWriter
    ) -> None:
        try:
            while data := await reader.read(1 << 16):
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
        except OSError:  # one side reset: so is the other
            writer.transport.abort()
            other.transport.abort()


def _claim_subnet() -> tuple[int, socket.socket]:
    for a in random.sample(range(16, 255), 239):
        claim = socket.socket()
        try:
            claim.bind((f"127.{a}.254.254", 65535))
            return a, claim
        except OSError:
            claim.close()
    raise RuntimeError("no free 127.A.0.0/16 left for another cluster")


class Cluster:
    """One emulated cluster: an Emulator with the bundled resources and the chart's CRDs, served
    on a loopback port through `edge` (a Gate), on an event loop in a thread of its own.

    `url` is what an operator (and kubectl) uses; `internal_url` is the emulator itself, which
    components inside the cluster (tests/support/kubelet.py) and this class's own helpers use, so a test
    can still look into a cluster it made unreachable."""

    def __init__(self, name: str = "cluster", crds: Sequence[Path] = CHART_CRDS) -> None:
        self.name = name
        self.subnet, self._claim = _claim_subnet()
        self.emulator = Emulator(subnet=self.subnet)
        self.emulator.resources.load_bundled()
        self._crds = [yaml.safe_load(p.read_text()) for p in crds]
        for crd in self._crds:
            self.register(crd)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=f"cluster-{name}", daemon=True)
        self.edge = Gate()
        self.port = self.internal_port = 0
        self._runner: aiohttp.web.ServerRunner | None = None

    def __repr__(self) -> str:
        return f"<Cluster {self.name} {self.url if self.port else '(stopped)'}>"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def internal_url(self) -> str:
        return f"http://127.0.0.1:{self.internal_port}"

    @property
    def node_ip(self) -> str:
        return f"127.{self.subnet}.254.1"

    def register(self, crd: Mapping[str, Any]) -> None:
        """Serve the resources of a CustomResourceDefinition (its manifest), as installing it does."""
        spec = crd["spec"]
        for version in spec["versions"]:
            self.emulator.resources[f"{spec['group']}/{version['name']}/{spec['names']['plural']}"] = {
                "kind": spec["names"]["kind"],
                "namespaced": spec["scope"] == "Namespaced",
                "singular": spec["names"].get("singular", spec["names"]["kind"].lower()),
                "shortnames": spec["names"].get("shortNames", []),
                "categories": spec["names"].get("categories", []),
                "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
                "subresources": list(version.get("subresources", {})),
            }

    def start(self) -> Self:
        self._thread.start()
        self.call(self._start())
        for namespace in ("default", "kube-system", "kube-public"):
            self.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        for crd in self._crds:
            self.create(crd)
        return self

    async def _start(self) -> None:
        await self.emulator.__aenter__()
        server = aiohttp.web.Server(self.emulator, handler_cancellation=True)
        self._runner = aiohttp.web.ServerRunner(server, handle_signals=False, shutdown_timeout=1)
        await self._runner.setup()
        site = aiohttp.web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.internal_port = self._runner.addresses[0][1]
        self.port = await self.edge.listen("127.0.0.1", 0, lambda: ("127.0.0.1", self.internal_port))

    def stop(self) -> None:
        """Stop serving; whatever else still runs on this cluster's loop is cancelled."""
        if self._thread.is_alive():
            self.call(self._stop())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()
        self._claim.close()

    async def _stop(self) -> None:
        await self.edge.close()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
        await self.emulator.__aexit__(None, None, None)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        """Run a coroutine on this cluster's loop, from any other thread, and wait for it."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def unreachable(self, *, hang: bool = False) -> None:
        """Cut the cluster off from outside: its API endpoint and its load balancers and node
        ports refuse connections (hang=False) or swallow them (hang=True: no packets, no errors).
        Inside the cluster, pods, Services and the kubelet go on as before."""
        self.call(self.edge.cut(hang=hang))

    def reachable(self) -> None:
        self.call(self.edge.heal())

    def kubeconfig(self, token: str = "emulated") -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": self.name, "cluster": {"server": self.url}}],
            "users": [{"name": self.name, "user": {"token": token}}],
            "contexts": [
                {"name": self.name, "context": {"cluster": self.name, "user": self.name, "namespace": "default"}}
            ],
            "current-context": self.name,
        }

    def api(self) -> kubernetes.client.ApiClient:
        return kubernetes.config.new_client_from_config_dict(self.kubeconfig())

    def request(
        self, method: str, url_path: str, body: Any = None, content_type: str = "application/merge-patch+json"
    ) -> Any:
        """An HTTP request to the emulator itself (not through the edge); the JSON it answers. A
        str body goes as it is (YAML), anything else as JSON."""
        data = None if body is None else body.encode() if isinstance(body, str) else json.dumps(body).encode()
        req = urllib.request.Request(
            self.internal_url + url_path,
            data=data,
            method=method,
            headers={"Content-Type": content_type, "Accept": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                text = resp.read().decode()
        except urllib.error.HTTPError as e:
            raise ApiError(e.code, e.read().decode()) from None
        return json.loads(text) if text.startswith(("{", "[")) else text

    def plural(self, api_version: str, kind: str) -> str:
        """ "v1", "Pod" -> "v1/pods", from the resources this cluster serves."""
        for resource in self.emulator.resources:
            group_version = f"{resource.group}/{resource.version}" if resource.group else resource.version
            if group_version == api_version and self.emulator.resources[resource].kind == kind:
                return f"{group_version}/{resource.plural}"
        raise KeyError(f"{api_version} {kind} is not served by {self.name}")

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """POST an object; the stored object (with uid, resourceVersion, ...) comes back."""
        resource = self.plural(obj["apiVersion"], obj["kind"])
        namespace = obj.get("metadata", {}).get("namespace") or None
        if namespace is None and self.emulator.resources[resource].namespaced:
            namespace = "default"
        return self.request("POST", path(resource, namespace), obj, content_type="application/json")

    def apply(self, obj: Mapping[str, Any], manager: str | None = "test", force: bool = False) -> dict[str, Any]:
        """Server-side apply of `obj` as `manager` (None: no fieldManager); the stored object."""
        resource = self.plural(obj["apiVersion"], obj["kind"])
        namespace = obj.get("metadata", {}).get("namespace") or None
        if namespace is None and self.emulator.resources[resource].namespaced:
            namespace = "default"
        query = {"fieldManager": manager, "force": "true" if force else None}
        query_text = urllib.parse.urlencode({k: v for k, v in query.items() if v is not None})
        url_path = path(resource, namespace, obj["metadata"]["name"]) + (f"?{query_text}" if query_text else "")
        return self.request("PATCH", url_path, obj, content_type=APPLY)

    def get(self, resource: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        """The object, or None if there is none."""
        try:
            return self.request("GET", path(resource, namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def list(self, resource: str, namespace: str | None = None, labels: str | None = None) -> list[dict[str, Any]]:
        query = "?" + urllib.parse.urlencode({"labelSelector": labels}) if labels else ""
        return self.request("GET", path(resource, namespace) + query)["items"]

    def patch(
        self, resource: str, namespace: str | None, name: str, patch: Any, subresource: str | None = None
    ) -> dict[str, Any]:
        kind = "application/json-patch+json" if isinstance(patch, list) else "application/merge-patch+json"
        return self.request("PATCH", path(resource, namespace, name, subresource), patch, content_type=kind)

    def delete(self, resource: str, namespace: str | None, name: str) -> dict[str, Any]:
        return self.request("DELETE", path(resource, namespace, name))


@contextlib.contextmanager
def clusters(*names: str) -> Iterator[tuple[Cluster, ...]]:
    """Started clusters, stopped at the end: `with clusters("home", "east") as (home, east):`."""
    started: list[Cluster] = []
    try:
        for name in names:
            started.append(Cluster(name))
            started[-1].start()
        yield tuple(started)
    finally:
        for cluster in reversed(started):
            cluster.stop()
