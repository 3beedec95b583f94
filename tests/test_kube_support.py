"""tests/support/kube.py and tests/support/kubelet.py do what the operator's tests rely on: the API server's
behaviour as kopf and the kubernetes client see it, and pods that really run and reach each other."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import re
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml
from kubernetes import client, watch
from support.kube import APPLY, HISTORY, ApiError, Cluster, clusters, path
from support.kubelet import Kubelet, kubelets
from support.wait import until

from sparrowrl.auth import pki

pytestmark = pytest.mark.kube


JOBS = "sparrowrl.dev/v1alpha1/sparrowrljobs"


def pod(name: str, command: list[str], **spec: Any) -> dict[str, Any]:
    container = {"name": "main", "image": "ignored", "command": command} | spec.pop("container", {})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", **spec.pop("metadata", {})},
        "spec": {"restartPolicy": "Never", "containers": [container], **spec},
    }


def python(name: str, code: str, **spec: Any) -> dict[str, Any]:
    return pod(name, ["python", "-c", code], **spec)


def phase(cluster: Cluster, name: str, *phases: str, timeout: float = 30) -> dict[str, Any]:
    """The pod, once it is in one of these phases."""
    return until(
        lambda: (p := cluster.get("v1/pods", "default", name)) and p["status"].get("phase") in phases and p,
        timeout,
        f"pod {name} in {cluster.name} to be {'/'.join(phases)}",
    )


def ready(cluster: Cluster, name: str, want: bool = True, timeout: float = 30) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        p = cluster.get("v1/pods", "default", name)
        conditions = {c["type"]: c["status"] for c in (p or {}).get("status", {}).get("conditions", [])}
        return p if p and conditions.get("Ready") == str(want) else None

    return until(probe, timeout, f"pod {name} in {cluster.name} Ready={want}")


def container(p: dict[str, Any] | None) -> dict[str, Any]:
    """The pod's container status ({} until the kubelet has written one)."""
    return ((p or {}).get("status", {}).get("containerStatuses") or [{}])[0]


def logged(kubelet: Kubelet, name: str, pattern: str, timeout: float = 10) -> re.Match[str]:
    """The first line of a pod's log that matches, once there is one."""
    return until(
        lambda: re.search(pattern, kubelet.log("default", name) or "", re.MULTILINE),
        timeout,
        f"{pattern!r} in {name}'s log",
    )


def terminated(p: dict[str, Any]) -> dict[str, Any]:
    return container(p)["state"]["terminated"]


@contextlib.contextmanager
def world(tmp_path: Path) -> Iterator[tuple[Cluster, Cluster, Kubelet, Kubelet]]:
    with clusters("east", "west") as (east, west), kubelets(east, west, root=tmp_path) as (k_east, k_west):
        yield east, west, k_east, k_west


WEB = pod(
    "web",
    ["python", "-m", "http.server", "--bind", "$(POD_IP)", "8080"],
    metadata={"labels": {"app": "web"}},
    container={
        "workingDir": "/srv",
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "http", "containerPort": 8080}],
        "readinessProbe": {"httpGet": {"path": "/site/index.html", "port": "http"}},
        "volumeMounts": [{"name": "site", "mountPath": "/srv/site"}],
    },
    volumes=[{"name": "site", "configMap": {"name": "site", "items": [{"key": "page", "path": "index.html"}]}}],
)
SITE = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "site"}, "data": {"page": "hello from east"}}


def service(name: str, kind: str, target: int | str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name},
        "spec": {"type": kind, "selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": target}]},
    }


