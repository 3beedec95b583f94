"""The operator as `kopf run` runs it, in a thread of the test, against emulated clusters
(tests/support/kube.py): a registry of its own, logged in to the home cluster's emulator."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import re
import threading
from collections.abc import Iterator

import kopf
import yaml

from sparrowrl_operator.clusters import Kube
from sparrowrl_operator.handlers import Config, Operator, register
from sparrowrl_operator.reconcile import Backoff
from support.kube import Cluster

FAST = Config(image="sparrowrl-runtime:test", interval=1.0, probe_interval=1.0, backoff=Backoff(base=1.0, cap=4.0))


@contextlib.contextmanager
def operator(home: Cluster, cfg: Config = FAST) -> Iterator[Operator]:
    registry = kopf.OperatorRegistry()
    op = Operator(cfg, Kube(home.api()))
    register(registry, op)

    @kopf.on.login(registry=registry)
    def login(**_) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=home.url, token="emulated")

    stop, ready = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def main() -> None:
        try:
            asyncio.run(
                kopf.operator(registry=registry, clusterwide=True, standalone=True, stop_flag=stop, ready_flag=ready)
            )
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    thread = threading.Thread(target=main, name="operator", daemon=True)
    thread.start()
    if not ready.wait(60):
        raise AssertionError(f"the operator did not start: {errors}")
    try:
        yield op
    finally:
        stop.set()
        thread.join(60)
        assert not errors, errors


def add_member(
    home: Cluster, member: Cluster, name: str, namespace: str = "sparrowrl", kubeconfig: dict | None = None
) -> None:
    """A SparrowCluster for `member`, its kubeconfig in a Secret of the home cluster."""
    with contextlib.suppress(Exception):
        home.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "sparrowrl-system"}})
    with contextlib.suppress(Exception):
        member.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    text = yaml.safe_dump(kubeconfig or member.kubeconfig())
    home.create(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": f"{name}-kubeconfig", "namespace": "sparrowrl-system"},
            "data": {"kubeconfig": base64.b64encode(text.encode()).decode()},
        }
    )
    home.create(
        {
            "apiVersion": "sparrowrl.dev/v1alpha1",
            "kind": "SparrowCluster",
            "metadata": {"name": name},
            "spec": {
                "kubeconfig": {"secretRef": {"name": f"{name}-kubeconfig", "namespace": "sparrowrl-system"}},
                "region": name,
                "namespace": namespace,
            },
        }
    )


def columns(crd: dict, obj: dict, wide: bool = False) -> dict[str, str]:
    """The printer columns `kubectl get` shows for `obj`, from the CRD's JSONPaths (a real API
    server computes them; the emulator cannot). Dotted paths, and one `[?(@.type=="X")]` filter."""
    out = {}
    for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]:
        if c.get("priority", 0) and not wide:
            continue
        node = obj
        for part in re.findall(r'\.(\w+)(?:\[\?\(@\.type=="(\w+)"\)\])?', c["jsonPath"]):
            name, match = part
            node = (node or {}).get(name) if isinstance(node, dict) else None
            if match:
                node = next((x for x in node or [] if x.get("type") == match), None)
        out[c["name"]] = "<none>" if node is None else str(node)
    return out