# --- the API server -------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_core_objects_round_trip_through_the_kubernetes_client() -> None:
    with clusters("solo") as (c,):
        v1 = client.CoreV1Api(c.api())
        kinds = {
            "pod": (
                v1.create_namespaced_pod,
                v1.read_namespaced_pod,
                v1.list_namespaced_pod,
                v1.patch_namespaced_pod,
                v1.delete_namespaced_pod,
                {"spec": {"containers": [{"name": "c", "image": "i"}]}},
            ),
            "service": (
                v1.create_namespaced_service,
                v1.read_namespaced_service,
                v1.list_namespaced_service,
                v1.patch_namespaced_service,
                v1.delete_namespaced_service,
                {"spec": {"ports": [{"port": 80}]}},
            ),
            "secret": (
                v1.create_namespaced_secret,
                v1.read_namespaced_secret,
                v1.list_namespaced_secret,
                v1.patch_namespaced_secret,
                v1.delete_namespaced_secret,
                {"stringData": {"token": "s3cret"}},
            ),
            "configmap": (
                v1.create_namespaced_config_map,
                v1.read_namespaced_config_map,
                v1.list_namespaced_config_map,
                v1.patch_namespaced_config_map,
                v1.delete_namespaced_config_map,
                {"data": {"k": "v"}},
            ),
            "pvc": (
                v1.create_namespaced_persistent_volume_claim,
                v1.read_namespaced_persistent_volume_claim,
                v1.list_namespaced_persistent_volume_claim,
                v1.patch_namespaced_persistent_volume_claim,
                v1.delete_namespaced_persistent_volume_claim,
                {"spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}},
            ),
            "event": (
                v1.create_namespaced_event,
                v1.read_namespaced_event,
                v1.list_namespaced_event,
                v1.patch_namespaced_event,
                v1.delete_namespaced_event,
                {"involvedObject": {"kind": "Pod", "name": "x"}, "reason": "Test", "message": "m"},
            ),
        }
        for kind, (create, read, list_, patch, delete, body) in kinds.items():
            made = create("default", {"metadata": {"name": f"a-{kind}", "labels": {"kind": kind}}, **body})
            assert made.metadata.uid and made.metadata.resource_version and made.metadata.creation_timestamp, kind
            assert made.metadata.namespace == "default", kind
            patched = patch(f"a-{kind}", "default", {"metadata": {"labels": {"touched": "yes"}}})
            assert int(patched.metadata.resource_version) > int(made.metadata.resource_version), kind
            assert read(f"a-{kind}", "default").metadata.labels == {"kind": kind, "touched": "yes"}, kind
            assert [o.metadata.name for o in list_("default", label_selector=f"kind={kind}").items] == [f"a-{kind}"], (
                kind
            )
            assert list_("default", label_selector="kind=none").items == [], kind
            delete(f"a-{kind}", "default")
            with pytest.raises(client.ApiException) as e:
                read(f"a-{kind}", "default")
            assert e.value.status == 404, kind
        assert c.emulator.resources["v1/services"].kind == "Service"

        secret = c.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}, "stringData": {"a": "b"}})
        assert secret["data"] == {"a": "Yg=="} and "stringData" not in secret
        svc = c.create(service("lb", "LoadBalancer", 8080))
        assert (
            svc["spec"]["clusterIP"].startswith(f"127.{c.subnet}.0.") and svc["spec"]["ports"][0]["nodePort"] >= 30000
        )
        named = c.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"generateName": "gen-"}})
        assert named["metadata"]["name"].startswith("gen-") and len(named["metadata"]["name"]) == 9
        with pytest.raises(ApiError) as e:
            c.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "namespace": "absent"}})
        assert e.value.status == 404 and "namespaces" in e.value.body
        c.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "absent"}})
        assert (
            c.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "namespace": "absent"}})[
                "metadata"
            ]["namespace"]
            == "absent"
        )
        assert {n.metadata.name for n in v1.list_namespace().items} == {
            "default",
            "kube-system",
            "kube-public",
            "absent",
        }


@pytest.mark.timeout(60)
def test_custom_resources_have_status_generation_and_optimistic_locking() -> None:
    with clusters("solo") as (c,):
        api = client.CustomObjectsApi(c.api())
        job = {
            "apiVersion": "sparrowrl.dev/v1alpha1",
            "kind": "SparrowRLJob",
            "metadata": {"name": "j"},
            "spec": {"x": 1},
            "status": {"phase": "ignored on create"},
        }
        made = api.create_namespaced_custom_object("sparrowrl.dev", "v1alpha1", "default", "sparrowrljobs", job)
        assert "status" not in made and made["metadata"]["generation"] == 1

        after = api.patch_namespaced_custom_object_status(
            "sparrowrl.dev",
            "v1alpha1",
            "default",
            "sparrowrljobs",
            "j",
            {"status": {"phase": "Running"}, "spec": {"x": 99}},
        )
        assert (
            after["status"] == {"phase": "Running"}
            and after["spec"] == {"x": 1}
            and after["metadata"]["generation"] == 1
        )

        after = api.patch_namespaced_custom_object(
            "sparrowrl.dev",
            "v1alpha1",
            "default",
            "sparrowrljobs",
            "j",
            {"status": {"phase": "ignored"}, "spec": {"x": 2}},
        )
        assert (
            after["status"] == {"phase": "Running"}
            and after["spec"] == {"x": 2}
            and after["metadata"]["generation"] == 2
        )
        after = c.patch(JOBS, "default", "j", {"metadata": {"labels": {"a": "b"}}})
        assert after["metadata"]["generation"] == 2, "metadata is not a spec change"

        with pytest.raises(ApiError) as e:
            c.patch(
                JOBS,
                "default",
                "j",
                {"metadata": {"resourceVersion": made["metadata"]["resourceVersion"]}, "spec": {"x": 3}},
            )
        assert e.value.status == 409
        with pytest.raises(ApiError) as e:
            c.patch(
                JOBS,
                "default",
                "j",
                [
                    {"op": "test", "path": "/metadata/resourceVersion", "value": "1"},
                    {"op": "replace", "path": "/spec/x", "value": 3},
                ],
            )
        assert e.value.status == 422
        assert c.get(JOBS, "default", "j")["spec"] == {"x": 2}

        member = c.create(
            {
                "apiVersion": "sparrowrl.dev/v1alpha1",
                "kind": "SparrowCluster",
                "metadata": {"name": "m", "namespace": "ignored"},
                "spec": {},
            }
        )
        assert "namespace" not in member["metadata"]
        assert [m["metadata"]["name"] for m in c.list("sparrowrl.dev/v1alpha1/sparrowclusters")] == ["m"]


@pytest.mark.timeout(60)
def test_a_watch_sees_every_change_it_selects() -> None:
    with clusters("solo") as (c,):
        v1 = client.CoreV1Api(c.api())
        body = {
            "metadata": {"name": "p", "labels": {"app": "w"}},
            "spec": {"containers": [{"name": "c", "image": "i"}]},
        }
        v1.create_namespaced_pod("default", body)
        seen: list[tuple[str, str, str]] = []
        stream = watch.Watch()

        def changes() -> None:
            until(lambda: seen, 10, "the first event")
            v1.create_namespaced_pod("default", {**body, "metadata": {"name": "other", "labels": {"app": "else"}}})
            v1.patch_namespaced_pod("p", "default", {"metadata": {"labels": {"step": "2"}}})
            v1.delete_namespaced_pod("p", "default")

        thread = threading.Thread(target=changes)
        thread.start()
        for event in stream.stream(v1.list_namespaced_pod, "default", label_selector="app=w", _request_timeout=20):
            meta = event["object"].metadata
            seen.append((event["type"], meta.name, (meta.labels or {}).get("step", "")))
            if event["type"] == "DELETED":
                stream.stop()
        thread.join(10)
        assert seen == [("ADDED", "p", ""), ("MODIFIED", "p", "2"), ("DELETED", "p", "2")]

        started = time.monotonic()
        ended = list(watch.Watch().stream(v1.list_namespaced_pod, "default", timeout_seconds=1))
        assert [e["object"].metadata.name for e in ended] == ["other"] and time.monotonic() - started < 5, (
            "timeoutSeconds ends it"
        )


def managed(obj: dict[str, Any]) -> dict[str, Any]:
    """Each manager's FieldsV1, from managedFields."""
    return {e["manager"]: e["fieldsV1"] for e in obj["metadata"].get("managedFields", [])}


@pytest.mark.timeout(60)
def test_server_side_apply_creates_merges_and_drops() -> None:
    """As the operator keeps its objects: an apply creates what is missing, sets again every field
    it applies, removes what it applied before and no longer applies, leaves others' fields, and
    writes nothing when nothing changes."""
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm", "labels": {"app": "x"}}}
    with clusters("solo") as (c,):
        made = c.apply(cm | {"data": {"a": "1", "b": "2"}}, manager="op")
        assert made["metadata"]["uid"] and made["metadata"]["namespace"] == "default"
        assert managed(made) == {"op": {"f:data": {"f:a": {}, "f:b": {}}, "f:metadata": {"f:labels": {"f:app": {}}}}}
        assert made["metadata"]["managedFields"][0]["operation"] == "Apply"
        c.patch("v1/configmaps", "default", "cm", {"data": {"a": "edited", "c": "3"}})  # someone else

        again = c.apply(cm | {"data": {"a": "1"}}, manager="op", force=True)
        assert again["data"] == {"a": "1", "c": "3"}, "a set again, b dropped (no longer applied), c not ours"
        assert int(again["metadata"]["resourceVersion"]) > int(made["metadata"]["resourceVersion"])
        assert managed(again)["op"] == {"f:data": {"f:a": {}}, "f:metadata": {"f:labels": {"f:app": {}}}}
        same = c.apply(cm | {"data": {"a": "1"}}, manager="op")
        assert same["metadata"]["resourceVersion"] == again["metadata"]["resourceVersion"], "a no-op writes nothing"
        other = c.apply({**cm, "metadata": {"name": "cm"}, "data": {"d": "4"}}, manager="other")
        assert other["data"] == {"a": "1", "c": "3", "d": "4"} and set(managed(other)) == {"op", "other"}
        assert other["metadata"]["labels"] == {"app": "x"}, "another manager's apply leaves op's fields"

        secret = c.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}, "stringData": {"t": "b"}})
        assert secret["data"] == {"t": "Yg=="} and "stringData" not in secret
        assert managed(secret)["test"] == {"f:data": {"f:t": {}}}

        lb = service("lb", "LoadBalancer", 8080)
        svc = c.apply(lb)
        ip, node_port = svc["spec"]["clusterIP"], svc["spec"]["ports"][0]["nodePort"]
        lb["spec"]["selector"] = {"app": "other"}
        svc = c.apply(lb)
        assert svc["spec"]["selector"] == {"app": "other"} and svc["spec"]["clusterIP"] == ip
        assert svc["spec"]["ports"][0] == {"port": 80, "targetPort": 8080, "protocol": "TCP", "nodePort": node_port}

        yaml_body = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: from-yaml\ndata:\n  k: v\n"
        url = "/api/v1/namespaces/default/configmaps/from-yaml?fieldManager=kubectl"
        assert c.request("PATCH", url, yaml_body, content_type="application/apply-patch+yaml")["data"] == {"k": "v"}

        with pytest.raises(ApiError) as e:
            c.apply(cm, manager=None)
        assert e.value.status == 400 and "fieldManager" in e.value.body
        for name, obj, why in [("cm", {**cm, "kind": "Secret"}, "kind"), ("x", cm, "name")]:
            with pytest.raises(ApiError) as e:
                c.request("PATCH", path("v1/configmaps", "default", name) + "?fieldManager=m", obj, APPLY)
            assert e.value.status == 400 and why in e.value.body
        assert c.get("v1/configmaps", "default", "x") is None


@pytest.mark.timeout(60)
def test_the_kubernetes_client_applies_and_a_watch_sees_it() -> None:
    """The kubernetes client's apply (as the operator sends it: JSON as apply-patch+yaml) is 201
    when it creates, and watchers see ADDED, then MODIFIED only for a change."""
    with clusters("solo") as (c,):
        v1 = client.CoreV1Api(c.api())
        body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "w"}, "data": {"k": "1"}}
        seen: list[tuple[str, str]] = []

        def changes() -> None:
            until(lambda: seen, 10, "the watch's first event")
            for value in ("2", "2", "3"):
                body["data"]["k"] = value
                v1.patch_namespaced_config_map(
                    "w", "default", body, field_manager="kc", force=True, _content_type=APPLY
                )

        made, status, _ = v1.patch_namespaced_config_map_with_http_info(
            "w", "default", body, field_manager="kc", _content_type=APPLY
        )
        assert status == 201 and made.data == {"k": "1"}
        thread = threading.Thread(target=changes)
        thread.start()
        stream = watch.Watch()
        for event in stream.stream(v1.list_namespaced_config_map, "default", _request_timeout=20):
            seen.append((event["type"], event["object"].data["k"]))
            if event["object"].data["k"] == "3":
                stream.stop()
        thread.join(10)
        assert seen == [("ADDED", "1"), ("MODIFIED", "2"), ("MODIFIED", "3")], "the same apply twice: one change"


@pytest.mark.timeout(60)
def test_kopf_runs_against_an_emulated_cluster() -> None:
    """The operator's framework: finalizers by JSON patch with a resourceVersion test, status
    through the subresource, deletion handlers, events."""
    registry = kopf.OperatorRegistry()
    deleted: list[str] = []
    with clusters("home") as (home,):

        @kopf.on.login(registry=registry)
        def login(**_: Any) -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(server=home.url, token="emulated")

        @kopf.on.startup(registry=registry)
        def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
            settings.peering.standalone = True

        @kopf.on.create("sparrowrl.dev", "v1alpha1", "sparrowrljobs", id="created", registry=registry)
        def created(body: kopf.Body, spec: Any, patch: kopf.Patch, **_: Any) -> dict[str, Any]:
            patch.status["phase"] = "Running"
            kopf.info(body, reason="Created", message="seen by the test's operator")
            return {"x": spec["x"]}

        @kopf.on.delete("sparrowrl.dev", "v1alpha1", "sparrowrljobs", registry=registry)
        def gone(name: str, **_: Any) -> None:
            deleted.append(name)

        started, stop = threading.Event(), threading.Event()
        thread = threading.Thread(
            target=lambda: asyncio.run(
                kopf.operator(registry=registry, clusterwide=True, ready_flag=started, stop_flag=stop)
            )
        )
        thread.start()
        try:
            assert started.wait(20)
            home.create(
                {
                    "apiVersion": "sparrowrl.dev/v1alpha1",
                    "kind": "SparrowRLJob",
                    "metadata": {"name": "j"},
                    "spec": {"x": 7},
                }
            )
            job = until(
                lambda: (j := home.get(JOBS, "default", "j")) and j.get("status", {}).get("phase") and j,
                20,
                "kopf's status",
            )
            assert job["status"] == {"phase": "Running", "created": {"x": 7}}
            assert job["metadata"]["finalizers"] == ["kopf.zalando.org/KopfFinalizerMarker"]
            home.delete(JOBS, "default", "j")
            until(lambda: home.get(JOBS, "default", "j") is None, 20, "the job to be gone")
            assert deleted == ["j"]
            event = until(lambda: home.list("v1/events", "default"), 20, "kopf's event")[0]
            assert event["message"] == "seen by the test's operator" and event["metadata"]["name"].startswith(
                "kopf-event-"
            )
        finally:
            stop.set()
            thread.join(20)


@pytest.mark.timeout(60)
def test_a_cluster_can_become_unreachable_and_come_back() -> None:
    with clusters("member") as (c,):
        v1 = client.CoreV1Api(c.api())
        assert v1.list_namespaced_pod("default").items == []
        c.unreachable()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", c.port), timeout=2)
        assert c.get("v1/namespaces", None, "default"), "the test still sees inside"
        c.reachable()
        assert v1.list_namespaced_pod("default").items == []

        c.unreachable(hang=True)
        with socket.create_connection(("127.0.0.1", c.port), timeout=2) as s:
            s.sendall(b"GET /api/v1/namespaces/default/pods HTTP/1.1\r\nHost: x\r\n\r\n")
            s.settimeout(1)
            with pytest.raises(TimeoutError):
                s.recv(100)
            c.reachable()
            s.settimeout(5)
            assert s.recv(100).startswith(b"HTTP/1.1 200"), "what was held flows once healed"


def test_a_long_test_costs_no_more_per_request_than_a_short_one() -> None:
    """kmock finds each request's reaction by filtering its whole request history: kept whole, a
    long end-to-end test's cluster spent all its time there. Only the newest are kept."""
    with clusters("busy") as (c,):
        for _ in range(3 * HISTORY):
            assert c.get("v1/namespaces", None, "default")
        assert HISTORY <= len(list(c.emulator)) <= 2 * HISTORY + 1


@pytest.mark.timeout(300)
def test_kubectl_works_against_an_emulated_cluster(tmp_path: Path, kube_tools: Path) -> None:
    with clusters("solo") as (c,):
        config = tmp_path / "kubeconfig"
        config.write_text(yaml.safe_dump(c.kubeconfig()))
        c.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "seen-by-kubectl"}})
        out = subprocess.run(
            [str(kube_tools / "kubectl"), "--kubeconfig", str(config), "get", "configmaps", "-o", "name"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.stdout.split() == ["configmap/seen-by-kubectl"], out.stderr


# --- the kubelet stand-in -------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_pods_reach_services_by_name_and_other_clusters_by_load_balancer(tmp_path: Path) -> None:
    hosts_before = Path("/etc/hosts").read_bytes()
    with world(tmp_path) as (east, west, k_east, _):
        east.create(SITE)
        east.create(WEB)
        web = ready(east, "web")
        assert web["status"]["phase"] == "Running" and web["status"]["podIP"].startswith(f"127.{east.subnet}.")
        assert web["spec"]["nodeName"] == k_east.node
        east.create(service("web", "ClusterIP", "http"))
        east.create(service("web-lb", "LoadBalancer", 8080))
        lb = until(
            lambda: (
                (s := east.get("v1/services", "default", "web-lb"))
                and s.get("status", {}).get("loadBalancer", {}).get("ingress")
            ),
            10,
            "a load balancer address",
        )[0]["ip"]
        with urllib.request.urlopen(f"http://{lb}/site/index.html", timeout=5) as resp:
            assert resp.read() == b"hello from east"

        fetch = (
            "import socket, sys, urllib.request\n"
            "for url in sys.argv[1:]:\n"
            "    print(url, urllib.request.urlopen(url, timeout=5).read().decode())\n"
        )
        east.create(
            pod(
                "inside",
                [
                    "python",
                    "-c",
                    fetch,
                    "http://web.default.svc.cluster.local/site/index.html",
                    "http://web/site/index.html",
                ],
            )
        )
        isolated = (
            "try:\n    socket.gethostbyname('web.default.svc.cluster.local')\n"
            "except socket.gaierror:\n    print('no such name here')\n"
            "else:\n    sys.exit('east names resolve in west')\n"
        )
        west.create(pod("outside", ["python", "-c", fetch + isolated, f"http://{lb}/site/index.html"]))
        phase(east, "inside", "Succeeded")
        assert k_east.log("default", "inside").count("hello from east") == 2
        phase(west, "outside", "Succeeded")
        log = client.CoreV1Api(west.api()).read_namespaced_pod_log("outside", "default")
        assert f"http://{lb}/site/index.html hello from east" in log and "no such name here" in log

        east.unreachable()
        with pytest.raises(urllib.error.URLError) as e:
            urllib.request.urlopen(f"http://{lb}/site/index.html", timeout=5)
        assert isinstance(e.value.reason, ConnectionRefusedError)
        east.reachable()
        with urllib.request.urlopen(f"http://{lb}/site/index.html", timeout=5) as resp:
            assert resp.read() == b"hello from east"
    assert Path("/etc/hosts").read_bytes() == hosts_before


@pytest.mark.timeout(90)
def test_env_from_secrets_and_the_downward_api_and_exit_codes(tmp_path: Path) -> None:
    with world(tmp_path) as (east, _, k_east, _):
        east.create(
            {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "creds"}, "stringData": {"token": "s3cret"}}
        )
        env = [
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
            {"name": "ME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "GREETING", "value": "hi $(ME), $$(ME) stays"},
        ]
        east.create(
            pod(
                "env",
                ["sh", "-c", 'echo "$TOKEN $ME $NS $UID $IP $1 | $GREETING"', "sh", "$(IP)"],
                container={"env": env},
            )
        )
        done = phase(east, "env", "Succeeded")
        assert terminated(done)["exitCode"] == 0 and terminated(done)["reason"] == "Completed"
        ip, uid = done["status"]["podIP"], done["metadata"]["uid"]
        assert f"s3cret env default {uid} {ip} {ip} | hi env, $(ME) stays" in k_east.log("default", "env")

        east.create(pod("three", ["sh", "-c", "exit 3"]))
        failed = phase(east, "three", "Failed")
        assert terminated(failed)["exitCode"] == 3 and terminated(failed)["reason"] == "Error"

        east.create(
            pod(
                "waits",
                ["true"],
                container={"env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "later", "key": "x"}}}]},
            )
        )
        waiting = until(lambda: container(p := east.get("v1/pods", "default", "waits")) and p, 10, "a status")
        assert waiting["status"]["phase"] == "Pending"
        assert container(waiting)["state"]["waiting"]["reason"] == "CreateContainerConfigError"
        east.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "later"}, "stringData": {"x": "1"}})
        phase(east, "waits", "Succeeded")

        east.create(pod("again", ["sh", "-c", "exit 3"], restartPolicy="Always"))
        restarted = until(
            lambda: container(p := east.get("v1/pods", "default", "again")).get("restartCount", 0) >= 2 and p,
            30,
            "restarts",
        )
        assert restarted["status"]["phase"] == "Running"
        assert container(restarted)["lastState"]["terminated"]["exitCode"] == 3


@pytest.mark.timeout(90)
def test_a_secret_volume_is_updated_in_place_and_an_https_probe_is_answered(tmp_path: Path) -> None:
    """As a kubelet does: a Secret's volume follows the Secret while the pod runs (whole, by one
    switch of ..data), a subPath of it stays as it was, and an HTTPS readiness probe is made
    without checking the certificate (here one no CA signed)."""
    serve = (
        "import http.server, ssl, pathlib\n"
        "ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); ctx.load_cert_chain('tls/tls.crt', 'tls/tls.key')\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        body = (pathlib.Path('tls/note').read_text() + '|' + pathlib.Path('pinned').read_text()).encode()\n"
        "        self.send_response(200); self.end_headers(); self.wfile.write(body)\n"
        "import os; s = http.server.HTTPServer((os.environ['IP'], 8443), H)\n"
        "s.socket = ctx.wrap_socket(s.socket, server_side=True); s.serve_forever()\n"
    )
    served = pki.serving(pki.authority("nobody's"), ["web"])
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "tls"},
        "stringData": {"tls.crt": served.cert.decode(), "tls.key": served.key.decode(), "note": "first"},
    }
    web = python(
        "tls-web",
        serve,
        container={
            "workingDir": "/srv",
            "env": [{"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
            "ports": [{"name": "https", "containerPort": 8443}],
            "readinessProbe": {"httpGet": {"path": "/", "port": "https", "scheme": "HTTPS"}},
            "volumeMounts": [
                {"name": "tls", "mountPath": "/srv/tls", "readOnly": True},
                {"name": "tls", "mountPath": "/srv/pinned", "subPath": "note"},
            ],
        },
        volumes=[{"name": "tls", "secret": {"secretName": "tls"}}],
    )
    insecure = ssl.create_default_context()
    insecure.check_hostname, insecure.verify_mode = False, ssl.CERT_NONE

    def fetch(ip: str) -> str:
        with urllib.request.urlopen(f"https://{ip}:8443/", timeout=5, context=insecure) as r:
            return r.read().decode()

    with world(tmp_path) as (east, _, _, _):
        east.create(secret)
        east.create(web)
        ip = ready(east, "tls-web")["status"]["podIP"]
        assert fetch(ip) == "first|first"
        east.patch("v1/secrets", "default", "tls", {"data": {"note": base64.b64encode(b"second").decode()}})
        assert until(lambda: (got := fetch(ip)) != "first|first" and got, 20, "the volume updated") == "second|first"


@pytest.mark.timeout(90)
def test_a_claim_outlives_its_pod(tmp_path: Path) -> None:
    count = (
        "import pathlib\n"
        "f = pathlib.Path('state/count')\n"
        "n = int(f.read_text()) + 1 if f.exists() else 1\n"
        "f.write_text(str(n)); print('count', n)\n"
    )
    trainer = python(
        "trainer",
        count,
        container={"workingDir": "/work", "volumeMounts": [{"name": "state", "mountPath": "/work/state"}]},
        volumes=[{"name": "state", "persistentVolumeClaim": {"claimName": "trainer-state"}}],
    )
    with world(tmp_path) as (east, _, k_east, _):
        east.create(trainer)
        waiting = until(lambda: container(p := east.get("v1/pods", "default", "trainer")) and p, 10, "a status")
        assert waiting["status"]["phase"] == "Pending", "no claim, no start"
        east.create(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": "trainer-state"},
                "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
            }
        )
        first = phase(east, "trainer", "Succeeded")
        assert "count 1" in k_east.log("default", "trainer")
        assert east.get("v1/persistentvolumeclaims", "default", "trainer-state")["status"]["phase"] == "Bound"
        east.delete("v1/pods", "default", "trainer")
        until(lambda: east.get("v1/pods", "default", "trainer") is None, 10, "the pod to be gone")
        east.create(trainer)
        second = phase(east, "trainer", "Succeeded")
        assert second["metadata"]["uid"] != first["metadata"]["uid"]
        assert "count 2" in k_east.log("default", "trainer")


@pytest.mark.timeout(90)
def test_a_read_only_root_leaves_only_the_pods_volumes_and_its_tmp_writable(tmp_path: Path) -> None:
    """readOnlyRootFilesystem: the machine's root mount is read-only in the pod's mount namespace,
    as an image's would be; its claim and its /tmp emptyDir (TMPDIR here) are not."""
    code = (
        "import errno, os, pathlib, tempfile\n"
        "pathlib.Path('state/kept').write_text('1')\n"
        "with tempfile.NamedTemporaryFile() as f: print('tmp', f.name.startswith(os.environ['TMPDIR']))\n"
        "for where in ('here', '/sparrowrl-ro-check'):\n"
        "    try: pathlib.Path(where).write_text('x'); print('wrote', where)\n"
        "    except OSError as e: print('refused', where, e.errno == errno.EROFS)\n"
    )
    spec = {
        "container": {
            "workingDir": "/work",
            "securityContext": {"readOnlyRootFilesystem": True},
            "volumeMounts": [{"name": "state", "mountPath": "/work/state"}, {"name": "tmp", "mountPath": "/tmp"}],
        },
        "volumes": [{"name": "state", "persistentVolumeClaim": {"claimName": "s"}}, {"name": "tmp", "emptyDir": {}}],
    }
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "s"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
    }
    with world(tmp_path) as (east, _, k_east, _):
        east.create(claim)
        east.create(python("ro", code, **spec))
        phase(east, "ro", "Succeeded")
        log = k_east.log("default", "ro")
        assert "tmp True" in log and "wrote" not in log and log.count("refused") == 2, log
        assert log.count(" True") == 3, log  # each refusal is the read-only file system's
        assert not Path("/sparrowrl-ro-check").exists()


@pytest.mark.timeout(90)
def test_killed_paused_and_deleted_pods(tmp_path: Path) -> None:
    release = tmp_path / "release"
    # The handler holds on until the test has seen the pod Terminating, so
    # the kubelet cannot finish the deletion before the test looks.
    sleeper = (
        "import os, pathlib, signal, sys, time\n"
        "print('pid', os.getpid(), flush=True)\n"
        "def done(*_):\n"
        "    print('got', signal.Signals(_[0]).name, flush=True)\n"
        f"    while not pathlib.Path({str(release)!r}).exists(): time.sleep(0.05)\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, done)\n"
        "time.sleep(600)\n"
    )
    with world(tmp_path) as (east, _, k_east, _):
        east.create(python("lost", sleeper))
        phase(east, "lost", "Running")
        logged(k_east, "lost", r"^pid \d+$")
        k_east.kill("default", "lost")
        lost = phase(east, "lost", "Failed")
        assert terminated(lost)["exitCode"] == 137 and terminated(lost)["signal"] == signal.SIGKILL

        east.create(SITE)
        east.create(WEB)
        ready(east, "web")
        k_east.pause("default", "web")
        ready(east, "web", want=False)
        k_east.resume("default", "web")
        ready(east, "web")

        east.create(python("doomed", sleeper))
        phase(east, "doomed", "Running")
        pid = int(logged(k_east, "doomed", r"^pid (\d+)$")[1])
        east.delete("v1/pods", "default", "doomed")
        logged(k_east, "doomed", r"^got SIGTERM$")
        assert east.get("v1/pods", "default", "doomed")["metadata"]["deletionTimestamp"], (
            "Terminating until the kubelet is done"
        )
        release.touch()
        until(lambda: east.get("v1/pods", "default", "doomed") is None, 10, "the pod to be gone")
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.timeout(60)
def test_what_the_stand_in_cannot_do_fails_the_test(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="not under workingDir"):
        with world(tmp_path) as (east, _, _, _):
            east.create(
                pod(
                    "bad",
                    ["true"],
                    container={"workingDir": "/work", "volumeMounts": [{"name": "v", "mountPath": "/data"}]},
                    volumes=[{"name": "v", "emptyDir": {}}],
                )
            )
            failed = phase(east, "bad", "Failed")
            assert "not under workingDir" in failed["status"]["message"]
